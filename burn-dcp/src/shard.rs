//! Sharding a packed micro-batch for a CP rank, and unsharding per-token results for checks.
//!
//! A packed micro-batch is sequences laid end to end (no padding): `tokens [T]`, `labels [T]`
//! (next token within the same sequence, `-1` at a sequence's last token), `positions [T]`
//! (position within the sequence) and `seq_lens`. A rank gets the tokens its layout assigns to it
//! ([`Sharding::packed_indices`]), in that order — the order CP attention expects — with their
//! *global* positions (RoPE) and labels.

use crate::error::CpError;
use crate::layout::{Layout, Sharding};

/// A packed micro-batch of whole sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedMicroBatch {
    pub tokens: Vec<i64>,
    pub labels: Vec<i64>,
    pub positions: Vec<i64>,
    pub seq_lens: Vec<usize>,
}

/// One rank's share of a micro-batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShard {
    pub tokens: Vec<i64>,
    pub labels: Vec<i64>,
    pub positions: Vec<i64>,
    /// Index in the packed micro-batch of every local token.
    pub packed_indices: Vec<usize>,
}

impl PackedMicroBatch {
    /// Packs whole documents: labels are the next token of the same document.
    pub fn from_documents(documents: &[Vec<i64>]) -> Self {
        let mut batch = Self {
            tokens: Vec::new(),
            labels: Vec::new(),
            positions: Vec::new(),
            seq_lens: Vec::new(),
        };
        for document in documents {
            batch.seq_lens.push(document.len());
            for (position, &token) in document.iter().enumerate() {
                batch.tokens.push(token);
                batch.positions.push(position as i64);
                batch
                    .labels
                    .push(document.get(position + 1).copied().unwrap_or(-1));
            }
        }
        batch
    }

    /// Number of tokens with a label (the loss's denominator).
    pub fn label_count(&self) -> usize {
        self.labels.iter().filter(|&&l| l >= 0).count()
    }

    /// The sharding of this micro-batch over `cp` ranks.
    pub fn sharding(&self, cp: usize, layout: Layout) -> Result<Sharding, CpError> {
        let total: usize = self.seq_lens.iter().sum();
        if total != self.tokens.len() || self.labels.len() != total || self.positions.len() != total
        {
            return Err(CpError::Input(format!(
                "micro-batch holds {} tokens, {} labels and {} positions but its sequence lengths sum to {total}",
                self.tokens.len(),
                self.labels.len(),
                self.positions.len()
            )));
        }
        Sharding::new(&self.seq_lens, cp, layout)
    }

    /// Rank `rank`'s tokens, labels and global positions.
    pub fn shard(&self, sharding: &Sharding, rank: usize) -> RankShard {
        let packed_indices = sharding.packed_indices(rank);
        let pick = |values: &[i64]| packed_indices.iter().map(|&i| values[i]).collect();
        RankShard {
            tokens: pick(&self.tokens),
            labels: pick(&self.labels),
            positions: pick(&self.positions),
            packed_indices,
        }
    }
}

/// Puts per-token rows (`width` values per token) of every rank back in packed order.
pub fn unshard_rows(
    shards: &[(Vec<usize>, Vec<f32>)],
    width: usize,
    total_tokens: usize,
) -> Vec<f32> {
    let mut full = vec![0.0; total_tokens * width];
    for (indices, rows) in shards {
        scatter_rows(&mut full, width, indices, rows);
    }
    full
}

/// Writes `rows` (token-major, `width` values per token) to rows `indices` of `full`.
pub fn scatter_rows(full: &mut [f32], width: usize, indices: &[usize], rows: &[f32]) {
    for (local, &index) in indices.iter().enumerate() {
        full[index * width..(index + 1) * width]
            .copy_from_slice(&rows[local * width..(local + 1) * width]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_batch_with_global_positions() {
        let batch = PackedMicroBatch::from_documents(&[vec![5, 6, 7, 8, 9], vec![1, 2, 3]]);
        assert_eq!(batch.labels, vec![6, 7, 8, 9, -1, 2, 3, -1]);
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            let sharding = batch.sharding(2, layout).unwrap();
            let shards: Vec<_> = (0..2).map(|r| batch.shard(&sharding, r)).collect();
            let rows: Vec<_> = shards
                .iter()
                .map(|s| {
                    (
                        s.packed_indices.clone(),
                        s.positions.iter().map(|&p| p as f32).collect(),
                    )
                })
                .collect();
            assert_eq!(
                unshard_rows(&rows, 1, 8),
                vec![0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 1.0, 2.0],
                "{layout}"
            );
        }
    }
}
