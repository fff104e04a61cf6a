//! Forward and backward on a chosen cubecl kernel (`cube::forward_with` / `backward_with`) in any
//! dtype, on a burn `CubeBackend` without fusion, against the oracle.

use burn::prelude::{Backend, Tensor};
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_dcp_kernels::cube::{backward_with, forward_with, AttentionKernel};
use burn_dcp_kernels::{reference, BackwardTensors, KernelError};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::{assert_gradients_near, assert_half_forward, inputs, read, upload, Case, Inputs};

/// A backend tensor from a cubecl primitive.
pub fn tensor<B: Backend, const D: usize>(primitive: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// One run of `kernel` on a case's random inputs (drawn from `seed`) in `dtype`, on `device`.
pub struct KernelRun<'a, B: Backend> {
    pub case: &'a Case,
    pub seed: u64,
    pub dtype: DType,
    pub kernel: AttentionKernel,
    pub device: B::Device,
}

impl<'a, R: CubeRuntime, B: Backend<FloatTensorPrimitive = CubeTensor<R>>> KernelRun<'a, B> {
    pub fn new(
        case: &'a Case,
        seed: u64,
        dtype: DType,
        kernel: AttentionKernel,
        device: B::Device,
    ) -> Self {
        Self {
            case,
            seed,
            dtype,
            kernel,
            device,
        }
    }

    /// The inputs on the device (`q`, `k`, `v`, `dout`) and as the device holds them (rounded to
    /// `dtype`).
    fn uploaded(&self) -> ([Tensor<B, 3>; 4], Inputs) {
        let s = &self.case.shape;
        let x = inputs(&mut SmallRng::seed_from_u64(self.seed), s);
        let upload =
            |values: &[f32], dims| upload::<B>(values, dims, &self.device).cast(self.dtype);
        let q = upload(&x.q, [s.q_tokens, s.heads, s.head_dim]);
        let k = upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]);
        let v = upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]);
        let dout = upload(&x.dout, [s.q_tokens, s.heads, s.value_dim]);
        let rounded = Inputs {
            q: read(q.clone()),
            k: read(k.clone()),
            v: read(v.clone()),
            dout: read(dout.clone()),
        };
        ([q, k, v, dout], rounded)
    }

    fn forward_on(
        &self,
        [q, k, v]: [&Tensor<B, 3>; 3],
    ) -> Result<(CubeTensor<R>, CubeTensor<R>), KernelError> {
        let primitive = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
        let problem = &self.case.problem;
        forward_with(
            primitive(q),
            primitive(k),
            primitive(v),
            problem,
            self.kernel,
        )
    }

    /// `(out, lse)` of the forward, and the inputs as the device holds them.
    pub fn forward(&self) -> Result<(Vec<f32>, Vec<f32>, Inputs), KernelError> {
        let ([q, k, v, _], rounded) = self.uploaded();
        let (out, lse) = self.forward_on([&q, &k, &v])?;
        let (out, lse) = (tensor::<B, 3>(out), tensor::<B, 2>(lse));
        assert_eq!(out.dtype(), self.dtype);
        assert_eq!(lse.dtype(), DType::F32);
        Ok((read(out), read(lse), rounded))
    }

    /// `[dq, dk, dv]` of the backward (after its forward), and the inputs as the device holds
    /// them.
    pub fn backward(&self) -> Result<([Vec<f32>; 3], Inputs), KernelError> {
        let ([q, k, v, dout], rounded) = self.uploaded();
        let (out, lse) = self.forward_on([&q, &k, &v])?;
        let primitive = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let inputs = BackwardTensors {
            q: primitive(q),
            k: primitive(k),
            v: primitive(v),
            out,
            lse,
            dout: primitive(dout),
        };
        let (dq, dk, dv) = backward_with(inputs, &self.case.problem, self.kernel)?;
        let grads = [dq, dk, dv].map(|g| {
            let g = tensor::<B, 3>(g);
            assert_eq!(g.dtype(), self.dtype);
            read(g)
        });
        Ok((grads, rounded))
    }

    /// The forward in a half dtype against the oracle ([`assert_half_forward`]).
    pub fn check_half_forward(&self, what: &str) {
        let (out, lse, x) = self.forward().unwrap();
        assert_half_forward((&out, &lse), &x, self.case, self.dtype, what);
    }

    /// The gradients against the oracle within `bound` (relative to the largest).
    pub fn check_gradients(&self, bound: f32, what: &str) {
        let ([dq, dk, dv], x) = self.backward().unwrap();
        let case = self.case;
        let want = reference::backward(&x.q, &x.k, &x.v, &x.dout, &case.problem, &case.shape);
        assert_gradients_near([&dq, &dk, &dv], &want.unwrap(), bound, what);
    }
}
