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
mod positions;
mod rope;

pub use crate::error::HeadError;
pub use crate::tensors::repeat_kv_heads;
pub use attention::grouped_attention;
pub use encoder::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput, TransformerEncoderLayer,
};
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use pos_encoding::{PositionalEncoding, PositionalEncodingConfig};
pub(crate) use positions::context_positions;
pub use positions::lengths_from_mask_pad;
pub use rope::{RotaryEncoding, RotaryEncodingConfig};
