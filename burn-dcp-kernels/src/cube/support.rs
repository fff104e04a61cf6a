//! What the launches share: the tile geometry, vector widths, dtypes and limits, device buffers
//! and the query tables uploaded for a call.

use burn::prelude::Tensor;
use burn::tensor::{DType, Shape, TensorCreationOptions, TensorPrimitive};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubecl::prelude::*;

use crate::ops::{KernelLimits, Operand};
use crate::tiling::{DenseSpans, TileIntervals};

/// Largest head or value dim the kernels take (their per-unit registers are sized by it).
pub const MAX_HEAD_DIM: usize = 256;
/// Units per cube of the element-wise kernels (delta, merge).
pub(super) const ELEMENTWISE_UNITS: u32 = 256;

pub(super) fn primitive<B: burn::prelude::Backend, const D: usize>(
    tensor: Tensor<B, D>,
) -> burn::tensor::ops::FloatTensor<B> {
    tensor.into_primitive().tensor()
}

pub(super) fn tensor<B: burn::prelude::Backend, const D: usize>(
    primitive: burn::tensor::ops::FloatTensor<B>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// Rows (queries, or keys in the dk/dv kernel) per cube of the tiled kernels.
pub(super) const CUBE_ROWS: usize = 128;

/// The tile geometry of one launch, chosen from the head and value dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    /// Rows per unit: every loaded row of the other side serves this many of the unit's rows.
    pub(super) rows: usize,
    /// Units per cube (`rows · units = CUBE_ROWS`).
    pub(super) units: usize,
    /// Rows of the other side per staged tile: the granularity of the tile lists.
    pub(super) block: usize,
}

impl Geometry {
    /// Four rows per unit up to dim 64, two up to 128, one above (the f32 registers of a unit
    /// stay near `4 · rows · dim`); tiles of 16 rows of the other side (8 when `D + Dv > 256`, so
    /// a staged tile stays within 16 KiB of shared memory in f32).
    pub(super) fn of(head_dim: usize, value_dim: usize) -> Self {
        let dim = head_dim.max(value_dim);
        let rows = match dim {
            0..=64 => 4,
            65..=128 => 2,
            _ => 1,
        };
        let block = if head_dim + value_dim <= 256 { 16 } else { 8 };
        Self {
            rows,
            units: CUBE_ROWS / rows,
            block,
        }
    }
}

/// The widest vector (4, 2 or 1 elements) every tensor can be read and written with: the dims
/// divide it, the last dim is contiguous, the other strides and the buffer offset are multiples
/// of it, and the runtime loads vectors that wide.
pub(super) fn vector_size<R: CubeRuntime>(tensors: &[&CubeTensor<R>], dims: &[usize]) -> usize {
    let Some(first) = tensors.first() else {
        return 1;
    };
    let supported: Vec<usize> = first
        .client
        .io_optimized_vector_sizes(first.dtype.size())
        .collect();
    [4usize, 2]
        .into_iter()
        .find(|&n| {
            supported.contains(&n)
                && dims.iter().all(|d| d % n == 0)
                && tensors.iter().all(|t| {
                    let strides = t.meta.strides();
                    let offset = t.handle.offset_start.unwrap_or(0);
                    strides.len() == 3
                        && strides[2] == 1
                        && strides[0] % n == 0
                        && strides[1] % n == 0
                        && offset % (n * t.dtype.size()) as u64 == 0
                })
        })
        .unwrap_or(1)
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

/// The spans and the forward/dq tile lists of a problem.
pub(super) struct QueryTables<R: CubeRuntime> {
    pub(super) spans: CubeTensor<R>,
    pub(super) max_spans: usize,
    pub(super) offsets: CubeTensor<R>,
    pub(super) runs: CubeTensor<R>,
    pub(super) dense: DenseSpans,
}

impl<R: CubeRuntime> QueryTables<R> {
    /// Tables for query tiles of `rows` queries against key tiles of `block` keys.
    pub(super) fn build(
        like: &CubeTensor<R>,
        dense: DenseSpans,
        rows: usize,
        block: usize,
    ) -> Self {
        let tiles = TileIntervals::by_query_tile(&dense, rows, block);
        Self {
            spans: upload_u32(&like.client, &like.device, &dense.spans),
            max_spans: dense.max_spans,
            offsets: upload_u32(&like.client, &like.device, &tiles.offsets),
            runs: upload_u32(&like.client, &like.device, &tiles.intervals),
            dense,
        }
    }
}

pub(super) fn operand<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Operand<'_> {
    Operand::new(tensor.meta.shape().as_slice(), tensor.dtype)
}
