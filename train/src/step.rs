//! One optimizer step on one rank: its planned batches through the pipeline schedule, then the
//! gradient and loss all-reduces; the bytes it sent.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::FloatDType;
use burn_dcp::backend::{set_context, CpContext};
use burn_dcp::comm::{Comm, CommStats, LinkBytes};
use burn_dcp::kernels::FlashOps;
use burn_dcp::CpError;
use serde::{Deserialize, Serialize};

use crate::config::{Recompute, TrainConfig};
use crate::data::TrainData;
use crate::error::{forward_failed, TrainError};
use crate::gradients::{clip_grad_norm, global_grad_norm, reduce_step, sum_losses};
use crate::groups::RankGroups;
use crate::model::{master_grads, step_copy, CpTrain, ShardInput, TrainModel};
use crate::pipeline::{stage_passes, Pass, StageRun};
use crate::plan::{PlannedBatch, ScheduleStats, StepPlan, StepSequences};
use crate::planning::plan_step;

/// Gradients of the global mean loss of step `step` (all-reduced over DP×CP; clipped to
/// `config.clip_grad_norm`), the loss and the step's token count. The step is planned here, synchronously; training plans ahead on a
/// background thread and calls `step_gradients_planned`.
pub fn step_gradients<B: FlashOps, M: TrainModel<CpTrain<B>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    data: &TrainData,
    step: usize,
    device: &B::Device,
) -> Result<(f64, GradientsParams, usize), CpError> {
    let plan = plan_step(config, data, step)?;
    let result = step_gradients_planned::<B, NoCheckpointing, M>(
        model, groups, config, data, &plan, device,
    )?;
    Ok((result.loss, result.grads, result.tokens))
}

/// One rank's step: the mean loss, the all-reduced gradients, the tokens, and what ran where.
pub(crate) struct StepResult {
    pub loss: f64,
    /// Every parameter's gradient of the step, clipped to `--clip-grad-norm`.
    pub grads: GradientsParams,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
    pub stats: ScheduleStats,
    /// Time of the gradient all-reduces over the pool (after the backward passes: not
    /// overlapped with them, see `gradients.rs`).
    pub grad_sync_ms: f64,
    /// This rank's time waiting for other pipeline stages (0 without a pipeline).
    pub pipeline_idle_ms: f64,
    /// Forward and backward times of the micro-batches (pp 1; see [`StepBytes::forward_ms`]).
    pub phases: Option<Phases>,
}

/// Where a step's compute went, at pp 1: the forwards and the backwards (device time with
/// `--sync-phases`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Phases {
    pub forward: Duration,
    pub backward: Duration,
}

/// Runs step `plan.step` by its plan: this rank's shard of every planned batch it is in, in the
/// batch's group — at pp 1 one forward and backward after the other, else through the
/// pipeline's stages on its schedule ([`pipeline`](crate::pipeline)) — then the all-reduces of
/// the gradients and the loss.
pub(crate) fn step_gradients_planned<
    B: FlashOps,
    C: CheckpointStrategy,
    M: TrainModel<CpTrain<B, C>>,
>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    data: &TrainData,
    plan: &StepPlan,
    device: &B::Device,
) -> Result<StepResult, CpError> {
    let step = plan.step;
    let batches = data.cp_step_batches(step, config.micro_batches)?;
    let global_labels: usize = batches.iter().map(|b| b.label_count()).sum();
    if global_labels == 0 {
        return Err(CpError::Input(format!(
            "step {step}: its {} micro-batches hold no labelled token, so the mean loss is undefined; use more micro-batches per step or longer documents",
            batches.len()
        )));
    }
    let tokens = batches.iter().map(|b| b.tokens.len()).sum();
    let sequences = StepSequences::new(batches.iter().map(|b| &**b).collect());
    let (accumulator, loss_sum, idle, phases) = run_plan::<B, C, M>(
        model,
        groups,
        config,
        (&sequences, global_labels),
        plan,
        device,
        true,
    )?;
    let reduce_started = std::time::Instant::now();
    let mut reduced =
        reduce_step::<B, C, M>(model, groups, step, accumulator, loss_sum, global_labels)?;
    if config.sync_phases {
        device_sync::<B>(device)?;
        reduced.grad_sync_ms = reduce_started.elapsed().as_secs_f64() * 1e3;
    }
    let grad_norm = global_grad_norm(model, &reduced.grads, groups)?;
    let grads = match config.clip_grad_norm {
        Some(max_norm) => clip_grad_norm(model, reduced.grads, grad_norm, max_norm),
        None => reduced.grads,
    };
    Ok(StepResult {
        loss: reduced.loss,
        grads,
        grad_norm,
        tokens,
        stats: plan.stats(groups.world.size()),
        grad_sync_ms: reduced.grad_sync_ms,
        pipeline_idle_ms: idle.as_secs_f64() * 1e3,
        phases,
    })
}

/// Waits for the work queued on `device` (`--sync-phases`).
pub(crate) fn device_sync<B: FlashOps>(device: &B::Device) -> Result<(), CpError> {
    B::sync(device).map_err(|e| CpError::RunFailed(format!("waiting for the device: {e:?}")))
}

/// This rank's passes over `plan` — forward and backward (`backward`; training) or forward only
/// (validation) — in each planned batch's group: at pp 1 one micro-batch after the other, else
/// through the pipeline's stages. Returns the accumulated gradients, the loss sum and the time
/// this rank waited for other stages.
fn run_plan<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    (sequences, global_labels): (&StepSequences<'_>, usize),
    plan: &StepPlan,
    device: &B::Device,
    backward: bool,
) -> Result<(GradientsAccumulator<M>, f64, Duration, Option<Phases>), CpError> {
    groups.ensure(plan)?;
    if config.pp > 1 {
        check_stages_agree(&groups.mesh.pp, plan)?;
    }
    // The schedule's units are the plan's sub-steps: this rank's batch in each, if any.
    let me = groups.world.rank();
    let mut units: Vec<Option<&PlannedBatch>> = vec![None; plan.sub_step_ranges().len()];
    for planned in plan.batches_of(me) {
        units[planned.sub_step] = Some(planned);
    }
    if config.pp > 1 || config.recompute == Recompute::Block {
        let chunks = model.chunks();
        if chunks > 1 {
            // The interleaved schedule takes whole rounds of pp units. A plan whose sub-steps
            // vary (dynamic CP, DCP, auto) is padded with units no rank holds: every stage skips
            // them alike, which removes the same passes from every rank's schedule and keeps
            // the order of the rest (static plans have whole rounds: `--vpp`'s rule).
            units.resize(units.len().next_multiple_of(config.pp), None);
        }
        let passes = match backward {
            true => stage_passes(
                config.pp_schedule,
                groups.mesh.pp.rank(),
                config.pp,
                chunks,
                units.len(),
            ),
            // Forward only: every unit's chunks in order, which each stage receives in the
            // order the one before sent them.
            false => (0..units.len() * chunks).map(Pass::Forward).collect(),
        };
        let (accumulator, loss, idle) = run_stages::<B, C, M>(
            model,
            groups,
            config,
            (sequences, global_labels),
            &units,
            &passes,
            device,
        )?;
        return Ok((accumulator, loss, idle, None));
    }
    let mut run = SingleStage::<B, C, M> {
        model,
        groups,
        sequences,
        global_labels,
        device,
        copy: (config.precision.compute_dtype()).map(|dtype| step_copy(model, dtype)),
        accumulator: GradientsAccumulator::new(),
        losses: Vec::new(),
        sync: config.sync_phases,
        phases: Phases::default(),
        checkpointing: PhantomData,
    };
    for (unit, planned) in units.iter().enumerate() {
        if let Some(planned) = planned {
            run.forward_backward(unit, planned, backward)?;
        }
    }
    let loss_sum = run.loss_sum()?;
    Ok((run.accumulator, loss_sum, Duration::ZERO, Some(run.phases)))
}

/// The validation loss of `model` (after an update): the mean loss over every labelled token of
/// the validation set's whole steps, each planned as a training step is and run forward only,
/// so cp N computes cp 1's.
pub(crate) fn validation_loss<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    validation: &TrainData,
    device: &B::Device,
) -> Result<f64, CpError> {
    let _span =
        burn_dcp::diagnostics::trace::span("validation", "compute", serde_json::Value::Null);
    let (mut loss_sum, mut labels) = (0.0, 0);
    for step in 1..=validation.whole_steps(config.micro_batches) {
        let plan = plan_step(config, validation, step)?;
        let batches = validation.cp_step_batches(step, config.micro_batches)?;
        let step_labels: usize = batches.iter().map(|b| b.label_count()).sum();
        let sequences = StepSequences::new(batches.iter().map(|b| &**b).collect());
        let (_, sum, _, _) = run_plan::<B, C, M>(
            model,
            groups,
            config,
            (&sequences, step_labels),
            &plan,
            device,
            false,
        )?;
        loss_sum += sum;
        labels += step_labels;
    }
    if labels == 0 {
        return Err(CpError::Input(
            "the validation set holds no labelled token (--eval-tokens)".into(),
        ));
    }
    Ok(sum_losses(groups, loss_sum)? / labels as f64)
}

/// The pipeline's `passes` over this rank's `units` (pp > 1, or `Recompute::Block`, which runs
/// the model stage by stage); returns the accumulated gradients and the loss sum.
fn run_stages<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    (sequences, global_labels): (&StepSequences<'_>, usize),
    units: &[Option<&PlannedBatch>],
    passes: &[Pass],
    device: &B::Device,
) -> Result<(GradientsAccumulator<M>, f64, Duration), CpError> {
    let mut run = StageRun::<B, C, M>::new(
        model,
        groups,
        sequences,
        global_labels,
        device,
        config.recompute,
        config.precision,
    );
    // A pass's virtual id is `unit · chunks + chunk`.
    let chunks = model.chunks();
    for &pass in passes {
        match pass {
            Pass::Forward(id) => {
                if let Some(planned) = units[id / chunks] {
                    let _span = micro_batch_span(id / chunks, "forward", planned);
                    run.forward(id, planned)?;
                }
            }
            Pass::Backward(id) => {
                if let Some(planned) = units[id / chunks] {
                    let _span = micro_batch_span(id / chunks, "backward", planned);
                    run.backward(id)?;
                }
            }
        }
    }
    run.finish()
}

/// One rank's micro-batches without a pipeline: each one's forward, then its backward.
struct SingleStage<'a, B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>> {
    model: &'a M,
    groups: &'a RankGroups,
    sequences: &'a StepSequences<'a>,
    global_labels: usize,
    device: &'a B::Device,
    /// The step's copy of the model in the compute dtype (`None`: f32, the model itself), made
    /// once for all of the step's micro-batches.
    copy: Option<M>,
    accumulator: GradientsAccumulator<M>,
    /// The unscaled losses of the micro-batches, on the device (read back once, after the last
    /// backward: the step queues its backward passes without waiting for its forwards).
    losses: Vec<burn::prelude::Tensor<CpTrain<B, C>, 1>>,
    /// `--sync-phases`: wait for the device after each backward.
    sync: bool,
    /// The micro-batches' forward and backward times.
    phases: Phases,
    /// The checkpointing the model's backend runs.
    checkpointing: PhantomData<C>,
}

impl<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>> SingleStage<'_, B, C, M> {
    /// The micro-batches' losses summed: the step's one read-back (0 without a micro-batch).
    fn loss_sum(&self) -> Result<f64, CpError> {
        if self.losses.is_empty() {
            return Ok(0.0);
        }
        // Each loss as f32, added in f64 in micro-batch order (as when each was read alone).
        let losses = burn::prelude::Tensor::cat(self.losses.clone(), 0)
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| CpError::Input(format!("reading the step's losses: {e:?}")))?;
        Ok(losses.into_iter().map(f64::from).sum())
    }

    /// The forward of `planned` (sub-step `unit`) in its CP group, its loss, and (`backward`) the
    /// backward of `loss / global_labels` into the accumulated gradients. Under a low precision the forward
    /// runs the step's copy of the model in it, whose gradients are accumulated in f32.
    fn forward_backward(
        &mut self,
        unit: usize,
        planned: &PlannedBatch,
        backward: bool,
    ) -> Result<(), CpError> {
        let me = self.groups.world.rank();
        let started = std::time::Instant::now();
        let loss = {
            let _span = micro_batch_span(unit, "forward", planned);
            let (shard, batch) = planned.rank_input(self.sequences, me, M::INPUT_ROWS)?;
            let group = self.groups.group(&planned.ranks, planned.strategy)?;
            let model = self.copy.as_ref().unwrap_or(self.model);
            let input = ShardInput::new(&shard, &batch, me - planned.ranks.start, self.device)?;
            let context = set_context(CpContext { group, batch });
            let loss = model
                .loss_sum(input, &self.groups.tp)
                .map_err(forward_failed)?;
            self.losses.push(loss.clone().detach());
            // Never silent: a model whose attention bypassed the op fails at its first
            // micro-batch.
            context.finish()?;
            loss
        };
        if self.sync {
            device_sync::<B>(self.device)?;
        }
        let forward_done = std::time::Instant::now();
        self.phases.forward += forward_done - started;
        if !backward {
            return Ok(());
        }
        let _span = micro_batch_span(unit, "backward", planned);
        let grads = (loss / self.global_labels as f64).backward();
        let grads = match &self.copy {
            Some(copy) => master_grads(self.model, GradientsParams::from_grads(grads, copy)),
            None => GradientsParams::from_grads(grads, self.model),
        };
        self.accumulator.accumulate(self.model, grads);
        if self.sync {
            device_sync::<B>(self.device)?;
        }
        self.phases.backward += forward_done.elapsed();
        Ok(())
    }
}

/// Stops the step with an error, rather than a hang or a wrong gradient, when the pipeline's stages
/// hold different plans for it (they compute them independently from the same configuration and
/// data, so this means the ranks were started inconsistently): every stage of a micro-batch must
/// run it on the same CP group, placement and strategy.
pub(crate) fn check_stages_agree(pp: &Comm, plan: &StepPlan) -> Result<(), CpError> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for batch in &plan.batches {
        (batch.sub_step, &batch.ranks, &batch.sequences).hash(&mut hasher);
        batch.strategy.hash(&mut hasher);
        batch.placement.hash(&mut hasher);
    }
    let fingerprint = format!("{:016x}", hasher.finish());
    let stages = pp.all_gather_control("pipeline plan check", fingerprint.clone().into_bytes())?;
    if let Some((stage, other)) = stages
        .iter()
        .enumerate()
        .find(|(_, f)| f.as_slice() != fingerprint.as_bytes())
    {
        return Err(CpError::Config(format!(
            "step {}: pipeline stage {} planned the step differently from stage {stage} (plan fingerprints {fingerprint} and {}): every stage of a micro-batch must run it on the same CP group",
            plan.step,
            pp.rank(),
            String::from_utf8_lossy(other)
        )));
    }
    Ok(())
}

/// The trace span of this rank's `pass` of its micro-batch in sub-step `unit`.
fn micro_batch_span(
    unit: usize,
    pass: &str,
    planned: &PlannedBatch,
) -> burn_dcp::diagnostics::trace::Span {
    burn_dcp::diagnostics::trace::span(
        format_args!("micro-batch {unit} {pass}"),
        "compute",
        serde_json::json!({"strategy": planned.strategy.to_string(), "ranks": [planned.ranks.start, planned.ranks.end]}),
    )
}

/// The bytes one rank sent during one step: every rank measures its own
/// ([`Communicator::stats`](burn_dcp::comm::Communicator::stats)) and rank 0 sums them, so the
/// totals are the same whether ranks are threads of one process or processes of an MPI job.
/// With them, the rank's time in CP attention, of which [`summed`](Self::summed) keeps the max.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct StepBytes {
    pub(crate) total: u64,
    pub(crate) links: LinkBytes,
    pub(crate) labels: BTreeMap<String, u64>,
    #[serde(default)]
    pub(crate) attention_ms: f64,
    /// This rank's peak memory so far ([`rank_peak_memory_mb`]).
    #[serde(default)]
    pub(crate) peak_memory_mb: Option<f64>,
    /// After [`summed`](Self::summed): every rank's, in world order.
    #[serde(default)]
    pub(crate) peak_memory_per_rank: Vec<Option<f64>>,
    /// This rank's device memory at its most so far ([`rank_peak_gpu_memory_mb`]); `None` on a
    /// backend without a device of its own.
    #[serde(default)]
    pub(crate) peak_gpu_memory_mb: Option<f64>,
    /// After [`summed`](Self::summed): every rank's, in world order.
    #[serde(default)]
    pub(crate) peak_gpu_memory_per_rank: Vec<Option<f64>>,
    /// The rank's time in communication calls and waits ([`burn_dcp::diagnostics::trace::comm_wait_time`]);
    /// [`summed`](Self::summed) keeps the max.
    #[serde(default)]
    pub(crate) comm_wait_ms: f64,
    /// The rank's optimizer update; [`summed`](Self::summed) keeps the max.
    #[serde(default)]
    pub(crate) optimizer_ms: f64,
    /// The rank's wait for other pipeline stages; [`summed`](Self::summed) sums every rank's.
    #[serde(default)]
    pub(crate) pipeline_idle_ms: f64,
    /// The rank's forwards and backwards (device time with `--sync-phases`, else the time to
    /// queue them); pp 1 only.
    /// [`summed`](Self::summed) keeps the max.
    #[serde(default)]
    pub(crate) forward_ms: Option<f64>,
    #[serde(default)]
    pub(crate) backward_ms: Option<f64>,
}

/// This rank's peak memory so far, in MiB (2²⁰ bytes). Ranks that are processes (MPI, TCP):
/// the process's peak resident memory. Ranks that are threads of an in-process world: the
/// allocation accounting of [`burn_dcp::kernels::memory`] for the rank (the bytes it allocated
/// and has not freed, at their most) when the binary installs its `TrackingAllocator` — so cp 1
/// and cp 8 on threads are measured alike; without it, the process's peak for a world of one
/// rank and `None` for more.
pub fn rank_peak_memory_mb(rank: usize) -> Option<f64> {
    use burn_dcp::kernels::{memory, portable::RankThreads};
    let bytes = match (RankThreads::current(), memory::peak_bytes(rank)) {
        (0, _) => memory::process_peak_bytes()?,
        (_, Some(bytes)) => bytes,
        (1, None) => memory::process_peak_bytes()?,
        _ => return None,
    };
    Some(bytes as f64 / (1u64 << 20) as f64)
}

/// This rank's device memory in MiB: what `B`'s allocator holds on `device` (reserved: cubecl's
/// pools keep their pages, so this is the high-water mark so far; torch's
/// `max_memory_reserved` is its analogue), the larger of it and `so_far`. `None` where `B`
/// allocates in host memory ([`FlashOps::device_memory`]). Ranks that are threads on one GPU
/// each have their own stream and pools: each counts its own.
pub fn rank_peak_gpu_memory_mb<B: FlashOps>(
    device: &B::Device,
    so_far: Option<f64>,
) -> Option<f64> {
    let now = B::device_memory(device).map(|m| m.reserved as f64 / (1u64 << 20) as f64);
    match (now, so_far) {
        (Some(now), Some(before)) => Some(now.max(before)),
        (now, before) => now.or(before),
    }
}

impl StepBytes {
    pub(crate) fn between(before: &CommStats, after: &CommStats) -> Self {
        let labels = after
            .bytes_by_label
            .iter()
            .map(|(label, bytes)| {
                let earlier = before.bytes_by_label.get(label).copied().unwrap_or(0);
                (label.clone(), bytes - earlier)
            })
            .collect();
        StepBytes {
            total: after.total_bytes() - before.total_bytes(),
            links: LinkBytes {
                intra_node: after.bytes_by_link.intra_node - before.bytes_by_link.intra_node,
                inter_node: after.bytes_by_link.inter_node - before.bytes_by_link.inter_node,
            },
            labels,
            attention_ms: 0.0,
            peak_memory_mb: None,
            peak_memory_per_rank: Vec::new(),
            peak_gpu_memory_mb: None,
            peak_gpu_memory_per_rank: Vec::new(),
            comm_wait_ms: 0.0,
            optimizer_ms: 0.0,
            pipeline_idle_ms: 0.0,
            forward_ms: None,
            backward_ms: None,
        }
    }

    /// Every rank's bytes of the step, summed (on every rank) through a control all-gather; the
    /// attention time is the slowest rank's.
    pub(crate) fn summed(self, world: &Comm) -> Result<StepBytes, TrainError> {
        let payload = serde_json::to_vec(&self)
            .map_err(|e| TrainError::Malformed(format!("a per-rank byte count: {e}")))?;
        let all = world.all_gather_control("step bytes", payload)?;
        let mut sum = StepBytes::default();
        for bytes in all {
            let rank: StepBytes = serde_json::from_slice(&bytes).map_err(|e| {
                TrainError::Malformed(format!("a malformed per-rank byte count: {e}"))
            })?;
            sum.total += rank.total;
            sum.attention_ms = sum.attention_ms.max(rank.attention_ms);
            sum.peak_memory_per_rank.push(rank.peak_memory_mb);
            sum.peak_gpu_memory_per_rank.push(rank.peak_gpu_memory_mb);
            sum.comm_wait_ms = sum.comm_wait_ms.max(rank.comm_wait_ms);
            sum.optimizer_ms = sum.optimizer_ms.max(rank.optimizer_ms);
            sum.pipeline_idle_ms += rank.pipeline_idle_ms;
            let max = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            sum.forward_ms = max(sum.forward_ms, rank.forward_ms);
            sum.backward_ms = max(sum.backward_ms, rank.backward_ms);
            sum.links.intra_node += rank.links.intra_node;
            sum.links.inter_node += rank.links.inter_node;
            for (label, bytes) in rank.labels {
                *sum.labels.entry(label).or_default() += bytes;
            }
        }
        Ok(sum)
    }
}

/// The mesh's axes, as `bytes_by_axis` names them.
pub const AXES: [&str; 4] = ["tp", "cp", "dp", "pp"];
