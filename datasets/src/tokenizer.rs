//! Tokenization: GPT-2's byte-level BPE (`r50k_base`, 50257 tokens, from tiktoken-rs, whose
//! vocabulary ships inside the crate — no download) or a byte-level fallback (256 tokens).
//! Tokenized corpora are cached on disk, keyed by the sources' identity and the tokenizer.

use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::corpus::Document;
use crate::error::DataError;

/// A tokenizer.
#[derive(Clone, Copy)]
pub enum Tokenizer {
    /// GPT-2 / r50k byte-level BPE.
    Gpt2,
    /// One token per byte.
    Bytes,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Tokenizer {
    /// `gpt2` (alias `r50k`) or `bytes`.
    pub fn from_name(name: &str) -> Result<Self, DataError> {
        match name {
            "gpt2" | "r50k" => Ok(Self::Gpt2),
            "bytes" => Ok(Self::Bytes),
            other => Err(DataError::Invalid(format!(
                "unknown tokenizer '{other}': expected gpt2 (r50k) or bytes"
            ))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Bytes => "bytes",
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2 => 50257,
            Self::Bytes => 256,
        }
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Self::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
            Self::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Self::Gpt2 => tiktoken_rs::r50k_base_singleton()
                .decode(tokens)
                .unwrap_or_else(|_| {
                    String::from_utf8_lossy(&self.decode_bytes(tokens)).into_owned()
                }),
            Self::Bytes => String::from_utf8_lossy(&self.decode_bytes(tokens)).into_owned(),
        }
    }

    fn decode_bytes(&self, tokens: &[u32]) -> Vec<u8> {
        tokens.iter().map(|&t| t as u8).collect()
    }
}

/// A tokenized corpus: documents' names and tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizedCorpus {
    pub names: Vec<String>,
    pub documents: Vec<Vec<u32>>,
}

impl TokenizedCorpus {
    /// Tokenizes `documents` (streamed).
    pub fn tokenize(
        documents: impl Iterator<Item = Result<Document, DataError>>,
        tokenizer: Tokenizer,
    ) -> Result<Self, DataError> {
        let mut corpus = Self::default();
        for document in documents {
            let document = document?;
            corpus.documents.push(tokenizer.encode(&document.text));
            corpus.names.push(document.name);
        }
        Ok(corpus)
    }

    /// Lengths in tokens.
    pub fn lengths(&self) -> Vec<usize> {
        self.documents.iter().map(Vec::len).collect()
    }

    pub fn total_tokens(&self) -> usize {
        self.documents.iter().map(Vec::len).sum()
    }

    fn write(&self, path: &Path) -> Result<(), DataError> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(CACHE_MAGIC);
        bytes.extend_from_slice(&(self.documents.len() as u64).to_le_bytes());
        for (name, tokens) in self.names.iter().zip(&self.documents) {
            bytes.extend_from_slice(&(name.len() as u64).to_le_bytes());
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
            tokens
                .iter()
                .for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
        }
        // A name of this writer's own: ranks started together (processes or threads) may all
        // write the cache at once, and each rename must find its own file.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temporary = path.with_extension(format!("tmp.{}.{write}", std::process::id()));
        let mut file =
            std::fs::File::create(&temporary).map_err(|e| DataError::io(&temporary, e))?;
        file.write_all(&bytes)
            .map_err(|e| DataError::io(&temporary, e))?;
        std::fs::rename(&temporary, path).map_err(|e| DataError::io(path, e))
    }

    fn read(path: &Path) -> Result<Self, DataError> {
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| DataError::io(path, e))?;
        let corrupt = || DataError::io(path, "corrupt token cache (delete it to rebuild)");
        let mut reader = ByteReader {
            bytes: &bytes,
            at: 0,
        };
        if reader.take(CACHE_MAGIC.len()).ok_or_else(corrupt)? != CACHE_MAGIC {
            return Err(corrupt());
        }
        let count = reader.u64().ok_or_else(corrupt)?;
        let mut corpus = Self::default();
        for _ in 0..count {
            let name_len = reader.u64().ok_or_else(corrupt)? as usize;
            let name = reader.take(name_len).ok_or_else(corrupt)?;
            corpus
                .names
                .push(String::from_utf8_lossy(name).into_owned());
            let len = reader.u64().ok_or_else(corrupt)? as usize;
            let raw = reader.take(len * 4).ok_or_else(corrupt)?;
            corpus.documents.push(
                raw.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            );
        }
        Ok(corpus)
    }
}

const CACHE_MAGIC: &[u8] = b"BDCPTOK1";

struct ByteReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let slice = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(slice)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
}

/// The cache directory: `$BURN_DCP_CACHE`, else `target/burn-dcp-cache` under the current directory.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("BURN_DCP_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target").join("burn-dcp-cache"))
}

/// Identity of a list of files for the cache: paths, sizes and modification times.
pub fn files_identity(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|path| {
            let meta = std::fs::metadata(path).ok();
            let size = meta.as_ref().map_or(0, |m| m.len());
            let modified = meta
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            format!("{}:{size}:{modified}", path.display())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Tokenizes the documents of `source` (identified by `identity`), reusing the on-disk cache in
/// `cache` when present and writing it otherwise.
pub fn tokenize_cached(
    identity: &str,
    documents: impl FnOnce() -> Result<Box<dyn Iterator<Item = Result<Document, DataError>>>, DataError>,
    tokenizer: Tokenizer,
    cache: &Path,
) -> Result<TokenizedCorpus, DataError> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (identity, tokenizer.name(), CACHE_MAGIC).hash(&mut hasher);
    let path = cache.join(format!(
        "{:016x}-{}.tokens",
        hasher.finish(),
        tokenizer.name()
    ));
    if path.is_file() {
        return TokenizedCorpus::read(&path);
    }
    let corpus = TokenizedCorpus::tokenize(documents()?, tokenizer)?;
    std::fs::create_dir_all(cache).map_err(|e| DataError::io(cache, e))?;
    corpus.write(&path)?;
    Ok(corpus)
}

/// The default corpus, tokenized (cached).
pub fn default_tokenized(tokenizer: Tokenizer) -> Result<TokenizedCorpus, DataError> {
    let files = crate::corpus::default_corpus_files()?;
    tokenize_cached(
        &files_identity(&files),
        || Ok(Box::new(crate::corpus::default_corpus()?)),
        tokenizer,
        &cache_dir(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_round_trips_text() {
        let text = "Context parallelism splits each sequence across devices.";
        let tokens = Tokenizer::Gpt2.encode(text);
        assert!(
            tokens.len() < text.len() / 2,
            "BPE should compress: {} tokens",
            tokens.len()
        );
        assert_eq!(Tokenizer::Gpt2.decode(&tokens), text);
    }

    #[test]
    fn the_cache_round_trips() {
        let corpus = TokenizedCorpus {
            names: vec!["a".into(), "b".into()],
            documents: vec![vec![1, 2, 3], vec![]],
        };
        let dir = std::env::temp_dir().join(format!("bdcp-cache-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.tokens");
        corpus.write(&path).unwrap();
        assert_eq!(TokenizedCorpus::read(&path).unwrap(), corpus);
        std::fs::write(&path, b"BDCPTOK1garbage").unwrap();
        assert!(TokenizedCorpus::read(&path)
            .unwrap_err()
            .to_string()
            .contains("corrupt"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
