//! A rank's training run: build the model, resume, plan ahead, train every step, save.

use std::path::Path;
use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::optim::Optimizer;
use burn::record::Recorder;
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::backend::attention_time;
use burn_dcp::comm::Comm;
use burn_dcp::diagnostics::trace::comm_wait_time;
use burn_dcp::kernels::FlashOps;
use burn_dcp::CpError;

use crate::checkpoint::{
    check_data_state, load_model, save_checkpoint, saved_checkpoint, Checkpoint, CheckpointFiles,
    Recorder_, TrainState,
};
use crate::config::{Precision, Recompute, TrainConfig};
use crate::data::TrainData;
use crate::error::TrainError;
use crate::files::read_json;
use crate::groups::RankGroups;
use crate::metrics::{StepMetrics, StepObserver};
use crate::model::{CpTrain, InputRows, TrainModel};
use crate::optim::{LrSchedule, OptimizerKind};
use crate::plan::StepPlan;
use crate::predict::plan_step_predicted;
use crate::predict::Predictor;
use crate::step::{
    rank_peak_gpu_memory_mb, rank_peak_memory_mb, step_gradients_planned, validation_loss,
    StepBytes, AXES,
};

/// The default training backend: [`CpTrain`] over burn Flex (CPU).
pub type TrainBackend = CpTrain<burn::backend::Flex>;

/// The result of one rank's training.
pub struct RankOutcome {
    pub metrics: Vec<StepMetrics>,
    /// `--eval-only`: the model's loss over the data (every rank's, the same value).
    pub eval_loss: Option<f64>,
}

/// What a rank's model is built from: the run's configuration, the rank's TP rank and pipeline
/// stage, its device.
pub struct ModelInit<'a, B: FlashOps> {
    pub config: &'a TrainConfig,
    pub tp_rank: usize,
    pub pp_rank: usize,
    pub device: &'a B::Device,
}

/// A training run as every rank sees it: the configuration, the data, where to resume from and
/// save to, and rank 0's observer of the steps.
pub struct Trainer<'a> {
    pub config: &'a TrainConfig,
    pub data: &'a TrainData,
    /// A run directory to continue (its checkpoint).
    pub resume: Option<&'a Path>,
    /// Where the checkpoint is saved at the end (all ranks take part).
    pub out: Option<&'a Path>,
    pub observer: &'a dyn StepObserver,
}

impl Trainer<'_> {
    /// Trains model `M` on this rank (`world`: the rank's communicator of the whole run) from
    /// the first step not yet trained; `init` builds the rank's model (every rank of a TP
    /// position must build the same weights: seed it, or load one record). The model is on
    /// [`CpTrain<B>`](CpTrain) (burn's `NoCheckpointing`); `config.recompute` may be `None` or
    /// `Block`. For `Recompute::Attention` use [`Self::train_rank_checkpointed`].
    pub fn train_rank<B, M, F>(
        &self,
        world: Comm,
        device: &B::Device,
        init: F,
    ) -> Result<RankOutcome, TrainError>
    where
        B: FlashOps,
        M: TrainModel<CpTrain<B>>,
        F: FnOnce(&ModelInit<'_, B>) -> Result<M, TrainError>,
    {
        self.train_rank_checkpointed::<B, NoCheckpointing, M, F>(world, device, init)
    }

    /// [`Self::train_rank`] on [`CpTrain<B, C>`](CpTrain), the autodiff checkpoint strategy
    /// `C` of burn: `BalancedCheckpointing` for `Recompute::Attention` (then the memory-bound
    /// activations and the CP attention's output are recomputed in the backward),
    /// `NoCheckpointing` otherwise. A strategy that does not match `config.recompute` is an
    /// error.
    pub fn train_rank_checkpointed<B, C, M, F>(
        &self,
        world: Comm,
        device: &B::Device,
        init: F,
    ) -> Result<RankOutcome, TrainError>
    where
        B: FlashOps,
        C: CheckpointStrategy,
        M: TrainModel<CpTrain<B, C>>,
        F: FnOnce(&ModelInit<'_, B>) -> Result<M, TrainError>,
    {
        let config = self.config;
        let schedule = config
            .lr_schedule
            .schedule(config.learning_rate, config.steps);
        let settings = &config.optimizer;
        match settings.kind {
            OptimizerKind::AdamW => {
                let optimizer = settings.adamw_matrices::<CpTrain<B, C>, M>();
                self.train_rank_with(world, device, init, optimizer, &schedule)
            }
            OptimizerKind::Adam => {
                let optimizer = settings.adam_matrices::<CpTrain<B, C>, M>();
                self.train_rank_with(world, device, init, optimizer, &schedule)
            }
            OptimizerKind::Sgd => {
                let optimizer = settings.sgd_matrices::<CpTrain<B, C>, M>();
                self.train_rank_with(world, device, init, optimizer, &schedule)
            }
        }
    }

    /// [`Self::train_rank_checkpointed`] with the caller's optimizer (any burn `Optimizer`; a
    /// resume loads its record from the checkpoint) and learning-rate schedule (burn's
    /// `LrScheduler`s through [`SteppedLr`](crate::SteppedLr)); `config.optimizer`,
    /// `config.lr_schedule` and `config.learning_rate` are then not used.
    pub fn train_rank_with<B, C, M, O, F>(
        &self,
        world: Comm,
        device: &B::Device,
        init: F,
        mut optimizer: O,
        schedule: &dyn LrSchedule,
    ) -> Result<RankOutcome, TrainError>
    where
        B: FlashOps,
        C: CheckpointStrategy,
        M: TrainModel<CpTrain<B, C>>,
        O: Optimizer<M, CpTrain<B, C>>,
        F: FnOnce(&ModelInit<'_, B>) -> Result<M, TrainError>,
    {
        let config = self.config;
        check_checkpoint_strategy::<C>(config.recompute)?;
        check_precision::<B>(config.precision, device)?;
        // Every call times its waits (`comm_wait_ms`) and, in a trace, is a span.
        let world = burn_dcp::diagnostics::trace::TracedComm::wrap(world);
        let groups = RankGroups::new(world, config)?;
        let (tp_rank, pp_rank) = (groups.tp.comm.rank(), groups.mesh.pp.rank());
        let mut model = init(&ModelInit {
            config,
            tp_rank,
            pp_rank,
            device,
        })?;
        check_model_support(&model, config)?;
        let files = CheckpointFiles::of(config, tp_rank, pp_rank);
        let mut first_step = 1;
        if let Some(dir) = self.resume {
            let checkpoint = saved_checkpoint(dir)?;
            model = load_model(model, &checkpoint, &files.model, device)?;
            let record = Recorder_::new()
                .load(checkpoint.join(&files.optimizer), device)
                .map_err(|e| {
                    TrainError::Checkpoint(format!(
                        "cannot load the optimizer checkpoint from {}: {e}",
                        checkpoint.display()
                    ))
                })?;
            optimizer = optimizer.load_record(record);
            let state: TrainState = read_json(&checkpoint.join("state.json"))?;
            let now = self.data.state(state.step, config.micro_batches);
            check_data_state(state.data.as_ref(), now.as_ref(), &checkpoint)?;
            first_step = state.step + 1;
        }
        if config.eval_only {
            // Every micro-batch of the data is one "step" of the evaluation.
            let per_window = TrainConfig {
                micro_batches: 1,
                ..config.clone()
            };
            let loss = validation_loss::<B, C, M>(&model, &groups, &per_window, self.data, device)?;
            return Ok(RankOutcome {
                metrics: Vec::new(),
                eval_loss: Some(loss),
            });
        }
        let run = StepLoop {
            groups: &groups,
            config,
            data: self.data,
            observer: self.observer,
            device,
            schedule,
        };
        // Rank 0 reports the steps: it predicts their attention time on an emulated machine
        // (measured here, before any rank computes).
        let predictor = match groups.mesh.world.rank() {
            0 => Predictor::of_run(config)
                .inspect_err(|e| groups.mesh.world.abort(&e.to_string()))?,
            _ => None,
        };
        groups.mesh.world.barrier()?;
        // A checkpoint of step `step` (with an output directory; every rank takes part).
        let save = |model: &M, optimizer: &O, step: usize| -> Result<(), TrainError> {
            let Some(out) = self.out else {
                return Ok(());
            };
            let state = TrainState {
                step,
                config: Some(config.clone()),
                model: Some(config.model_identity()?),
                data: self.data.state(step, config.micro_batches),
            };
            let saved = Checkpoint {
                out,
                model,
                optimizer,
                state: &state,
                files: &files,
                keep: config.keep_checkpoints,
                chunk_bytes: config.checkpoint_chunk_bytes,
                heartbeat: Duration::from_secs(config.timeout_secs) / 4,
                commit_limit: Duration::from_secs(config.checkpoint_timeout_secs),
                observer: self.observer,
            };
            save_checkpoint(&groups, &saved)
                .inspect_err(|e| groups.mesh.world.abort(&e.to_string()))
        };
        let (model, metrics) = std::thread::scope(|scope| {
            let plans = plan_ahead(scope, config, self.data, first_step, predictor);
            run.steps(model, &mut optimizer, first_step, &plans, &save)
        })?;
        save(&model, &optimizer, config.steps)?;
        Ok(RankOutcome {
            metrics,
            eval_loss: None,
        })
    }
}

/// `recompute` runs on the checkpoint strategy `C` it names: burn's `BalancedCheckpointing` (any
/// strategy that recomputes) for `Attention`, `NoCheckpointing` for `None` and `Block` (blocks
/// recomputed whole need nothing recomputed inside them).
fn check_checkpoint_strategy<C: CheckpointStrategy>(
    recompute: Recompute,
) -> Result<(), TrainError> {
    let recomputes = burn_dcp::backend::recomputes::<C>();
    if recomputes != (recompute == Recompute::Attention) {
        return Err(TrainError::Config(format!(
            "recompute {recompute} runs on {}, but the model is on Autodiff<_, {}>: {}",
            match recompute {
                Recompute::Attention => "a checkpoint strategy that recomputes (Autodiff<B, BalancedCheckpointing>)",
                _ => "Autodiff<B, NoCheckpointing>",
            },
            std::any::type_name::<C>().rsplit("::").next().unwrap_or_default(),
            match recompute {
                Recompute::Attention => "train it with Trainer::train_rank_checkpointed::<B, BalancedCheckpointing, _, _>",
                _ => "train it with Trainer::train_rank",
            }
        )));
    }
    Ok(())
}

/// The backend computes in `precision` on `device` (lavapipe, for one, has no bf16).
fn check_precision<B: burn::prelude::Backend>(
    precision: Precision,
    device: &B::Device,
) -> Result<(), TrainError> {
    let dtype = precision.dtype();
    if !B::supports_dtype(device, dtype) {
        let supported: Vec<&str> = Precision::ALL
            .into_iter()
            .filter(|other| B::supports_dtype(device, other.dtype()))
            .map(|other| other.name())
            .collect();
        return Err(TrainError::Config(format!(
            "precision {precision}: the backend {} does not compute in {dtype:?} on this device; \
             it supports --precision {}",
            B::name(device),
            supported.join(", ")
        )));
    }
    Ok(())
}

/// The mesh asks only what the model supports: TP needs [`TrainModel::tensor_parallel`], PP
/// [`TrainModel::stages`].
pub(crate) fn check_model_support<B: AutodiffBackend, M: TrainModel<B>>(
    model: &M,
    config: &TrainConfig,
) -> Result<(), TrainError> {
    if config.tp > 1 && !model.tensor_parallel() {
        return Err(TrainError::Config(format!(
            "tp {} needs a model that shards itself over a TP group (TrainModel::tensor_parallel); this one does not",
            config.tp
        )));
    }
    if config.pp > 1 && model.stages().is_none() {
        return Err(TrainError::Config(format!(
            "pp {} needs a model split into pipeline stages (TrainModel::stages); this one is not",
            config.pp
        )));
    }
    if config.vpp > 1 && model.chunks() != config.vpp {
        return Err(TrainError::Config(format!(
            "--vpp {} needs a model of {} chunks per pipeline rank (TrainModel::chunks); this one has {}",
            config.vpp,
            config.vpp,
            model.chunks()
        )));
    }
    if config.recompute == Recompute::Block && model.stages().is_none() {
        return Err(TrainError::Config(
            "recompute block recomputes the model's layers one by one: the model must expose them (TrainModel::stages, PipelineStage::layers); this one does not".into(),
        ));
    }
    // Stages take packed rows: the pipeline sends them between stages, and block recompute
    // runs the layers on them.
    if M::INPUT_ROWS != InputRows::Packed {
        let why = match (config.pp, config.recompute) {
            (pp, _) if pp > 1 => Some(format!("pp {pp} sends packed rows between stages")),
            (_, Recompute::Block) => {
                Some("recompute block runs the model's layers on packed rows".to_string())
            }
            _ => None,
        };
        if let Some(why) = why {
            return Err(TrainError::Config(format!(
                "{why}: the model must take InputRows::Packed"
            )));
        }
    }
    Ok(())
}

/// A receiver of the plans of consecutive steps, computed ahead on a background thread.
pub(crate) type PlanReceiver = std::sync::mpsc::Receiver<Result<StepPlan, CpError>>;

/// Plans steps `first..=steps` on a thread of `scope`, at most `plan_ahead` steps ahead of the one
/// training (a bounded channel). The thread stops when the receiver is dropped.
pub(crate) fn plan_ahead<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    config: &'env TrainConfig,
    data: &'env TrainData,
    first: usize,
    predictor: Option<Predictor>,
) -> PlanReceiver {
    let (sender, receiver) = std::sync::mpsc::sync_channel(config.plan_ahead);
    scope.spawn(move || {
        for step in first..=config.steps {
            let plan = plan_step_predicted(config, data, step, predictor.as_ref());
            if sender.send(plan).is_err() {
                break;
            }
        }
    });
    receiver
}

/// What every step of a rank's training needs.
pub(crate) struct StepLoop<'a, B: FlashOps> {
    groups: &'a RankGroups,
    config: &'a TrainConfig,
    data: &'a TrainData,
    observer: &'a dyn StepObserver,
    device: &'a B::Device,
    schedule: &'a dyn LrSchedule,
}

impl<B: FlashOps> StepLoop<'_, B> {
    /// Trains steps `first..=steps` and returns the trained model; rank 0 also returns (and
    /// reports) the steps' metrics.
    fn steps<C, M, O>(
        &self,
        mut model: M,
        optimizer: &mut O,
        first: usize,
        plans: &PlanReceiver,
        save: &dyn Fn(&M, &O, usize) -> Result<(), TrainError>,
    ) -> Result<(M, Vec<StepMetrics>), TrainError>
    where
        C: CheckpointStrategy,
        M: TrainModel<CpTrain<B, C>>,
        O: Optimizer<M, CpTrain<B, C>>,
    {
        let world = &self.groups.mesh.world;
        let mut metrics = Vec::new();
        let mut gpu_peak = None;
        for step in first..=self.config.steps {
            let step_trace = burn_dcp::diagnostics::trace::StepTrace::open(step);
            let started = Instant::now();
            world.barrier()?;
            let stats_before = world.stats();
            let waited = Instant::now();
            let plan = plans
                .recv()
                .map_err(|_| TrainError::PlannerStopped { step })??;
            let plan_wait_ms = waited.elapsed().as_secs_f64() * 1e3;
            let attention_before = attention_time();
            let wait_before = comm_wait_time();
            let result = step_gradients_planned::<B, C, M>(
                &model,
                self.groups,
                self.config,
                self.data,
                &plan,
                self.device,
            )?;
            let optimizer_started = Instant::now();
            let span = burn_dcp::diagnostics::trace::span(
                "optimizer",
                "optimizer",
                serde_json::Value::Null,
            );
            let lr = self.schedule.lr(step);
            model = optimizer.step(lr, model, result.grads);
            if self.config.sync_phases {
                crate::step::device_sync::<B>(self.device)?;
            }
            drop(span);
            let optimizer_ms = optimizer_started.elapsed().as_secs_f64() * 1e3;
            let mut bytes = StepBytes::between(&stats_before, &world.stats());
            bytes.attention_ms = (attention_time() - attention_before).as_secs_f64() * 1e3;
            bytes.comm_wait_ms = (comm_wait_time() - wait_before).as_secs_f64() * 1e3;
            bytes.optimizer_ms = optimizer_ms;
            bytes.pipeline_idle_ms = result.pipeline_idle_ms;
            bytes.forward_ms = result.phases.map(|p| p.forward.as_secs_f64() * 1e3);
            bytes.backward_ms = result.phases.map(|p| p.backward.as_secs_f64() * 1e3);
            bytes.peak_memory_mb = rank_peak_memory_mb(world.rank());
            gpu_peak = rank_peak_gpu_memory_mb::<B>(self.device, gpu_peak);
            bytes.peak_gpu_memory_mb = gpu_peak;
            // After the step's time and byte counts: validation is not the step's.
            let step_ms = started.elapsed().as_secs_f64() * 1e3;
            let val_loss = match (self.config.eval_every, self.data.validation()) {
                (Some(every), Some(validation))
                    if step % every == 0 || step == self.config.steps =>
                {
                    Some(validation_loss::<B, C, M>(
                        &model,
                        self.groups,
                        self.config,
                        validation,
                        self.device,
                    )?)
                }
                _ => None,
            };
            let bytes = bytes.summed(world)?;
            if world.rank() == 0 {
                let bytes_by_axis = AXES
                    .iter()
                    .map(|axis| {
                        let sent = bytes.labels.get(*axis).copied().unwrap_or(0);
                        (axis.to_string(), sent)
                    })
                    .collect();
                let step_metrics = StepMetrics {
                    step,
                    loss: result.loss,
                    lr,
                    grad_norm: result.grad_norm,
                    val_loss,
                    tokens: result.tokens,
                    bytes_communicated: bytes.total,
                    bytes_by_link: bytes.links,
                    step_ms,
                    cp_group_sizes: result
                        .stats
                        .cp_group_sizes
                        .iter()
                        .map(|(size, count)| (size.to_string(), *count))
                        .collect(),
                    rank_workload_imbalance: result.stats.rank_workload_imbalance,
                    plan_ms: Some(plan.plan_ms),
                    plan_wait_ms: Some(plan_wait_ms),
                    bytes_by_axis,
                    strategy_counts: result.stats.strategy_counts.clone(),
                    auto_choices: plan.auto_choices.clone(),
                    grad_sync_ms: Some(result.grad_sync_ms),
                    grad_sync_exposed_ms: Some(result.grad_sync_ms),
                    attention_ms: Some(bytes.attention_ms),
                    predicted_attention_ms: plan.predicted_attention_ms,
                    peak_memory_mb: bytes.peak_memory_per_rank.iter().copied().collect(),
                    peak_gpu_memory_mb: bytes.peak_gpu_memory_per_rank.iter().copied().collect(),
                    comm_wait_ms: Some(bytes.comm_wait_ms),
                    optimizer_ms: Some(bytes.optimizer_ms),
                    forward_ms: bytes.forward_ms,
                    backward_ms: bytes.backward_ms,
                    pipeline_bubble_ms: (self.config.pp > 1)
                        .then(|| bytes.pipeline_idle_ms / world.size() as f64),
                };
                self.observer.on_step(&step_metrics);
                metrics.push(step_metrics);
            }
            world.barrier()?;
            drop(step_trace);
            // `--checkpoint-every`: the last step's checkpoint is written after the loop.
            let every = self.config.checkpoint_every;
            if every.is_some_and(|n| step % n == 0) && step < self.config.steps {
                save(&model, optimizer, step)?;
            }
        }
        Ok((model, metrics))
    }
}
