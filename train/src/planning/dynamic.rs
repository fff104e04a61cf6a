//! Dynamic CP in training (Megatron-style, `--strategy dynamic`).
//!
//! The `dp × cp` ranks form one pool. Each optimizer step takes the step's global batch (the same
//! packed micro-batches, in the same order, as a static run) as a list of sequences; the scheduler
//! ([`burn_dcp::planner::dynamic`]) gives every sequence a group of the pool and splits the step
//! into sub-steps ([`plan_dynamic`]). A rank runs, per sub-step, the sub-micro-batch of its
//! group: the group's sequences packed together and placed over the group by the inner strategy's
//! layout, under a CP context with the group's communicator. Groups are created once per rank range
//! (one collective split of the pool per sub-step that needs new ones, `groups.rs`) and cached;
//! the backward of every attention call runs in the group its forward used (the autodiff node
//! keeps its context). Gradients are all-reduced over the whole pool and the loss is the mean over every labelled token of the step,
//! so the step equals cp 1 on the same data.
//!
//!
//! The work of a sequence is [`sequence_work`](crate::plan::sequence_work).

use std::sync::Arc;

use burn_dcp::planner::auto::executable_dcp_plan;
use burn_dcp::planner::dynamic::{schedule_with, DynamicCpSchedule};
use burn_dcp::{CpError, Layout, Placement, Strategy};

use super::dcp::{plan_input, run_blocks};
use crate::config::{GroupStrategy, TrainConfig};
use crate::model::ModelShape;
use crate::plan::{PlannedBatch, StepSequences};
use crate::settings::{strategy_for, DynamicSettings};

/// Dynamic CP's step: the scheduler's groups over the run's pool, each running `inner` (with
/// `--inner-strategy dcp`, a DCP block plan on the group's own ranks and topology).
pub(super) fn plan_groups(
    sequences: &StepSequences<'_>,
    works: &[f64],
    settings: &DynamicSettings,
    inner: &GroupStrategy,
    config: &TrainConfig,
    model: &ModelShape,
) -> Result<Vec<PlannedBatch>, CpError> {
    let (strategy, layout) = match inner {
        GroupStrategy::Static { strategy, layout } => (*strategy, *layout),
        GroupStrategy::Dcp(_) => (Strategy::Dcp, Layout::Zigzag),
    };
    let mut batches = plan_dynamic(
        sequences,
        works,
        settings,
        config.pool_size(),
        strategy,
        layout,
    )?;
    if let GroupStrategy::Dcp(dcp) = inner {
        for batch in &mut batches {
            let mut input = plan_input(batch, sequences, config, model, dcp)?;
            input.topology = config.ranks_topology(&batch.ranks)?;
            run_blocks(batch, &executable_dcp_plan(&input)?, &input.topology)?;
        }
    }
    Ok(batches)
}

/// Dynamic CP: every group of every sub-step of the scheduler's plan for a pool of `pool` ranks,
/// each placed by `layout` over its group and run by `inner` (sized to the group).
pub(crate) fn plan_dynamic(
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
