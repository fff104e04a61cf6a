//! Forward and backward on a chosen kernel (`cube::forward_with` / `backward_with`) in any
//! dtype, on the burn backend without fusion.

use super::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_dcp_kernels::cube::{backward_with, forward_with, AttentionKernel};

type B = WgpuPlain;

pub(super) fn upload(values: &[f32], dims: [usize; 3], dtype: DType) -> Tensor<B, 3> {
    Tensor::<B, 3>::from_data(TensorData::new(values.to_vec(), dims), &device()).cast(dtype)
}

pub(super) fn read<const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// `(out, lse)` of the forward on `kernel`, and the inputs as the device holds them (rounded
/// to `dtype`).
pub(super) fn run(
    case: &Case,
    seed: u64,
    dtype: DType,
    kernel: AttentionKernel,
) -> Result<(Vec<f32>, Vec<f32>, Inputs), burn_dcp_kernels::KernelError> {
    let Case { problem, shape: s } = case;
    let x = inputs(&mut SmallRng::seed_from_u64(seed), s);
    let q = upload(&x.q, [s.q_tokens, s.heads, s.head_dim], dtype);
    let k = upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim], dtype);
    let v = upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim], dtype);
    let rounded = Inputs {
        q: read(q.clone()),
        k: read(k.clone()),
        v: read(v.clone()),
        dout: Vec::new(),
    };
    let primitive = |t: Tensor<B, 3>| t.into_primitive().tensor();
    let (out, lse) = forward_with(primitive(q), primitive(k), primitive(v), problem, kernel)?;
    let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
    let lse = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse));
    assert_eq!(out.dtype(), dtype);
    assert_eq!(lse.dtype(), DType::F32);
    Ok((read(out), read(lse), rounded))
}

/// `[dq, dk, dv]` of the backward on `kernel` (after its forward), and the inputs as the
/// device holds them.
pub(super) fn run_backward(
    case: &Case,
    seed: u64,
    dtype: DType,
    kernel: AttentionKernel,
) -> Result<([Vec<f32>; 3], Inputs), burn_dcp_kernels::KernelError> {
    let Case { problem, shape: s } = case;
    let x = inputs(&mut SmallRng::seed_from_u64(seed), s);
    let q = upload(&x.q, [s.q_tokens, s.heads, s.head_dim], dtype);
    let k = upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim], dtype);
    let v = upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim], dtype);
    let dout = upload(&x.dout, [s.q_tokens, s.heads, s.value_dim], dtype);
    let rounded = Inputs {
        q: read(q.clone()),
        k: read(k.clone()),
        v: read(v.clone()),
        dout: read(dout.clone()),
    };
    let primitive = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
    let (out, lse) = forward_with(primitive(&q), primitive(&k), primitive(&v), problem, kernel)?;
    let (dq, dk, dv) = backward_with(
        primitive(&q),
        primitive(&k),
        primitive(&v),
        out,
        lse,
        primitive(&dout),
        problem,
        kernel,
    )?;
    let grads = [dq, dk, dv].map(|g| {
        let g = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(g));
        assert_eq!(g.dtype(), dtype);
        read(g)
    });
    Ok((grads, rounded))
}
