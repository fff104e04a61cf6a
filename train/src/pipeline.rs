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
use burn_dcp::batch::shard::RankShard;
use burn_dcp::comm::{Comm, Payload, PendingSend};
use burn_dcp::kernels::FlashOps;
use burn_dcp::{CpError, CpGroup};

use crate::config::{Precision, Recompute};
use crate::error::{forward_failed as failed, TrainError};
use crate::groups::RankGroups;
use crate::model::{cast_model, CpTrain, PipelineStage, ShardInput, TrainModel};
use crate::plan::{PlannedBatch, StepSequences};

mod recompute;
mod schedule;

use recompute::KeptLayers;
pub(crate) use schedule::{stage_passes, Pass};

/// Hidden states between pipeline stages (and, under `Recompute::Block`, between layers).
type Hidden<B, C> = Tensor<CpTrain<B, C>, 3>;

/// `Recompute::Block` of a model without pipeline stages, as the step's error.
fn no_stages() -> CpError {
    failed(TrainError::Model(
        "the model has no stages to recompute".into(),
    ))
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
