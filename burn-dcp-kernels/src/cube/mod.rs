//! [`FlashOps`] for burn's `CubeBackend` (wgpu, CUDA): the tiled `#[cube]` kernels of
//! [`kernels`], launched with the host-built tables of [`crate::tiling`].
//!
//! - **Forward**: one cube per (tile of 128 queries, head); each unit owns `rows` queries
//!   (`Geometry`: 4 up to dim 64, 2 up to 128, 1 above). Per listed key tile the cube stages
//!   K and V (16 keys, 8 when `D + Dv > 256`) in shared memory, then every unit scores its rows
//!   against each key and runs the online softmax with f32 accumulators; writes `out` and the
//!   f32 LSE.
//! - **Backward**: `delta = rowsum(dout ∘ out)`, then two kernels with no atomics: `dq` (the
//!   forward's geometry, K/V tiles staged) and `dk`/`dv` (a unit owns `rows` keys; per listed
//!   query tile the cube stages Q, dout, lse, delta and the spans; it loops over the query heads
//!   of its GQA group). Recomputing the scores in both kernels costs one extra `q·k` per pair; in
//!   exchange the results are deterministic, there is no float atomic add (not a core WebGPU
//!   feature, absent on lavapipe) and the GQA group reduction stays in registers.
//! - **Vectors**: rows are loaded and stored as vectors of 4 (else 2, else 1) elements, the
//!   widest every operand allows (`vector_size`: divisible dims, contiguous last dim, strides
//!   and offsets that are multiples); f16/bf16 inputs are widened to f32 after the load.
//! - **Merge**: one unit per (head, query); in place in `a`'s buffers when nothing else holds them.
//!
//! Limits (checked, with errors): f32 / f16 / bf16 inputs, head and value dims in `1..=256`.
//!
//! Why several rows per unit: on lavapipe (the CI device) every load from a storage buffer or
//! shared memory is a loop over the SIMD lanes with a branch per lane (Mesa 22.3's gallivm has no
//! uniform-address fast path), so a kernel that loads one key element per multiply-add is bound
//! by loads. A unit owning four rows issues a quarter of the loads per pair, and vector loads
//! share one lane loop between four elements; together with staging, this took the forward from
//! 0.43× to 3.3× burn's attention on the dense shape (benches/RESULTS.md). On GPUs the same
//! structure is the classic register tiling; shared memory serves the reuse across units.
//!
//! **Every loop over a head or value dim is unrolled** (and the row, span-slot and staging
//! loops). Besides the usual register benefits, this is needed for correctness on Mesa's
//! lavapipe (llvmpipe), which CI runs: gallivm caps the *total* number of loop iterations of one
//! shader invocation at 65 535 (`LP_MAX_TGSI_LOOP_ITERATIONS`, one limiter shared by every loop
//! of the function) and then silently leaves every loop after one iteration. With rolled `for d
//! in 0..head_dim` loops a query attending 512 keys at head dim 64 crossed it and returned
//! garbage. What remains rolled are the loops over tiles, tile runs and the keys (queries) of a
//! tile, so on lavapipe a query may attend about 60 000 keys (and a key be attended by that many
//! queries per GQA group); real GPUs have no such cap.
//!
//! The forward updates its online softmax one key at a time (rescaling only when the running
//! max grows) rather than per tile with a score array: the per-tile form took lavapipe's LLVM
//! minutes to compile at head dim 128. The whole kernel test suite (dims 3 to 136, f32 and f16,
//! both backends) runs in about 40 s with a cold Mesa shader cache, 10 s with a warm one.
//!
//! **Matrix tiles and tensor cores** ([`matrix`], [`AttentionKernel`]): the same three kernels
//! (forward with LSE, dq, dk/dv) on 16 × 16 tiles, one plane (32 units) per 16 rows: per tile
//! pair each plane computes `S = Q·Kᵀ` (and `dP = dO·Vᵀ`) as 16 × 16 × 16 products with f32
//! accumulators, runs the softmax (or `dS`) with one unit per row, stores `P` (`dS`) in the
//! input dtype and accumulates `O += P·V` (`dQ += dS·K`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`) in f32
//! in shared memory. The products are `cmma` (tensor cores: `wmma` on CUDA) or, with
//! `tensor_cores: false`, the same products on ordinary units; everything else is shared.
//! [`KERNEL_ENV`] (`BURN_DCP_ATTENTION_KERNEL`) picks the kernels of every `FlashOps` call:
//! `vector` (the default), `auto` (tensor cores where the device has them for the dtype and
//! the tiles fit its shared memory, else vector), `tiles`, `tensor-cores`.
//!
//! **Not run on a GPU:** no GPU was available to this project's sessions. The matrix-tile
//! kernels are checked on lavapipe with their products on ordinary units (f32 ≤ 1e-5 vs the
//! oracle for every mask, ragged GQA, padded dims, several tiles; f16 within the rounding
//! bounds), and their `cmma` branches are compiled to CUDA C++ by cubecl-cuda's compiler in CI
//! (`burn-dcp/tests/cuda_codegen.rs`: `wmma` loads, products and stores on 32-byte-aligned shared
//! memory); `tests/cube_cuda.rs` (`#[ignore]`d) and the bench group `cuda` run them on a GPU.
//! Until those have passed, the default stays `vector`. The vector kernels themselves have
//! not run on CUDA either (they build for it).

pub mod kernels;
pub mod matrix;
mod matrix_launch;

use matrix_launch::{backward_on_tiles, choose, forward_on_tiles, TilesKernel};
pub use matrix_launch::{AttentionKernel, KERNEL_ENV};

use burn::prelude::Tensor;
use burn::tensor::{DType, Shape, TensorCreationOptions, TensorPrimitive};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeCount, CubeDim};

use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::ops::{check_backward, check_forward, check_merge, KernelLimits, Operand};
use crate::tiling::{DenseSpans, TileIntervals};
use crate::{FlashGradients, FlashOps, FlashOutput};

/// Largest head or value dim the kernels take (their per-unit registers are sized by it).
pub const MAX_HEAD_DIM: usize = 256;
/// Units per cube of the element-wise kernels (delta, merge).
const ELEMENTWISE_UNITS: u32 = 256;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FlashOps
    for CubeBackend<R, F, I, BT>
{
    const LIMITS: KernelLimits = LIMITS;

    fn check_kernels(
        device: &Self::Device,
        shape: &AttentionShape,
        dtype: DType,
        problem: &VarlenAttention,
        backward: bool,
    ) -> Result<(), KernelError> {
        let kernel = AttentionKernel::from_env()?;
        if kernel == AttentionKernel::Vector || shape.q_tokens == 0 || shape.kv_tokens == 0 {
            return Ok(());
        }
        let client = R::client(device);
        let dense = DenseSpans::build(problem)?;
        let kernels = TilesKernel::of_pass(backward);
        choose(
            kernel,
            client.properties(),
            dtype,
            shape,
            dense.max_spans,
            kernels,
        )
        .map(|_| ())
    }

    fn flash_forward(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        problem: &VarlenAttention,
    ) -> Result<FlashOutput<Self>, KernelError> {
        let (out, lse) = forward::<R>(primitive(q), primitive(k), primitive(v), problem)?;
        Ok(FlashOutput {
            out: tensor(out),
            lse: tensor(lse),
        })
    }

    fn flash_backward(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        out: Tensor<Self, 3>,
        lse: Tensor<Self, 2>,
        dout: Tensor<Self, 3>,
        problem: &VarlenAttention,
    ) -> Result<FlashGradients<Self>, KernelError> {
        let (dq, dk, dv) = backward::<R>(
            primitive(q),
            primitive(k),
            primitive(v),
            primitive(out),
            primitive(lse),
            primitive(dout),
            problem,
        )?;
        Ok(FlashGradients {
            dq: tensor(dq),
            dk: tensor(dk),
            dv: tensor(dv),
        })
    }

    fn flash_merge(
        a: FlashOutput<Self>,
        b: FlashOutput<Self>,
    ) -> Result<FlashOutput<Self>, KernelError> {
        let (out, lse) = merge::<R>(
            primitive(a.out),
            primitive(a.lse),
            primitive(b.out),
            primitive(b.lse),
        )?;
        Ok(FlashOutput {
            out: tensor(out),
            lse: tensor(lse),
        })
    }
}

fn primitive<B: burn::prelude::Backend, const D: usize>(
    tensor: Tensor<B, D>,
) -> burn::tensor::ops::FloatTensor<B> {
    tensor.into_primitive().tensor()
}

fn tensor<B: burn::prelude::Backend, const D: usize>(
    primitive: burn::tensor::ops::FloatTensor<B>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// Rows (queries, or keys in the dk/dv kernel) per cube of the tiled kernels.
const CUBE_ROWS: usize = 128;

/// The tile geometry of one launch, chosen from the head and value dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    /// Rows per unit: every loaded row of the other side serves this many of the unit's rows.
    rows: usize,
    /// Units per cube (`rows · units = CUBE_ROWS`).
    units: usize,
    /// Rows of the other side per staged tile: the granularity of the tile lists.
    block: usize,
}

impl Geometry {
    /// Four rows per unit up to dim 64, two up to 128, one above (the f32 registers of a unit
    /// stay near `4 · rows · dim`); tiles of 16 rows of the other side (8 when `D + Dv > 256`, so
    /// a staged tile stays within 16 KiB of shared memory in f32).
    fn of(head_dim: usize, value_dim: usize) -> Self {
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
fn vector_size<R: CubeRuntime>(tensors: &[&CubeTensor<R>], dims: &[usize]) -> usize {
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
const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// What the kernels take: `DTYPES`, dims up to [`MAX_HEAD_DIM`], 32-bit token indices.
pub const LIMITS: KernelLimits = KernelLimits {
    dtypes: Some(DTYPES),
    max_dim: Some(MAX_HEAD_DIM),
    max_tokens: Some(u32::MAX as usize),
};

/// The kernels' storage type of a dtype [`LIMITS`] admitted.
fn storage(dtype: DType) -> StorageType {
    dtype.into()
}

fn dims3<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Vec<usize> {
    tensor.meta.shape().iter().copied().collect()
}

/// A `u32` table on the device (never empty: zero-size bindings are not portable).
fn upload_u32<R: CubeRuntime>(
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

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, dims: Vec<usize>, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims),
        dtype,
    )
}

/// A tensor filled with `value` (the degenerate shapes the kernels are not launched on).
fn filled<R: CubeRuntime, const D: usize>(
    like: &CubeTensor<R>,
    dims: [usize; D],
    value: f32,
    dtype: DType,
) -> CubeTensor<R> {
    type B<R> = CubeBackend<R, f32, i32, u32>;
    let options = TensorCreationOptions::<B<R>>::new(like.device.clone()).with_dtype(dtype);
    Tensor::<B<R>, D>::full(dims, value, options)
        .into_primitive()
        .tensor()
}

/// The spans and the forward/dq tile lists of a problem.
struct QueryTables<R: CubeRuntime> {
    spans: CubeTensor<R>,
    max_spans: usize,
    offsets: CubeTensor<R>,
    runs: CubeTensor<R>,
    dense: DenseSpans,
}

impl<R: CubeRuntime> QueryTables<R> {
    /// Tables for query tiles of `rows` queries against key tiles of `block` keys.
    fn build(like: &CubeTensor<R>, dense: DenseSpans, rows: usize, block: usize) -> Self {
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

fn operand<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Operand<'_> {
    Operand::new(tensor.meta.shape().as_slice(), tensor.dtype)
}

/// Forward on device tensors: `(out [Tq, H, Dv], lse [H, Tq] f32)`, on the kernels
/// [`KERNEL_ENV`] names ([`AttentionKernel::Vector`] when unset).
pub fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    problem: &VarlenAttention,
) -> Result<(CubeTensor<R>, CubeTensor<R>), KernelError> {
    forward_with(q, k, v, problem, AttentionKernel::from_env()?)
}

/// [`forward`] on a chosen kernel. Errors when the device cannot run it (tensor cores it lacks,
/// tiles beyond its shared memory), naming what is missing.
pub fn forward_with<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    problem: &VarlenAttention,
    kernel: AttentionKernel,
) -> Result<(CubeTensor<R>, CubeTensor<R>), KernelError> {
    let (s, dtype) = check_forward(&LIMITS, operand(&q), operand(&k), operand(&v), problem)?;
    let out_dims = [s.q_tokens, s.heads, s.value_dim];
    let lse_dims = [s.heads, s.q_tokens];
    if s.q_tokens == 0 || s.kv_tokens == 0 {
        return Ok((
            filled(&q, out_dims, 0.0, dtype),
            filled(&q, lse_dims, f32::NEG_INFINITY, DType::F32),
        ));
    }
    let dense = DenseSpans::build(problem)?;
    let properties = q.client.properties();
    let kernels = TilesKernel::of_pass(false);
    if let Some(tiles) = choose(kernel, properties, dtype, &s, dense.max_spans, kernels)? {
        return forward_on_tiles(q, k, v, problem, &s, dtype, dense, tiles[0]);
    }
    let geometry = Geometry::of(s.head_dim, s.value_dim);
    let tables = QueryTables::build(&q, dense, CUBE_ROWS, geometry.block);
    let out = empty(&q, out_dims.to_vec(), dtype);
    let lse = empty(&q, lse_dims.to_vec(), DType::F32);
    let vector = vector_size(&[&q, &k, &v, &out], &[s.head_dim, s.value_dim]);
    let client = q.client.clone();
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        kernels::forward_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(s.q_tokens.div_ceil(CUBE_ROWS) as u32, s.heads as u32, 1),
            CubeDim::new_1d(geometry.units as u32),
            vector,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            tables.spans.into_tensor_arg(),
            tables.offsets.into_tensor_arg(),
            tables.runs.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            problem.softmax_scale(s.head_dim) as f32,
            f32::NEG_INFINITY,
            s.head_dim / vector,
            s.value_dim / vector,
            geometry.rows,
            geometry.units,
            geometry.block,
            tables.max_spans,
            storage(dtype),
        );
    }
    Ok((out, lse))
}

/// `(dq, dk, dv)` on the device.
pub(crate) type Gradients<R> = (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>);

/// Backward on device tensors: `(dq, dk, dv)`, on the kernels [`KERNEL_ENV`] names
/// ([`AttentionKernel::Vector`] when unset).
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    problem: &VarlenAttention,
) -> Result<Gradients<R>, KernelError> {
    let kernel = AttentionKernel::from_env()?;
    backward_with(q, k, v, out, lse, dout, problem, kernel)
}

/// [`backward`] on chosen kernels. Errors when the device cannot run them (tensor cores it
/// lacks, tiles beyond its shared memory), naming what is missing.
#[allow(clippy::too_many_arguments)]
pub fn backward_with<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    problem: &VarlenAttention,
    kernel: AttentionKernel,
) -> Result<Gradients<R>, KernelError> {
    let (s, dtype) = check_backward(
        &LIMITS,
        operand(&q),
        operand(&k),
        operand(&v),
        operand(&out),
        operand(&lse),
        operand(&dout),
        problem,
    )?;
    let dq_dims = [s.q_tokens, s.heads, s.head_dim];
    let dk_dims = [s.kv_tokens, s.kv_heads, s.head_dim];
    let dv_dims = [s.kv_tokens, s.kv_heads, s.value_dim];
    if s.q_tokens == 0 || s.kv_tokens == 0 {
        return Ok((
            filled(&q, dq_dims, 0.0, dtype),
            filled(&q, dk_dims, 0.0, dtype),
            filled(&q, dv_dims, 0.0, dtype),
        ));
    }
    let dense = DenseSpans::build(problem)?;
    let kernels = TilesKernel::of_pass(true);
    let properties = q.client.properties();
    let tiles = choose(kernel, properties, dtype, &s, dense.max_spans, kernels)?;
    let client = q.client.clone();
    let storage = storage(dtype);
    let scale = problem.softmax_scale(s.head_dim) as f32;

    let delta = empty(&q, vec![s.heads, s.q_tokens], DType::F32);
    let rows = s.heads * s.q_tokens;
    let unit_dim = CubeDim::new_1d(ELEMENTWISE_UNITS);
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        kernels::delta_kernel::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, rows, unit_dim),
            unit_dim,
            out.into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            s.value_dim,
            storage,
        );
    }

    if let Some(tiles) = tiles {
        let inputs = [q, k, v, dout, lse, delta];
        let geometries = [tiles[0], tiles[1]];
        return Ok(backward_on_tiles(
            inputs, problem, &s, dtype, dense, geometries,
        ));
    }

    let geometry = Geometry::of(s.head_dim, s.value_dim);
    let tables = QueryTables::build(&q, dense, CUBE_ROWS, geometry.block);
    // Key side: key tiles of `CUBE_ROWS` keys against query tiles of `block` queries.
    let key_tiles = s.kv_tokens.div_ceil(CUBE_ROWS);
    let by_key =
        TileIntervals::by_query_tile(&tables.dense, geometry.block, CUBE_ROWS).transpose(key_tiles);
    let dk = empty(&q, dk_dims.to_vec(), dtype);
    let dv = empty(&q, dv_dims.to_vec(), dtype);
    let dq = empty(&q, dq_dims.to_vec(), dtype);
    let vector = vector_size(
        &[&q, &k, &v, &dout, &dq, &dk, &dv],
        &[s.head_dim, s.value_dim],
    );
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        kernels::dkdv_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(key_tiles as u32, s.kv_heads as u32, 1),
            CubeDim::new_1d(geometry.units as u32),
            vector,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            tables.spans.clone().into_tensor_arg(),
            upload_u32(&client, &q.device, &by_key.offsets).into_tensor_arg(),
            upload_u32(&client, &q.device, &by_key.intervals).into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            s.head_dim / vector,
            s.value_dim / vector,
            geometry.rows,
            geometry.units,
            geometry.block,
            tables.max_spans,
            storage,
        );
    }
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        kernels::dq_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(s.q_tokens.div_ceil(CUBE_ROWS) as u32, s.heads as u32, 1),
            CubeDim::new_1d(geometry.units as u32),
            vector,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            tables.spans.into_tensor_arg(),
            tables.offsets.into_tensor_arg(),
            tables.runs.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            s.head_dim / vector,
            s.value_dim / vector,
            geometry.rows,
            geometry.units,
            geometry.block,
            tables.max_spans,
            storage,
        );
    }

    Ok((dq, dk, dv))
}

/// Merge on device tensors; writes into `a`'s buffers when nothing else holds them.
pub fn merge<R: CubeRuntime>(
    out_a: CubeTensor<R>,
    lse_a: CubeTensor<R>,
    out_b: CubeTensor<R>,
    lse_b: CubeTensor<R>,
) -> Result<(CubeTensor<R>, CubeTensor<R>), KernelError> {
    let dtype = check_merge(
        &LIMITS,
        operand(&out_a),
        operand(&lse_a),
        operand(&out_b),
        operand(&lse_b),
    )?;
    let storage = storage(dtype);
    let dims = dims3(&out_a);
    let (tokens, heads, value_dim) = (dims[0], dims[1], dims[2]);
    if tokens * heads == 0 {
        return Ok((out_a, lse_a));
    }
    let client = out_a.client.clone();
    let unit_dim = CubeDim::new_1d(ELEMENTWISE_UNITS);
    let count = calculate_cube_count_elemwise(&client, tokens * heads, unit_dim);
    let writable = |t: &CubeTensor<R>| t.can_mut() && t.is_nonoverlapping();
    if writable(&out_a) && writable(&lse_a) {
        // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
        unsafe {
            kernels::merge_in_place_kernel::launch_unchecked::<R>(
                &client,
                count,
                unit_dim,
                out_a.clone().into_tensor_arg(),
                lse_a.clone().into_tensor_arg(),
                out_b.into_tensor_arg(),
                lse_b.into_tensor_arg(),
                value_dim,
                storage,
            );
        }
        return Ok((out_a, lse_a));
    }
    let out = empty(&out_a, dims, dtype);
    let lse = empty(&out_a, vec![heads, tokens], DType::F32);
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        kernels::merge_kernel::launch_unchecked::<R>(
            &client,
            count,
            unit_dim,
            out_a.into_tensor_arg(),
            lse_a.into_tensor_arg(),
            out_b.into_tensor_arg(),
            lse_b.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            value_dim,
            storage,
        );
    }
    Ok((out, lse))
}
