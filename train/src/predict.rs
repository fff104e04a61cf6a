//! `predicted_attention_ms`: the cost model's attention time of a step's plan on the machine a
//! run with `--emulate-links` is (`burn_dcp::planner::cost`), next to the measured
//! `attention_ms`.
//!
//! Every planned batch of the step is planned again as the cost model's strategy of what it runs
//! (`planner::executed_plan`: ring and all-gather with the zigzag layout, Ulysses,
//! USP of its degree; dcp: the same executable plan, planned again from the same input and seed) on its CP group's nodes, and
//! evaluated on the emulated machine ([`crate::links::emulated_topology`]: the preset's links
//! slowed by the run's time scale, this machine's kernels as [`crate::links::cpu_compute`]
//! measured them, the ranks sharing its cores). A rank's step time is its batches' times, each
//! once per attention layer of its pipeline stage; the step's prediction is the slowest rank's,
//! as `attention_ms` is. Ring or all-gather with the contiguous or stripe layout has no plan in
//! the cost model: the step's prediction is then `None`.

use burn_dcp::planner::auto::executable_dcp_plan;
use burn_dcp::planner::cost::{evaluate_with, RoutedPlan};
use burn_dcp::planner::executed_plan;
use burn_dcp::planner::topology::Topology;
use burn_dcp::{CpError, Strategy};

use crate::config::TrainConfig;
use crate::data::TrainData;
use crate::error::TrainError;
use crate::links::{cpu_compute, emulated_topology, time_scale, CpuCompute};
use crate::model::ModelShape;
use crate::plan::{PlannedBatch, StepPlan, StepSequences};
use crate::planning::{plan_input, plan_step};
use crate::settings::DcpSettings;

/// What predicting a step needs: the links' time scale and this machine's measured kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Predictor {
    pub time_scale: f64,
    pub cpu: CpuCompute,
}

impl Predictor {
    /// The predictor of `config`'s emulated run (`None` without `--emulate-links`): its time
    /// scale (as the links use it: the value measured once per process, or `--link-scale`) and
    /// the kernels measured for one TP rank's heads.
    pub(crate) fn of_run(config: &TrainConfig) -> Result<Option<Self>, TrainError> {
        let Some(links) = config.emulate_links else {
            return Ok(None);
        };
        let model = config.model_shape()?;
        let topology = Topology::for_ranks(&config.topology, config.nodes, config.world_size())?;
        let time_scale = time_scale(links, &topology, config.world_size())?;
        let heads = config.rank_heads(&model)?;
        let cpu = cpu_compute(
            heads.heads(),
            heads.kv_heads(),
            model.head_dim(),
            config.world_size(),
        )?;
        Ok(Some(Self { time_scale, cpu }))
    }

    /// The predicted attention time (ms) of `plan`'s slowest rank; `None` when a batch runs a
    /// strategy the cost model has no plan of.
    pub(crate) fn step_ms(
        &self,
        plan: &StepPlan,
        sequences: &StepSequences<'_>,
        config: &TrainConfig,
        model: &ModelShape,
    ) -> Result<Option<f64>, CpError> {
        // The static strategies' plans start from a block of 128 tokens (halved as their layout
        // needs, `PlanInput::static_problem`); dcp plans with its own settings.
        let dcp = config.mode.dcp().cloned().unwrap_or(DcpSettings {
            block: 128,
            stages: 4,
        });
        let layers = (model.n_layers / config.pp.max(1)).max(1) as f64;
        let mut per_rank = vec![0.0f64; config.pool_size()];
        for batch in &plan.batches {
            let Some(ms) = self.batch_ms(batch, sequences, config, model, &dcp)? else {
                return Ok(None);
            };
            for rank in batch.ranks.clone() {
                if let Some(total) = per_rank.get_mut(rank) {
                    *total += layers * ms;
                }
            }
        }
        Ok(Some(per_rank.into_iter().fold(0.0, f64::max)))
    }

    /// One attention call's forward + backward (ms) of `batch` on the emulated machine.
    fn batch_ms(
        &self,
        batch: &PlannedBatch,
        sequences: &StepSequences<'_>,
        config: &TrainConfig,
        model: &ModelShape,
        dcp: &DcpSettings,
    ) -> Result<Option<f64>, CpError> {
        let mut input = plan_input(batch, sequences, config, model, dcp)?;
        let routed: RoutedPlan = match (batch.strategy, config.mode.layout()) {
            // The executed plan, planned again alike: on the static group's topology, or on its
            // dynamic CP group's.
            (Strategy::Dcp, _) => {
                if config.mode.dynamic().is_some() {
                    input.topology = config.ranks_topology(&batch.ranks)?;
                }
                executable_dcp_plan(&input)?
            }
            (strategy, layout) => {
                input.topology = config.ranks_topology(&batch.ranks)?;
                match executed_plan(strategy, layout, &input)? {
                    Some(plan) => plan,
                    None => return Ok(None),
                }
            }
        };
        let machine = emulated_topology(&input.topology, self.time_scale, self.cpu.flops_per_rank);
        let report = evaluate_with(&routed, &machine, &self.cpu.model)?;
        Ok(Some(report.attention_fwd_ms + report.attention_bwd_ms))
    }
}

/// [`plan_step`] with the step's predicted attention time from `predictor`.
pub(crate) fn plan_step_predicted(
    config: &TrainConfig,
    data: &TrainData,
    step: usize,
    predictor: Option<&Predictor>,
) -> Result<StepPlan, CpError> {
    let mut plan = plan_step(config, data, step)?;
    if let Some(predictor) = predictor {
        let batches = data.cp_step_batches(step, config.micro_batches)?;
        let sequences = StepSequences::new(batches.iter().map(|b| &**b).collect());
        let model = config
            .model_shape()
            .map_err(|e| CpError::Config(e.to_string()))?;
        plan.predicted_attention_ms = predictor
            .step_ms(&plan, &sequences, config, &model)
            .map_err(|e| CpError::Config(format!("step {step}: predicting its attention: {e}")))?;
    }
    Ok(plan)
}
