//! Small tensor helpers of the drop-ins.

use burn::prelude::{Backend, Bool, Shape, Tensor};
use burn::tensor::BasicOps;

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
