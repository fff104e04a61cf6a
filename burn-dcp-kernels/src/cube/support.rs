//! What the launches share: dtypes and limits, device buffers and tensors.

use burn::prelude::{Backend, Tensor};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorCreationOptions, TensorPrimitive};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubecl::prelude::*;

use crate::ops::{FlashGradients, FlashOutput, KernelLimits, Operand};

/// Largest head or value dim the kernels take ([`FLASH_MAX_DIM`](super::flash::FLASH_MAX_DIM)).
pub const MAX_HEAD_DIM: usize = super::flash::FLASH_MAX_DIM;
/// Units per cube of the element-wise kernels (delta, merge).
pub(super) const ELEMENTWISE_UNITS: u32 = 256;

/// A float tensor's primitive (what the launches take).
pub(crate) fn primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// A float primitive as a tensor.
pub(crate) fn tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// A forward's result from its primitives.
pub(crate) fn output<B: Backend>(out: FloatTensor<B>, lse: FloatTensor<B>) -> FlashOutput<B> {
    FlashOutput {
        out: tensor(out),
        lse: tensor(lse),
    }
}

/// A backward's result from its primitives.
pub(crate) fn gradients<B: Backend>(
    dq: FloatTensor<B>,
    dk: FloatTensor<B>,
    dv: FloatTensor<B>,
) -> FlashGradients<B> {
    FlashGradients {
        dq: tensor(dq),
        dk: tensor(dk),
        dv: tensor(dv),
    }
}

/// The dtypes the kernels take (f32 accumulation and LSE whatever the input).
pub(super) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// What the kernels take: `DTYPES`, dims up to [`MAX_HEAD_DIM`], 32-bit token indices.
pub const LIMITS: KernelLimits = KernelLimits {
    dtypes: Some(DTYPES),
    max_dim: Some(MAX_HEAD_DIM),
    max_tokens: Some(u32::MAX as usize),
};

/// The kernels' storage type of a dtype [`LIMITS`] admitted.
pub(super) fn storage(dtype: DType) -> StorageType {
    dtype.into()
}

pub(super) fn dims3<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Vec<usize> {
    tensor.meta.shape().iter().copied().collect()
}

/// A `u32` table on the device (never empty: zero-size bindings are not portable).
pub(super) fn upload_u32<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    values: &[u32],
) -> CubeTensor<R> {
    let values: Vec<u32> = if values.is_empty() {
        vec![0]
    } else {
        values.to_vec()
    };
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let handle = client.create_from_slice(&bytes);
    CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        Shape::new([values.len()]),
        handle,
        DType::U32,
    )
}

pub(super) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    dims: Vec<usize>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims),
        dtype,
    )
}

/// A tensor filled with `value` (the degenerate shapes the kernels are not launched on;
/// [`crate::ops::filled`]: no launch where it has no elements).
pub(super) fn filled<R: CubeRuntime, const D: usize>(
    like: &CubeTensor<R>,
    dims: [usize; D],
    value: f32,
    dtype: DType,
) -> CubeTensor<R> {
    type B<R> = CubeBackend<R, f32, i32, u32>;
    let options = TensorCreationOptions::<B<R>>::new(like.device.clone()).with_dtype(dtype);
    crate::ops::filled::<B<R>, D>(dims, value, options)
        .into_primitive()
        .tensor()
}

pub(super) fn operand<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Operand<'_> {
    Operand::new(tensor.meta.shape().as_slice(), tensor.dtype)
}
