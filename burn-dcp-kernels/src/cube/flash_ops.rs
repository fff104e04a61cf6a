//! [`FlashOps`] for burn's `CubeBackend`: checks, then the launches of [`super::launch`].

use burn::prelude::Tensor;
use burn::tensor::DType;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::choice::AttentionKernel;
use super::launch::{backward, forward, merge};
use super::support::{gradients, output, primitive, LIMITS};
use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::ops::KernelLimits;
use crate::tiling::DenseSpans;
use crate::{DeviceMemory, FlashBackward, FlashGradients, FlashOps, FlashOutput};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FlashOps
    for CubeBackend<R, F, I, BT>
{
    const LIMITS: KernelLimits = LIMITS;

    fn device_memory(device: &Self::Device) -> Option<DeviceMemory> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(DeviceMemory {
            in_use: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
        })
    }

    fn check_kernels(
        device: &Self::Device,
        shape: &AttentionShape,
        dtype: DType,
        problem: &VarlenAttention,
        // The forward and the backward kernels come from one plan: the same check.
        _backward: bool,
    ) -> Result<(), KernelError> {
        let kernel = AttentionKernel::from_env()?;
        if shape.q_tokens == 0 || shape.kv_tokens == 0 {
            return Ok(());
        }
        let dense = DenseSpans::build(problem)?;
        kernel
            .flash_plan(&R::client(device), dtype, shape, dense.max_spans)
            .map(|_| ())
    }

    fn flash_forward(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        problem: &VarlenAttention,
    ) -> Result<FlashOutput<Self>, KernelError> {
        let (out, lse) = forward::<R>(primitive(q), primitive(k), primitive(v), problem)?;
        Ok(output(out, lse))
    }

    fn flash_backward(
        inputs: FlashBackward<Self>,
        problem: &VarlenAttention,
    ) -> Result<FlashGradients<Self>, KernelError> {
        let (dq, dk, dv) = backward::<R>(inputs.map(primitive, primitive), problem)?;
        Ok(gradients(dq, dk, dv))
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
        Ok(output(out, lse))
    }
}
