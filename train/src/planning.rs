//! Planning a step ([`plan_step`]): the static split and dynamic CP's groups (`plan.rs`), DCP's
//! block plans of each micro-batch (`plan_blocks`) and `auto`'s choice per micro-batch
//! ([`plan_auto`]), which need the planners' problem form.

use std::sync::Arc;
use std::time::Instant;

use burn_dcp::planner::auto::{choose_strategy, executable_dcp_plan};
use burn_dcp::planner::cost::{AttentionDims, RoutedPlan};
use burn_dcp::planner::dcp::DcpConfig;
use burn_dcp::planner::strategies::{megatron_schedule, usp_ulysses_degree, PlanInput};
use burn_dcp::planner::topology::Topology;
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpError, Layout, Strategy, StrategyKind};

use crate::config::TrainConfig;
use crate::data::TrainData;
use crate::model::ModelShape;
use crate::plan::{
    assign_sub_steps, plan_dynamic, plan_static, schedule_batches, sequence_works, AutoRecord,
    PlannedBatch, StepPlan, StepSequences,
};

/// The planner's input for `batch`: its sequences and masks, the attention dimensions its CP
/// calls see (one TP rank's query heads, K/V repeated to as many heads, elements of the training
/// precision), the group's topology, and DCP's block, stages and seed.
pub fn plan_input(
    batch: &PlannedBatch,
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    model: &ModelShape,
) -> Result<PlanInput, CpError> {
    let lengths = sequences.lengths();
    let dcp = config.dcp.as_ref().ok_or_else(|| {
        CpError::Config(format!(
            "strategy {} plans blocks but has no DCP settings (--block, --stages)",
            config.strategy_name()
        ))
    })?;
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

/// Strategy dcp: plans `batch` with the DCP planner (one head unit: a token's heads stay
/// together) for the group's topology; the plan's homes become the placement.
pub(crate) fn plan_blocks(
    batch: &mut PlannedBatch,
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    model: &ModelShape,
) -> Result<(), CpError> {
    let input = plan_input(batch, sequences, config, model)?;
    run_blocks(batch, &executable_dcp_plan(&input)?, &input.topology)
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

/// Strategy auto: each micro-batch of the static split runs the candidate with the lowest
/// estimated attention time; returns the planned batches and every micro-batch's choice.
pub fn plan_auto(
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    candidates: &[StrategyKind],
    model: &ModelShape,
) -> Result<(Vec<PlannedBatch>, Vec<AutoRecord>), CpError> {
    let lengths = sequences.lengths();
    let mut planned = Vec::new();
    let mut records = Vec::new();
    let split = plan_static(
        sequences,
        config.cp,
        config.dp,
        Strategy::Ring,
        Layout::Zigzag,
    )?;
    for (micro_batch, mut batch) in split.into_iter().enumerate() {
        let input = plan_input(&batch, sequences, config, model)?;
        let choice = choose_strategy(&input, candidates)?;
        records.push(AutoRecord {
            micro_batch,
            strategy: choice.winner.name().into(),
            seq_lens: input.seq_lens.clone(),
            masks: input.masks.iter().map(|m| m.to_string()).collect(),
            estimated_ms: choice
                .estimates
                .iter()
                .filter_map(|e| e.estimated_ms.map(|ms| (e.strategy.to_string(), ms)))
                .collect(),
        });
        let cp = config.cp;
        match choice.winner {
            StrategyKind::Usp => {
                let degree = usp_ulysses_degree(&input)?;
                batch.strategy = StrategyKind::Usp.strategy(Some(degree), cp)?;
                planned.push(batch);
            }
            StrategyKind::Dcp => {
                run_blocks(&mut batch, &choice.plan, &input.topology)?;
                planned.push(batch);
            }
            StrategyKind::Dynamic => planned.extend(schedule_batches(
                megatron_schedule(&input)?,
                &lengths,
                |s| batch.sequences[s],
                batch.ranks.start,
                Strategy::Ring,
                Layout::Zigzag,
            )?),
            // Ring (zigzag: auto's static candidates run the layout they are planned with),
            // all-gather, Ulysses.
            ring_gather_or_ulysses => {
                batch.strategy = ring_gather_or_ulysses.strategy(None, cp)?;
                planned.push(batch);
            }
        }
    }
    assign_sub_steps(&mut planned);
    Ok((planned, records))
}

/// The topology of `batch`'s CP group (its DP × CP pool ranks) as they sit on the run's nodes:
/// the nodes it touches, holding equal shares of it.
pub(crate) fn group_topology(
    config: &TrainConfig,
    batch: &PlannedBatch,
) -> Result<Topology, CpError> {
    let per_node = (config.ranks_per_node()? / config.tp.max(1)).max(1);
    let size = batch.ranks.len();
    let first = batch.ranks.start / per_node;
    let last = batch.ranks.end.saturating_sub(1) / per_node;
    let nodes = last - first + 1;
    if !size.is_multiple_of(nodes) {
        return Err(CpError::Config(format!(
            "a CP group of {size} ranks ({:?}) spreads unevenly over {nodes} nodes of {per_node}",
            batch.ranks
        )));
    }
    Topology::for_ranks(&config.topology, nodes, size)
        .map_err(|e| CpError::Config(format!("--topology {}: {e}", config.topology)))
}

/// The plan of step `step` (1-based) under `config`: dynamic CP's schedule, auto's choices, or
/// the static split (with DCP's block plans for strategy dcp).
pub fn plan_step(config: &TrainConfig, data: &TrainData, step: usize) -> Result<StepPlan, CpError> {
    let started = Instant::now();
    let sequences = StepSequences::new(data.step_batches(step, config.micro_batches));
    let model = config
        .model_shape()
        .map_err(|e| CpError::Config(e.to_string()))?;
    let works = sequence_works(&sequences, &model);
    let at_step = |e: CpError| match e {
        CpError::Config(message) => CpError::Config(format!("step {step}: {message}")),
        other => CpError::Config(format!("step {step}: {other}")),
    };
    let micro_batches = sequences.micro_batches();
    let mut auto_choices = Vec::new();
    let batches = if let Some(settings) = &config.dynamic {
        let mut batches = plan_dynamic(
            &sequences,
            &works,
            settings,
            config.pool_size(),
            config.strategy,
            config.layout,
        )
        .map_err(at_step)?;
        // `--inner-strategy dcp`: each group's sequences get a DCP block plan on its own ranks.
        if config.strategy == Strategy::Dcp {
            for batch in &mut batches {
                let mut input = plan_input(batch, &sequences, config, &model).map_err(at_step)?;
                input.topology = group_topology(config, batch).map_err(at_step)?;
                let routed = executable_dcp_plan(&input).map_err(at_step)?;
                run_blocks(batch, &routed, &input.topology).map_err(at_step)?;
            }
        }
        batches
    } else if let Some(auto) = &config.auto {
        let (batches, choices) =
            plan_auto(&sequences, config, &auto.candidates, &model).map_err(at_step)?;
        auto_choices = choices;
        batches
    } else {
        let mut batches = plan_static(
            &sequences,
            config.cp,
            config.dp,
            config.strategy,
            config.layout,
        )
        .map_err(at_step)?;
        if config.strategy == Strategy::Dcp {
            for batch in &mut batches {
                plan_blocks(batch, &sequences, config, &model).map_err(at_step)?;
            }
        }
        batches
    };
    let strategies = if config.auto.is_some() {
        auto_choices.iter().map(|c| c.strategy.clone()).collect()
    } else {
        vec![config.strategy_name(); micro_batches]
    };
    Ok(StepPlan {
        step,
        batches,
        works,
        plan_ms: started.elapsed().as_secs_f64() * 1e3,
        strategies,
        auto_choices,
        predicted_attention_ms: None,
    })
}
