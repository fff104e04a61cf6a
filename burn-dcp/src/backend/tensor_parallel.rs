//! Tensor-parallel communication as autodiff ops (Megatron-LM's `f` and `g`):
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`tp_copy`] (`f`, enter a TP region) | identity | all-reduce of the gradient over the TP group |
//! | [`tp_reduce`] (`g`, leave a TP region) | all-reduce over the TP group | identity |
//!
//! A column-parallel linear layer takes `tp_copy(x)` (every TP rank sees the whole input; their
//! partial input gradients are summed in backward); a row-parallel one ends in `tp_reduce` (the
//! partial outputs are summed; the output gradient is the same on every rank). Each op is one
//! autodiff node on `ContextParallel<Autodiff<B>>`; on a backend without autodiff the forward
//! runs alone.
//!
//! A communication failure in forward is returned as an error; in backward (which burn runs
//! without a way to return one) it panics naming the op, the TP rank and the error, after marking
//! this rank failed so that its peers fail at once naming it.

use burn::prelude::Tensor;
use burn::tensor::TensorPrimitive;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_backend::tensor::FloatTensor;
use burn_backend::Backend;
use burn_dcp_kernels::FlashOps;

use super::{ContextParallel, CpInner};
use crate::comm::{Comm, CommError, Payload};
use crate::error::CpError;

/// Which TP region boundary an op is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// `f`: identity forward, all-reduce backward.
    Copy,
    /// `g`: all-reduce forward, identity backward.
    Reduce,
}

/// Backends that can run the TP region ops on their primitives. The default is the forward
/// alone (backends without autodiff: burn Flex, the cubecl backends); `Autodiff<B>` records a
/// node whose backward is the other half of the pair.
pub trait TpInner: CpInner {
    fn tp_region(
        x: FloatTensor<Self>,
        comm: &Comm,
        region: Region,
    ) -> Result<FloatTensor<Self>, CpError> {
        plain::<Self>(x, comm, region)
    }
}

/// All-reduce of a primitive of any rank over `comm` (flattened for the wire).
fn all_reduce<B: Backend>(x: FloatTensor<B>, comm: &Comm) -> Result<FloatTensor<B>, CpError> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let device = B::float_device(&x);
    // The tensor stays on its device (the in-process world passes it as it is).
    let summed = comm.all_reduce(Payload::from_float::<B>(x))?;
    summed.into_float::<B>(&device).map_err(|message| {
        CpError::Comm(CommError::Invalid {
            group: comm.name().to_string(),
            message: format!("all-reduce: {message}"),
        })
    })
}

fn plain<B: Backend>(
    x: FloatTensor<B>,
    comm: &Comm,
    region: Region,
) -> Result<FloatTensor<B>, CpError> {
    match region {
        Region::Copy => Ok(x),
        Region::Reduce => all_reduce::<B>(x, comm),
    }
}

impl TpInner for burn::backend::Flex {}

#[cfg(feature = "cube")]
impl<R, F, I, BT> TpInner for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

#[cfg(feature = "fusion")]
impl<B: burn_fusion::FusionBackend + FlashOps> TpInner for burn_fusion::Fusion<B> {}

/// The backward of a region op: the other half of its pair.
#[derive(Debug)]
struct RegionBackward;

/// What the backward needs: the TP group and which op it was.
#[derive(Clone, Debug)]
struct RegionState {
    comm: Comm,
    region: Region,
}

impl<B: FlashOps> Backward<B, 1> for RegionBackward {
    type State = RegionState;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut burn_autodiff::checkpoint::base::Checkpointer,
    ) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let RegionState { comm, region } = ops.state;
        let grad = match region {
            Region::Copy => all_reduce::<B>(grad, &comm).unwrap_or_else(|error| {
                comm.abort(&error.to_string());
                panic!(
                    "tensor-parallel all-reduce of a gradient (backward of tp_copy) failed on TP rank {} of {}: {error}",
                    comm.rank(),
                    comm.size()
                )
            }),
            Region::Reduce => grad,
        };
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, grad);
        }
    }
}

impl<B: FlashOps, C: CheckpointStrategy> TpInner for Autodiff<B, C> {
    fn tp_region(
        x: FloatTensor<Self>,
        comm: &Comm,
        region: Region,
    ) -> Result<FloatTensor<Self>, CpError> {
        let output = plain::<B>(x.primitive, comm, region)?;
        Ok(
            match RegionBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    RegionState {
                        comm: comm.clone(),
                        region,
                    },
                    output,
                ),
                OpsKind::UnTracked(prep) => prep.finish(output),
            },
        )
    }
}

fn region<B: TpInner, const D: usize>(
    x: Tensor<ContextParallel<B>, D>,
    comm: &Comm,
    region: Region,
) -> Result<Tensor<ContextParallel<B>, D>, CpError> {
    let primitive = x.into_primitive().tensor();
    let output = B::tp_region(primitive, comm, region)?;
    Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
}

/// `f`: identity in forward, all-reduce of the gradient over `comm` (the TP group) in backward.
pub fn tp_copy<B: TpInner, const D: usize>(
    x: Tensor<ContextParallel<B>, D>,
    comm: &Comm,
) -> Result<Tensor<ContextParallel<B>, D>, CpError> {
    region(x, comm, Region::Copy)
}

/// `g`: all-reduce over `comm` (the TP group) in forward, identity in backward.
pub fn tp_reduce<B: TpInner, const D: usize>(
    x: Tensor<ContextParallel<B>, D>,
    comm: &Comm,
) -> Result<Tensor<ContextParallel<B>, D>, CpError> {
    region(x, comm, Region::Reduce)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{InProcessWorld, WorldConfig};
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = ContextParallel<Autodiff<Flex>>;

    /// Two TP ranks, rank r holding weights w_r: y = Σ_r (f(x) · w_r) (a column- then
    /// row-parallel product). dL/dx = Σ_r w_r on every rank (the all-reduce of `f`'s backward),
    /// dL/dw_r = x (the identity of `g`'s backward), and y is the full sum on both ranks.
    #[test]
    fn f_and_g_have_the_megatron_gradients() {
        let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
        let results = world.run(|comm| -> Result<_, CpError> {
            let device = Default::default();
            let r = comm.rank() as f32;
            let x = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &device)
                .require_grad();
            let w = Tensor::<B, 1>::from_data(
                TensorData::new(vec![3.0 + r, 5.0 + 2.0 * r], [2]),
                &device,
            )
            .require_grad();
            let partial = tp_copy(x.clone(), &comm)? * w.clone();
            let y = tp_reduce(partial, &comm)?;
            let grads = y.clone().sum().backward();
            Ok((
                y.into_data().to_vec::<f32>().unwrap(),
                x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
                w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
            ))
        });
        for result in results {
            let (y, dx, dw) = result.unwrap();
            // w_0 = [3, 5], w_1 = [4, 7]: y = x ⊙ (w_0 + w_1) = [7, 24]
            assert_eq!(y, vec![7.0, 24.0]);
            assert_eq!(dx, vec![7.0, 12.0]);
            assert_eq!(dw, vec![1.0, 2.0]);
        }
    }
}
