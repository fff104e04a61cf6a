//! [`FlashOps`] for burn-fusion backends: `Fusion<B>` over any backend `B` with [`FlashOps`]
//! (with burn's default features, `burn::backend::Wgpu` and `burn::backend::Cuda` are
//! `Fusion<CubeBackend<…>>`).
//!
//! burn-fusion records operations in a stream per thread and runs them later, fusing what it can.
//! Each of our three operations joins that stream as one custom operation
//! ([`OperationIr::Custom`]): when the stream reaches it, it takes the inner backend's tensors
//! from the stream's handles, runs `B`'s kernel on them and registers the outputs. Element-wise
//! work before and after still fuses; nothing is read back to the host and the stream is not
//! flushed at the call.
//!
//! Because the operation runs later, where no error can be returned, every call is checked
//! first, on the tensors' shapes and dtypes alone, with the inner backend's [`FlashOps::LIMITS`]
//! ([`check_forward`], [`check_backward`], [`check_merge`]): a bad call gets its error here, at the
//! call, and a queued operation has passed every check its kernel makes.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::prelude::Tensor;
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::cube::{gradients, output, primitive, tensor};
use crate::definition::{BackwardTensors, KernelError, VarlenAttention};
use crate::ops::{check_backward, check_forward, check_merge, KernelLimits, Operand};
use crate::{FlashBackward, FlashGradients, FlashOps, FlashOutput};

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

impl<B: FusionBackend + FlashOps> FlashOps for Fusion<B> {
    const LIMITS: KernelLimits = B::LIMITS;

    fn device_memory(device: &Self::Device) -> Option<crate::DeviceMemory> {
        B::device_memory(device)
    }

    fn check_kernels(
        device: &Self::Device,
        shape: &crate::AttentionShape,
        dtype: DType,
        problem: &VarlenAttention,
        backward: bool,
    ) -> Result<(), KernelError> {
        B::check_kernels(device, shape, dtype, problem, backward)
    }

    fn flash_forward(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        problem: &VarlenAttention,
    ) -> Result<FlashOutput<Self>, KernelError> {
        let [q, k, v] = [q, k, v].map(primitive);
        let (s, dtype) = check_forward(&B::LIMITS, operand(&q), operand(&k), operand(&v), problem)?;
        B::check_kernels(q.client.device(), &s, dtype, problem, false)?;
        let client = q.client.clone();
        let streams = OperationStreams::with_inputs([&q, &k, &v]);
        let outputs = [
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::from([s.q_tokens, s.heads, s.value_dim]),
                dtype,
            ),
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::from([s.heads, s.q_tokens]),
                DType::F32,
            ),
        ];
        let desc = CustomOpIr::new(
            "burn_dcp_flash_forward",
            &[q.into_ir(), k.into_ir(), v.into_ir()],
            &outputs,
        );
        let op = Queued::<B>::new(desc.clone(), Kind::Forward(Arc::new(problem.clone())));
        let [out, lse] = two(client.register(streams, OperationIr::Custom(desc), op));
        Ok(output(out, lse))
    }

    fn flash_backward(
        inputs: FlashBackward<Self>,
        problem: &VarlenAttention,
    ) -> Result<FlashGradients<Self>, KernelError> {
        let inputs = inputs.map(primitive, primitive);
        let (s, dtype) =
            check_backward(&B::LIMITS, inputs.as_ref().map(operand, operand), problem)?;
        B::check_kernels(inputs.q.client.device(), &s, dtype, problem, true)?;
        let client = inputs.q.client.clone();
        let tensors = inputs.into_array();
        let streams = OperationStreams::with_inputs(tensors.each_ref());
        let outputs = [
            [s.q_tokens, s.heads, s.head_dim],
            [s.kv_tokens, s.kv_heads, s.head_dim],
            [s.kv_tokens, s.kv_heads, s.value_dim],
        ]
        .map(|dims| TensorIr::uninit(client.create_empty_handle(), Shape::from(dims), dtype));
        let desc = CustomOpIr::new(
            "burn_dcp_flash_backward",
            &tensors.map(FusionTensor::into_ir),
            &outputs,
        );
        let op = Queued::<B>::new(desc.clone(), Kind::Backward(Arc::new(problem.clone())));
        let [dq, dk, dv]: [FusionTensor<B::FusionRuntime>; 3] = client
            .register(streams, OperationIr::Custom(desc), op)
            .try_into()
            .expect("the backward registers three outputs");
        Ok(gradients(dq, dk, dv))
    }

    fn flash_merge(
        a: FlashOutput<Self>,
        b: FlashOutput<Self>,
    ) -> Result<FlashOutput<Self>, KernelError> {
        let [out_a, out_b] = [a.out, b.out].map(primitive);
        let [lse_a, lse_b] = [a.lse, b.lse].map(primitive);
        let dtype = check_merge(
            &B::LIMITS,
            operand(&out_a),
            operand(&lse_a),
            operand(&out_b),
            operand(&lse_b),
        )?;
        let client = out_a.client.clone();
        let streams = OperationStreams::with_inputs([&out_a, &lse_a, &out_b, &lse_b]);
        let outputs = [
            TensorIr::uninit(client.create_empty_handle(), out_a.shape.clone(), dtype),
            TensorIr::uninit(
                client.create_empty_handle(),
                lse_a.shape.clone(),
                DType::F32,
            ),
        ];
        let desc = CustomOpIr::new(
            "burn_dcp_flash_merge",
            &[
                out_a.into_ir(),
                lse_a.into_ir(),
                out_b.into_ir(),
                lse_b.into_ir(),
            ],
            &outputs,
        );
        let op = Queued::<B>::new(desc.clone(), Kind::Merge);
        let [out, lse] = two(client.register(streams, OperationIr::Custom(desc), op));
        Ok(output(out, lse))
    }
}

/// Which of the three operations a queued one is, with what it needs besides its tensors.
#[derive(Clone, Debug)]
enum Kind {
    Forward(Arc<VarlenAttention>),
    Backward(Arc<VarlenAttention>),
    Merge,
}

/// One of our operations in a fusion stream: its tensors (`desc`) and what it runs.
struct Queued<B> {
    desc: CustomOpIr,
    kind: Kind,
    backend: PhantomData<fn() -> B>,
}

impl<B> Queued<B> {
    fn new(desc: CustomOpIr, kind: Kind) -> Self {
        Self {
            desc,
            kind,
            backend: PhantomData,
        }
    }
}

impl<B> std::fmt::Debug for Queued<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued")
            .field("desc", &self.desc)
            .field("kind", &self.kind)
            .finish()
    }
}

impl<B: FusionBackend + FlashOps> Operation<B::FusionRuntime> for Queued<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let outputs: Vec<burn::tensor::ops::FloatTensor<B>> = match &self.kind {
            Kind::Forward(problem) => {
                let ([q, k, v], [_, _]) = self.desc.as_fixed();
                let [q, k, v] = [q, k, v].map(|ir| input::<B, 3>(handles, ir));
                let result = B::flash_forward(q, k, v, problem).unwrap_or_else(|e| unreachable(e));
                vec![primitive(result.out), primitive(result.lse)]
            }
            Kind::Backward(problem) => {
                let ([q, k, v, out, lse, dout], [_, _, _]) = self.desc.as_fixed();
                let inputs = BackwardTensors {
                    q: input(handles, q),
                    k: input(handles, k),
                    v: input(handles, v),
                    out: input(handles, out),
                    lse: input(handles, lse),
                    dout: input(handles, dout),
                };
                let grads = B::flash_backward(inputs, problem).unwrap_or_else(|e| unreachable(e));
                vec![
                    primitive(grads.dq),
                    primitive(grads.dk),
                    primitive(grads.dv),
                ]
            }
            Kind::Merge => {
                let ([out_a, lse_a, out_b, lse_b], [_, _]) = self.desc.as_fixed();
                let a = FlashOutput {
                    out: input::<B, 3>(handles, out_a),
                    lse: input::<B, 2>(handles, lse_a),
                };
                let b = FlashOutput {
                    out: input::<B, 3>(handles, out_b),
                    lse: input::<B, 2>(handles, lse_b),
                };
                let merged = B::flash_merge(a, b).unwrap_or_else(|e| unreachable(e));
                vec![primitive(merged.out), primitive(merged.lse)]
            }
        };
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// A queued operation passed the checks of its kernel at the call (see the module docs), so its
/// kernel cannot reject it; if it ever did, that is a bug in those checks.
fn unreachable(error: KernelError) -> ! {
    panic!(
        "burn-dcp attention kernel rejected an operation its checks had admitted (a bug): {error}"
    )
}

fn input<B: FusionBackend, const D: usize>(
    handles: &mut Handles<B>,
    ir: &TensorIr,
) -> Tensor<B, D> {
    tensor(handles.get_float_tensor::<B>(ir))
}

fn operand<R: FusionRuntime>(tensor: &FusionTensor<R>) -> Operand<'_> {
    Operand::new(tensor.shape.as_slice(), tensor.dtype)
}

fn two<T>(outputs: Vec<T>) -> [T; 2] {
    match outputs.try_into() {
        Ok(pair) => pair,
        Err(_) => panic!("the operation registers two outputs"),
    }
}
