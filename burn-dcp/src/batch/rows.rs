//! Batches of several rows: `[B, S, …]` tensors, as burn models see them.
//!
//! A packed micro-batch is a list of sequences ([`Placement::seq_lens`]). burn models take
//! `[B, S, …]` batches whose rows are padded to a common length (burn-nn's `mask_pad`). Under CP,
//! [`BatchRows`] says which sequences each row holds: one each ([`BatchRows::one_per_row`]) or a
//! packed row of several ([`BatchRows::packed`]), laid end to end from column 0, padding after.
//! Padded tokens are not sequences: they are never sharded, attended or communicated.
//!
//! On rank `r`, the local batch is `[B, W, …]`: row `b` holds the rank's tokens of row `b`'s
//! sequences in the placement's order, in columns `0..n_b`, and padding after (any `W ≥ max n_b`;
//! [`LocalRows::width`] is the smallest). [`LocalRows`] cuts a rank's rows out of a full batch,
//! gives their global positions (for RoPE and sinusoids) and padding mask, and maps them to the
//! packed order the strategies work in.

use burn::prelude::{Backend, Bool, Int, Tensor, TensorData};

use crate::batch::placement::Placement;
use crate::error::CpError;

/// Which sequences of the micro-batch each row of a `[B, S, …]` batch holds (consecutive
/// sequences, in order: row 0 the first `seqs_per_row[0]`, row 1 the next, …).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BatchRows {
    seqs_per_row: Vec<usize>,
}

impl BatchRows {
    /// `rows` rows of one sequence each (sequence `b` in row `b`).
    pub fn one_per_row(rows: usize) -> Self {
        Self {
            seqs_per_row: vec![1; rows],
        }
    }

    /// Rows of several sequences each, packed end to end (`seqs_per_row[b]` sequences in row `b`).
    pub fn packed(seqs_per_row: Vec<usize>) -> Self {
        Self { seqs_per_row }
    }

    /// Number of rows (`B`).
    pub fn rows(&self) -> usize {
        self.seqs_per_row.len()
    }

    pub fn seqs_per_row(&self) -> &[usize] {
        &self.seqs_per_row
    }

    /// The row of every sequence, and its first column in that row.
    fn homes(&self, seq_lens: &[usize]) -> Result<Vec<(usize, usize)>, CpError> {
        let total: usize = self.seqs_per_row.iter().sum();
        if total != seq_lens.len() {
            return Err(CpError::Config(format!(
                "the batch rows hold {total} sequences ({:?} per row) but the micro-batch has {} (lengths {seq_lens:?})",
                self.seqs_per_row,
                seq_lens.len()
            )));
        }
        let mut homes = Vec::with_capacity(seq_lens.len());
        let mut seq = 0;
        for (row, &count) in self.seqs_per_row.iter().enumerate() {
            let mut column = 0;
            for _ in 0..count {
                homes.push((row, column));
                column += seq_lens[seq];
                seq += 1;
            }
        }
        Ok(homes)
    }

    /// Rank `rank`'s rows under `placement`.
    pub fn local(&self, placement: &Placement, rank: usize) -> Result<LocalRows, CpError> {
        if rank >= placement.cp() {
            return Err(CpError::Config(format!(
                "rank {rank} is not in a placement over {} ranks",
                placement.cp()
            )));
        }
        let homes = self.homes(&placement.seq_lens)?;
        let mut tokens: Vec<Vec<LocalToken>> = vec![Vec::new(); self.rows()];
        let mut packed = Vec::with_capacity(placement.tokens(rank));
        for segment in placement.segments(rank) {
            let (row, first_column) = homes[segment.seq];
            for t in 0..segment.len {
                let position = segment.position(t);
                packed.push((row, tokens[row].len()));
                tokens[row].push(LocalToken {
                    position,
                    column: first_column + position,
                });
            }
        }
        let full_width = (0..self.rows())
            .map(|row| {
                homes
                    .iter()
                    .zip(&placement.seq_lens)
                    .filter(|((r, _), _)| *r == row)
                    .map(|(_, len)| len)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        Ok(LocalRows {
            tokens,
            packed,
            full_width,
        })
    }
}

/// One local token of a row: its position in its sequence and its column in the full row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LocalToken {
    position: usize,
    column: usize,
}

/// A rank's rows of a batch (see the module docs): built by [`BatchRows::local`] or
/// [`CpBatch::local_rows`](crate::strategy::CpBatch::local_rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRows {
    /// Per row, its local tokens in local column order.
    tokens: Vec<Vec<LocalToken>>,
    /// (row, local column) of each local token in the placement's (packed) order.
    packed: Vec<(usize, usize)>,
    /// The longest full row (real tokens, without padding).
    full_width: usize,
}

impl LocalRows {
    /// Number of rows (`B`).
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The smallest local width: the most tokens one row holds on this rank.
    pub fn width(&self) -> usize {
        self.tokens.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The local tokens of row `row`.
    pub fn tokens(&self, row: usize) -> usize {
        self.tokens[row].len()
    }

    /// Tokens of this rank (all rows).
    pub fn total_tokens(&self) -> usize {
        self.packed.len()
    }

    /// The longest row of the full batch without padding (the smallest full width).
    pub fn full_width(&self) -> usize {
        self.full_width
    }

    fn check_width(&self, width: usize) -> Result<(), CpError> {
        if width < self.width() {
            return Err(CpError::Input(format!(
                "local rows of width {width} cannot hold this rank's tokens: a row holds up to {} of them",
                self.width()
            )));
        }
        Ok(())
    }

    /// Row-major `[B, width]` values: `value(token)` at each local token, `pad` after.
    fn fill<T: Copy>(
        &self,
        width: usize,
        pad: T,
        value: impl Fn(&LocalToken) -> T,
    ) -> Result<Vec<T>, CpError> {
        self.check_width(width)?;
        let mut out = vec![pad; self.rows() * width];
        for (row, tokens) in self.tokens.iter().enumerate() {
            for (column, token) in tokens.iter().enumerate() {
                out[row * width + column] = value(token);
            }
        }
        Ok(out)
    }

    /// This rank's `[B, width]` slice of a full row-major `[B, full_width]` batch (token ids,
    /// labels, …); padding columns get `pad`.
    pub fn gather<T: Copy>(
        &self,
        full: &[T],
        full_width: usize,
        width: usize,
        pad: T,
    ) -> Result<Vec<T>, CpError> {
        if full_width < self.full_width || full.len() != self.rows() * full_width {
            return Err(CpError::Input(format!(
                "the full batch has {} values; {} rows of width {full_width} (at least {}) were expected",
                full.len(),
                self.rows(),
                self.full_width
            )));
        }
        let mut out = vec![pad; self.rows() * width];
        self.check_width(width)?;
        for (row, tokens) in self.tokens.iter().enumerate() {
            for (column, token) in tokens.iter().enumerate() {
                out[row * width + column] = full[row * full_width + token.column];
            }
        }
        Ok(out)
    }

    /// Writes this rank's `[B, width]` rows (`values`, `item` values per token) back into a full
    /// row-major `[B, full_width, item]` buffer (padding untouched).
    pub fn scatter<T: Copy>(
        &self,
        values: &[T],
        width: usize,
        item: usize,
        full: &mut [T],
        full_width: usize,
    ) -> Result<(), CpError> {
        self.check_width(width)?;
        if values.len() != self.rows() * width * item
            || full.len() != self.rows() * full_width * item
            || full_width < self.full_width
        {
            return Err(CpError::Input(format!(
                "scatter of {} local values ({} rows × {width} × {item}) into {} values of width {full_width}",
                values.len(),
                self.rows(),
                full.len()
            )));
        }
        for (row, tokens) in self.tokens.iter().enumerate() {
            for (column, token) in tokens.iter().enumerate() {
                let from = (row * width + column) * item;
                let to = (row * full_width + token.column) * item;
                full[to..to + item].copy_from_slice(&values[from..from + item]);
            }
        }
        Ok(())
    }

    /// Global positions (within each token's sequence) of the `[B, width]` local batch; 0 at padding.
    pub fn positions(&self, width: usize) -> Result<Vec<i64>, CpError> {
        self.fill(width, 0, |token| token.position as i64)
    }

    /// burn-nn's padding mask of the `[B, width]` local batch: `true` at padding.
    pub fn mask_pad(&self, width: usize) -> Result<Vec<bool>, CpError> {
        self.fill(width, true, |_| false)
    }

    /// [`Self::positions`] as a `[B, width]` tensor.
    pub fn positions_tensor<B: Backend>(
        &self,
        width: usize,
        device: &B::Device,
    ) -> Result<Tensor<B, 2, Int>, CpError> {
        let data = TensorData::new(self.positions(width)?, [self.rows(), width]);
        Ok(Tensor::from_data(data, device))
    }

    /// [`Self::mask_pad`] as a `[B, width]` tensor.
    pub fn mask_pad_tensor<B: Backend>(
        &self,
        width: usize,
        device: &B::Device,
    ) -> Result<Tensor<B, 2, Bool>, CpError> {
        let data = TensorData::new(self.mask_pad(width)?, [self.rows(), width]);
        Ok(Tensor::from_data(data, device))
    }

    /// For each local token in the placement's (packed) order, its index in the flattened
    /// `[B · width]` local batch.
    pub fn packed_indices(&self, width: usize) -> Result<Vec<usize>, CpError> {
        self.check_width(width)?;
        Ok(self
            .packed
            .iter()
            .map(|&(row, column)| row * width + column)
            .collect())
    }

    /// Whether `[rows, width]` local tensors already are the packed order (one row, no padding).
    pub fn is_packed_order(&self, rows: usize, width: usize) -> bool {
        rows == 1 && self.rows() == 1 && width == self.total_tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::layout::Layout;

    #[test]
    fn padded_rows_cover_every_token_once_with_global_positions() {
        let lens = [5, 2, 4];
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            for cp in 1..5 {
                let placement = Placement::of_layout(&lens, cp, layout).unwrap();
                let rows = BatchRows::one_per_row(3);
                let full_width = 6;
                let full: Vec<i64> = (0..18).collect();
                let mut back = vec![-1i64; 18];
                for rank in 0..cp {
                    let local = rows.local(&placement, rank).unwrap();
                    let width = local.width() + 1;
                    let values = local.gather(&full, full_width, width, -7).unwrap();
                    let positions = local.positions(width).unwrap();
                    let pad = local.mask_pad(width).unwrap();
                    for i in 0..values.len() {
                        if pad[i] {
                            assert_eq!(values[i], -7);
                        } else {
                            // A full row's column is the token's position (one sequence per row).
                            assert_eq!(values[i] % 6, positions[i], "{layout} cp {cp}");
                        }
                    }
                    local
                        .scatter(&values, width, 1, &mut back, full_width)
                        .unwrap();
                    // The packed order visits exactly the real local tokens.
                    let mut flat = local.packed_indices(width).unwrap();
                    assert_eq!(flat.len(), placement.tokens(rank));
                    flat.sort_unstable();
                    flat.dedup();
                    assert!(flat.iter().all(|&i| !pad[i]));
                    assert_eq!(flat.len(), placement.tokens(rank));
                }
                for (i, v) in back.iter().enumerate() {
                    let (row, column) = (i / 6, i % 6);
                    let real = column < lens[row];
                    assert_eq!(*v, if real { i as i64 } else { -1 }, "{layout} cp {cp}");
                }
            }
        }
    }

    #[test]
    fn packed_rows_put_sequences_end_to_end() {
        let placement = Placement::of_layout(&[3, 2, 4], 1, Layout::Contiguous).unwrap();
        let local = BatchRows::packed(vec![2, 1]).local(&placement, 0).unwrap();
        assert_eq!(local.width(), 5);
        assert_eq!(local.full_width(), 5);
        assert_eq!(
            local.positions(5).unwrap(),
            vec![0, 1, 2, 0, 1, 0, 1, 2, 3, 0]
        );
        assert_eq!(
            local.packed_indices(5).unwrap(),
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8]
        );
        let error = BatchRows::packed(vec![1, 1])
            .local(&placement, 0)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("2 sequences") && error.contains("has 3"),
            "{error}"
        );
        let narrow = local.positions(4).unwrap_err().to_string();
        assert!(narrow.contains("width 4"), "{narrow}");
    }
}
