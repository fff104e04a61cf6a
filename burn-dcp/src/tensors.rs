//! Small tensor helpers shared by the decorator and the drop-ins: a reshape that keeps zero
//! dims, a bool tensor's values, and grouped-query heads repeated for the query heads.

use burn::prelude::{Backend, Bool, Shape, Tensor};
use burn::tensor::BasicOps;
use burn_dcp_kernels::heads::Heads;

use crate::error::HeadError;

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

/// `key`/`value` `[B, K, S, D]` → `[B, H, S, D]`, each kv head repeated for its `H/K` query
/// heads (in place: heads `g·H/K .. (g+1)·H/K` read kv head `g`).
pub fn repeat_kv_heads<B: Backend>(
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    heads: usize,
) -> Result<(Tensor<B, 4>, Tensor<B, 4>), HeadError> {
    let (kv_heads, value_heads) = (key.dims()[1], value.dims()[1]);
    let group = Heads::of_tensors(heads, kv_heads, value_heads)
        .map_err(|_| HeadError::KeyValue {
            heads,
            key: kv_heads,
            value: value_heads,
        })?
        .group_size();
    Ok((repeat(key, group), repeat(value, group)))
}

fn repeat<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, heads, tokens, dim] = x.dims();
    let repeated = exact_reshape(x, [batch, heads, 1, tokens, dim]).repeat_dim(2, group);
    exact_reshape(repeated, [batch, heads * group, tokens, dim])
}
