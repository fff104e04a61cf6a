//! Planning a step ([`plan_step`]): one file per mode — the static split (`fixed.rs`), DCP's
//! block plans (`dcp.rs`), dynamic CP's groups (`dynamic.rs`) and auto's choice per micro-batch
//! (`auto.rs`) — each turning the step's sequences into planned batches (`crate::plan`).

mod auto;
mod dcp;
mod dynamic;
mod fixed;

use std::time::Instant;

use burn_dcp::CpError;

pub(crate) use dcp::plan_input;

use crate::config::{TrainConfig, TrainMode};
use crate::data::TrainData;
use crate::plan::{sequence_works, StepPlan, StepSequences};

/// The plan of step `step` (1-based) under `config`: its mode's planned batches, auto's choices,
/// and the strategy name of every micro-batch.
pub fn plan_step(config: &TrainConfig, data: &TrainData, step: usize) -> Result<StepPlan, CpError> {
    let started = Instant::now();
    let batches = data.cp_step_batches(step, config.micro_batches)?;
    let sequences = StepSequences::new(batches.iter().map(|b| &**b).collect());
    let model = config
        .model_shape()
        .map_err(|e| CpError::Config(e.to_string()))?;
    let works = sequence_works(&sequences, &model);
    let mut auto_choices = Vec::new();
    let batches = if let TrainMode::Dynamic { settings, inner } = &config.mode {
        dynamic::plan_groups(&sequences, &works, settings, inner, config, &model)
    } else {
        // Static, DCP and auto start from the static split (replica d runs micro-batches d,
        // d + dp, …), planned as the strategy and layout their groups start from.
        let (strategy, layout) = (config.mode.group_strategy(), config.mode.layout());
        fixed::plan_static(&sequences, config.cp, config.dp, strategy, layout).and_then(|split| {
            match &config.mode {
                TrainMode::Dcp(dcp) => dcp::plan_blocks(split, &sequences, config, &model, dcp),
                TrainMode::Auto { settings, dcp } => {
                    let (batches, choices) =
                        auto::choose(split, &sequences, config, &settings.candidates, dcp, &model)?;
                    auto_choices = choices;
                    Ok(batches)
                }
                _ => Ok(split),
            }
        })
    }
    .map_err(|e| match e {
        CpError::Config(message) => CpError::Config(format!("step {step}: {message}")),
        other => CpError::Config(format!("step {step}: {other}")),
    })?;
    let strategies = match config.mode {
        TrainMode::Auto { .. } => auto_choices.iter().map(|c| c.strategy.clone()).collect(),
        _ => vec![config.strategy_name(); sequences.micro_batches()],
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
