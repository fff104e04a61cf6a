//! Tokenization: GPT-2's byte-level BPE (`r50k_base`, 50257 tokens, from tiktoken-rs, whose
//! vocabulary ships inside the crate — no download), a byte-level fallback (256 tokens), or the
//! user's own Hugging Face `tokenizer.json` (the `tokenizers` crate, offline).
//! Tokenized corpora are cached on disk, keyed by the sources' identity and the tokenizer
//! through [`stable_hash`] (FNV-1a: the same key from every Rust release, unlike
//! `DefaultHasher`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::corpus::Document;
use crate::error::DataError;

/// FNV-1a (64 bits) of `bytes`: a hash fixed by its definition, for keys that must not change
/// between builds.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// A tokenizer.
#[derive(Clone)]
pub enum Tokenizer {
    /// GPT-2 / r50k byte-level BPE.
    Gpt2,
    /// One token per byte.
    Bytes,
    /// A Hugging Face `tokenizer.json` ([`Tokenizer::from_file`]).
    File(Arc<FileTokenizer>),
}

/// A Hugging Face tokenizer read from its `tokenizer.json`.
pub struct FileTokenizer {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    /// [`stable_hash`] of the file's bytes: the tokenizer's part of a cache key.
    digest: u64,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
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

    /// A Hugging Face `tokenizer.json` (read once per process and path).
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        static LOADED: std::sync::Mutex<Vec<(PathBuf, Arc<FileTokenizer>)>> =
            std::sync::Mutex::new(Vec::new());
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, tokenizer)) = loaded.iter().find(|(p, _)| p == path) {
            return Ok(Self::File(tokenizer.clone()));
        }
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| DataError::io(path, format!("not a Hugging Face tokenizer.json: {e}")))?;
        let file = Arc::new(FileTokenizer {
            tokenizer,
            path: path.to_path_buf(),
            digest: stable_hash(&bytes),
        });
        loaded.push((path.to_path_buf(), file.clone()));
        Ok(Self::File(file))
    }

    /// `gpt2`, `bytes`, or the tokenizer file's path.
    pub fn name(&self) -> String {
        match self {
            Self::Gpt2 => "gpt2".into(),
            Self::Bytes => "bytes".into(),
            Self::File(file) => file.path.display().to_string(),
        }
    }

    /// The tokenizer's part of a cache file name: its name, or the file's content hash.
    fn cache_tag(&self) -> String {
        match self {
            Self::File(file) => format!("file{:016x}", file.digest),
            other => other.name(),
        }
    }

    /// Ids are `0 .. vocab_size()` (a tokenizer file's added tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2 => 50257,
            Self::Bytes => 256,
            Self::File(file) => file.tokenizer.get_vocab_size(true),
        }
    }

    /// The ids of `text` (a tokenizer file adds no special tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Self::Gpt2 => Ok(tiktoken_rs::r50k_base_singleton().encode_ordinary(text)),
            Self::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Self::File(file) => file
                .tokenizer
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| DataError::io(&file.path, format!("cannot encode: {e}"))),
        }
    }

    /// A document's ids: its prompt's, then its text's; and how many are the prompt's.
    pub fn encode_document(&self, document: &Document) -> Result<(Vec<u32>, usize), DataError> {
        let mut tokens = match &document.prompt {
            Some(prompt) => self.encode(prompt)?,
            None => Vec::new(),
        };
        let prompt = tokens.len();
        tokens.extend(self.encode(&document.text)?);
        Ok((tokens, prompt))
    }

    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Self::Gpt2 => tiktoken_rs::r50k_base_singleton()
                .decode(tokens)
                .unwrap_or_else(|_| {
                    String::from_utf8_lossy(&self.decode_bytes(tokens)).into_owned()
                }),
            Self::Bytes => String::from_utf8_lossy(&self.decode_bytes(tokens)).into_owned(),
            Self::File(file) => file
                .tokenizer
                .decode(tokens, false)
                .unwrap_or_else(|_| format!("{tokens:?}")),
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
    /// The prompt's tokens at the start of each document (no training target: jsonl
    /// `{"prompt", "completion"}` lines), one per document; empty when no document has one.
    pub prompts: Vec<usize>,
}

impl TokenizedCorpus {
    /// Tokenizes `documents` (streamed): a prompt's tokens, then the text's.
    pub fn tokenize(
        documents: impl Iterator<Item = Result<Document, DataError>>,
        tokenizer: &Tokenizer,
    ) -> Result<Self, DataError> {
        let mut corpus = Self::default();
        for document in documents {
            let document = document?;
            let (tokens, prompt) = tokenizer.encode_document(&document)?;
            corpus.documents.push(tokens);
            corpus.names.push(document.name);
            if prompt > 0 && corpus.prompts.is_empty() {
                corpus.prompts = vec![0; corpus.documents.len() - 1];
            }
            if prompt > 0 || !corpus.prompts.is_empty() {
                corpus.prompts.push(prompt);
            }
        }
        Ok(corpus)
    }

    /// Tokens of document `doc`'s prompt (0 without one).
    pub fn prompt_len(&self, doc: usize) -> usize {
        self.prompts.get(doc).copied().unwrap_or(0)
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
        for (doc, (name, tokens)) in self.names.iter().zip(&self.documents).enumerate() {
            bytes.extend_from_slice(&(self.prompt_len(doc) as u64).to_le_bytes());
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
        let mut prompts = Vec::new();
        for _ in 0..count {
            prompts.push(reader.u64().ok_or_else(corrupt)? as usize);
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
        if prompts.iter().any(|&p| p > 0) {
            corpus.prompts = prompts;
        }
        Ok(corpus)
    }
}

const CACHE_MAGIC: &[u8] = b"BDCPTOK2";

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
    tokenizer: &Tokenizer,
    cache: &Path,
) -> Result<TokenizedCorpus, DataError> {
    let tag = tokenizer.cache_tag();
    let key = [identity.as_bytes(), tag.as_bytes(), CACHE_MAGIC].join(&0u8);
    let path = cache.join(format!("{:016x}-{tag}.tokens", stable_hash(&key)));
    if path.is_file() {
        return TokenizedCorpus::read(&path);
    }
    let corpus = TokenizedCorpus::tokenize(documents()?, tokenizer)?;
    std::fs::create_dir_all(cache).map_err(|e| DataError::io(cache, e))?;
    corpus.write(&path)?;
    Ok(corpus)
}

/// The default corpus, tokenized (cached).
pub fn default_tokenized(tokenizer: &Tokenizer) -> Result<TokenizedCorpus, DataError> {
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
        let tokens = Tokenizer::Gpt2.encode(text).unwrap();
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
            prompts: vec![2, 0],
        };
        let dir = std::env::temp_dir().join(format!("bdcp-cache-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.tokens");
        corpus.write(&path).unwrap();
        assert_eq!(TokenizedCorpus::read(&path).unwrap(), corpus);
        std::fs::write(&path, b"BDCPTOK2garbage").unwrap();
        assert!(TokenizedCorpus::read(&path)
            .unwrap_err()
            .to_string()
            .contains("corrupt"));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The stable hash is FNV-1a's published 64-bit function: its test vectors.
    #[test]
    fn the_cache_key_hash_is_fixed_by_its_definition() {
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(stable_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
