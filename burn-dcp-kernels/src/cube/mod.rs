//! [`FlashOps`](crate::ops::FlashOps) for burn's `CubeBackend` (wgpu, CUDA): the tiled `#[cube]` kernels of
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
//! - **Merge** (and the backward's delta: `elementwise.rs`): one unit per (head, query); in place
//!   in `a`'s buffers when nothing else holds them.
//!
//! Limits (checked, with errors): f32 / f16 / bf16 inputs, head and value dims in `1..=256`.
//!
//! Which kernels run ([`AttentionKernel`], [`KERNEL_ENV`]): the flash kernels ([`flash`]) on
//! tensor cores where the device and the problem allow (f16/bf16 on CUDA sm_80+), else these
//! vector kernels; why they are shaped so (lavapipe's loads and loop cap): [`kernels`].

mod choice;
mod elementwise;
pub mod flash;
mod flash_ops;
pub mod kernels;
mod launch;
mod support;

pub use choice::{AttentionKernel, KERNEL_ENV};
pub(crate) use launch::Gradients;
pub use launch::{backward, backward_with, forward, forward_with, merge};
pub use support::{LIMITS, MAX_HEAD_DIM};
// The kernels' and the launches' `super::` helpers.
use support::{empty, storage, upload_u32};
