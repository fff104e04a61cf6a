//! Tensor helpers of the models.

use burn::prelude::{Backend, Shape, Tensor};
use burn::tensor::BasicOps;

/// `tensor.reshape(dims)` that also works when a dim of `dims` is 0 (a CP rank holding no token):
/// burn 0.21's `Tensor::reshape` reads a 0 in the target as "keep the source's dim at this index"
/// (ONNX style), so `[0, 8] → [1, 1, 0, 8]` panics and `[1, 0, 8] → [0, 8]` picks the wrong dims.
/// The backend op takes the shape as given (and autodiff records it as usual).
pub fn reshape<B: Backend, const D1: usize, const D2: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D1, K>,
    dims: [usize; D2],
) -> Tensor<B, D2, K> {
    let elements: usize = dims.iter().product();
    assert_eq!(
        tensor.shape().num_elements(),
        elements,
        "reshape of a {:?} tensor to {dims:?}",
        tensor.dims()
    );
    Tensor::from_primitive(K::reshape(tensor.into_primitive(), Shape::from(dims)))
}
