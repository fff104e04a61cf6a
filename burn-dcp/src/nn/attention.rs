//! burn's `attention` op with grouped-query heads, on any backend.

use burn::prelude::{Backend, Bool, Tensor};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use crate::backend::is_context_parallel;
use crate::tensors::repeat_kv_heads;

/// burn's [`attention`] op with `key`/`value` of fewer heads than `query` (`[B, K, S, D]`,
/// `H % K == 0`, kv head `h / (H/K)` serving query head `h`).
///
/// On a `ContextParallel<…>` backend the kv heads go to the op as they are: under a CP context
/// the strategies move the real kv heads (not `H/K` copies), and without one the decorator
/// repeats them before the inner backend's attention. On any other backend they are repeated
/// here. Panics, naming the counts, when `K` does not divide `H`.
pub fn grouped_attention<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    options: AttentionModuleOptions,
) -> Tensor<B, 4> {
    let heads = query.dims()[1];
    let (key, value) = if is_context_parallel::<B>(&query.device()) {
        (key, value)
    } else {
        repeat_kv_heads(key, value, heads).unwrap_or_else(|message| panic!("{message}"))
    };
    attention(query, key, value, mask, attn_bias, options)
}
