//! [`FlashOps`](crate::ops::FlashOps) for burn's `CubeBackend` (wgpu, CUDA): the flash kernels
//! ([`flash`]: forward with LSE, dq, dk/dv), launched with the host-built tables of
//! [`crate::tiling`], and the element-wise kernels beside them (`elementwise.rs`: the
//! backward's `delta = rowsum(dout ∘ out)`, the merge of two partial results, one unit per
//! (head, query), in place in `a`'s buffers when nothing else holds them).
//!
//! Limits (checked, with errors): f32 / f16 / bf16 inputs, head and value dims in `1..=256`.
//!
//! Which body runs ([`AttentionKernel`], [`KERNEL_ENV`]): tensor cores where the device and the
//! problem allow (f16/bf16 on CUDA sm_80+), else plain units — by plane shuffles where the
//! device's planes shuffle ([`flash::plain_body`]), else through shared memory.

mod choice;
mod elementwise;
pub mod flash;
mod flash_ops;
mod launch;
mod support;

pub use choice::{AttentionKernel, KERNEL_ENV};
pub(crate) use launch::Gradients;
pub use launch::{backward, backward_with, forward, forward_with, merge};
pub use support::{LIMITS, MAX_HEAD_DIM};
// burn-fusion's backends convert their tensors as the plain backends do.
pub(crate) use support::{gradients, output, primitive, tensor};
// The kernels' and the launches' `super::` helpers.
use support::{empty, storage, upload_u32};
