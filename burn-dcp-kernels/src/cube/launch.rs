//! The launches of one forward, backward or merge on device tensors.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

use super::choice::AttentionKernel;
use super::elementwise;
use super::flash::{backward_flash, forward_flash};
use super::support::*;
use crate::definition::{BackwardTensors, KernelError, VarlenAttention};
use crate::ops::{check_backward, check_forward, check_merge};
use crate::tiling::DenseSpans;

/// Forward on device tensors: `(out [Tq, H, Dv], lse [H, Tq] f32)`, on the kernels
/// [`KERNEL_ENV`](super::KERNEL_ENV) names ([`AttentionKernel::Auto`] when unset).
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
    let plan = kernel.flash_plan(&q.client, dtype, &s, dense.max_spans)?;
    Ok(forward_flash(q, k, v, problem, &s, dtype, &dense, &plan))
}

/// `(dq, dk, dv)` on the device.
pub(crate) type Gradients<R> = (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>);

/// Backward on device tensors: `(dq, dk, dv)`, on the kernels [`KERNEL_ENV`](super::KERNEL_ENV) names
/// ([`AttentionKernel::Auto`] when unset).
pub fn backward<R: CubeRuntime>(
    inputs: BackwardTensors<CubeTensor<R>>,
    problem: &VarlenAttention,
) -> Result<Gradients<R>, KernelError> {
    backward_with(inputs, problem, AttentionKernel::from_env()?)
}

/// [`backward`] on chosen kernels. Errors when the device cannot run them (tensor cores it
/// lacks, tiles beyond its shared memory), naming what is missing.
pub fn backward_with<R: CubeRuntime>(
    inputs: BackwardTensors<CubeTensor<R>>,
    problem: &VarlenAttention,
    kernel: AttentionKernel,
) -> Result<Gradients<R>, KernelError> {
    let (s, dtype) = check_backward(&LIMITS, inputs.as_ref().map(operand, operand), problem)?;
    let BackwardTensors {
        q,
        k,
        v,
        out,
        lse,
        dout,
    } = inputs;
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
    let plan = kernel.flash_plan(&q.client, dtype, &s, dense.max_spans)?;
    let client = q.client.clone();
    let storage = storage(dtype);

    let delta = empty(&q, vec![s.heads, s.q_tokens], DType::F32);
    let rows = s.heads * s.q_tokens;
    let unit_dim = CubeDim::new_1d(ELEMENTWISE_UNITS);
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked above.
    unsafe {
        elementwise::delta_kernel::launch_unchecked::<R>(
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

    let inputs = [q, k, v, dout, lse, delta];
    Ok(backward_flash(inputs, problem, &s, dtype, &dense, &plan))
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
            elementwise::merge_in_place_kernel::launch_unchecked::<R>(
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
        elementwise::merge_kernel::launch_unchecked::<R>(
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
