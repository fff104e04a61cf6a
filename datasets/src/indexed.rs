//! Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read memory-mapped and written.
//!
//! The layout, as Megatron-LM's `megatron/core/datasets/indexed_dataset.py` writes it (version
//! 1, little-endian):
//!
//! | `.idx` field | bytes |
//! |---|---|
//! | magic `MMIDIDX\0\0` | 9 |
//! | version (`u64`, 1) | 8 |
//! | token dtype code (`u8`: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16) | 1 |
//! | sequence count `S` (`u64`) | 8 |
//! | document index count `D` (`u64`: documents + 1) | 8 |
//! | sequence lengths (`i32` × S, in tokens) | 4·S |
//! | sequence pointers (`i64` × S, byte offsets into `.bin`) | 8·S |
//! | document indices (`i64` × D: the first sequence of each document, then S) | 8·D |
//!
//! `.bin` holds the tokens of every sequence back to back in the dtype. Reading maps both files
//! and touches only the bytes asked for: a rank reads its own tokens, never the whole file.

use std::fs::File;

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::DataError;

mod token_type;
mod writer;

pub use token_type::TokenType;
pub use writer::IndexedWriter;

const MAGIC: &[u8; 9] = b"MMIDIDX\0\0";
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// A Megatron-LM indexed dataset, memory-mapped: the index is checked once, tokens are read
/// on demand.
pub struct IndexedDataset {
    idx: Mmap,
    bin: Mmap,
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: TokenType,
    sequences: usize,
    documents: usize,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("index", &self.idx_path)
            .field("bin", &self.bin_path)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequences)
            .field("documents", &self.documents())
            .finish()
    }
}

/// `PREFIX.idx` and `PREFIX.bin`.
pub fn indexed_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |extension: &str| {
        let mut path = prefix.as_os_str().to_owned();
        path.push(extension);
        PathBuf::from(path)
    };
    (with(".idx"), with(".bin"))
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin`, checking the index: magic, version, dtype, that
    /// the counts fit the file, every sequence inside `.bin`, document indices ascending up to
    /// the sequence count. Errors name the file and the rule.
    pub fn open(prefix: &Path) -> Result<Self, DataError> {
        let (idx_path, bin_path) = indexed_paths(prefix);
        let (idx, bin) = (map(&idx_path)?, map(&bin_path)?);
        let bad = |reason: String| DataError::Malformed {
            path: idx_path.clone(),
            line: 0,
            reason,
        };
        if idx.len() < HEADER || &idx[..9] != MAGIC {
            return Err(bad(format!(
                "not a Megatron indexed dataset index (magic MMIDIDX\\0\\0, {HEADER}-byte header; \
                 {} bytes)",
                idx.len()
            )));
        }
        let word = |at: usize| u64::from_le_bytes(idx[at..at + 8].try_into().unwrap_or_default());
        let version = word(9);
        if version != 1 {
            return Err(bad(format!("version {version}: only version 1 is read")));
        }
        let dtype = TokenType::from_code(idx[17]).ok_or_else(|| {
            bad(format!(
                "dtype code {}: token ids are uint8 (1), int16 (3), int32 (4), int64 (5) or \
                 uint16 (8)",
                idx[17]
            ))
        })?;
        let (sequences, documents) = (word(18) as usize, word(26) as usize);
        let need = sequences
            .checked_mul(12)
            .and_then(|s| documents.checked_mul(8).and_then(|d| s.checked_add(d)))
            .and_then(|n| n.checked_add(HEADER));
        if need.is_none_or(|need| need > idx.len()) {
            return Err(bad(format!(
                "{sequences} sequences and {documents} document indices need more than the \
                 file's {} bytes",
                idx.len()
            )));
        }
        let data = Self {
            idx,
            bin,
            idx_path: idx_path.clone(),
            bin_path,
            dtype,
            sequences,
            documents,
        };
        // Megatron writes the sequences back to back: the last one ends where `.bin` ends.
        // Sequences are checked one by one when read, so opening touches no per-sequence page
        // (the index of a large data set is never read whole).
        if sequences > 0 {
            let last = sequences - 1;
            let end = (data.raw_len(last) as i64)
                .checked_mul(dtype.size() as i64)
                .and_then(|bytes| data.pointer(last).checked_add(bytes));
            if end != Some(data.bin.len() as i64) {
                return Err(bad(format!(
                    "the last sequence ({} tokens at byte {}) does not end where {} ends ({} bytes)",
                    data.raw_len(last),
                    data.pointer(last),
                    data.bin_path.display(),
                    data.bin.len()
                )));
            }
        }
        Ok(data)
    }

    /// Sequence `i`'s length and byte offset, checked: both non-negative and the tokens inside
    /// `.bin`.
    fn checked(&self, i: usize) -> Result<(usize, usize), DataError> {
        let (len, pointer) = (self.raw_len(i), self.pointer(i));
        let end = (len >= 0 && pointer >= 0)
            .then(|| (pointer as u64).checked_add(len as u64 * self.dtype.size() as u64))
            .flatten();
        if end.is_none_or(|end| end > self.bin.len() as u64) {
            return Err(DataError::Malformed {
                path: self.idx_path.clone(),
                line: 0,
                reason: format!(
                    "sequence {i} ({len} tokens at byte {pointer}) is not inside {} ({} bytes)",
                    self.bin_path.display(),
                    self.bin.len()
                ),
            });
        }
        Ok((len as usize, pointer as usize))
    }

    fn raw_len(&self, i: usize) -> i32 {
        let at = HEADER + 4 * i;
        i32::from_le_bytes(self.idx[at..at + 4].try_into().unwrap_or_default())
    }

    fn pointer(&self, i: usize) -> i64 {
        let at = HEADER + 4 * self.sequences + 8 * i;
        i64::from_le_bytes(self.idx[at..at + 8].try_into().unwrap_or_default())
    }

    /// The `.bin` file.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// The token type of `.bin`.
    pub fn dtype(&self) -> TokenType {
        self.dtype
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.sequences
    }

    /// Whether there is no sequence.
    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// Number of documents.
    pub fn documents(&self) -> usize {
        self.documents.saturating_sub(1)
    }

    /// Tokens of sequence `i < len()`, from the index alone; an error names a sequence that
    /// does not lie inside `.bin`.
    pub fn sequence_len(&self, i: usize) -> Result<usize, DataError> {
        self.in_range(i)?;
        Ok(self.checked(i)?.0)
    }

    /// Tokens in `.bin` (every sequence's, back to back).
    pub fn total_tokens(&self) -> usize {
        self.bin.len() / self.dtype.size()
    }

    fn in_range(&self, i: usize) -> Result<(), DataError> {
        if i >= self.sequences {
            return Err(DataError::Invalid(format!(
                "sequence {i}: {} has {} sequences",
                self.idx_path.display(),
                self.sequences
            )));
        }
        Ok(())
    }

    /// The first sequence of each document, then the sequence count; an error when they do not
    /// rise from 0 to the sequence count.
    pub fn document_indices(&self) -> Result<Vec<usize>, DataError> {
        let base = HEADER + 12 * self.sequences;
        let indices: Vec<i64> = (0..self.documents)
            .map(|d| {
                let at = base + 8 * d;
                i64::from_le_bytes(self.idx[at..at + 8].try_into().unwrap_or_default())
            })
            .collect();
        let ordered = indices.first() == Some(&0)
            && indices.last() == Some(&(self.sequences as i64))
            && indices.windows(2).all(|w| w[0] <= w[1]);
        if !ordered {
            return Err(DataError::Malformed {
                path: self.idx_path.clone(),
                line: 0,
                reason: format!(
                    "document indices must rise from 0 to the sequence count {}",
                    self.sequences
                ),
            });
        }
        Ok(indices.into_iter().map(|i| i as usize).collect())
    }

    /// The sequences holding tokens `range` of the concatenation of every sequence (in `.bin`
    /// order), as `(sequence, range within it)`, empty sequences left out. Finds the first one by
    /// bisection over the byte pointers and checks each sequence it reads: in `.bin`, and
    /// directly after the one before (Megatron's layout), so a disordered index is an error,
    /// never a wrong read. Touches `O(log S + sequences in range)` entries of the index.
    pub fn locate(
        &self,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<(usize, std::ops::Range<usize>)>, DataError> {
        let size = self.dtype.size();
        if range.start > range.end || range.end > self.total_tokens() {
            return Err(DataError::Invalid(format!(
                "tokens {range:?} of {}: it holds {} tokens",
                self.bin_path.display(),
                self.total_tokens()
            )));
        }
        let mut parts = Vec::new();
        if range.is_empty() {
            return Ok(parts);
        }
        // The last sequence starting at or before the first byte asked for.
        let (mut low, mut high) = (0, self.sequences);
        while high - low > 1 {
            let middle = (low + high) / 2;
            if self.checked(middle)?.1 <= range.start * size {
                low = middle;
            } else {
                high = middle;
            }
        }
        let (mut sequence, mut at) = (low, range.start);
        let (mut len, mut pointer) = self.checked(sequence)?;
        let disordered = |reason: String| DataError::Malformed {
            path: self.idx_path.clone(),
            line: 0,
            reason: format!(
                "{reason}: sequences must lie back to back in .bin, as Megatron writes them"
            ),
        };
        loop {
            let first = pointer / size;
            if pointer % size != 0 || (len > 0 && !(first..first + len).contains(&at)) {
                return Err(disordered(format!(
                    "token {at} is not in sequence {sequence} ({len} tokens at byte {pointer})"
                )));
            }
            if len > 0 {
                let upto = (first + len).min(range.end);
                parts.push((sequence, at - first..upto - first));
                at = upto;
            }
            if at == range.end {
                break;
            }
            let next = sequence + 1;
            if next >= self.sequences {
                return Err(disordered(format!(
                    "token {at} lies past the last sequence"
                )));
            }
            let following = self.checked(next)?;
            if following.1 != pointer + len * size {
                return Err(disordered(format!(
                    "sequence {next} does not start where sequence {sequence} ends (byte {})",
                    pointer + len * size
                )));
            }
            (sequence, (len, pointer)) = (next, following);
        }
        Ok(parts)
    }

    /// Tokens `range` of sequence `i`, reading only their bytes. Errors name a range outside the
    /// sequence or a token id outside `u32`.
    pub fn tokens(&self, i: usize, range: std::ops::Range<usize>) -> Result<Vec<u32>, DataError> {
        self.in_range(i)?;
        let (len, pointer) = self.checked(i)?;
        if range.start > range.end || range.end > len {
            return Err(DataError::Invalid(format!(
                "tokens {range:?} of sequence {i}: {} has {} sequences, that one {len} tokens",
                self.bin_path.display(),
                self.sequences,
            )));
        }
        let size = self.dtype.size();
        decode_tokens(
            &self.bin[pointer + range.start * size..pointer + range.end * size],
            self.dtype,
            &self.bin_path,
            |k| format!("token {} of sequence {i}", range.start + k),
        )
    }
}

/// `bytes` decoded as `dtype` tokens; an error names the file and the token (`which(k)` for
/// the `k`-th) whose id is outside `u32`.
pub(crate) fn decode_tokens(
    bytes: &[u8],
    dtype: TokenType,
    path: &Path,
    which: impl Fn(usize) -> String,
) -> Result<Vec<u32>, DataError> {
    bytes
        .chunks_exact(dtype.size())
        .enumerate()
        .map(|(k, bytes)| {
            let token = dtype.decode(bytes);
            u32::try_from(token).map_err(|_| DataError::Malformed {
                path: path.to_path_buf(),
                line: 0,
                reason: format!("{} is {token}: ids are 0 ..= {}", which(k), u32::MAX),
            })
        })
        .collect()
}

/// `path` memory-mapped, read only.
pub(crate) fn map(path: &Path) -> Result<Mmap, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    // SAFETY: the map is read only; a file changed by another process while mapped would
    // change what is read (the tokens), never memory safety of this process beyond that, as
    // with any reader of a file that is being rewritten.
    unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, format!("cannot map: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("bdcp-indexed-{name}-{}", std::process::id()))
    }

    #[test]
    fn written_documents_read_back_by_range() {
        let documents: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![], vec![65_000, 7], vec![42]];
        for dtype in [TokenType::U16, TokenType::I32, TokenType::I64] {
            let prefix = prefix(&format!("{dtype:?}"));
            let mut writer = IndexedWriter::create(&prefix, dtype).unwrap();
            for document in &documents {
                writer.add_document(document).unwrap();
            }
            writer.finish().unwrap();
            let data = IndexedDataset::open(&prefix).unwrap();
            assert_eq!((data.len(), data.documents(), data.dtype()), (4, 4, dtype));
            assert_eq!(data.document_indices().unwrap(), vec![0, 1, 2, 3, 4]);
            for (i, document) in documents.iter().enumerate() {
                assert_eq!(data.sequence_len(i).unwrap(), document.len());
                assert_eq!(&data.tokens(i, 0..document.len()).unwrap(), document);
            }
            assert_eq!(data.tokens(0, 1..3).unwrap(), vec![2, 3]);
            let err = data.tokens(0, 2..4).unwrap_err().to_string();
            assert!(err.contains("2..4") && err.contains("3 tokens"), "{err}");
            let (idx, bin) = indexed_paths(&prefix);
            std::fs::remove_file(idx).ok();
            std::fs::remove_file(bin).ok();
        }
        let mut writer = IndexedWriter::create(&prefix("u8"), TokenType::U8).unwrap();
        let err = writer.add_document(&[300]).unwrap_err().to_string();
        assert!(err.contains("300") && err.contains("U8"), "{err}");
        let (idx, bin) = indexed_paths(&prefix("u8"));
        std::fs::remove_file(idx).ok();
        std::fs::remove_file(bin).ok();
    }

    /// An index laid out by hand as Megatron-LM writes it: two documents, the first of two
    /// sequences (a document split into sentences), uint16 tokens.
    #[test]
    fn reads_a_hand_written_megatron_index() {
        let prefix = prefix("megatron");
        let (idx_path, bin_path) = indexed_paths(&prefix);
        let tokens: [u16; 6] = [10, 11, 12, 20, 30, 31];
        let bin: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&bin_path, bin).unwrap();
        let mut idx = b"MMIDIDX\0\0".to_vec();
        idx.extend(1u64.to_le_bytes());
        idx.push(8); // uint16
        idx.extend(3u64.to_le_bytes()); // sequences
        idx.extend(3u64.to_le_bytes()); // documents + 1
        for len in [3i32, 1, 2] {
            idx.extend(len.to_le_bytes());
        }
        for pointer in [0i64, 6, 8] {
            idx.extend(pointer.to_le_bytes());
        }
        for document in [0i64, 2, 3] {
            idx.extend(document.to_le_bytes());
        }
        std::fs::write(&idx_path, &idx).unwrap();
        let data = IndexedDataset::open(&prefix).unwrap();
        assert_eq!((data.len(), data.documents()), (3, 2));
        assert_eq!(data.document_indices().unwrap(), vec![0, 2, 3]);
        assert_eq!(data.tokens(1, 0..1).unwrap(), vec![20]);
        assert_eq!(data.tokens(2, 0..2).unwrap(), vec![30, 31]);
        // The concatenation of the sequences, located by token range.
        assert_eq!(data.total_tokens(), 6);
        assert_eq!(
            data.locate(0..6).unwrap(),
            vec![(0, 0..3), (1, 0..1), (2, 0..2)]
        );
        assert_eq!(
            data.locate(2..5).unwrap(),
            vec![(0, 2..3), (1, 0..1), (2, 0..1)]
        );
        assert_eq!(data.locate(3..4).unwrap(), vec![(1, 0..1)]);
        assert_eq!(data.locate(4..4).unwrap(), vec![]);
        assert!(data
            .locate(5..7)
            .unwrap_err()
            .to_string()
            .contains("holds 6 tokens"));

        // Broken indexes are refused, naming the rule.
        let refused = |idx: &[u8], expect: &str| {
            std::fs::write(&idx_path, idx).unwrap();
            let err = IndexedDataset::open(&prefix).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: {err}");
        };
        let mut magic = idx.clone();
        magic[0] = b'X';
        refused(&magic, "magic");
        let mut version = idx.clone();
        version[9] = 2;
        refused(&version, "version 2");
        let mut float = idx.clone();
        float[17] = 7;
        refused(&float, "dtype code 7");
        refused(&idx[..idx.len() - 1], "need more than");
        let mut outside = idx.clone();
        let pointer_at = HEADER + 12 + 16;
        outside[pointer_at..pointer_at + 8].copy_from_slice(&100i64.to_le_bytes());
        refused(
            &outside,
            "the last sequence (2 tokens at byte 100) does not end",
        );
        // Per-sequence rules are checked where a sequence is read (opening reads no entry).
        let opened_then_refused =
            |idx: &[u8], read: &dyn Fn(&IndexedDataset) -> Result<(), DataError>, expect: &str| {
                std::fs::write(&idx_path, idx).unwrap();
                let data = IndexedDataset::open(&prefix).unwrap();
                let err = read(&data).unwrap_err().to_string();
                assert!(err.contains(expect), "{expect}: {err}");
            };
        let mut middle = idx.clone();
        let pointer_at = HEADER + 12 + 8;
        middle[pointer_at..pointer_at + 8].copy_from_slice(&100i64.to_le_bytes());
        let expect = "sequence 1 (1 tokens at byte 100) is not inside";
        opened_then_refused(&middle, &|d| d.tokens(1, 0..1).map(drop), expect);
        opened_then_refused(&middle, &|d| d.locate(0..6).map(drop), expect);
        let mut apart = idx.clone();
        apart[pointer_at..pointer_at + 8].copy_from_slice(&8i64.to_le_bytes());
        let expect = "sequence 1 does not start where sequence 0 ends (byte 6)";
        opened_then_refused(&apart, &|d| d.locate(0..6).map(drop), expect);
        let mut unordered = idx.clone();
        let docs_at = HEADER + 36 + 8;
        unordered[docs_at..docs_at + 8].copy_from_slice(&5i64.to_le_bytes());
        opened_then_refused(
            &unordered,
            &|d| d.document_indices().map(drop),
            "document indices",
        );
        std::fs::remove_file(idx_path).ok();
        std::fs::remove_file(bin_path).ok();
    }
}
