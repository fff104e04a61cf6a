//! Strategy auto: every micro-batch of the static split runs the candidate with the lowest
//! estimated attention time (`burn_dcp::planner::auto`): a static strategy placed zigzag, the
//! megatron-dynamic schedule inside the replica (its groups run one after the other) or the DCP
//! plan.

use burn_dcp::planner::auto::choose_strategy;
use burn_dcp::planner::strategies::{megatron_schedule, usp_ulysses_degree};
use burn_dcp::{CpError, Layout, Strategy, StrategyKind};

use super::dcp::{plan_input, run_blocks};
use super::dynamic::schedule_batches;
use crate::config::TrainConfig;
use crate::model::ModelShape;
use crate::plan::{assign_sub_steps, AutoRecord, PlannedBatch, StepSequences};
use crate::settings::DcpSettings;

/// Strategy auto: each micro-batch of the static `split` (planned ring-zigzag) runs the
/// candidate with the lowest estimated attention time; returns the planned batches and every
/// micro-batch's choice.
pub(super) fn choose(
    split: Vec<PlannedBatch>,
    sequences: &StepSequences<'_>,
    config: &TrainConfig,
    candidates: &[StrategyKind],
    dcp: &DcpSettings,
    model: &ModelShape,
) -> Result<(Vec<PlannedBatch>, Vec<AutoRecord>), CpError> {
    let lengths = sequences.lengths();
    let mut planned = Vec::new();
    let mut records = Vec::new();
    for (micro_batch, mut batch) in split.into_iter().enumerate() {
        let input = plan_input(&batch, sequences, config, model, dcp)?;
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
