//! The interception of `ModuleOps::attention`: the only logic of the decorator.
//!
//! burn calls `attention(q, k, v, mask, bias, options)` with `q [batch, heads, seq, dim]` and
//! `k`/`v [batch, kv_heads, seq, dim]` (`heads % kv_heads == 0`: grouped-query heads are taken as
//! they are, and the strategies move only the real kv heads). Under a CP context `seq` is this
//! rank's tokens: without [`BatchRows`](crate::batch::rows::BatchRows) in the context, one packed row
//! (`batch` 1) in the placement's order; with them, `batch` rows, each holding the rank's tokens
//! of that row's sequences first and padding after (gathered into the packed order and scattered
//! back, padding gets zeros). The masks come from the context (per sequence, on global
//! positions), so `mask`/`attn_bias` tensors — dense masks of the local shard that cannot describe
//! cross-rank attention — are rejected with an error, never ignored. `options.scale` is honoured;
//! `options.softcap` is rejected (not supported yet); `options.is_causal` must agree with the
//! context's masks. Every call under a context is counted for
//! [`CpContextGuard::finish`](crate::backend::CpContextGuard::finish).
//!
//! Without a context, K/V with fewer heads are repeated and the inner backend's attention runs.

use std::sync::Arc;

use burn::prelude::{Int, Tensor, TensorData};
use burn::tensor::{IndexingUpdateOp, TensorPrimitive};
use burn_autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_autodiff::NodeId;
use burn_backend::ops::AttentionModuleOptions;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, Shape, TensorMetadata};
use burn_dcp_kernels::{FlashOps, FlashOutput, MaskSpec};

use crate::backend::context::{intercept, CpContext};
use crate::backend::timing::timed;
use crate::batch::rows::LocalRows;
use crate::error::CpError;
use crate::strategy::{cp_attention_backward, cp_attention_forward, BackwardInputs};
use crate::tensors::{exact_reshape, repeat_kv_heads};

/// Backends `ContextParallel` can wrap: they know how to run CP attention on their primitives.
/// Implemented for `Autodiff<B: FlashOps>` (one autodiff node whose backward runs the strategy's
/// backward) and for plain [`FlashOps`] backends (forward only: burn Flex; the cubecl backends
/// with the kernels). A blanket impl over `FlashOps` is impossible next to the `Autodiff` one
/// (coherence: `FlashOps` lives in another crate), so plain backends use [`cp_attention_forward_only`].
pub trait CpInner: Backend {
    /// CP attention on `q [1, H, T, D]`, `k`/`v [1, K, T, D]` (this rank's tokens).
    fn cp_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        context: Arc<CpContext>,
    ) -> FloatTensor<Self>;
}

/// Where the panic of a failed CP attention call points (op boundary: burn ops cannot return errors).
fn fail(what: &str, context: &CpContext, shape: &[usize], error: impl std::fmt::Display) -> ! {
    panic!(
        "ContextParallel attention {what} failed on CP rank {} of {} (strategy {}, q shape {shape:?}): {error}",
        context.group.comm.rank(),
        context.group.cp(),
        context.group.strategy
    )
}

/// `[1, H, T, D]` → `[T, H, D]`. The reshapes use the backend op with the exact shape:
/// `Tensor::reshape` reads a 0 in the target as "keep the source's dim", which breaks on a rank
/// that holds no token of the micro-batch (T = 0).
fn to_tokens<B: Backend>(tensor: FloatTensor<B>) -> Tensor<B, 3> {
    let [_, heads, tokens, dim] = tensor.shape().dims();
    let tensor = B::float_reshape(tensor, Shape::from([heads, tokens, dim]));
    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(tensor)).swap_dims(0, 1)
}

/// `[T, H, D]` → `[1, H, T, D]`.
fn to_heads<B: Backend>(tensor: Tensor<B, 3>) -> FloatTensor<B> {
    let [tokens, heads, dim] = tensor.dims();
    let tensor = tensor.swap_dims(0, 1).into_primitive().tensor();
    B::float_reshape(tensor, Shape::from([1, heads, tokens, dim]))
}

/// [`CpInner::cp_attention`] of a backend without autodiff: the strategy's forward only.
pub fn cp_attention_forward_only<B: FlashOps>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    context: Arc<CpContext>,
) -> FloatTensor<B> {
    let shape = query.shape().to_vec();
    let (q, k, v) = (
        to_tokens::<B>(query),
        to_tokens::<B>(key),
        to_tokens::<B>(value),
    );
    to_heads(strategy_forward("forward", &context, &shape, q, k, v).out)
}

/// The strategy's forward on `q`/`k`/`v` in token layout (`pass`: `forward`, or `recompute` in a
/// backward), timed as attention; a failure panics naming the pass, the rank and the shape.
fn strategy_forward<B: FlashOps>(
    pass: &str,
    context: &CpContext,
    shape: &[usize],
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> FlashOutput<B> {
    timed(pass, &context.group.strategy, || {
        cp_attention_forward(&context.group, &context.batch, q, k, v)
    })
    .unwrap_or_else(|error| fail(pass, context, shape, error))
}

/// [`CpInner::cp_attention`] of a plain [`FlashOps`] backend: [`cp_attention_forward_only`].
macro_rules! forward_only {
    () => {
        fn cp_attention(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            context: Arc<CpContext>,
        ) -> FloatTensor<Self> {
            cp_attention_forward_only::<Self>(query, key, value, context)
        }
    };
}

/// burn's CPU backend without autodiff: forward only.
impl CpInner for burn::backend::Flex {
    forward_only!();
}

/// The cubecl backends (wgpu, CUDA) without autodiff: forward only, on the cubecl kernels.
#[cfg(feature = "cube")]
impl<R, F, I, BT> CpInner for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    forward_only!();
}

/// burn-fusion's backends (`Fusion<CubeBackend<…>>`, burn's default `Wgpu` and `Cuda`) without
/// autodiff: forward only, the kernels queued on the fusion stream.
#[cfg(feature = "fusion")]
impl<B: burn_fusion::FusionBackend + FlashOps> CpInner for burn_fusion::Fusion<B> {
    forward_only!();
}

/// What the backward of one CP attention call needs: its inputs (through burn's checkpointer, so
/// the checkpoint strategy decides whether they are kept or recomputed), the forward's output and
/// LSE when they are kept, and the context it ran with.
#[derive(Clone, Debug)]
struct SavedAttention<B: Backend> {
    q: NodeId,
    k: NodeId,
    v: NodeId,
    /// The forward's `out` and `lse` in token layout; `None` under a checkpoint strategy that
    /// recomputes ([`recomputes`]): the backward reruns the forward once, communicating again.
    kept: Option<(FloatTensor<B>, FloatTensor<B>)>,
    context: Arc<CpContext>,
}

/// Whether the autodiff checkpoint strategy `C` recomputes what it can (every strategy but burn's
/// `NoCheckpointing`, e.g. `BalancedCheckpointing`): then the CP attention node keeps only its
/// inputs and its backward starts by rerunning the forward (`out`, LSE), once.
pub fn recomputes<C: CheckpointStrategy>() -> bool {
    std::any::TypeId::of::<C>() != std::any::TypeId::of::<NoCheckpointing>()
}

#[derive(Debug)]
struct CpAttentionBackward;

impl<B: FlashOps> Backward<B, 3> for CpAttentionBackward {
    type State = SavedAttention<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut burn_autodiff::checkpoint::base::Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad_out = grads.consume::<B>(&ops.node);
        let saved = ops.state;
        let mut input = |id| to_tokens::<B>(checkpointer.retrieve_node_output(id));
        let (q, k, v) = (input(saved.q), input(saved.k), input(saved.v));
        let shape = q.dims().to_vec();
        let context = saved.context;
        let (out, lse) = match saved.kept {
            Some((out, lse)) => (
                Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out)),
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse)),
            ),
            None => {
                let result = strategy_forward(
                    "recompute",
                    &context,
                    &shape,
                    q.clone(),
                    k.clone(),
                    v.clone(),
                );
                (result.out, result.lse)
            }
        };
        let inputs = BackwardInputs {
            q,
            k,
            v,
            out,
            lse,
            dout: to_tokens::<B>(grad_out),
        };
        let grads_out = timed("backward", &context.group.strategy, || {
            cp_attention_backward(&context.group, &context.batch, inputs)
        })
        .unwrap_or_else(|error| fail("backward", &context, &shape, error));
        for (node, grad) in [
            (node_q, grads_out.dq),
            (node_k, grads_out.dk),
            (node_v, grads_out.dv),
        ] {
            if let Some(node) = node {
                grads.register::<B>(node.id, to_heads(grad));
            }
        }
    }
}

impl<B: FlashOps, C: CheckpointStrategy> CpInner for Autodiff<B, C> {
    fn cp_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        context: Arc<CpContext>,
    ) -> FloatTensor<Self> {
        let shape = query.primitive.shape().to_vec();
        let (q, k, v) = (
            to_tokens::<B>(query.primitive.clone()),
            to_tokens::<B>(key.primitive.clone()),
            to_tokens::<B>(value.primitive.clone()),
        );
        let result = strategy_forward("forward", &context, &shape, q, k, v);
        let out = to_heads(result.out.clone());
        let nodes = [query.node.clone(), key.node.clone(), value.node.clone()];
        match CpAttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let saved = SavedAttention {
                    q: prep.checkpoint(&query),
                    k: prep.checkpoint(&key),
                    v: prep.checkpoint(&value),
                    kept: (!recomputes::<C>()).then(|| {
                        (
                            result.out.into_primitive().tensor(),
                            result.lse.into_primitive().tensor(),
                        )
                    }),
                    context,
                };
                prep.finish(saved, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `ModuleOps::attention` of `ContextParallel<B>`.
pub fn attention<B: CpInner>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    attn_bias: Option<FloatTensor<B>>,
    options: burn_backend::ops::AttentionModuleOptions,
) -> FloatTensor<B> {
    let Some(context) = intercept() else {
        return without_context::<B>(query, key, value, mask, attn_bias, options);
    };
    let shape = query.shape().to_vec();
    let dims = [shape.clone(), key.shape().to_vec(), value.shape().to_vec()];
    let rows = check_call(
        &context,
        &dims,
        mask.is_some(),
        attn_bias.is_some(),
        &options,
    )
    .unwrap_or_else(|message| fail("call", &context, &shape, message));
    let context = match options.scale {
        Some(scale) if context.batch.scale != Some(scale) => {
            let mut with_scale = (*context).clone();
            with_scale.batch.scale = Some(scale);
            Arc::new(with_scale)
        }
        _ => context,
    };
    let [batch, _, width, _] = [shape[0], shape[1], shape[2], shape[3]];
    if rows.is_packed_order(batch, width) {
        return B::cp_attention(query, key, value, context);
    }
    // Rows of a `[B, S, …]` batch: this rank's tokens gathered into the packed order the
    // strategies work in, results scattered back (padding gets zeros). Both are autodiff ops of `B`.
    let indices = rows
        .packed_indices(width)
        .unwrap_or_else(|message| fail("call", &context, &shape, message));
    let device = B::float_device(&query);
    let indices = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            indices.iter().map(|&i| i as i64).collect::<Vec<_>>(),
            [indices.len()],
        ),
        &device,
    );
    let out = B::cp_attention(
        to_packed::<B>(query, indices.clone()),
        to_packed::<B>(key, indices.clone()),
        to_packed::<B>(value, indices.clone()),
        context,
    );
    from_packed::<B>(out, indices, batch, width)
}

/// Without a CP context: the inner backend's attention, after repeating each kv head for its
/// query group (burn's op takes equal head counts; the CP strategies take the real kv heads, so
/// one model code runs with and without a context).
fn without_context<B: CpInner>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    attn_bias: Option<FloatTensor<B>>,
    options: AttentionModuleOptions,
) -> FloatTensor<B> {
    let heads = query.shape()[1];
    let kv_heads = key.shape()[1];
    if kv_heads == heads {
        return B::attention(query, key, value, mask, attn_bias, options);
    }
    let tensor = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (key, value) = repeat_kv_heads(tensor(key), tensor(value), heads)
        .unwrap_or_else(|message| panic!("ContextParallel attention: {message}"));
    let primitive = |t: Tensor<B, 4>| t.into_primitive().tensor();
    B::attention(
        query,
        primitive(key),
        primitive(value),
        mask,
        attn_bias,
        options,
    )
}

/// `[B, H, S, D]` → `[1, H, T, D]`: the rows' tokens at `indices` of the flattened `[B·S]`.
fn to_packed<B: Backend>(tensor: FloatTensor<B>, indices: Tensor<B, 1, Int>) -> FloatTensor<B> {
    let [batch, heads, width, dim] = tensor.shape().dims();
    let tokens = indices.dims()[0];
    let rows = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(tensor)).swap_dims(1, 2);
    let picked = exact_reshape(rows, [batch * width, heads, dim])
        .select(0, indices)
        .swap_dims(0, 1);
    exact_reshape(picked, [1, heads, tokens, dim])
        .into_primitive()
        .tensor()
}

/// `[1, H, T, Dv]` → `[B, H, S, Dv]`, token `t` at index `indices[t]` of `[B·S]`, zeros elsewhere.
fn from_packed<B: Backend>(
    tensor: FloatTensor<B>,
    indices: Tensor<B, 1, Int>,
    batch: usize,
    width: usize,
) -> FloatTensor<B> {
    let [_, heads, tokens, dim] = tensor.shape().dims();
    let dtype = tensor.dtype();
    let device = B::float_device(&tensor);
    let packed = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(tensor));
    let packed = exact_reshape(packed, [heads, tokens, dim]).swap_dims(0, 1);
    let full = Tensor::<B, 3>::zeros([batch * width, heads, dim], (&device, dtype)).select_assign(
        0,
        indices,
        packed,
        IndexingUpdateOp::Add,
    );
    exact_reshape(full, [batch, width, heads, dim])
        .swap_dims(1, 2)
        .into_primitive()
        .tensor()
}

/// The rules of a CP attention call (see the module docs); returns this rank's rows.
fn check_call(
    context: &CpContext,
    [q, k, v]: &[Vec<usize>; 3],
    has_mask: bool,
    has_bias: bool,
    options: &AttentionModuleOptions,
) -> Result<LocalRows, CpError> {
    if has_mask || has_bias {
        return Err(CpError::Input(format!(
            "an explicit dense {} tensor cannot be sharded across CP ranks; describe the mask per sequence in the CP context (MaskSpec) instead",
            if has_mask { "mask" } else { "attn_bias" }
        )));
    }
    if let Some(softcap) = options.softcap {
        return Err(CpError::Input(format!(
            "softcap {softcap} is not supported by context-parallel attention yet"
        )));
    }
    if k.len() != 4 || v.len() != 4 || k[0] != q[0] || v[0] != q[0] || k[2] != q[2] || v[2] != q[2]
    {
        return Err(CpError::Input(format!(
            "CP attention is self-attention over this rank's tokens: q {q:?}, k {k:?} and v {v:?} must share batch and sequence dims"
        )));
    }
    burn_dcp_kernels::heads::Heads::of_tensors(q[1], k[1], v[1])
        .map_err(|e| CpError::Input(format!("q {q:?}, k {k:?} and v {v:?}: {e}")))?;
    let rank = context.group.comm.rank();
    let rows = context.batch.local_rows(rank)?;
    let (batch, width) = (q[0], q[2]);
    if batch != rows.rows() {
        return Err(CpError::Input(match &context.batch.rows {
            None => format!(
                "a batch of {batch} rows needs the CP context to say which sequences each row holds (CpBatch::with_rows(BatchRows::one_per_row({batch})) or BatchRows::packed); without it the context is one packed row ([1, heads, tokens, dim])"
            ),
            Some(_) => format!(
                "the batch has {batch} rows but the CP context's BatchRows describe {}",
                rows.rows()
            ),
        }));
    }
    if width < rows.width() {
        return Err(CpError::Input(format!(
            "rows of {width} tokens cannot hold this rank's share: under the {} rank {rank} holds up to {} tokens of a row",
            context.batch.placement.kind,
            rows.width()
        )));
    }
    let seq_lens = &context.batch.placement.seq_lens;
    for (seq, &len) in seq_lens.iter().enumerate() {
        let mask = context.batch.mask(seq);
        let causal = is_causal_mask(mask, len);
        if options.is_causal && !causal {
            return Err(CpError::Input(format!("attention was called with is_causal = true but the CP context's mask of sequence {seq} is {mask}, which lets queries attend later keys")));
        }
        if !options.is_causal && causal && *mask != MaskSpec::Full {
            return Err(CpError::Input(format!("attention was called with is_causal = false but the CP context's mask of sequence {seq} is the causal-family mask {mask}")));
        }
    }
    Ok(rows)
}

/// Whether every allowed key of the mask is at or before its query.
pub(crate) fn is_causal_mask(mask: &MaskSpec, len: usize) -> bool {
    match mask {
        MaskSpec::Full => len <= 1,
        MaskSpec::KeyRanges(_) => {
            (0..len).all(|i| mask.key_ranges(i, len).iter().all(|r| r.end <= i + 1))
        }
        _ => true,
    }
}
