//! DCP's block plans: the planner's input for a planned batch ([`plan_input`]), and a plan's
//! homes made the batch's placement ([`run_blocks`]).

use std::sync::Arc;

use burn_dcp::planner::auto::executable_dcp_plan;
use burn_dcp::planner::cost::{AttentionDims, RoutedPlan};
use burn_dcp::planner::dcp::DcpConfig;
use burn_dcp::planner::strategies::PlanInput;
use burn_dcp::planner::topology::Topology;
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpError, Strategy};

use crate::config::TrainConfig;
use crate::model::ModelShape;
use crate::plan::{PlannedBatch, StepSequences};
use crate::settings::DcpSettings;

/// Strategy dcp: each micro-batch of the static split planned by the DCP planner (one head
/// unit: a token's heads stay together) for its group's topology; the plan's homes become the
/// placement.
pub(super) fn plan_blocks(
    mut batches: Vec<PlannedBatch>,
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    model: &ModelShape,
    dcp: &DcpSettings,
) -> Result<Vec<PlannedBatch>, CpError> {
    for batch in &mut batches {
        let input = plan_input(batch, sequences, config, model, dcp)?;
        run_blocks(batch, &executable_dcp_plan(&input)?, &input.topology)?;
    }
    Ok(batches)
}

/// The planner's input for `batch`: its sequences and masks, the attention dimensions its CP
/// calls see (one TP rank's query heads, K/V repeated to as many heads, elements of the training
/// precision), the static group's topology, and DCP's block, stages and seed.
pub(crate) fn plan_input(
    batch: &PlannedBatch,
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    model: &ModelShape,
    dcp: &DcpSettings,
) -> Result<PlanInput, CpError> {
    let lengths = sequences.lengths();
    Ok(PlanInput {
        seq_lens: batch.sequences.iter().map(|&s| lengths[s]).collect(),
        masks: batch
            .sequences
            .iter()
            .map(|&s| sequences.mask(s).clone())
            .collect(),
        dims: {
            // CP attention runs on the heads of one TP rank, and the strategies move K/V with
            // its real kv heads (the models hand GQA's K/V to the op unrepeated).
            let heads = config
                .rank_heads(model)
                .map_err(|e| CpError::Config(e.to_string()))?;
            AttentionDims {
                heads: heads.heads(),
                kv_heads: heads.kv_heads(),
                head_dim: model.head_dim(),
                element_bytes: config.precision.dtype().size(),
            }
        },
        topology: config.group_topology()?,
        block: dcp.block,
        dcp: DcpConfig {
            stages: dcp.stages,
            seed: config.seed,
            ..DcpConfig::default()
        },
        max_seq_len_per_rank: None,
    })
}

/// Makes `batch` run the DCP plan `routed`: its homes become the placement.
pub(crate) fn run_blocks(
    batch: &mut PlannedBatch,
    routed: &RoutedPlan,
    topology: &Topology,
) -> Result<(), CpError> {
    let schedule = BlockSchedule::new(&routed.plan, &routed.problem, topology)?;
    batch.placement = Arc::new(schedule.placement().clone());
    batch.blocks = Some(Arc::new(schedule));
    batch.strategy = Strategy::Dcp;
    Ok(())
}
