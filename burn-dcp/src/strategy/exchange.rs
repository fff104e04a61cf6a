//! Moving burn tensors through a [`Communicator`](crate::comm::Communicator).

use burn::prelude::{Backend, Tensor};
use burn::tensor::{DType, TensorCreationOptions};
pub use burn_dcp_kernels::filled;
use burn_dcp_kernels::Segment;

use crate::comm::{Comm, CommError, Payload};

/// A block received from group rank `from`, as a tensor on `device` (moved when it is already a
/// tensor of this backend, copied only from another device or from the host), once checked
/// against what the receiver expects (`expected` dims and `dtype`): a block of another shape
/// means the ranks disagree or a message was mixed up.
pub fn checked_tensor<B: Backend, const D: usize>(
    comm: &Comm,
    data: Payload,
    from: usize,
    expected: [usize; D],
    dtype: DType,
    what: &str,
    device: &B::Device,
) -> Result<Tensor<B, D>, CommError> {
    let protocol = |message: String| CommError::Protocol {
        group: comm.name().to_string(),
        rank: comm.rank(),
        peer_global: comm.global_rank(from),
        message: format!("{what}: {message}"),
    };
    if data.shape() != expected || data.dtype() != dtype {
        return Err(protocol(format!(
            "expected a {expected:?} {dtype:?} block, got {:?} {:?}",
            data.shape(),
            data.dtype()
        )));
    }
    data.into_tensor(device)
        .map_err(|e| protocol(e.to_string()))
}

/// All-to-all of tensors: `parts[p]` goes to rank `p`; returns what each rank sent here, each
/// checked to have the dims `expected(sender)` and the dtype of the parts sent.
pub fn all_to_all<B: Backend, const D: usize>(
    comm: &Comm,
    parts: Vec<Tensor<B, D>>,
    device: &B::Device,
    expected: impl Fn(usize) -> [usize; D],
    what: &str,
) -> Result<Vec<Tensor<B, D>>, CommError> {
    let dtype = parts[0].dtype();
    let received = comm.all_to_all(parts.into_iter().map(Payload::device).collect())?;
    received
        .into_iter()
        .enumerate()
        .map(|(from, data)| checked_tensor(comm, data, from, expected(from), dtype, what, device))
        .collect()
}

/// All-gather of a tensor: every rank's tensor, by rank, each checked to have the dims
/// `expected(sender)` and this tensor's dtype.
pub fn all_gather<B: Backend, const D: usize>(
    comm: &Comm,
    tensor: Tensor<B, D>,
    expected: impl Fn(usize) -> [usize; D],
    what: &str,
) -> Result<Vec<Tensor<B, D>>, CommError> {
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let received = comm.all_gather(Payload::device(tensor))?;
    received
        .into_iter()
        .enumerate()
        .map(|(from, data)| checked_tensor(comm, data, from, expected(from), dtype, what, &device))
        .collect()
}

/// Concatenation of tensors along `dim` that tolerates empty pieces (and an all-empty list).
pub fn cat_tokens<B: Backend, const D: usize>(
    parts: Vec<Tensor<B, D>>,
    dim: usize,
) -> Tensor<B, D> {
    let first_dims = parts[0].dims();
    let device = parts[0].device();
    let dtype = parts[0].dtype();
    let non_empty: Vec<_> = parts.into_iter().filter(|t| t.dims()[dim] > 0).collect();
    match non_empty.len() {
        0 => {
            let mut dims = first_dims;
            dims[dim] = 0;
            Tensor::empty(dims, TensorCreationOptions::new(device).with_dtype(dtype))
        }
        1 => non_empty.into_iter().next().expect("one tensor"),
        _ => Tensor::cat(non_empty, dim),
    }
}

/// Splits `tensor` along `dim` into consecutive pieces of the given sizes.
pub fn split_sizes<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    dim: usize,
    sizes: &[usize],
) -> Vec<Tensor<B, D>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&size| {
            let piece = narrow(tensor.clone(), dim, start, size);
            start += size;
            piece
        })
        .collect()
}

/// `tensor.narrow(dim, start, size)`, also for `size == 0` (burn's narrow rejects empty ranges),
/// in `tensor`'s dtype (burn-flex 0.21 narrows an empty bf16 or f16 tensor into an empty f32
/// one: cast back, a no-op otherwise).
pub fn narrow<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    dim: usize,
    start: usize,
    size: usize,
) -> Tensor<B, D> {
    if size > 0 {
        let dtype = tensor.dtype();
        return tensor.narrow(dim, start, size).cast(dtype);
    }
    let mut dims = tensor.dims();
    dims[dim] = 0;
    let options = TensorCreationOptions::new(tensor.device()).with_dtype(tensor.dtype());
    Tensor::empty(dims, options)
}

/// The segments of several ranks, concatenated in rank order (the token order after a gather).
pub fn concat_segments<'a>(lists: impl IntoIterator<Item = &'a [Segment]>) -> Vec<Segment> {
    lists.into_iter().flatten().copied().collect()
}

/// The dtype partial attention results are accumulated in for inputs of `dtype`: f32 for f16 and
/// bf16 (ring's running merge, the dq/dk/dv sums of ring, DCP and Ulysses' replicated heads add
/// in f32 and round once, when a result is sent or returned), the inputs' own otherwise.
pub fn accumulator_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// `t` in its [`accumulator_dtype`] (no op for f32 and f64).
pub fn widened<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = accumulator_dtype(t.dtype());
    t.cast(dtype)
}
