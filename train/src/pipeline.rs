//! Pipeline parallelism (PP), Megatron-LM style: the model's layers are split into `pp` stages
//! (`TpGpt::stage`: the embedding on the first, the final norm, LM head and loss on the last), and
//! a step's micro-batches flow through them on a 1F1B or GPipe schedule. Activations go forward
//! and their gradients backward by send/recv on the PP group (the ranks that differ only in their
//! stage).
//!
//! **The unit of the schedule is a sub-step of the step's plan** (`PlannedBatch::sub_step`): the
//! batches of one sub-step run side by side on disjoint ranks of the DP × CP pool. Every stage
//! holds the same pool and computes the same plan, so the ranks of a sub-step's CP group at stage
//! `s` hand their activations to the same group at stage `s + 1`: every stage of a micro-batch
//! agrees on its CP group, its placement and its strategy, whether it is static, dynamic, DCP or
//! auto (Megatron's dynamic CP with PP has the same rule). A rank that holds no batch in a
//! sub-step skips it at every stage; since all ranks of a stage walk the sub-steps in the same
//! order, the CP groups' collectives never cross.
//!
//! At a stage boundary the sender keeps the autodiff graph of its output `y`; the receiver makes
//! the received tensor a leaf `x` that requires its gradient. Backward, the receiver sends
//! `∂L/∂x` back and the sender runs the backward of `Σ y ⊙ ∂L/∂y`, whose gradient with respect to
//! `y` is exactly the received one. The CP context a micro-batch ran with travels in its
//! attention's autodiff node, so its backward runs on its own group however the passes interleave.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::{Int, Tensor, TensorData, ToElement};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::backend::{set_context, CpContext};
use burn_dcp::comm::{Comm, Payload, PendingSend};
use burn_dcp::kernels::FlashOps;
use burn_dcp::{CpBatch, CpError, CpGroup};

use burn_dcp::batch::shard::RankShard;

use crate::config::{PpSchedule, Precision, Recompute};
use crate::error::{forward_failed as failed, TrainError};
use crate::groups::RankGroups;
use crate::model::{cast_model, CpTrain, PipelineStage, ShardInput, TrainModel};
use crate::plan::{PlannedBatch, StepSequences};

/// Hidden states between pipeline stages (and, under `Recompute::Block`, between layers).
type Hidden<B, C> = Tensor<CpTrain<B, C>, 3>;

/// `Recompute::Block` of a model without pipeline stages, as the step's error.
fn no_stages() -> CpError {
    failed(TrainError::Model(
        "the model has no stages to recompute".into(),
    ))
}

/// A forward or backward pass of one schedule unit (a sub-step of the plan) on one model chunk,
/// named by its virtual id `unit · chunks + chunk` (the unit itself with one chunk per rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward(usize),
    Backward(usize),
}

/// The passes stage `stage` of `stages` runs over `units` schedule units of its `chunks` model
/// chunks, in order. One chunk: 1F1B or GPipe, backward passes in the forwards' order, so a stage
/// receives gradients in the order it sent activations. Several chunks (`--vpp`; `units` a
/// multiple of `stages`): Megatron-LM's interleaved 1F1B — forward `k` runs chunk
/// `(k mod stages·chunks) / stages` of unit `(k / (stages·chunks))·stages + k mod stages`
/// (backward: the chunks in reverse), after `2·(stages − stage − 1) + (chunks − 1)·stages`
/// warm-up forwards; messages are tagged, since one pair of ranks may carry both directions.
pub(crate) fn stage_passes(
    schedule: PpSchedule,
    stage: usize,
    stages: usize,
    chunks: usize,
    units: usize,
) -> Vec<Pass> {
    if chunks > 1 {
        return interleaved_passes(stage, stages, chunks, units);
    }
    let warmup = match schedule {
        PpSchedule::OneFOneB => (stages - stage - 1).min(units),
        PpSchedule::Gpipe => units,
    };
    let mut passes: Vec<Pass> = (0..warmup).map(Pass::Forward).collect();
    for unit in 0..units - warmup {
        passes.push(Pass::Forward(warmup + unit));
        passes.push(Pass::Backward(unit));
    }
    passes.extend((units - warmup..units).map(Pass::Backward));
    passes
}

/// Megatron-LM's interleaved 1F1B (see [`stage_passes`]), over virtual ids.
fn interleaved_passes(stage: usize, stages: usize, chunks: usize, units: usize) -> Vec<Pass> {
    let total = units * chunks;
    let round = stages * chunks;
    let id = |k: usize, forward: bool| {
        let (group, within) = (k / round, k % round);
        let chunk = match forward {
            true => within / stages,
            false => chunks - 1 - within / stages,
        };
        (group * stages + within % stages) * chunks + chunk
    };
    let warmup = (2 * (stages - stage - 1) + (chunks - 1) * stages).min(total);
    let mut passes: Vec<Pass> = (0..warmup).map(|k| Pass::Forward(id(k, true))).collect();
    for k in 0..total - warmup {
        passes.push(Pass::Forward(id(warmup + k, true)));
        passes.push(Pass::Backward(id(k, false)));
    }
    passes.extend((total - warmup..total).map(|k| Pass::Backward(id(k, false))));
    passes
}

/// What a pipeline message carries: activations forward, their gradients backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Carried {
    Activations,
    Gradients,
}

impl Carried {
    fn name(self) -> &'static str {
        match self {
            Self::Activations => "activations",
            Self::Gradients => "gradients",
        }
    }
}

/// What a forward pass leaves for its backward pass.
struct InFlight<B: FlashOps, C: CheckpointStrategy> {
    output: Output<B, C>,
    /// The input received from the previous stage (none on the first stage).
    input: Option<Hidden<B, C>>,
    /// The CP group the unit ran on.
    group: CpGroup,
    /// Under `Recompute::Block`: what the backward recomputes the layers from.
    layers: Option<KeptLayers<B, C>>,
}

/// The end of a stage's forward pass.
enum Output<B: FlashOps, C: CheckpointStrategy> {
    /// Last stage: the loss sum (its backward is that of `loss / global_labels`).
    Loss(Tensor<CpTrain<B, C>, 1>),
    /// Other stages: the hidden states sent to the next stage.
    Hidden(Hidden<B, C>),
}

/// A stage's forward: the input received (kept for its gradient) and the output.
type StageForward<B, C> = (Option<Hidden<B, C>>, Output<B, C>);

/// A stage's forward under [`Recompute::Block`]: the output and what it kept.
type KeptForward<B, C> = (Output<B, C>, KeptLayers<B, C>);

/// What a stage's forward keeps under [`Recompute::Block`]: each layer's input, computed without
/// an autodiff graph, and the ends around the layers that keep theirs (the embedding, the loss).
struct KeptLayers<B: FlashOps, C: CheckpointStrategy> {
    /// The input of every layer, in order (no graph).
    inputs: Vec<Hidden<B, C>>,
    /// First stage: the embedding's output, with its graph (its backward takes `∂L/∂x₀`).
    embedded: Option<Hidden<B, C>>,
    /// Last stage: the last layer's output as the leaf the loss was computed from.
    last: Option<Hidden<B, C>>,
    positions: Tensor<CpTrain<B, C>, 1, Int>,
    /// The micro-batch's CP batch, set again as the context of each layer's recompute.
    batch: CpBatch,
}

/// One rank's passes over a step at pp > 1 (or under `Recompute::Block`, which runs the model
/// stage by stage, layer by layer): its stage of the model, and what is in flight. At pp 1 a step
/// runs each micro-batch's forward and backward without it (`step.rs`).
pub(super) struct StageRun<'a, B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>> {
    model: &'a M,
    groups: &'a RankGroups,
    sequences: &'a StepSequences<'a>,
    global_labels: usize,
    device: &'a B::Device,
    accumulator: GradientsAccumulator<M>,
    /// Sum of the last stage's unscaled losses (0 on the other stages).
    loss_sum: f64,
    in_flight: HashMap<usize, InFlight<B, C>>,
    recompute: Recompute,
    /// The dtype each forward's copy of the model is cast to (`None`: f32, the model itself).
    compute: Option<burn::tensor::FloatDType>,
    /// Sends not yet known to be complete: waited for at the end of the step ([`Self::finish`]),
    /// not right after posting, so that a stage never waits for its send while its peer waits
    /// for it (under a rendezvous transport such as MPI or NCCL, 1F1B's warm-up forward sends
    /// complete only once the next stage posts their receives, after it sent a gradient back).
    sends: Vec<PendingSend>,
    /// Model chunks of this rank (`--vpp`; 1 without).
    chunks: usize,
    /// Tagged messages (several chunks) received before the pass that takes them.
    stash: HashMap<(Carried, usize), Payload>,
    /// Time spent waiting for a message from another stage: the pipeline's bubble on this rank.
    idle: Duration,
}

impl<'a, B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>> StageRun<'a, B, C, M> {
    pub(crate) fn new(
        model: &'a M,
        groups: &'a RankGroups,
        sequences: &'a StepSequences<'a>,
        global_labels: usize,
        device: &'a B::Device,
        recompute: Recompute,
        precision: Precision,
    ) -> Self {
        Self {
            model,
            groups,
            sequences,
            global_labels,
            device,
            accumulator: GradientsAccumulator::new(),
            loss_sum: 0.0,
            in_flight: HashMap::new(),
            recompute,
            compute: precision.compute_dtype(),
            sends: Vec::new(),
            chunks: model.chunks(),
            stash: HashMap::new(),
            idle: Duration::ZERO,
        }
    }

    /// The model a forward runs: under a low precision a fresh copy cast to it (every forward
    /// its own: each backward consumes the casts' graph), whose gradients reach the f32
    /// parameters of [`Self::model`] in f32; else `None` (the model itself, not cloned).
    fn cast_copy(&self) -> Option<M> {
        self.compute
            .map(|dtype| cast_model(self.model.clone(), dtype))
    }

    /// `model` in the compute dtype (itself in f32).
    fn in_compute_dtype(&self, model: M) -> M {
        match self.compute {
            Some(dtype) => cast_model(model, dtype),
            None => model,
        }
    }

    /// Waits for this rank's sends; returns its accumulated gradients, its loss sum and the time
    /// it waited for other stages.
    pub(crate) fn finish(self) -> Result<(GradientsAccumulator<M>, f64, Duration), CpError> {
        for send in self.sends {
            send.wait()?;
        }
        Ok((self.accumulator, self.loss_sum, self.idle))
    }

    /// The stage and virtual id that feed pass `id` (none on the first virtual stage): the
    /// previous pipeline rank's same chunk, or after the last rank the next chunk on rank 0.
    fn previous(&self, id: usize) -> Option<(usize, usize)> {
        let (rank, chunk) = (self.pp().rank(), id % self.chunks);
        match (rank, chunk) {
            (0, 0) => None,
            (0, _) => Some((self.pp().size() - 1, id - 1)),
            _ => Some((rank - 1, id)),
        }
    }

    /// The stage and virtual id pass `id` feeds (none on the last virtual stage).
    fn next(&self, id: usize) -> Option<(usize, usize)> {
        let (rank, chunk) = (self.pp().rank(), id % self.chunks);
        if rank + 1 < self.pp().size() {
            Some((rank + 1, id))
        } else if chunk + 1 < self.chunks {
            Some((0, id + 1))
        } else {
            None
        }
    }

    fn no_peer(&self, id: usize, which: &str) -> CpError {
        CpError::Config(format!(
            "pipeline stage {}: pass {id} has no {which} stage",
            self.pp().rank()
        ))
    }

    /// Sends `payload` of virtual id `id` (the receiver's) to stage `peer`; with several chunks
    /// a header `[what, id]` goes first (one pair of ranks may carry activations and gradients).
    fn send(
        &mut self,
        (peer, id): (usize, usize),
        carried: Carried,
        payload: Payload,
    ) -> Result<(), CpError> {
        if self.chunks > 1 {
            let header = TensorData::new(vec![carried as i64, id as i64], [2]);
            self.sends
                .push(self.pp().isend(peer, Payload::Host(header))?);
        }
        self.sends.push(self.pp().isend(peer, payload)?);
        Ok(())
    }

    /// The next message of stage `peer` that is `carried` for pass `id`: with several chunks, read
    /// by its header, others kept for their own passes.
    fn receive_payload(
        &mut self,
        peer: usize,
        id: usize,
        carried: Carried,
    ) -> Result<Payload, CpError> {
        if self.chunks == 1 {
            return Ok(self.pp().irecv(peer)?.wait()?);
        }
        if let Some(payload) = self.stash.remove(&(carried, id)) {
            return Ok(payload);
        }
        loop {
            let header = self.pp().irecv(peer)?.wait()?;
            let payload = self.pp().irecv(peer)?.wait()?;
            let words = match header {
                Payload::Host(data) => data.to_vec::<i64>().unwrap_or_default(),
                Payload::Device(_) => Vec::new(),
            };
            let key = match words.as_slice() {
                [0, tagged] => (Carried::Activations, *tagged as usize),
                [1, tagged] => (Carried::Gradients, *tagged as usize),
                _ => {
                    return Err(CpError::Input(format!(
                        "pipeline stage {}: a message from stage {peer} without its [what, pass] header (got {words:?})",
                        self.pp().rank()
                    )))
                }
            };
            if key == (carried, id) {
                return Ok(payload);
            }
            self.stash.insert(key, payload);
        }
    }

    fn pp(&self) -> &Comm {
        &self.groups.mesh.pp
    }

    /// Receives a `[1, tokens, d]` tensor of unit `unit` from stage `peer` (`what`: activations
    /// or gradients), checking its shape.
    fn receive(
        &mut self,
        peer: usize,
        unit: usize,
        tokens: usize,
        carried: Carried,
    ) -> Result<Hidden<B, C>, CpError> {
        let what = carried.name();
        let waiting = Instant::now();
        let data = self.receive_payload(peer, unit, carried)?;
        self.idle += waiting.elapsed();
        let d_model = self.model.stages().map_or(0, |stage| stage.hidden_size());
        if data.shape() != [1, tokens, d_model] {
            return Err(CpError::Input(format!(
                "pipeline stage {}: the {what} of sub-step {unit} from stage {peer} have shape {:?}, expected [1, {tokens}, {d_model}] (the stages disagree on the plan)",
                self.pp().rank(),
                data.shape(),
            )));
        }
        data.into_tensor(self.device)
            .map_err(|e| CpError::Input(e.to_string()))
    }

    /// Waits until the ranks that communicate in a backward pass (the unit's CP group, each with
    /// its TP group) are all about to run it. burn-autodiff holds a rank's graph lock through its
    /// backward, CP and TP collectives included, and after every backward it briefly locks every
    /// graph of the process (`cleanup_orphaned_entries`). A rank starting a backward while a peer
    /// is still busy elsewhere (waiting for its gradient from the next stage, or cleaning up after
    /// its previous backward) could wait for that peer while the peer, or the rank the peer waits
    /// for, waits for its lock: a deadlock. Without a pipeline every backward follows its forward,
    /// whose collectives already line the ranks up — except under `Recompute::Block`, where a
    /// rank's layer backward may follow a recompute that did not meet every peer (a DCP plan
    /// need not connect every pair), so every layer's backward is entered together.
    fn enter_backward(&self, group: &CpGroup) -> Result<(), CpError> {
        if self.pp().size() > 1 || self.recompute == Recompute::Block {
            group.comm.barrier()?;
            self.groups.tp.comm.barrier()?;
        }
        Ok(())
    }

    /// The forward pass of schedule unit `unit`, in which this rank runs `planned`.
    pub(crate) fn forward(&mut self, unit: usize, planned: &PlannedBatch) -> Result<(), CpError> {
        let me = self.groups.world.rank();
        let (shard, batch) = planned.rank_input(self.sequences, me, M::INPUT_ROWS)?;
        let group = self.groups.group(&planned.ranks, planned.strategy)?;
        let blocks = self.recompute == Recompute::Block;
        let copy = self.cast_copy();
        let model: &M = copy.as_ref().unwrap_or(self.model);
        let stage = model
            .chunk(unit % self.chunks)
            .filter(|_| self.pp().size() > 1 || blocks);
        let kept_batch = blocks.then(|| batch.clone());
        let input = match stage {
            None => Some(ShardInput::new(
                &shard,
                &batch,
                me - planned.ranks.start,
                self.device,
            )?),
            Some(_) => None,
        };
        let context = set_context(CpContext {
            group: group.clone(),
            batch,
        });
        let (input, output, layers) = match (stage, input, kept_batch) {
            (Some(stage), _, Some(batch)) => {
                let (output, layers) = self.stage_forward_kept(stage, unit, &shard, batch)?;
                (None, output, Some(layers))
            }
            (Some(stage), _, None) => {
                let (input, output) = self.stage_forward(stage, unit, &shard)?;
                (input, output, None)
            }
            (None, Some(input), _) => {
                let loss = model.loss_sum(input, &self.groups.tp).map_err(failed)?;
                self.loss_sum += loss.clone().into_scalar().to_f64();
                (None, Output::Loss(loss), None)
            }
            (None, None, _) => {
                unreachable!("the input of a single-stage forward is built above")
            }
        };
        // Never silent: a model whose attention bypassed the op fails at its first micro-batch.
        context.finish()?;
        let in_flight = InFlight {
            output,
            input,
            group,
            layers,
        };
        self.in_flight.insert(unit, in_flight);
        Ok(())
    }

    /// One pipeline stage's forward of unit `unit`: the embedding (first stage) or the previous
    /// stage's activations, this stage's layers, then the loss (last stage) or a send onwards.
    fn stage_forward(
        &mut self,
        model: &dyn PipelineStage<CpTrain<B, C>>,
        unit: usize,
        shard: &RankShard,
    ) -> Result<StageForward<B, C>, CpError> {
        let x = self.stage_input(model, unit, shard)?;
        let (input, x) = match model.is_first_stage() {
            true => (None, x),
            false => {
                let x = x.require_grad();
                (Some(x.clone()), x)
            }
        };
        let positions = int_tensor(&shard.positions, self.device);
        let output = model
            .forward_hidden(x, positions, &self.groups.tp)
            .map_err(failed)?;
        Ok((input, self.stage_output(model, unit, shard, output)?))
    }

    /// What a stage's layers start from: the embedding of the shard's tokens (first stage) or
    /// the activations received from the previous stage.
    fn stage_input(
        &mut self,
        model: &dyn PipelineStage<CpTrain<B, C>>,
        unit: usize,
        shard: &RankShard,
    ) -> Result<Hidden<B, C>, CpError> {
        match model.is_first_stage() {
            true => {
                let tokens = int_tensor(&shard.tokens, self.device);
                model.embed(tokens, &self.groups.tp).map_err(failed)
            }
            false => {
                let (previous, _) = self
                    .previous(unit)
                    .ok_or_else(|| self.no_peer(unit, "previous"))?;
                self.receive(previous, unit, shard.tokens.len(), Carried::Activations)
            }
        }
    }

    /// The end of a stage's forward from its layers' output `x`: the loss (last stage) or a send
    /// of `x` to the next stage.
    fn stage_output(
        &mut self,
        model: &dyn PipelineStage<CpTrain<B, C>>,
        unit: usize,
        shard: &RankShard,
        x: Hidden<B, C>,
    ) -> Result<Output<B, C>, CpError> {
        if model.is_last_stage() {
            let labels = int_tensor(&shard.labels, self.device);
            let loss = model
                .loss_from_hidden(x, labels, &self.groups.tp)
                .map_err(failed)?;
            self.loss_sum += loss.clone().into_scalar().to_f64();
            return Ok(Output::Loss(loss));
        }
        let next = self.next(unit).ok_or_else(|| self.no_peer(unit, "next"))?;
        self.send(
            next,
            Carried::Activations,
            Payload::device(x.clone().detach()),
        )?;
        Ok(Output::Hidden(x))
    }

    /// The backward pass of schedule unit `unit` (whose forward this rank ran).
    pub(crate) fn backward(&mut self, unit: usize) -> Result<(), CpError> {
        let stage = self.pp().rank();
        let InFlight {
            output,
            input,
            group,
            layers,
        } = self.in_flight.remove(&unit).ok_or_else(|| {
            CpError::Config(format!(
                "pipeline stage {stage}: backward of sub-step {unit} before its forward"
            ))
        })?;
        if let Some(layers) = layers {
            return self.backward_kept(unit, output, layers, group);
        }
        let grads = match output {
            Output::Loss(loss) => {
                self.enter_backward(&group)?;
                (loss / self.global_labels as f64).backward()
            }
            Output::Hidden(output) => {
                let tokens = output.dims()[1];
                let (next, _) = self.next(unit).ok_or_else(|| self.no_peer(unit, "next"))?;
                let grad = self.receive(next, unit, tokens, Carried::Gradients)?;
                self.enter_backward(&group)?;
                (output * grad).sum().backward()
            }
        };
        if let Some(input) = input {
            let grad = match input.grad(&grads) {
                Some(grad) => Payload::device(grad),
                // An input no output depends on (no tokens): a zero gradient of its shape and
                // dtype.
                None => Payload::device(input.zeros_like().inner()),
            };
            let previous = self
                .previous(unit)
                .ok_or_else(|| self.no_peer(unit, "previous"))?;
            self.send(previous, Carried::Gradients, grad)?;
        }
        self.accumulate(grads);
        Ok(())
    }

    fn accumulate(&mut self, grads: <CpTrain<B, C> as AutodiffBackend>::Gradients) {
        let grads = GradientsParams::from_grads(grads, self.model);
        self.accumulator.accumulate(self.model, grads);
    }

    /// A stage's forward under [`Recompute::Block`]: the embedding (first stage) or the previous
    /// stage's activations, then every layer without an autodiff graph (a copy of the model that
    /// requires no gradient), keeping each layer's input; then the loss (last stage, from the
    /// last layer's output as a leaf) or a send onwards.
    fn stage_forward_kept(
        &mut self,
        model: &dyn PipelineStage<CpTrain<B, C>>,
        unit: usize,
        shard: &RankShard,
        batch: CpBatch,
    ) -> Result<KeptForward<B, C>, CpError> {
        let x = self.stage_input(model, unit, shard)?;
        let embedded = model.is_first_stage().then(|| x.clone());
        let mut x = x.detach();
        let positions = int_tensor(&shard.positions, self.device);
        let frozen = self.in_compute_dtype(self.model.clone().no_grad());
        let frozen = frozen.chunk(unit % self.chunks).ok_or_else(no_stages)?;
        let mut inputs = Vec::with_capacity(frozen.layers());
        for layer in 0..frozen.layers() {
            inputs.push(x.clone());
            x = frozen
                .forward_layer(layer, x, positions.clone(), &self.groups.tp)
                .map_err(failed)?;
        }
        // The loss is computed from the last layer's output as a leaf, whose gradient the
        // backward takes into the layers.
        let last = model.is_last_stage().then(|| x.clone().require_grad());
        let output = self.stage_output(model, unit, shard, last.clone().unwrap_or(x))?;
        let layers = KeptLayers {
            inputs,
            embedded,
            last,
            positions,
            batch,
        };
        Ok((output, layers))
    }

    /// The backward of a unit under [`Recompute::Block`]: `∂L/∂x` of the last layer's output
    /// (from the loss, or received from the next stage), then layer by layer from the last: its
    /// forward again from its kept input with autodiff (under the micro-batch's CP context: its
    /// attention communicates once more), the backward of `Σ y ⊙ ∂L/∂y`, which gives the
    /// layer's parameter gradients and `∂L/∂x` of its input; last the embedding's backward
    /// (first stage) or a send of `∂L/∂x₀` to the previous stage.
    fn backward_kept(
        &mut self,
        unit: usize,
        output: Output<B, C>,
        kept: KeptLayers<B, C>,
        group: CpGroup,
    ) -> Result<(), CpError> {
        let groups = self.groups;
        let tp = &groups.tp;
        let copy = self.cast_copy();
        let model = copy
            .as_ref()
            .unwrap_or(self.model)
            .chunk(unit % self.chunks)
            .ok_or_else(no_stages)?;
        let mut grad = match output {
            Output::Loss(loss) => {
                self.enter_backward(&group)?;
                let grads = (loss / self.global_labels as f64).backward();
                let last = kept.last.as_ref().expect("the last stage keeps its leaf");
                let grad = gradient_of(last, &grads);
                self.accumulate(grads);
                grad
            }
            Output::Hidden(output) => {
                let (next, _) = self.next(unit).ok_or_else(|| self.no_peer(unit, "next"))?;
                self.receive(next, unit, output.dims()[1], Carried::Gradients)?
            }
        };
        for (layer, x) in kept.inputs.into_iter().enumerate().rev() {
            let x = x.require_grad();
            let context = set_context(CpContext {
                group: group.clone(),
                batch: kept.batch.clone(),
            });
            let y = model
                .forward_layer(layer, x.clone(), kept.positions.clone(), tp)
                .map_err(failed)?;
            drop(context);
            self.enter_backward(&group)?;
            let grads = (y * grad).sum().backward();
            grad = gradient_of(&x, &grads);
            self.accumulate(grads);
        }
        match kept.embedded {
            Some(embedded) => {
                self.enter_backward(&group)?;
                let grads = (embedded * grad).sum().backward();
                self.accumulate(grads);
            }
            None => {
                let previous = self
                    .previous(unit)
                    .ok_or_else(|| self.no_peer(unit, "previous"))?;
                self.send(previous, Carried::Gradients, Payload::device(grad))?;
            }
        }
        Ok(())
    }
}

/// `∂L/∂x` of a leaf `x` from the gradients of a backward (zeros of its shape for an input no
/// output depends on: no tokens).
fn gradient_of<B: FlashOps, C: CheckpointStrategy>(
    x: &Hidden<B, C>,
    grads: &<CpTrain<B, C> as AutodiffBackend>::Gradients,
) -> Hidden<B, C> {
    match x.grad(grads) {
        Some(grad) => Tensor::from_inner(grad),
        None => x.zeros_like().detach(),
    }
}

fn int_tensor<B: burn::prelude::Backend>(values: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TrainError;

    #[test]
    fn one_f_one_b_warms_up_alternates_and_drains() {
        use Pass::{Backward as B, Forward as F};
        // Stage 0 of 3 over 4 units: two warm-up forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 3, 1, 4),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        // The last stage alternates from the start.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 2, 3, 1, 2),
            vec![F(0), B(0), F(1), B(1)]
        );
        // Fewer units than warm-up forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 4, 1, 2),
            vec![F(0), F(1), B(0), B(1)]
        );
        assert_eq!(
            stage_passes(PpSchedule::Gpipe, 1, 3, 1, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
        for schedule in [PpSchedule::OneFOneB, PpSchedule::Gpipe] {
            for stages in 1..5 {
                for stage in 0..stages {
                    for units in 0..6 {
                        let passes = stage_passes(schedule, stage, stages, 1, units);
                        let (forwards, backwards): (Vec<Pass>, Vec<Pass>) =
                            passes.iter().partition(|p| matches!(p, Pass::Forward(_)));
                        let unit = |p: &Pass| match p {
                            Pass::Forward(u) | Pass::Backward(u) => *u,
                        };
                        let forwards: Vec<usize> = forwards.iter().map(unit).collect();
                        let backwards: Vec<usize> = backwards.iter().map(unit).collect();
                        assert_eq!(forwards, (0..units).collect::<Vec<_>>());
                        assert_eq!(backwards, forwards);
                        // Every backward comes after its forward.
                        for unit in 0..units {
                            let f = passes.iter().position(|p| *p == Pass::Forward(unit));
                            let b = passes.iter().position(|p| *p == Pass::Backward(unit));
                            assert!(f < b);
                        }
                    }
                }
            }
        }
        assert_eq!(PpSchedule::parse("gpipe").unwrap(), PpSchedule::Gpipe);
        let error = PpSchedule::parse("zb").unwrap_err();
        assert!(matches!(error, TrainError::Config(_)), "{error:?}");
        assert!(error.to_string().contains("expected 1f1b or gpipe"));
    }

    /// Interleaved 1F1B runs every pass once, each backward after its forward, and the whole
    /// pipeline completes when each rank takes its passes in order and waits only for the
    /// message a pass needs (simulated: activations from the previous virtual stage, gradients
    /// from the next).
    #[test]
    fn interleaved_one_f_one_b_completes_for_every_shape() {
        use Pass::{Backward as B, Forward as F};
        // Megatron's order on 2 stages × 2 chunks × 2 units (virtual id = unit · 2 + chunk):
        // stage 0 warms up with 2·1 + 1·2 = 4 forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 2, 2, 2),
            vec![F(0), F(2), F(1), F(3), B(1), B(3), B(0), B(2)]
        );
        for stages in 2..5 {
            for chunks in 2..4 {
                for units in (stages..=3 * stages).step_by(stages) {
                    let plans: Vec<Vec<Pass>> = (0..stages)
                        .map(|s| stage_passes(PpSchedule::OneFOneB, s, stages, chunks, units))
                        .collect();
                    let total = units * chunks;
                    // Virtual stage of (rank, id): chunk · stages + rank.
                    let virtual_stage = |rank: usize, id: usize| (id % chunks) * stages + rank;
                    let last = stages * chunks - 1;
                    let mut done_forward = vec![vec![false; stages * chunks]; units];
                    let mut done_backward = vec![vec![false; stages * chunks]; units];
                    let mut next = vec![0; stages];
                    loop {
                        let mut progressed = false;
                        for rank in 0..stages {
                            while let Some(&pass) = plans[rank].get(next[rank]) {
                                let ready = match pass {
                                    F(id) => {
                                        let v = virtual_stage(rank, id);
                                        v == 0 || done_forward[id / chunks][v - 1]
                                    }
                                    B(id) => {
                                        let v = virtual_stage(rank, id);
                                        done_forward[id / chunks][v]
                                            && (v == last || done_backward[id / chunks][v + 1])
                                    }
                                };
                                if !ready {
                                    break;
                                }
                                match pass {
                                    F(id) => {
                                        done_forward[id / chunks][virtual_stage(rank, id)] = true
                                    }
                                    B(id) => {
                                        done_backward[id / chunks][virtual_stage(rank, id)] = true
                                    }
                                }
                                next[rank] += 1;
                                progressed = true;
                            }
                        }
                        if !progressed {
                            break;
                        }
                    }
                    for (rank, plan) in plans.iter().enumerate() {
                        assert_eq!(plan.len(), 2 * total, "{stages}×{chunks}, {units} units");
                        assert_eq!(
                            next[rank],
                            plan.len(),
                            "{stages} stages × {chunks} chunks, {units} units: rank {rank} stuck at {:?}",
                            plan.get(next[rank])
                        );
                    }
                }
            }
        }
    }
}
