//! Text to token files (`prepare_data`): documents tokenized one at a time and written as a
//! Megatron-LM indexed dataset (`PREFIX.bin` + `PREFIX.idx`, as Megatron's
//! `tools/preprocess_data.py` writes them: one sequence per document, the smallest token type of
//! the vocabulary) or as a flat token file (`PREFIX.bin` without an index, each document ended
//! by the end-of-document id, nanoGPT's layout). Documents with a prompt (jsonl
//! `{"prompt", "completion"}`) also write the loss mask beside the tokens
//! ([`crate::tokens::mask_path`]): 0 for the prompt's tokens, 1 for the rest.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::corpus::Document;
use crate::error::DataError;
use crate::indexed::{indexed_paths, IndexedWriter, TokenType};
use crate::tokenizer::Tokenizer;
use crate::tokens::mask_path;

/// Which token file to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `PREFIX.bin` + `PREFIX.idx`.
    Indexed,
    /// `PREFIX.bin` alone, documents ended by the end-of-document id.
    Flat,
}

/// What [`write_token_file`] wrote.
#[derive(Clone, Debug, Serialize)]
pub struct Written {
    pub documents: usize,
    pub tokens: usize,
    /// Tokens that are no training target (prompts).
    pub prompt_tokens: usize,
    /// What `--data-path` takes: the prefix (indexed) or the token file (flat).
    pub data_path: PathBuf,
    pub files: Vec<PathBuf>,
    pub dtype: String,
}

/// Tokenizes `documents` and writes them under `prefix` (module docs). `eod`: the id appended
/// to each document (required for a flat file; optional for an indexed one, Megatron's
/// `--append-eod`). The loss mask is written when a document has a prompt.
pub fn write_token_file(
    documents: impl Iterator<Item = Result<Document, DataError>>,
    tokenizer: &Tokenizer,
    prefix: &Path,
    format: Format,
    eod: Option<u32>,
) -> Result<Written, DataError> {
    let vocab = tokenizer.vocab_size();
    if let Some(eod) = eod.filter(|&eod| eod as usize >= vocab) {
        return Err(DataError::Invalid(format!(
            "end-of-document id {eod} is outside the tokenizer's {vocab} ids"
        )));
    }
    let dtype = match format {
        Format::Indexed => TokenType::for_vocab(vocab),
        Format::Flat if vocab <= 1 << 16 => TokenType::U16,
        Format::Flat => TokenType::U32,
    };
    let (idx_path, bin_path) = indexed_paths(prefix);
    let mut writer = match format {
        Format::Indexed => Writer::Indexed(IndexedWriter::create(prefix, dtype)?),
        Format::Flat => {
            if eod.is_none() {
                return Err(DataError::Invalid(
                    "a flat token file needs an end-of-document id (--eod-token): it is the \
                     only boundary between its documents"
                        .into(),
                ));
            }
            let file = File::create(&bin_path).map_err(|e| DataError::io(&bin_path, e))?;
            Writer::Flat(BufWriter::new(file))
        }
    };
    let mask_file = mask_path(&bin_path);
    // Targets of the documents so far, kept only until the first prompt shows a mask is needed
    // (then streamed): a corpus without prompts writes no mask.
    let mut mask: Option<BufWriter<File>> = None;
    let mut written = Written {
        documents: 0,
        tokens: 0,
        prompt_tokens: 0,
        data_path: match format {
            Format::Indexed => prefix.to_path_buf(),
            Format::Flat => bin_path.clone(),
        },
        files: Vec::new(),
        dtype: format!("{dtype:?}").to_lowercase(),
    };
    let mut bytes = Vec::new();
    for document in documents {
        let document = document?;
        let (mut tokens, prompt) = tokenizer.encode_document(&document)?;
        if let Some(eod) = eod {
            tokens.push(eod);
        }
        if prompt > 0 && mask.is_none() {
            let file = File::create(&mask_file).map_err(|e| DataError::io(&mask_file, e))?;
            let mut writer = BufWriter::new(file);
            // Every token before this document was a target.
            write_mask(&mut writer, &mask_file, written.tokens, 1)?;
            mask = Some(writer);
        }
        if let Some(writer) = &mut mask {
            write_mask(writer, &mask_file, prompt, 0)?;
            write_mask(writer, &mask_file, tokens.len() - prompt, 1)?;
        }
        match &mut writer {
            Writer::Indexed(indexed) => indexed.add_document(&tokens)?,
            Writer::Flat(flat) => {
                bytes.clear();
                for &token in &tokens {
                    match dtype {
                        TokenType::U16 => bytes.extend((token as u16).to_le_bytes()),
                        _ => bytes.extend(token.to_le_bytes()),
                    }
                }
                flat.write_all(&bytes)
                    .map_err(|e| DataError::io(&bin_path, e))?;
            }
        }
        written.documents += 1;
        written.tokens += tokens.len();
        written.prompt_tokens += prompt;
    }
    match writer {
        Writer::Indexed(indexed) => {
            indexed.finish()?;
            written.files.push(idx_path);
        }
        Writer::Flat(mut flat) => flat.flush().map_err(|e| DataError::io(&bin_path, e))?,
    }
    written.files.insert(0, bin_path);
    if let Some(mut writer) = mask {
        writer.flush().map_err(|e| DataError::io(&mask_file, e))?;
        written.files.push(mask_file);
    } else if mask_file.exists() {
        // A mask left by an earlier run beside the same tokens would no longer match them.
        std::fs::remove_file(&mask_file).map_err(|e| DataError::io(&mask_file, e))?;
    }
    Ok(written)
}

enum Writer {
    Indexed(IndexedWriter),
    Flat(BufWriter<File>),
}

fn write_mask(
    writer: &mut BufWriter<File>,
    path: &Path,
    count: usize,
    value: u8,
) -> Result<(), DataError> {
    let chunk = [value; 4096];
    let mut left = count;
    while left > 0 {
        let n = left.min(chunk.len());
        writer
            .write_all(&chunk[..n])
            .map_err(|e| DataError::io(path, e))?;
        left -= n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::{FlatFormat, TokenFile};

    fn documents() -> Vec<Result<Document, DataError>> {
        vec![
            Ok(Document {
                name: "a".into(),
                text: "hello".into(),
                prompt: None,
            }),
            Ok(Document {
                name: "b".into(),
                text: "yes".into(),
                prompt: Some("Q?".into()),
            }),
        ]
    }

    #[test]
    fn both_layouts_read_back_with_their_mask() {
        let dir = std::env::temp_dir().join(format!("bdcp-prepare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for format in [Format::Indexed, Format::Flat] {
            let prefix = dir.join(format!("{format:?}"));
            let written = write_token_file(
                documents().into_iter(),
                &Tokenizer::Bytes,
                &prefix,
                format,
                Some(0),
            )
            .unwrap();
            assert_eq!(
                (written.documents, written.tokens, written.prompt_tokens),
                (2, 12, 2)
            );
            let flat = FlatFormat {
                eod: Some(0),
                ..FlatFormat::default()
            };
            let file = TokenFile::open(written.data_path.to_str().unwrap(), flat).unwrap();
            let tokens: Vec<Vec<u32>> = file
                .window(0..12)
                .unwrap()
                .into_iter()
                .map(|s| s.tokens)
                .collect();
            let expect = |text: &str| text.bytes().map(u32::from).chain([0]).collect::<Vec<_>>();
            assert_eq!(tokens, vec![expect("hello"), expect("Q?yes")]);
            let targets = file.loss_mask().unwrap().unwrap().targets(0..12).unwrap();
            let mut expected = vec![true; 12];
            expected[6..8].fill(false);
            assert_eq!(targets, expected);
        }
        let err = write_token_file(
            documents().into_iter(),
            &Tokenizer::Bytes,
            &dir.join("x"),
            Format::Flat,
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("--eod-token"), "{err}");
        let err = write_token_file(
            documents().into_iter(),
            &Tokenizer::Bytes,
            &dir.join("x"),
            Format::Indexed,
            Some(256),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("outside the tokenizer's 256 ids"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
