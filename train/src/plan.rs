//! A step's plan: which world ranks run which (sub-)micro-batch as one CP group, and where every
//! token of it lives (the group's [`Placement`]). Every mode is a plan (`planning/`, one file per
//! mode: static split, DCP's block plans, dynamic CP's groups, auto's choice per micro-batch);
//! each planned batch carries the strategy its group runs.
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
use burn_dcp::planner::dynamic::rank_work;
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpBatch, CpError, Placement, Strategy};
use serde::{Deserialize, Serialize};

use crate::model::{InputRows, ModelShape};

/// The sequences of a step's global batch, micro-batch by micro-batch, numbered in that order.
pub(crate) struct StepSequences<'a> {
    batches: Vec<&'a MicroBatch>,
    /// (micro-batch, sequence index in it) of every sequence of the step.
    sequences: Vec<(usize, usize)>,
}

impl<'a> StepSequences<'a> {
    /// The step's micro-batches.
    pub(crate) fn micro_batches(&self) -> usize {
        self.batches.len()
    }

    /// The step's micro-batches, in order.
    pub(crate) fn batches(&self) -> &[&'a MicroBatch] {
        &self.batches
    }

    pub(crate) fn new(batches: Vec<&'a MicroBatch>) -> Self {
        let sequences = batches
            .iter()
            .enumerate()
            .flat_map(|(b, batch)| (0..batch.sequences()).map(move |s| (b, s)))
            .collect();
        Self { batches, sequences }
    }

    pub(crate) fn lengths(&self) -> Vec<usize> {
        self.sequences
            .iter()
            .map(|&(b, s)| self.batches[b].sequence(s).len())
            .collect()
    }

    pub(crate) fn mask(&self, sequence: usize) -> &MaskSpec {
        let (b, s) = self.sequences[sequence];
        &self.batches[b].masks[s]
    }

    /// The micro-batch of `sequences`, packed in that order (all of one micro-batch, in order,
    /// give it back unchanged).
    pub(crate) fn gather(&self, sequences: &[usize]) -> MicroBatch {
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
    /// Its sequences, as indices into the step's sequences (`StepSequences`), in packing order.
    pub sequences: Vec<usize>,
    /// Where each of its tokens lives in the group.
    pub placement: Arc<Placement>,
    /// Strategy dcp: the batch's block plan (it decided the placement).
    pub blocks: Option<Arc<BlockSchedule>>,
    /// The strategy its CP group runs.
    pub strategy: Strategy,
}

/// A planned batch as one rank runs it: the batch (for its masks) and the rank's shard of it.
pub(crate) struct RankWork {
    pub batch: MicroBatch,
    pub shard: RankShard,
}

impl PlannedBatch {
    /// World rank `rank`'s shard of this batch: its sequences gathered from the step's
    /// micro-batches, cut by the placement (`rank` must be one of [`Self::ranks`]).
    pub(crate) fn shard(
        &self,
        sequences: &StepSequences<'_>,
        rank: usize,
    ) -> Result<RankWork, CpError> {
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

    /// World rank `rank`'s shard of this batch and the CP batch its attention calls run on (the
    /// placement, masks and block plan), in the model's input `rows`.
    pub(crate) fn rank_input(
        &self,
        sequences: &StepSequences<'_>,
        rank: usize,
        rows: InputRows,
    ) -> Result<(RankShard, CpBatch), CpError> {
        let RankWork { batch, shard } = self.shard(sequences, rank)?;
        let batch = rows.rows_of(CpBatch {
            placement: self.placement.clone(),
            masks: batch.masks,
            scale: None,
            blocks: self.blocks.clone(),
            rows: None,
        })?;
        Ok((shard, batch))
    }
}

/// Everything a step runs.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub step: usize,
    pub batches: Vec<PlannedBatch>,
    /// Work estimate of every sequence of the step (see `sequence_work`).
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
pub(crate) struct ScheduleStats {
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
    pub(crate) fn stats(&self, world: usize) -> ScheduleStats {
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

/// Allowed query-key pairs of a sequence's mask (exact).
fn attention_pairs(mask: &MaskSpec, len: usize) -> f64 {
    (0..len)
        .map(|i| mask.key_ranges(i, len).count() as f64)
        .sum()
}

/// Forward FLOPs of a sequence: what dynamic CP's scheduler balances (per rank `work / group
/// size`). `4 · d_model · n_layers · pairs(mask)` of attention (`pairs` = allowed query-key pairs
/// of its mask, counted exactly) plus `2 · linear_params · len` of the token-local layers
/// (`linear_params` = the weights of the QKV/output projections and the MLP of every layer, and
/// the LM head). The backward multiplies both by about the same factor, so it is left out.
pub(crate) fn sequence_work(len: usize, mask: &MaskSpec, model: &ModelShape) -> f64 {
    let d = model.d_model as f64;
    let kv_dim = d * model.n_kv_heads as f64 / model.n_heads as f64;
    let per_layer = d * d * 2.0 + 2.0 * d * kv_dim + 2.0 * d * model.d_ff as f64;
    let linear_params = per_layer * model.n_layers as f64 + d * model.vocab_size as f64;
    let attention = 4.0 * d * model.n_layers as f64 * attention_pairs(mask, len);
    attention + 2.0 * linear_params * len as f64
}

/// Work estimate of every sequence of the step.
pub(crate) fn sequence_works(sequences: &StepSequences<'_>, model: &ModelShape) -> Vec<f64> {
    let lengths = sequences.lengths();
    (0..lengths.len())
        .map(|s| sequence_work(lengths[s], sequences.mask(s), model))
        .collect()
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
