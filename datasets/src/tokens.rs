//! Pre-tokenized token files, read memory-mapped: a Megatron-LM indexed dataset
//! ([`IndexedDataset`], `PREFIX.bin` + `PREFIX.idx`) or a flat token file (nanoGPT's
//! `train.bin`: uint16 or uint32 ids, little-endian, each document followed by an
//! end-of-document id), with an optional loss mask beside it.
//!
//! Both are read as one stream of tokens (the sequences in `.bin` order) cut into windows; a
//! window's sequences are the index's sequences (indexed) or the runs that end at an
//! end-of-document id (flat; the id stays the last token of its document, so the model learns
//! to end a document and never predicts across one). Reading a window touches its own bytes and,
//! for an indexed set, `O(log S)` index entries: nothing scales with the file.
//!
//! **Loss mask** (`TOKENS.mask`, beside the token file `TOKENS`: `PREFIX.bin.mask` for an
//! indexed set): one byte per token of the stream, `1` when the token is a training target
//! (predicted from the tokens before it), `0` when it is not (a prompt's tokens in fine-tuning).
//! `prepare_data` writes it from jsonl `{"prompt", "completion"}` lines.

use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::DataError;
use crate::indexed::{decode_tokens, indexed_paths, map, IndexedDataset, TokenType};

/// How a flat token file is read: its token type and end-of-document id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlatFormat {
    /// `--token-dtype`: `U16` (nanoGPT) or `U32`.
    pub dtype: TokenType,
    /// `--eod-token`: required for a flat file (its only document boundary).
    pub eod: Option<u32>,
}

impl Default for FlatFormat {
    fn default() -> Self {
        Self {
            dtype: TokenType::U16,
            eod: None,
        }
    }
}

/// A flat token file, memory-mapped.
pub struct FlatTokens {
    map: Mmap,
    path: PathBuf,
    dtype: TokenType,
    eod: u32,
}

impl FlatTokens {
    /// Maps `path`: its length must be a whole number of `dtype` tokens.
    pub fn open(path: &Path, dtype: TokenType, eod: u32) -> Result<Self, DataError> {
        if !matches!(dtype, TokenType::U16 | TokenType::U32) {
            return Err(DataError::Invalid(format!(
                "{}: a flat token file holds uint16 or uint32 tokens, not {dtype:?}",
                path.display()
            )));
        }
        let map = map(path)?;
        if !map.len().is_multiple_of(dtype.size()) {
            return Err(DataError::Malformed {
                path: path.to_path_buf(),
                line: 0,
                reason: format!(
                    "{} bytes are not a whole number of {}-byte tokens",
                    map.len(),
                    dtype.size()
                ),
            });
        }
        Ok(Self {
            map,
            path: path.to_path_buf(),
            dtype,
            eod,
        })
    }

    pub fn total_tokens(&self) -> usize {
        self.map.len() / self.dtype.size()
    }

    /// Tokens `range` of the file.
    pub fn tokens(&self, range: Range<usize>) -> Result<Vec<u32>, DataError> {
        if range.start > range.end || range.end > self.total_tokens() {
            return Err(DataError::Invalid(format!(
                "tokens {range:?} of {}: it holds {} tokens",
                self.path.display(),
                self.total_tokens()
            )));
        }
        let size = self.dtype.size();
        decode_tokens(
            &self.map[range.start * size..range.end * size],
            self.dtype,
            &self.path,
            |k| format!("token {}", range.start + k),
        )
    }
}

/// A token file of either kind.
pub enum TokenFile {
    Indexed(IndexedDataset),
    Flat(FlatTokens),
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenFile({})", self.path().display())
    }
}

/// One sequence of a window: where it starts in the stream and its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The sequence it belongs to (indexed: the sequence number; flat: the stream offset of
    /// the window's first token of it) and its offset there.
    pub sequence: usize,
    pub offset: usize,
    /// Stream offset of its first token.
    pub at: usize,
    pub tokens: Vec<u32>,
}

impl TokenFile {
    /// `spec` as `--data-path` names it: a prefix with `PREFIX.bin` and `PREFIX.idx` (or the
    /// `.bin` of such a pair), else a flat token file (which needs `flat.eod`).
    pub fn open(spec: &str, flat: FlatFormat) -> Result<Self, DataError> {
        let prefix = Path::new(spec);
        let (idx, bin) = indexed_paths(prefix);
        if idx.is_file() && bin.is_file() {
            return IndexedDataset::open(prefix).map(Self::Indexed);
        }
        // `PREFIX.bin` given for the pair: Megatron names the prefix, but the intent is clear.
        if let Some(stem) = spec.strip_suffix(".bin") {
            if indexed_paths(Path::new(stem)).0.is_file() {
                return IndexedDataset::open(Path::new(stem)).map(Self::Indexed);
            }
        }
        if prefix.is_file() {
            let eod = flat.eod.ok_or_else(|| {
                DataError::Invalid(format!(
                    "--data-path {spec} is a flat token file: --eod-token must say which id ends \
                     a document (nanoGPT's GPT-2 files: 50256)"
                ))
            })?;
            return FlatTokens::open(prefix, flat.dtype, eod).map(Self::Flat);
        }
        Err(DataError::Invalid(format!(
            "--data-path {spec}: neither a Megatron prefix ({} and {}) nor a token file",
            bin.display(),
            idx.display()
        )))
    }

    /// The token file (`.bin` of an indexed set).
    pub fn path(&self) -> &Path {
        match self {
            Self::Indexed(data) => data.bin_path(),
            Self::Flat(flat) => &flat.path,
        }
    }

    /// Tokens in the stream.
    pub fn total_tokens(&self) -> usize {
        match self {
            Self::Indexed(data) => data.total_tokens(),
            Self::Flat(flat) => flat.total_tokens(),
        }
    }

    /// The sequences of stream tokens `range`, in order; the first and last may be parts of
    /// longer ones.
    pub fn window(&self, range: Range<usize>) -> Result<Vec<Segment>, DataError> {
        match self {
            Self::Indexed(data) => {
                let mut at = range.start;
                data.locate(range)?
                    .into_iter()
                    .map(|(sequence, part)| {
                        let segment = Segment {
                            sequence,
                            offset: part.start,
                            at,
                            tokens: data.tokens(sequence, part.clone())?,
                        };
                        at += part.len();
                        Ok(segment)
                    })
                    .collect()
            }
            Self::Flat(flat) => {
                let tokens = flat.tokens(range.clone())?;
                let mut segments = Vec::new();
                let mut start = 0;
                for (k, &token) in tokens.iter().enumerate() {
                    if token == flat.eod || k + 1 == tokens.len() {
                        segments.push(Segment {
                            sequence: range.start + start,
                            offset: 0,
                            at: range.start + start,
                            tokens: tokens[start..=k].to_vec(),
                        });
                        start = k + 1;
                    }
                }
                Ok(segments)
            }
        }
    }

    /// The length of every document (indexed: every sequence, from the index; flat: the runs
    /// ended by the end-of-document id, read through the file once, in blocks). For statistics:
    /// training never reads a file whole.
    pub fn document_lengths(&self) -> Result<Vec<usize>, DataError> {
        match self {
            Self::Indexed(data) => (0..data.len()).map(|i| data.sequence_len(i)).collect(),
            Self::Flat(flat) => {
                let (mut lengths, mut current) = (Vec::new(), 0);
                let block = 1 << 20;
                for start in (0..flat.total_tokens()).step_by(block) {
                    let end = (start + block).min(flat.total_tokens());
                    for token in flat.tokens(start..end)? {
                        current += 1;
                        if token == flat.eod {
                            lengths.push(current);
                            current = 0;
                        }
                    }
                }
                if current > 0 {
                    lengths.push(current);
                }
                Ok(lengths)
            }
        }
    }

    /// The loss mask beside the token file (`TOKENS.mask`), if there is one.
    pub fn loss_mask(&self) -> Result<Option<LossMask>, DataError> {
        let path = mask_path(self.path());
        if !path.exists() {
            return Ok(None);
        }
        let mask = LossMask {
            map: map(&path)?,
            path,
        };
        if mask.map.len() != self.total_tokens() {
            return Err(DataError::Malformed {
                path: mask.path.clone(),
                line: 0,
                reason: format!(
                    "{} bytes, but {} holds {} tokens: a loss mask has one byte per token",
                    mask.map.len(),
                    self.path().display(),
                    self.total_tokens()
                ),
            });
        }
        Ok(Some(mask))
    }
}

/// The loss mask of token file `tokens`: `tokens` with `.mask` appended.
pub fn mask_path(tokens: &Path) -> PathBuf {
    let mut path = tokens.as_os_str().to_owned();
    path.push(".mask");
    PathBuf::from(path)
}

/// A loss mask, memory-mapped (see the module docs).
#[derive(Debug)]
pub struct LossMask {
    map: Mmap,
    path: PathBuf,
}

impl LossMask {
    /// Whether each token of stream `range` is a target; an error names a byte other than 0
    /// or 1.
    pub fn targets(&self, range: Range<usize>) -> Result<Vec<bool>, DataError> {
        let bytes = self.map.get(range.clone()).ok_or_else(|| {
            DataError::Invalid(format!(
                "bytes {range:?} of {}: it holds {}",
                self.path.display(),
                self.map.len()
            ))
        })?;
        bytes
            .iter()
            .enumerate()
            .map(|(k, &byte)| match byte {
                0 => Ok(false),
                1 => Ok(true),
                other => Err(DataError::Malformed {
                    path: self.path.clone(),
                    line: 0,
                    reason: format!(
                        "byte {} is {other}: a loss mask holds 1 (a target) or 0 (not one)",
                        range.start + k
                    ),
                }),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::IndexedWriter;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("bdcp-tokens-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_flat_file_splits_after_each_end_of_document() {
        let path = temp("flat");
        let tokens: [u16; 9] = [5, 6, 0, 7, 0, 8, 9, 10, 0];
        std::fs::write(
            &path,
            tokens
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let flat = FlatFormat {
            dtype: TokenType::U16,
            eod: Some(0),
        };
        let file = TokenFile::open(path.to_str().unwrap(), flat).unwrap();
        assert_eq!(file.total_tokens(), 9);
        let windows: Vec<Vec<Vec<u32>>> = [0..4, 4..8]
            .into_iter()
            .map(|range| {
                file.window(range)
                    .unwrap()
                    .into_iter()
                    .map(|s| s.tokens)
                    .collect()
            })
            .collect();
        assert_eq!(windows[0], vec![vec![5, 6, 0], vec![7]]);
        assert_eq!(windows[1], vec![vec![0], vec![8, 9, 10]]);
        let err = TokenFile::open(path.to_str().unwrap(), FlatFormat::default()).unwrap_err();
        assert!(err.to_string().contains("--eod-token"), "{err}");
        std::fs::write(&path, [1u8, 2, 3]).unwrap();
        let err = TokenFile::open(path.to_str().unwrap(), flat).unwrap_err();
        assert!(err.to_string().contains("3 bytes"), "{err}");
        std::fs::remove_file(&path).ok();
        let err = TokenFile::open(path.to_str().unwrap(), flat).unwrap_err();
        assert!(
            err.to_string().contains("neither a Megatron prefix"),
            "{err}"
        );
    }

    #[test]
    fn an_indexed_window_crosses_sequences_and_reads_its_mask() {
        let prefix = temp("indexed");
        let mut writer = IndexedWriter::create(&prefix, TokenType::U16).unwrap();
        for document in [vec![1, 2, 3], vec![], vec![4, 5], vec![6, 7, 8, 9]] {
            writer.add_document(&document).unwrap();
        }
        writer.finish().unwrap();
        let file = TokenFile::open(prefix.to_str().unwrap(), FlatFormat::default()).unwrap();
        assert_eq!(file.total_tokens(), 9);
        // The pair's `.bin` names it too.
        let by_bin = format!("{}.bin", prefix.to_str().unwrap());
        let by_bin = TokenFile::open(&by_bin, FlatFormat::default()).unwrap();
        assert!(matches!(by_bin, TokenFile::Indexed(_)));
        let segments = file.window(2..7).unwrap();
        let parts: Vec<(usize, usize, usize, Vec<u32>)> = segments
            .into_iter()
            .map(|s| (s.sequence, s.offset, s.at, s.tokens))
            .collect();
        assert_eq!(
            parts,
            vec![
                (0, 2, 2, vec![3]),
                (2, 0, 3, vec![4, 5]),
                (3, 0, 5, vec![6, 7])
            ]
        );
        assert!(file.loss_mask().unwrap().is_none());
        let mask = mask_path(file.path());
        std::fs::write(&mask, [0u8, 0, 1, 1, 1, 0, 1, 1, 1]).unwrap();
        let targets = file.loss_mask().unwrap().unwrap().targets(1..4).unwrap();
        assert_eq!(targets, vec![false, true, true]);
        std::fs::write(&mask, [0u8, 2, 1, 1, 1, 0, 1, 1, 1]).unwrap();
        let err = file
            .loss_mask()
            .unwrap()
            .unwrap()
            .targets(0..3)
            .unwrap_err();
        assert!(err.to_string().contains("byte 1 is 2"), "{err}");
        std::fs::write(&mask, [0u8; 4]).unwrap();
        let err = file.loss_mask().unwrap_err().to_string();
        assert!(err.contains("one byte per token"), "{err}");
        for path in [mask, file.path().to_path_buf(), indexed_paths(&prefix).0] {
            std::fs::remove_file(path).ok();
        }
    }
}
