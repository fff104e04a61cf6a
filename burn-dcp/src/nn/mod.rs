//! Drop-in replacements of burn-nn 0.21's attention and position modules that stay correct under
//! context parallelism.
//!
//! # Which burn modules bypass the op `ContextParallel` intercepts
//!
//! `ContextParallel` sees attention only through burn's `attention` op
//! (`burn::tensor::module::attention`). burn-nn 0.21 computes it with matmul + softmax instead, in
//! `MultiHeadAttention` and so in everything built on it: `TransformerEncoder`,
//! `TransformerDecoder` and `CrossAttention`. Under a CP context each rank would attend only to
//! its own shard, with no error. burn-nn's `RotaryEncoding` and `PositionalEncoding` use
//! positions `0..seq_len` of the local tensor, wrong on every rank but the first (on every rank
//! under the zigzag and stripe layouts). [`CpContextGuard::finish`](crate::backend::CpContextGuard::finish)
//! turns a forward pass with no intercepted call into an error.
//!
//! The modules here have burn-nn's names, `Config` fields, defaults, builders, inputs, outputs,
//! `forward` signatures and **record layout** (a burn-nn checkpoint loads into them and back):
//! [`MultiHeadAttention`], [`TransformerEncoder`], [`RotaryEncoding`], [`PositionalEncoding`],
//! and their configs and inputs. Differences, all documented on the types: `MhaOutput::weights` is
//! an `Option`; `n_kv_heads` (grouped-query attention) and `causal()` are extensions; burn-nn's
//! autoregressive caches are not provided; under a CP context, what CP cannot compute panics at
//! the call with the rule. `TransformerDecoder` and `CrossAttention` have no drop-in yet.

mod attention;
mod encoder;
mod mha;
mod pos_encoding;
mod rope;

pub use attention::{grouped_attention, repeat_kv_heads};
pub use encoder::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput, TransformerEncoderLayer,
};
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use pos_encoding::{PositionalEncoding, PositionalEncodingConfig};
pub use rope::{RotaryEncoding, RotaryEncodingConfig};

use burn::prelude::{Backend, Bool, Shape, Tensor};
use burn::tensor::BasicOps;

use crate::backend::current_context;
use crate::error::CpError;

/// Sequence lengths of a burn-nn padding mask (`[B, S]`, `true` at padding): the real tokens of
/// each row. Padding must come after a row's tokens (right padding, as burn-nn's
/// `generate_padding_mask` makes).
pub fn lengths_from_mask_pad<B: Backend>(
    mask_pad: Tensor<B, 2, Bool>,
) -> Result<Vec<usize>, CpError> {
    let [rows, width] = mask_pad.dims();
    let values = bool_values(mask_pad);
    (0..rows)
        .map(|row| {
            let row_values = &values[row * width..(row + 1) * width];
            let len = row_values.iter().take_while(|&&padded| !padded).count();
            match row_values[len..].iter().position(|&padded| !padded) {
                Some(offset) => Err(CpError::Input(format!(
                    "row {row} of mask_pad has a real token at column {} after padding at column {len}; padding must come after a row's tokens",
                    len + offset
                ))),
                None => Ok(len),
            }
        })
        .collect()
}

/// Global positions of the local `[batch, width]` rows under this thread's CP context (row-major,
/// 0 at padding), or `None` without a context.
///
/// # Panics
/// When the context's rows do not fit `[batch, width]`.
pub(crate) fn context_positions(batch: usize, width: usize) -> Option<Vec<i64>> {
    let context = current_context()?;
    let rank = context.group.comm.rank();
    let positions = context
        .batch
        .local_rows(rank)
        .and_then(|rows| {
            if rows.rows() != batch {
                return Err(CpError::Input(format!(
                    "the input has {batch} rows but the CP context describes {} (CpBatch::with_rows)",
                    rows.rows()
                )));
            }
            rows.positions(width)
        })
        .unwrap_or_else(|e| panic!("position encoding under the CP context of rank {rank}: {e}"));
    Some(positions)
}

/// `tensor.reshape(dims)` that also works when a dim is 0 (a rank holding no token): burn 0.21's
/// `Tensor::reshape` reads a 0 in the target as "keep the source's dim".
pub(crate) fn exact_reshape<B: Backend, const D1: usize, const D2: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D1, K>,
    dims: [usize; D2],
) -> Tensor<B, D2, K> {
    Tensor::from_primitive(K::reshape(tensor.into_primitive(), Shape::from(dims)))
}

/// A bool tensor's values, row-major.
pub(crate) fn bool_values<B: Backend, const D: usize>(tensor: Tensor<B, D, Bool>) -> Vec<bool> {
    tensor
        .int()
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("int tensor data")
        .into_iter()
        .map(|v| v != 0)
        .collect()
}
