//! Block recompute (`Recompute::Block`) inside a stage's passes: the forward keeps each layer's
//! input without an autodiff graph; the backward runs each layer again, from the last, with its
//! graph, under the micro-batch's CP context.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::prelude::{Int, Tensor};
use burn_dcp::backend::{set_context, CpContext};
use burn_dcp::batch::shard::RankShard;
use burn_dcp::comm::Payload;
use burn_dcp::kernels::FlashOps;
use burn_dcp::{CpBatch, CpError, CpGroup};

use super::{gradient_of, int_tensor, no_stages, Carried, Hidden, Output, StageRun};
use crate::error::forward_failed as failed;
use crate::model::{CpTrain, PipelineStage, TrainModel};

/// A stage's forward under [`Recompute::Block`](crate::Recompute::Block): the output and what it kept.
pub(super) type KeptForward<B, C> = (Output<B, C>, KeptLayers<B, C>);

/// What a stage's forward keeps under [`Recompute::Block`](crate::Recompute::Block): each layer's input, computed without
/// an autodiff graph, and the ends around the layers that keep theirs (the embedding, the loss).
pub(super) struct KeptLayers<B: FlashOps, C: CheckpointStrategy> {
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

impl<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>> StageRun<'_, B, C, M> {
    /// A stage's forward under [`Recompute::Block`](crate::Recompute::Block): the embedding (first stage) or the previous
    /// stage's activations, then every layer without an autodiff graph (a copy of the model that
    /// requires no gradient), keeping each layer's input; then the loss (last stage, from the
    /// last layer's output as a leaf) or a send onwards.
    pub(super) fn stage_forward_kept(
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

    /// The backward of a unit under [`Recompute::Block`](crate::Recompute::Block): `∂L/∂x` of the last layer's output
    /// (from the loss, or received from the next stage), then layer by layer from the last: its
    /// forward again from its kept input with autodiff (under the micro-batch's CP context: its
    /// attention communicates once more), the backward of `Σ y ⊙ ∂L/∂y`, which gives the
    /// layer's parameter gradients and `∂L/∂x` of its input; last the embedding's backward
    /// (first stage) or a send of `∂L/∂x₀` to the previous stage.
    pub(super) fn backward_kept(
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
