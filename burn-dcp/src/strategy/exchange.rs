//! Moving burn tensors through a [`Communicator`](crate::comm::Communicator).

use burn::prelude::{Backend, Tensor};
use burn::tensor::{TensorCreationOptions, TensorData};
use burn_dcp_kernels::Segment;

use crate::comm::{Comm, CommError};

/// A tensor rebuilt from received data, on `device`, keeping the data's dtype.
pub fn tensor_from<B: Backend, const D: usize>(
    data: TensorData,
    device: &B::Device,
) -> Tensor<B, D> {
    let dtype = data.dtype;
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// All-to-all of tensors: `parts[p]` goes to rank `p`; returns what each rank sent here.
pub fn all_to_all<B: Backend, const D: usize>(
    comm: &Comm,
    parts: Vec<Tensor<B, D>>,
    device: &B::Device,
) -> Result<Vec<Tensor<B, D>>, CommError> {
    let received = comm.all_to_all(parts.into_iter().map(Tensor::into_data).collect())?;
    Ok(received
        .into_iter()
        .map(|d| tensor_from(d, device))
        .collect())
}

/// All-gather of a tensor: every rank's tensor, by rank.
pub fn all_gather<B: Backend, const D: usize>(
    comm: &Comm,
    tensor: Tensor<B, D>,
) -> Result<Vec<Tensor<B, D>>, CommError> {
    let device = tensor.device();
    let received = comm.all_gather(tensor.into_data())?;
    Ok(received
        .into_iter()
        .map(|d| tensor_from(d, &device))
        .collect())
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

/// `tensor.narrow(dim, start, size)`, also for `size == 0` (burn's narrow rejects empty ranges).
pub fn narrow<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    dim: usize,
    start: usize,
    size: usize,
) -> Tensor<B, D> {
    if size > 0 {
        return tensor.narrow(dim, start, size);
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
