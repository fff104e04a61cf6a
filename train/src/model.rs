//! What the engine needs of a model: [`TrainModel`] (the loss over a rank's shard, and optional
//! tensor- and pipeline-parallel hooks) and [`ModelShape`] (the sizes the planners and the cost
//! model use). The GPT of `burn-dcp-models` implements both; any burn model can.

use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::module::{AutodiffModule, ParamId};
use burn::prelude::{Backend, Bool, Int, Tensor, TensorData};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::batch::shard::RankShard;
use burn_dcp::heads::Heads;
use burn_dcp::{BatchRows, CpBatch, CpError};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::tensor_parallel::TpGroup;

/// The training backend over an inner backend `B` (burn Flex on the CPU, or a cubecl backend with
/// the kernels): the decorator over autodiff over `B`, with burn's autodiff checkpoint strategy
/// `C` (`NoCheckpointing`: keep every activation; `BalancedCheckpointing`: recompute the
/// memory-bound ones and CP attention's output in the backward, see [`Recompute`](crate::Recompute)).
pub type CpTrain<B, C = NoCheckpointing> = burn_dcp::ContextParallel<burn::backend::Autodiff<B, C>>;

/// The sizes of a transformer that the planners' work and cost estimates, the head checks of the
/// strategies and the TP rules read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    /// Query heads of one attention layer.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); divides `n_heads`.
    pub n_kv_heads: usize,
    /// Width of the feed-forward network.
    pub d_ff: usize,
    /// The width of one head when it is not `d_model / n_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// The LM head shares the embedding (under PP, the first and last stage sum its gradients).
    #[serde(default)]
    pub tied_embeddings: bool,
}

impl ModelShape {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// The query and kv heads ([`Heads`]' rules).
    pub fn heads(&self) -> Result<Heads, TrainError> {
        Heads::new(self.n_heads, self.n_kv_heads).map_err(|e| TrainError::Config(e.to_string()))
    }

    /// Checks the head rules, naming the values.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.n_heads == 0
            || (self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_heads))
        {
            return Err(TrainError::Config(format!(
                "d_model {} must be a multiple of n_heads {} (or head_dim given)",
                self.d_model, self.n_heads
            )));
        }
        self.heads()?;
        if self.n_layers == 0 {
            return Err(TrainError::Config(
                "a model needs at least one layer".into(),
            ));
        }
        Ok(())
    }
}

/// How a model takes a rank's share of a planned micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputRows {
    /// One packed row `[1, T_r]` of every sequence, in the placement's order (the GPT).
    Packed,
    /// One row per sequence, right-padded: `[sequences, W_r]` (burn-nn's `mask_pad`
    /// convention; the CP context carries `BatchRows::one_per_row`).
    OnePerSequence,
}

impl InputRows {
    /// The batch with its rows (see [`burn_dcp::batch::rows`]).
    pub fn rows_of(self, batch: CpBatch) -> Result<CpBatch, CpError> {
        match self {
            InputRows::Packed => Ok(batch),
            InputRows::OnePerSequence => {
                let count = batch.placement.seq_lens.len();
                batch.with_rows(BatchRows::one_per_row(count))
            }
        }
    }
}

/// The loss a [`TrainModel::loss_sum`] returns, from the model's logits `[rows, width, vocab]`
/// and the shard's labels `[rows, width]` ([`ShardInput::labels`]): the cross-entropy summed
/// over the labelled tokens (labels `< 0`, padding included, are ignored), in f32
/// ([`burn_dcp_models::cross_entropy_sum`]).
pub fn cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [rows, width, vocab] = logits.dims();
    let n = rows * width;
    burn_dcp_models::cross_entropy_sum(logits.reshape([n, vocab]), labels.reshape([n]))
}

/// A rank's share of a planned micro-batch as tensors `[rows, width]` (see [`InputRows`]).
pub struct ShardInput<B: Backend> {
    /// Token ids (0 at padding).
    pub tokens: Tensor<B, 2, Int>,
    /// Each token's position in its own sequence (global: a rank's tokens are anywhere in it).
    pub positions: Tensor<B, 2, Int>,
    /// The next token of the same sequence, `-1` where there is none (and at padding).
    pub labels: Tensor<B, 2, Int>,
    /// burn-nn's padding mask: `true` at padding.
    pub mask_pad: Tensor<B, 2, Bool>,
}

impl<B: Backend> ShardInput<B> {
    /// The shard's tensors laid out as the batch's rows say (`batch` must be the one the CP
    /// context holds, `rank` this rank's index in the group).
    pub fn new(
        shard: &RankShard,
        batch: &CpBatch,
        rank: usize,
        device: &B::Device,
    ) -> Result<Self, CpError> {
        let rows = batch.local_rows(rank)?;
        let width = rows.width();
        let slots = rows.packed_indices(width)?;
        let layout = |values: &[i64], pad: i64| -> Tensor<B, 2, Int> {
            let mut laid = vec![pad; rows.rows() * width];
            for (&slot, &value) in slots.iter().zip(values) {
                laid[slot] = value;
            }
            Tensor::from_data(TensorData::new(laid, [rows.rows(), width]), device)
        };
        Ok(Self {
            tokens: layout(&shard.tokens, 0),
            positions: layout(&shard.positions, 0),
            labels: layout(&shard.labels, -1),
            mask_pad: rows.mask_pad_tensor(width, device)?,
        })
    }
}

/// A model the engine trains context-parallel, on `B = ContextParallel<Autodiff<…>>`.
///
/// The one required method is the loss over a rank's shard. The engine scales it by the step's
/// global label count (so gradients summed over every rank are the mean loss's) and all-reduces
/// the gradients of every parameter over the DP × CP pool. Its attention must go through burn's
/// `attention` op (`burn_dcp::nn` has drop-ins of burn-nn's modules); the engine checks every
/// micro-batch with `CpContextGuard::finish`.
pub trait TrainModel<B: AutodiffBackend>: AutodiffModule<B> {
    /// How the model takes its shard.
    const INPUT_ROWS: InputRows = InputRows::Packed;

    /// Sum of the loss over the labelled tokens of `input` (labels ≥ 0) as a `[1]` tensor. `tp`
    /// is the rank's tensor-parallel group (size 1 unless [`Self::tensor_parallel`]). A model's
    /// own rule is a [`TrainError::Model`]; CP and communication errors convert with `?`.
    fn loss_sum(&self, input: ShardInput<B>, tp: &TpGroup) -> Result<Tensor<B, 1>, TrainError>;

    /// Whether the model shards itself over a TP group (the engine refuses `tp > 1` otherwise).
    fn tensor_parallel(&self) -> bool {
        false
    }

    /// Pipeline stages (the engine refuses `pp > 1` without them).
    fn stages(&self) -> Option<&dyn PipelineStage<B>> {
        None
    }

    /// Model chunks this pipeline rank holds (`--vpp`: chunk `v` of pipeline rank `r` is
    /// virtual stage `v · pp + r` of `pp · vpp`); 1: the one stage of [`Self::stages`].
    fn chunks(&self) -> usize {
        1
    }

    /// Chunk `v` of [`Self::chunks`] (default: chunk 0 is [`Self::stages`]).
    fn chunk(&self, v: usize) -> Option<&dyn PipelineStage<B>> {
        match v {
            0 => self.stages(),
            _ => None,
        }
    }

    /// Parameters whose gradients are partial over the TP ranks that replicate them (the GPT's
    /// k/v projections when tp > kv heads): summed over those ranks too.
    fn kv_param_ids(&self) -> Vec<ParamId> {
        Vec::new()
    }

    /// Under PP with a tied LM head: the embedding, whose gradients the first and last stage sum.
    fn tied_embedding_id(&self) -> Option<ParamId> {
        None
    }

    /// Under TP: the parameters every rank of the TP group holds whole (the GPT's norms), which
    /// the global gradient norm counts once (on TP rank 0); every other parameter is a shard of
    /// its own. A TP model that holds such parameters must name them here, or `--clip-grad-norm`
    /// overcounts them.
    fn tp_replicated_ids(&self) -> Vec<ParamId> {
        Vec::new()
    }
}

/// One pipeline stage of a model (packed rows: `[1, T, d]` hidden states of tokens `[T]`).
pub trait PipelineStage<B: Backend> {
    fn is_first_stage(&self) -> bool;
    fn is_last_stage(&self) -> bool;
    /// The width `d` of the hidden states sent between stages.
    fn hidden_size(&self) -> usize;
    /// First stage: the tokens' embeddings.
    fn embed(&self, tokens: Tensor<B, 1, Int>, tp: &TpGroup) -> Result<Tensor<B, 3>, TrainError>;
    /// This stage's layers.
    fn forward_hidden(
        &self,
        x: Tensor<B, 3>,
        positions: Tensor<B, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<B, 3>, TrainError>;
    /// The layers [`Self::forward_hidden`] runs one after the other, each of which
    /// [`Recompute::Block`](crate::Recompute::Block) recomputes on its own (default 1: the
    /// whole stage is one block).
    fn layers(&self) -> usize {
        1
    }
    /// Layer `layer` (of [`Self::layers`]) on the hidden states `x`; chained over every layer it
    /// must compute what [`Self::forward_hidden`] does. Default: the whole stage.
    fn forward_layer(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
        positions: Tensor<B, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<B, 3>, TrainError> {
        match layer {
            0 => self.forward_hidden(x, positions, tp),
            _ => Err(TrainError::Model(format!(
                "layer {layer} of a stage of {} layers",
                self.layers()
            ))),
        }
    }
    /// Last stage: the loss sum of the labels `≥ 0`.
    fn loss_from_hidden(
        &self,
        x: Tensor<B, 3>,
        labels: Tensor<B, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<B, 1>, TrainError>;
}

/// A copy of `model` whose float parameters are cast to `dtype` (same parameter ids): each is a
/// differentiable cast of the original, so a backward through the copy brings the gradients to
/// the original parameters in their own dtype (f32 master weights with a bf16 forward).
pub fn cast_model<B: Backend, M: burn::module::Module<B>>(
    model: M,
    dtype: burn::tensor::FloatDType,
) -> M {
    struct CastParams(burn::tensor::FloatDType);
    impl<B: Backend> burn::module::ModuleMapper<B> for CastParams {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|tensor| tensor.cast(dtype))
        }
    }
    model.map(&mut CastParams(dtype))
}

/// The step's copy of `model` in the compute dtype: every float parameter cast to `dtype` as a
/// leaf of its own (the same parameter id; a leaf requires its gradient where the parameter
/// does). Made once per optimizer step, it serves every micro-batch's forward — one cast per
/// parameter per step, where [`cast_model`] casts per forward — and [`master_grads`] brings a
/// backward's gradients of it to the f32 parameters: the same values as through `cast_model`'s
/// differentiable casts (a cast's backward only widens its bf16 gradient).
pub(crate) fn step_copy<B: AutodiffBackend, M: burn::module::Module<B>>(
    model: &M,
    dtype: burn::tensor::FloatDType,
) -> M {
    struct Leaves(burn::tensor::FloatDType);
    impl<B: AutodiffBackend> burn::module::ModuleMapper<B> for Leaves {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|tensor| {
                let trained = tensor.is_require_grad();
                let leaf = Tensor::from_inner(tensor.inner().cast(dtype));
                match trained {
                    true => leaf.require_grad(),
                    false => leaf,
                }
            })
        }
    }
    model.clone().map(&mut Leaves(dtype))
}

/// `grads` of a [`step_copy`] of `model` as gradients of `model`'s f32 parameters (each cast to
/// f32; the parameters share their ids).
pub(crate) fn master_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: burn::optim::GradientsParams,
) -> burn::optim::GradientsParams {
    struct ToF32<'a>(&'a mut burn::optim::GradientsParams);
    impl<B: AutodiffBackend> burn::module::ModuleVisitor<B> for ToF32<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            if let Some(grad) = self.0.remove::<B::InnerBackend, D>(param.id) {
                self.0
                    .register(param.id, grad.cast(burn::tensor::FloatDType::F32));
            }
        }
    }
    model.visit(&mut ToF32(&mut grads));
    grads
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::optim::{GradientsAccumulator, GradientsParams};
    use burn::tensor::{DType, Distribution, FloatDType};

    use super::*;

    type A = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Tiny<B: Backend> {
        w: Param<Tensor<B, 2>>,
        gain: Param<Tensor<B, 1>>,
    }

    fn forward(model: &Tiny<A>, x: &Tensor<A, 2>) -> Tensor<A, 1> {
        let h = x.clone().cast(FloatDType::BF16).matmul(model.w.val());
        let h = h * model.gain.val().unsqueeze_dim(0);
        (h.clone() * h).sum().cast(FloatDType::F32)
    }

    /// The f32 gradients of `model` accumulated over `inputs`, through a cast copy per forward
    /// (`per_forward`) or the step's one copy.
    fn accumulated(model: &Tiny<A>, inputs: &[Tensor<A, 2>], per_forward: bool) -> Vec<Vec<f32>> {
        let mut accumulator = GradientsAccumulator::new();
        let step = step_copy(model, FloatDType::BF16);
        for x in inputs {
            let grads = if per_forward {
                let copy = cast_model(model.clone(), FloatDType::BF16);
                GradientsParams::from_grads(forward(&copy, x).backward(), model)
            } else {
                let grads = GradientsParams::from_grads(forward(&step, x).backward(), &step);
                master_grads(model, grads)
            };
            accumulator.accumulate(model, grads);
        }
        let grads = accumulator.grads();
        let w = grads.get::<Flex, 2>(model.w.id).unwrap();
        let gain = grads.get::<Flex, 1>(model.gain.id).unwrap();
        assert_eq!((w.dtype(), gain.dtype()), (DType::F32, DType::F32));
        vec![
            w.into_data().to_vec().unwrap(),
            gain.into_data().to_vec().unwrap(),
        ]
    }

    /// The step's one bf16 copy gives the f32 parameters exactly the gradients a cast per forward
    /// gives them, accumulated over three micro-batches.
    #[test]
    fn one_copy_per_step_gives_the_gradients_of_a_copy_per_forward() {
        let device = Default::default();
        let random = |shape: [usize; 2]| {
            Tensor::<A, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
        };
        let model = Tiny {
            w: Param::from_tensor(random([8, 6])),
            gain: Param::from_tensor(random([1, 6]).reshape([6])),
        };
        let inputs: Vec<_> = (0..3).map(|_| random([4, 8])).collect();
        let per_step = accumulated(&model, &inputs, false);
        assert_eq!(per_step, accumulated(&model, &inputs, true));
        assert!(per_step.iter().flatten().any(|g| *g != 0.0));
    }
}
