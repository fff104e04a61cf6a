//! Host side of the FlashAttention-2-class kernels: their tables and launches (the comptime
//! shapes and whether a device and a problem can run them: [`super::plan`]).

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::{CubeCount, CubeDim};

use super::plan::FlashPlan;
use super::{backward, forward, FlashConfig};
use crate::cube::{empty, storage, upload_u32};
use crate::definition::{AttentionShape, VarlenAttention};
use crate::tiling::{DenseSpans, TileRuns};

/// `tensor` as the copies read it: contiguous last dim, strides and offset multiples of 16
/// bytes (a copy otherwise).
fn aligned<R: CubeRuntime>(tensor: CubeTensor<R>, config: &FlashConfig) -> CubeTensor<R> {
    if !config.async_copy {
        return tensor;
    }
    let element = tensor.dtype.size();
    let chunk = 16 / element;
    let strides = tensor.meta.strides();
    let offset = tensor.handle.offset_start.unwrap_or(0);
    let fine = strides.len() == 3
        && strides[2] == 1
        && strides[0].is_multiple_of(chunk)
        && strides[1].is_multiple_of(chunk)
        && offset.is_multiple_of(16);
    if fine {
        tensor
    } else {
        into_contiguous(tensor)
    }
}

fn cube_dim(config: &FlashConfig) -> CubeDim {
    CubeDim::new_2d(32, config.planes as u32)
}

/// Cubes per grid dimension at most: WebGPU's limit, and CUDA's for y.
const GRID_DIM: usize = 65_535;

/// The grid of a launch of `cubes` cubes, numbered x fastest ([`launch_slot`](fn@super::stage::launch_slot));
/// the cubes past `cubes` in its last row return at once.
fn grid(cubes: usize) -> CubeCount {
    let x = cubes.min(GRID_DIM);
    CubeCount::Static(x as u32, cubes.div_ceil(x.max(1)).max(1) as u32, 1)
}

/// The forward: `(out, lse)`.
#[allow(clippy::too_many_arguments)]
pub fn forward_flash<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    problem: &VarlenAttention,
    s: &AttentionShape,
    dtype: DType,
    dense: &DenseSpans,
    plan: &FlashPlan,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let config = plan.forward;
    let [q, k, v] = [q, k, v].map(|t| aligned(t, &config));
    let tokens = config.tokens_per_cube();
    let runs = TileRuns::by_query_tile(dense, tokens, config.block);
    let out = empty(&q, vec![s.q_tokens, s.heads, s.value_dim], dtype);
    let lse = empty(&q, vec![s.heads, s.q_tokens], DType::F32);
    let client = q.client.clone();
    let upload = |values: &[u32]| upload_u32(&client, &q.device, values);
    let order = runs.heaviest_first();
    let count = grid(order.len() * (s.heads / config.heads_per_cube));
    let (spans, offsets, runs, order) = (
        upload(&dense.spans),
        upload(&runs.offsets),
        upload(&runs.runs),
        upload(&order),
    );
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked
    // by the caller; shared memory was sized by `FlashPlan::new`; the copies' alignment by
    // `aligned`.
    unsafe {
        forward::flash_forward_kernel::launch_unchecked::<R>(
            &client,
            count,
            cube_dim(&config),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            spans.into_tensor_arg(),
            offsets.into_tensor_arg(),
            runs.into_tensor_arg(),
            order.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            problem.softmax_scale(s.head_dim) as f32,
            f32::NEG_INFINITY,
            config,
            storage(dtype),
        );
    }
    (out, lse)
}

/// The backward (`delta` already computed): `(dq, dk, dv)`.
pub fn backward_flash<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 6],
    problem: &VarlenAttention,
    s: &AttentionShape,
    dtype: DType,
    dense: &DenseSpans,
    plan: &FlashPlan,
) -> crate::cube::Gradients<R> {
    let [q, k, v, dout, lse, delta] = inputs;
    let [q, k, v, dout] = [q, k, v, dout].map(|t| aligned(t, &plan.dq));
    let client = q.client.clone();
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let device = q.device.clone();
    let upload = |values: &[u32]| upload_u32(&client, &device, values);
    let dq = empty(&q, vec![s.q_tokens, s.heads, s.head_dim], dtype);
    let dk = empty(&q, vec![s.kv_tokens, s.kv_heads, s.head_dim], dtype);
    let dv = empty(&q, vec![s.kv_tokens, s.kv_heads, s.value_dim], dtype);
    let spans = upload(&dense.spans);

    let c = plan.dkdv;
    let keys = 16 * c.planes;
    let key_tiles = s.kv_tokens.div_ceil(keys);
    let by_key = TileRuns::by_query_tile(dense, c.block, keys).transpose(key_tiles);
    // SAFETY: as in `forward_flash`.
    unsafe {
        backward::flash_dkdv_kernel::launch_unchecked::<R>(
            &client,
            grid(key_tiles * s.kv_heads),
            cube_dim(&c),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            spans.clone().into_tensor_arg(),
            upload(&by_key.offsets).into_tensor_arg(),
            upload(&by_key.runs).into_tensor_arg(),
            upload(&by_key.heaviest_first()).into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            c,
            storage(dtype),
        );
    }

    let c = plan.dq;
    let tokens = c.tokens_per_cube();
    let runs = TileRuns::by_query_tile(dense, tokens, c.block);
    let order = runs.heaviest_first();
    // SAFETY: as in `forward_flash`.
    unsafe {
        backward::flash_dq_kernel::launch_unchecked::<R>(
            &client,
            grid(order.len() * (s.heads / c.heads_per_cube)),
            cube_dim(&c),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            spans.into_tensor_arg(),
            upload(&runs.offsets).into_tensor_arg(),
            upload(&runs.runs).into_tensor_arg(),
            upload(&order).into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            c,
            storage(dtype),
        );
    }
    (dq, dk, dv)
}
