//! A rank's shard of a packed micro-batch, and unsharding per-token results for checks.
//!
//! A packed micro-batch ([`MicroBatch`]) is sequences laid end to end (no padding): tokens,
//! labels (next token within the same sequence, `-1` at a sequence's last token), positions
//! within the sequence, `cu_seqlens` and a mask per sequence. A [`Placement`] says which tokens
//! each rank of the CP group holds; [`RankShard::of`] cuts rank `r`'s out, in the placement's
//! local order — the order CP attention expects — with their *global* positions (RoPE) and labels.

use burn_dcp_kernels::MicroBatch;

use crate::batch::placement::Placement;
use crate::error::CpError;

/// One rank's share of a micro-batch, ready for the model (`i64`, burn's int element).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShard {
    pub tokens: Vec<i64>,
    pub labels: Vec<i64>,
    pub positions: Vec<i64>,
    /// Index in the packed micro-batch of every local token.
    pub packed_indices: Vec<usize>,
}

impl RankShard {
    /// Rank `rank`'s tokens, labels and global positions under `placement`.
    pub fn of(batch: &MicroBatch, placement: &Placement, rank: usize) -> Result<Self, CpError> {
        batch.validate()?;
        let seq_lens = batch.seq_lens();
        if placement.seq_lens != seq_lens {
            return Err(CpError::Input(format!(
                "the placement is for sequences of lengths {:?}, the micro-batch's are {seq_lens:?}",
                placement.seq_lens
            )));
        }
        if rank >= placement.cp() {
            return Err(CpError::Config(format!(
                "rank {rank} is not in a placement over {} ranks",
                placement.cp()
            )));
        }
        let packed_indices = placement.packed_indices(rank);
        Ok(Self {
            tokens: packed_indices
                .iter()
                .map(|&i| i64::from(batch.tokens[i]))
                .collect(),
            labels: packed_indices.iter().map(|&i| batch.labels[i]).collect(),
            positions: packed_indices
                .iter()
                .map(|&i| batch.positions[i] as i64)
                .collect(),
            packed_indices,
        })
    }

    /// Number of labelled tokens of the shard.
    pub fn label_count(&self) -> usize {
        self.labels.iter().filter(|&&l| l >= 0).count()
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
    use crate::batch::layout::Layout;
    use burn_dcp_kernels::MaskSpec;

    #[test]
    fn shards_cover_the_batch_with_global_positions() {
        let batch =
            MicroBatch::from_documents(&[vec![5, 6, 7, 8, 9], vec![1, 2, 3]], MaskSpec::Causal);
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            let placement = Placement::of_layout(&batch.seq_lens(), 2, layout).unwrap();
            let shards: Vec<_> = (0..2)
                .map(|r| RankShard::of(&batch, &placement, r).unwrap())
                .collect();
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
            let labels: usize = shards.iter().map(RankShard::label_count).sum();
            assert_eq!(labels, batch.label_count());
        }
    }

    #[test]
    fn a_placement_of_other_sequences_is_refused() {
        let batch = MicroBatch::from_documents(&[vec![5, 6, 7]], MaskSpec::Causal);
        let placement = Placement::of_layout(&[2, 1], 2, Layout::Zigzag).unwrap();
        let error = RankShard::of(&batch, &placement, 0)
            .unwrap_err()
            .to_string();
        assert!(error.contains("[2, 1]") && error.contains("[3]"), "{error}");
        let placement = Placement::of_layout(&[3], 2, Layout::Zigzag).unwrap();
        assert!(RankShard::of(&batch, &placement, 2).is_err());
    }
}
