//! Writing an indexed dataset: `.bin` as documents arrive, `.idx` at [`IndexedWriter::finish`].

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{indexed_paths, TokenType, HEADER, MAGIC};
use crate::error::DataError;

/// Writes a Megatron-LM indexed dataset: one sequence per document (as Megatron's
/// `preprocess_data.py` writes unsplit documents), the index at [`Self::finish`].
pub struct IndexedWriter {
    bin: BufWriter<File>,
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: TokenType,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    written: i64,
    buffer: Vec<u8>,
}

impl IndexedWriter {
    /// Creates `PREFIX.bin` (the index is written by [`Self::finish`]).
    pub fn create(prefix: &Path, dtype: TokenType) -> Result<Self, DataError> {
        let (idx_path, bin_path) = indexed_paths(prefix);
        if dtype.code().is_none() {
            return Err(DataError::Invalid(format!(
                "{dtype:?}: Megatron's index has no code for it (int32 holds every id below 2^31)"
            )));
        }
        let file = File::create(&bin_path).map_err(|e| DataError::io(&bin_path, e))?;
        Ok(Self {
            bin: BufWriter::new(file),
            idx_path,
            bin_path,
            dtype,
            lengths: Vec::new(),
            pointers: Vec::new(),
            written: 0,
            buffer: Vec::new(),
        })
    }

    /// Appends one document. Errors name a token the type cannot hold, or a document longer
    /// than the index's `i32` lengths.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let len = i32::try_from(tokens.len()).map_err(|_| {
            DataError::Invalid(format!(
                "a document of {} tokens: the index holds lengths up to {}",
                tokens.len(),
                i32::MAX
            ))
        })?;
        self.buffer.clear();
        for &token in tokens {
            if !self.dtype.encode(token, &mut self.buffer) {
                return Err(DataError::Invalid(format!(
                    "token {token} does not fit {:?} (writing {})",
                    self.dtype,
                    self.bin_path.display()
                )));
            }
        }
        self.bin
            .write_all(&self.buffer)
            .map_err(|e| DataError::io(&self.bin_path, e))?;
        self.lengths.push(len);
        self.pointers.push(self.written);
        self.written += self.buffer.len() as i64;
        Ok(())
    }

    /// Flushes `.bin` and writes `.idx`.
    pub fn finish(mut self) -> Result<(), DataError> {
        self.bin
            .flush()
            .map_err(|e| DataError::io(&self.bin_path, e))?;
        let sequences = self.lengths.len();
        let mut idx = Vec::with_capacity(HEADER + 20 * sequences + 8);
        idx.extend(MAGIC);
        idx.extend(1u64.to_le_bytes());
        idx.push(self.dtype.code().unwrap_or_default());
        idx.extend((sequences as u64).to_le_bytes());
        idx.extend((sequences as u64 + 1).to_le_bytes());
        for len in &self.lengths {
            idx.extend(len.to_le_bytes());
        }
        for pointer in &self.pointers {
            idx.extend(pointer.to_le_bytes());
        }
        for document in 0..=sequences as i64 {
            idx.extend(document.to_le_bytes());
        }
        std::fs::write(&self.idx_path, idx).map_err(|e| DataError::io(&self.idx_path, e))
    }
}
