//! A step's plan: which world ranks run which (sub-)micro-batch as one CP group, and where every
//! token of it lives (the group's [`Placement`]). Every strategy is a plan:
//!
//! - **static CP** ([`plan_static`]): micro-batch `i` of the step runs on DP replica `i mod dp`
//!   (world ranks `d·cp .. (d+1)·cp`), placed by the layout;
//! - **dynamic CP** ([`plan_dynamic`]): the scheduler's groups, each running the sequences it was
//!   given, placed by the layout over the group;
//! - **DCP** (static groups, `plan_blocks` in `block_plans.rs`): each micro-batch's DCP block plan for the group's
//!   topology; its homes are the placement and it travels with the batch to the executor.
//! - **auto** ([`plan_auto`](crate::plan_auto)): static groups; each micro-batch runs the candidate with the lowest
//!   estimated attention time (`burn_dcp::planner::auto`): a static strategy placed zigzag, the
//!   megatron-dynamic schedule inside the replica (its groups run one after the other) or the DCP
//!   plan. Each planned batch carries the strategy its group runs.
//!
//! The step executes every plan alike (`step_gradients_planned`): a rank takes each planned batch
//! whose ranks include it and asks it for its shard ([`PlannedBatch::shard`]: the batch's
//! sequences gathered from the step's micro-batches into one [`MicroBatch`], cut by the
//! placement with [`RankShard::of`]) and runs the model in the group. Planning is pure (the same on every rank), so each rank plans for itself, ahead, on
//! a background thread.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use burn_dcp::batch::shard::RankShard;
use burn_dcp::kernels::{MaskSpec, MicroBatch};
use burn_dcp::planner::dynamic::{rank_work, schedule_with, DynamicCpSchedule};
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpError, Layout, Placement, Strategy};
use serde::{Deserialize, Serialize};

use crate::dynamic::{sequence_work, strategy_for, DynamicSettings};
use crate::model::ModelShape;

/// The sequences of a step's global batch, micro-batch by micro-batch, numbered in that order.
pub struct StepSequences<'a> {
    batches: Vec<&'a MicroBatch>,
    /// (micro-batch, sequence index in it) of every sequence of the step.
    sequences: Vec<(usize, usize)>,
}

impl<'a> StepSequences<'a> {
    /// The step's micro-batches.
    pub fn micro_batches(&self) -> usize {
        self.batches.len()
    }

    pub fn new(batches: Vec<&'a MicroBatch>) -> Self {
        let sequences = batches
            .iter()
            .enumerate()
            .flat_map(|(b, batch)| (0..batch.sequences()).map(move |s| (b, s)))
            .collect();
        Self { batches, sequences }
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    pub fn lengths(&self) -> Vec<usize> {
        self.sequences
            .iter()
            .map(|&(b, s)| self.batches[b].sequence(s).len())
            .collect()
    }

    pub fn mask(&self, sequence: usize) -> &MaskSpec {
        let (b, s) = self.sequences[sequence];
        &self.batches[b].masks[s]
    }

    /// The micro-batch of `sequences`, packed in that order (all of one micro-batch, in order,
    /// give it back unchanged).
    pub fn gather(&self, sequences: &[usize]) -> MicroBatch {
        MicroBatch::gather(sequences.iter().map(|&sequence| {
            let (b, s) = self.sequences[sequence];
            (self.batches[b], s)
        }))
    }
}

/// One (sub-)micro-batch of a step: the world ranks that run it as a CP group, its sequences and
/// where their tokens live.
#[derive(Clone, Debug)]
pub struct PlannedBatch {
    /// Batches of one sub-step run side by side, on disjoint rank ranges.
    pub sub_step: usize,
    /// World ranks of the CP group (rank `ranks.start + r` is the group's rank `r`).
    pub ranks: Range<usize>,
    /// Its sequences, as indices into the step's sequences ([`StepSequences`]), in packing order.
    pub sequences: Vec<usize>,
    /// Where each of its tokens lives in the group.
    pub placement: Arc<Placement>,
    /// Strategy dcp: the batch's block plan (it decided the placement).
    pub blocks: Option<Arc<BlockSchedule>>,
    /// The strategy its CP group runs.
    pub strategy: Strategy,
}

/// A planned batch as one rank runs it: the batch (for its masks) and the rank's shard of it.
pub struct RankWork {
    pub batch: MicroBatch,
    pub shard: RankShard,
}

impl PlannedBatch {
    /// World rank `rank`'s shard of this batch: its sequences gathered from the step's
    /// micro-batches, cut by the placement (`rank` must be one of [`Self::ranks`]).
    pub fn shard(&self, sequences: &StepSequences<'_>, rank: usize) -> Result<RankWork, CpError> {
        if !self.ranks.contains(&rank) {
            return Err(CpError::Config(format!(
                "world rank {rank} is not in this batch's CP group (world ranks {:?})",
                self.ranks
            )));
        }
        let batch = sequences.gather(&self.sequences);
        let shard = RankShard::of(&batch, &self.placement, rank - self.ranks.start)?;
        Ok(RankWork { batch, shard })
    }
}

/// Everything a step runs.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub step: usize,
    pub batches: Vec<PlannedBatch>,
    /// Work estimate of every sequence of the step (see [`sequence_work`]).
    pub works: Vec<f64>,
    /// Time the planning took.
    pub plan_ms: f64,
    /// The strategy each of the step's micro-batches ran, in order (`strategy_counts`).
    pub strategies: Vec<String>,
    /// `auto`: every micro-batch's choice.
    pub auto_choices: Vec<AutoRecord>,
    /// With `--emulate-links`: the cost model's attention time of the step on the emulated
    /// machine (`crate::predict`); `None` otherwise, or where a strategy has no plan there.
    pub predicted_attention_ms: Option<f64>,
}

/// `--strategy auto`'s choice for one micro-batch (in `metrics.jsonl`'s `auto_choices`): what
/// `plan_sim --strategies auto` reports for the same batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AutoRecord {
    /// The micro-batch's index in the step.
    pub micro_batch: usize,
    /// The winner.
    pub strategy: String,
    /// Its sequences' lengths.
    pub seq_lens: Vec<usize>,
    /// Its sequences' masks, as `plan_sim --masks` takes them.
    #[serde(default)]
    pub masks: Vec<String>,
    /// Estimated attention time (forward + backward, ms) of every candidate that can run it.
    pub estimated_ms: BTreeMap<String, f64>,
}

/// What a step's plan does, for the metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScheduleStats {
    /// Group size → number of sequences that ran in groups of that size.
    pub cp_group_sizes: BTreeMap<usize, usize>,
    /// Max / mean of the per-rank estimated work over the step.
    pub rank_workload_imbalance: f64,
    /// Strategy → micro-batches that ran it.
    pub strategy_counts: BTreeMap<String, usize>,
}

impl StepPlan {
    /// The batches rank `rank` (of the world) takes part in, in order.
    pub fn batches_of(&self, rank: usize) -> impl Iterator<Item = &PlannedBatch> {
        self.batches.iter().filter(move |b| b.ranks.contains(&rank))
    }

    /// The rank ranges of every sub-step, in order.
    pub fn sub_step_ranges(&self) -> Vec<Vec<Range<usize>>> {
        let mut sub_steps: Vec<Vec<Range<usize>>> = Vec::new();
        for batch in &self.batches {
            if sub_steps.len() <= batch.sub_step {
                sub_steps.resize(batch.sub_step + 1, Vec::new());
            }
            sub_steps[batch.sub_step].push(batch.ranks.clone());
        }
        sub_steps
    }

    /// Group sizes and the per-rank work imbalance over a world of `world` ranks.
    pub fn stats(&self, world: usize) -> ScheduleStats {
        let mut sizes = BTreeMap::new();
        for batch in &self.batches {
            *sizes.entry(batch.ranks.len()).or_default() += batch.sequences.len();
        }
        let groups = self
            .batches
            .iter()
            .map(|b| (b.ranks.clone(), b.sequences.as_slice()));
        let load = rank_work(groups, &self.works, world);
        let mean = load.iter().sum::<f64>() / world.max(1) as f64;
        let max = load.iter().copied().fold(0.0, f64::max);
        let mut strategy_counts = BTreeMap::new();
        for name in &self.strategies {
            *strategy_counts.entry(name.clone()).or_default() += 1;
        }
        ScheduleStats {
            cp_group_sizes: sizes,
            rank_workload_imbalance: if mean > 0.0 { max / mean } else { 1.0 },
            strategy_counts,
        }
    }
}

/// Work estimate of every sequence of the step.
pub fn sequence_works(sequences: &StepSequences<'_>, model: &ModelShape) -> Vec<f64> {
    let lengths = sequences.lengths();
    (0..lengths.len())
        .map(|s| sequence_work(lengths[s], sequences.mask(s), model))
        .collect()
}

/// Static CP: micro-batch `i` on replica `i mod dp` (of `cp` ranks), sub-step `⌊i / dp⌋`, placed
/// by `layout`, run by `strategy`.
pub fn plan_static(
    sequences: &StepSequences<'_>,
    cp: usize,
    dp: usize,
    strategy: Strategy,
    layout: Layout,
) -> Result<Vec<PlannedBatch>, CpError> {
    let mut first = 0;
    let mut planned = Vec::with_capacity(sequences.batches.len());
    for (index, batch) in sequences.batches.iter().enumerate() {
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

/// Dynamic CP: every group of every sub-step of the scheduler's plan for a pool of `pool` ranks,
/// each placed by `layout` over its group and run by `inner` (sized to the group).
pub fn plan_dynamic(
    sequences: &StepSequences<'_>,
    works: &[f64],
    settings: &DynamicSettings,
    pool: usize,
    inner: Strategy,
    layout: Layout,
) -> Result<Vec<PlannedBatch>, CpError> {
    let lengths = sequences.lengths();
    let schedule = schedule_with(&lengths, works, &settings.scheduler(pool), layout)?;
    schedule_batches(schedule, &lengths, |s| s, 0, inner, layout)
}

/// The planned batches of a dynamic CP schedule: every group of every sub-step, placed by
/// `layout` over its group and run by `inner` (sized to the group). The schedule's sequence `s`
/// is the step's sequence `sequence_of(s)` (whose length is in `lengths`) and its rank `r` the
/// pool rank `first_rank + r`.
pub(crate) fn schedule_batches(
    schedule: DynamicCpSchedule,
    lengths: &[usize],
    sequence_of: impl Fn(usize) -> usize,
    first_rank: usize,
    inner: Strategy,
    layout: Layout,
) -> Result<Vec<PlannedBatch>, CpError> {
    let mut planned = Vec::new();
    for (sub_step, micro_batch) in schedule.micro_batches.into_iter().enumerate() {
        for group in micro_batch.groups {
            let sequences: Vec<usize> = group.sequences.iter().map(|&s| sequence_of(s)).collect();
            let group_lengths: Vec<usize> = sequences.iter().map(|&s| lengths[s]).collect();
            let placement = Placement::of_layout(&group_lengths, group.ranks.len(), layout)?;
            planned.push(PlannedBatch {
                sub_step,
                strategy: strategy_for(inner, group.ranks.len())?,
                ranks: first_rank + group.ranks.start..first_rank + group.ranks.end,
                sequences,
                placement: Arc::new(placement),
                blocks: None,
            });
        }
    }
    Ok(planned)
}

/// Numbers sub-steps so that batches of one sub-step run on disjoint ranks: each batch comes one
/// after the latest earlier batch it shares a rank with (in plan order, which every rank follows).
pub(crate) fn assign_sub_steps(batches: &mut [PlannedBatch]) {
    for i in 0..batches.len() {
        let after = batches[..i]
            .iter()
            .filter(|b| {
                b.ranks.start < batches[i].ranks.end && batches[i].ranks.start < b.ranks.end
            })
            .map(|b| b.sub_step + 1)
            .max()
            .unwrap_or(0);
        batches[i].sub_step = after;
    }
}

#[cfg(test)]
mod tests {
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
