//! Dynamic CP in training (Megatron-style, `--strategy dynamic`).
//!
//! The `dp × cp` ranks form one pool. Each optimizer step takes the step's global batch (the same
//! packed micro-batches, in the same order, as a static run) as a list of sequences; the scheduler
//! ([`burn_dcp::planner::dynamic`]) gives every sequence a group of the pool and splits the step
//! into sub-steps. A rank runs, per sub-step, the sub-micro-batch of its group: the group's
//! sequences packed together and sharded over the group by the inner strategy's layout, under a CP
//! context with the group's communicator. Groups are created once per rank range (one collective
//! split of the pool per sub-step that needs new ones) and cached; the backward of every attention
//! call runs in the group its forward used (the autodiff node keeps its context). Gradients are
//! all-reduced over the whole pool and the loss is the mean over every labelled token of the step,
//! so the step equals cp 1 on the same data.
//!
//! Work estimate of a sequence (what the scheduler balances, per rank `work / group size`):
//! forward FLOPs `4 · d_model · n_layers · pairs(mask)` of attention (`pairs` = allowed
//! query-key pairs of its mask, counted exactly) plus `2 · linear_params · len` of the token-local
//! layers (`linear_params` = the weights of the QKV/output projections and the MLP of every layer,
//! and the LM head). The backward multiplies both by about the same factor, so it is left out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use burn_dcp::comm::Comm;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::layout::Layout;
use burn_dcp::planner::dynamic::{
    rank_work, schedule_with, DynamicCpConfig, DynamicCpSchedule, ScheduledMicroBatch,
};
use burn_dcp::shard::PackedMicroBatch;
use burn_dcp::{CpError, CpGroup, Strategy};
use burn_dcp_models::GptConfig;
use serde::{Deserialize, Serialize};

use super::TrainBatch;

/// Group sizes the scheduler may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpSizes {
    /// Powers of two (Megatron), plus the whole pool.
    Pow2,
    /// Any size.
    Any,
}

impl std::str::FromStr for CpSizes {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "pow2" => Ok(Self::Pow2),
            "any" => Ok(Self::Any),
            other => Err(format!(
                "unknown --cp-sizes '{other}': expected pow2 or any"
            )),
        }
    }
}

/// Settings of `--strategy dynamic`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicSettings {
    /// The scheduler's per-rank token budget (`--max-tokens-per-rank`).
    pub max_tokens_per_rank: usize,
    /// Smallest group size (`--min-cp-size`).
    pub min_cp_size: usize,
    /// Group sizes (`--cp-sizes`).
    pub cp_sizes: CpSizes,
    /// Steps planned ahead on a background thread (`--plan-ahead`).
    pub plan_ahead: usize,
}

/// The most steps that may be planned ahead.
pub const MAX_PLAN_AHEAD: usize = 64;

impl DynamicSettings {
    /// The scheduler's configuration for a pool of `pool` ranks.
    pub fn scheduler(&self, pool: usize) -> DynamicCpConfig {
        DynamicCpConfig {
            world: pool,
            max_seq_len_per_rank: self.max_tokens_per_rank,
            min_cp_size: self.min_cp_size,
            power_of_two: self.cp_sizes == CpSizes::Pow2,
        }
    }

    /// Checks the settings for a pool of `pool` ranks, an inner strategy and the model's heads.
    pub fn validate(
        &self,
        pool: usize,
        inner: Strategy,
        heads: usize,
        kv_heads: usize,
    ) -> Result<(), String> {
        if self.plan_ahead == 0 || self.plan_ahead > MAX_PLAN_AHEAD {
            return Err(format!(
                "--plan-ahead {} must be between 1 and {MAX_PLAN_AHEAD}",
                self.plan_ahead
            ));
        }
        let scheduler = self.scheduler(pool);
        scheduler.validate().map_err(|e| e.to_string())?;
        for size in scheduler.sizes() {
            let strategy = strategy_for(inner, size).map_err(|e| e.to_string())?;
            strategy
                .validate_heads(heads, kv_heads, size)
                .map_err(|e| format!("dynamic CP may use groups of {size} ranks: {e}"))?;
        }
        Ok(())
    }
}

/// The inner strategy on a group of `size` ranks (USP keeps its Ulysses degree; the ring degree
/// is what remains).
pub fn strategy_for(inner: Strategy, size: usize) -> Result<Strategy, CpError> {
    match inner {
        Strategy::Usp { ulysses_degree, .. } => {
            if !size.is_multiple_of(ulysses_degree) {
                return Err(CpError::Config(format!(
                    "inner strategy usp with ulysses degree {ulysses_degree} needs every group size to be a multiple of it; dynamic CP may use a group of {size} (raise --min-cp-size or use --cp-sizes pow2)"
                )));
            }
            Ok(Strategy::Usp {
                ulysses_degree,
                ring_degree: size / ulysses_degree,
            })
        }
        other => Ok(other),
    }
}

/// The sequences of a step's global batch, micro-batch by micro-batch.
pub struct StepSequences<'a> {
    batches: Vec<&'a TrainBatch>,
    /// (micro-batch, sequence index in it, its tokens in the packed micro-batch).
    sequences: Vec<(usize, usize, Range<usize>)>,
}

impl<'a> StepSequences<'a> {
    pub fn new(batches: Vec<&'a TrainBatch>) -> Self {
        let mut sequences = Vec::new();
        for (b, batch) in batches.iter().enumerate() {
            let mut start = 0;
            for (s, &len) in batch.packed.seq_lens.iter().enumerate() {
                sequences.push((b, s, start..start + len));
                start += len;
            }
        }
        Self { batches, sequences }
    }

    pub fn lengths(&self) -> Vec<usize> {
        self.sequences.iter().map(|(_, _, r)| r.len()).collect()
    }

    pub fn mask(&self, sequence: usize) -> &MaskSpec {
        let (b, s, _) = &self.sequences[sequence];
        burn_dcp::kernels::mask_of(&self.batches[*b].masks, *s)
    }

    /// The sub-micro-batch of `sequences`, packed in that order, with their masks.
    pub fn gather(&self, sequences: &[usize]) -> TrainBatch {
        let mut packed = PackedMicroBatch {
            tokens: Vec::new(),
            labels: Vec::new(),
            positions: Vec::new(),
            seq_lens: Vec::new(),
        };
        let mut masks = Vec::new();
        for &sequence in sequences {
            let (b, _, range) = &self.sequences[sequence];
            let source = &self.batches[*b].packed;
            packed
                .tokens
                .extend_from_slice(&source.tokens[range.clone()]);
            packed
                .labels
                .extend_from_slice(&source.labels[range.clone()]);
            packed
                .positions
                .extend_from_slice(&source.positions[range.clone()]);
            packed.seq_lens.push(range.len());
            masks.push(self.mask(sequence).clone());
        }
        TrainBatch { packed, masks }
    }
}

/// Allowed query-key pairs of a sequence's mask (exact).
fn attention_pairs(mask: &MaskSpec, len: usize) -> f64 {
    (0..len)
        .map(|i| mask.key_ranges(i, len).count() as f64)
        .sum()
}

/// Forward FLOPs of a sequence (see the module docs).
pub fn sequence_work(len: usize, mask: &MaskSpec, model: &GptConfig) -> f64 {
    let d = model.d_model as f64;
    let kv_dim = d * model.n_kv_heads as f64 / model.n_heads as f64;
    let per_layer = d * d * 2.0 + 2.0 * d * kv_dim + 2.0 * d * model.d_ff as f64;
    let linear_params = per_layer * model.n_layers as f64 + d * model.vocab_size as f64;
    let attention = 4.0 * d * model.n_layers as f64 * attention_pairs(mask, len);
    attention + 2.0 * linear_params * len as f64
}

/// One step's dynamic CP plan.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub step: usize,
    pub schedule: DynamicCpSchedule,
    /// Work estimate of every sequence.
    pub works: Vec<f64>,
    /// Time the scheduler took.
    pub plan_ms: f64,
}

/// Plans step `step` over `sequences` for a pool of `pool` ranks sharded with `layout`.
pub fn plan_step(
    step: usize,
    sequences: &StepSequences,
    settings: &DynamicSettings,
    pool: usize,
    layout: Layout,
    model: &GptConfig,
) -> Result<StepPlan, CpError> {
    let started = Instant::now();
    let lengths = sequences.lengths();
    let works: Vec<f64> = (0..lengths.len())
        .map(|s| sequence_work(lengths[s], sequences.mask(s), model))
        .collect();
    let schedule = schedule_with(&lengths, &works, &settings.scheduler(pool), layout)
        .map_err(|e| CpError::Config(format!("step {step}: {e}")))?;
    Ok(StepPlan {
        step,
        schedule,
        works,
        plan_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

/// The CP groups of the pool one rank belongs to, created on first use and kept.
pub struct PoolGroups {
    world: Comm,
    inner: Strategy,
    /// Every rank range created so far (the same on every rank: creation is collective).
    created: HashSet<(usize, usize)>,
    mine: HashMap<(usize, usize), CpGroup>,
}

impl PoolGroups {
    pub fn new(world: Comm, inner: Strategy) -> Self {
        Self {
            world,
            inner,
            created: HashSet::new(),
            mine: HashMap::new(),
        }
    }

    /// Creates the groups of `sub_step` that do not exist yet: one split of the pool, called by
    /// every rank (each computes the same schedule, so all agree on which ranges are new).
    pub fn ensure(&mut self, sub_step: &ScheduledMicroBatch) -> Result<(), CpError> {
        let new: Vec<Range<usize>> = sub_step
            .groups
            .iter()
            .map(|g| g.ranks.clone())
            .filter(|r| !self.created.contains(&(r.start, r.end)))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let me = self.world.rank();
        let mine = new.iter().position(|r| r.contains(&me));
        // Ranks outside every new range get a color of their own (a group they do not use).
        let color = mine.unwrap_or(new.len() + me);
        let comm = self.world.split(color, me)?;
        for range in &new {
            self.created.insert((range.start, range.end));
        }
        if let Some(index) = mine {
            let range = &new[index];
            let strategy = strategy_for(self.inner, range.len())?;
            self.mine
                .insert((range.start, range.end), CpGroup::new(comm, strategy)?);
        }
        Ok(())
    }

    /// This rank's group for the rank range `ranks` (after [`Self::ensure`]).
    pub fn group(&self, ranks: &Range<usize>) -> Option<&CpGroup> {
        self.mine.get(&(ranks.start, ranks.end))
    }
}

/// What a step's schedule did, for the metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScheduleStats {
    /// Group size → number of sequences that ran in groups of that size.
    pub cp_group_sizes: BTreeMap<usize, usize>,
    /// Max / mean of the per-rank estimated work over the step.
    pub rank_workload_imbalance: f64,
}

/// Statistics of groups given as `(rank range, sequences)` for the step's sequence works.
pub fn schedule_stats<'a>(
    groups: impl IntoIterator<Item = (Range<usize>, &'a [usize])>,
    works: &[f64],
    pool: usize,
) -> ScheduleStats {
    let groups: Vec<(Range<usize>, &[usize])> = groups.into_iter().collect();
    let mut sizes = BTreeMap::new();
    for (ranks, sequences) in &groups {
        *sizes.entry(ranks.len()).or_default() += sequences.len();
    }
    let load = rank_work(groups, works, pool);
    let mean = load.iter().sum::<f64>() / pool.max(1) as f64;
    let max = load.iter().copied().fold(0.0, f64::max);
    ScheduleStats {
        cp_group_sizes: sizes,
        rank_workload_imbalance: if mean > 0.0 { max / mean } else { 1.0 },
    }
}
