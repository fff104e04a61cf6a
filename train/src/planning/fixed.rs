//! The static split (static strategies and DCP start from it): micro-batch `i` of the step runs
//! on DP replica `i mod dp` (world ranks `d·cp .. (d+1)·cp`), placed by the layout.

use std::sync::Arc;

use burn_dcp::{CpError, Layout, Placement, Strategy};

use crate::plan::{PlannedBatch, StepSequences};

/// Static CP: micro-batch `i` on replica `i mod dp` (of `cp` ranks), sub-step `⌊i / dp⌋`, placed
/// by `layout`, run by `strategy`.
pub(crate) fn plan_static(
    sequences: &StepSequences<'_>,
    cp: usize,
    dp: usize,
    strategy: Strategy,
    layout: Layout,
) -> Result<Vec<PlannedBatch>, CpError> {
    let mut first = 0;
    let mut planned = Vec::with_capacity(sequences.micro_batches());
    for (index, batch) in sequences.batches().iter().enumerate() {
        let count = batch.sequences();
        let replica = index % dp;
        planned.push(PlannedBatch {
            sub_step: index / dp,
            ranks: replica * cp..(replica + 1) * cp,
            sequences: (first..first + count).collect(),
            placement: Arc::new(Placement::of_layout(&batch.seq_lens(), cp, layout)?),
            blocks: None,
            strategy,
        });
        first += count;
    }
    Ok(planned)
}

#[cfg(test)]
mod tests {
    use burn_dcp::kernels::{MaskSpec, MicroBatch};

    use super::*;

    #[test]
    fn static_plans_run_replica_d_on_micro_batches_d_plus_k_dp() {
        let a = MicroBatch::from_documents(&[vec![1, 2, 3], vec![4, 5]], MaskSpec::Causal);
        let b = MicroBatch::from_documents(&[vec![6, 7, 8, 9]], MaskSpec::Causal);
        let sequences = StepSequences::new(vec![&a, &b, &a, &b]);
        assert_eq!(sequences.lengths(), vec![3, 2, 4, 3, 2, 4]);
        let planned = plan_static(&sequences, 2, 2, Strategy::Ring, Layout::Zigzag).unwrap();
        let summary: Vec<_> = planned
            .iter()
            .map(|p| (p.sub_step, p.ranks.clone(), p.sequences.clone()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (0, 0..2, vec![0, 1]),
                (0, 2..4, vec![2]),
                (1, 0..2, vec![3, 4]),
                (1, 2..4, vec![5])
            ]
        );
        assert_eq!(sequences.gather(&planned[2].sequences), a);
        let work = planned[1].shard(&sequences, 3).unwrap();
        assert_eq!(work.batch, b);
        // Zigzag over 2 ranks of 4 tokens: rank 1 holds positions 1 and 2.
        assert_eq!(work.shard.positions, vec![1, 2]);
        assert_eq!(work.shard.tokens, vec![7, 8]);
        assert!(planned[1].shard(&sequences, 0).is_err());
    }
}
