//! [`FlashOps`](crate::ops::FlashOps) for burn's `CubeBackend` (wgpu, CUDA): the flash kernels
//! ([`flash`]: forward with LSE, dq, dk/dv on register fragments, each with a tensor-core body
//! and a plain one), the element-wise delta and merge kernels ([`elementwise`]), launched with
//! the host-built tables of [`crate::tiling`].
//!
//! - **Forward**: FlashAttention-2's loop; each plane (warp) owns 16 query rows, per listed key
//!   tile it computes `S = Q·Kᵀ`, the online softmax step and `O += P·V` in registers; writes
//!   `out` and the f32 LSE.
//! - **Backward**: `delta = rowsum(dout ∘ out)`, then two kernels with no atomics: dq (the
//!   forward's cubes and key tiles) and dk/dv (a plane owns 16 keys; per listed query tile it
//!   recomputes `Sᵀ` and `dPᵀ`; it loops over the query heads of its GQA group). Recomputing
//!   the scores in both kernels costs one extra `q·k` per pair; in exchange the results are
//!   deterministic, there is no float atomic add (not a core WebGPU feature, absent on
//!   lavapipe) and the GQA group reduction stays in registers.
//! - **Merge**: one unit per (head, query); in place in `a`'s buffers when nothing else holds them.
//!
//! Limits (checked, with errors): f32 / f16 / bf16 inputs, head and value dims in `1..=256`,
//! cubes within the device's shared memory. Which bodies run ([`AttentionKernel`],
//! [`KERNEL_ENV`]): tensor cores where the device and the problem allow (f16/bf16 on CUDA
//! sm_80+), else the plain bodies.

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
// The kernels' and the launches' `super::` helpers.
use support::{empty, storage, upload_u32};
