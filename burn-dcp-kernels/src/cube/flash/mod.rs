//! FlashAttention-2-class kernels: forward with LSE, dq, dk/dv on `m16n8k16` register fragments.
//!
//! Each plane (warp) owns 16 rows; its operands and accumulators stay in registers across the
//! loop over the other side's tiles (`S = Q·Kᵀ`, the online softmax, `O += P·V`; the backward's
//! `dP`, `dS` and gradients likewise), which are staged in shared memory — double-buffered
//! `cp.async` copies on CUDA — and read with `ldmatrix`. Only the tiles the mask leaves anything
//! in are visited, and only the partial ones are masked ([`crate::tiling::TileRuns`]). The
//! pieces are in [`fragment`] (loads, product, row reductions), [`tile`] (a tile's products and
//! masks) and [`stage`] (copies, spans,
//! tile cursor); [`forward`] and [`backward`] compose them. Each piece has a tensor-core body
//! and a plain one that runs on any device, so CI runs these kernels on lavapipe; see
//! `docs/flash-kernels.md` for the layouts, the choices and what has run where.

pub mod backward;
mod dkdv;
mod dq;
pub mod forward;
pub mod fragment;
mod launch;
mod plan;
mod quad;
pub mod stage;
pub mod tile;

pub use launch::{backward_flash, forward_flash};
pub use plan::{flash_fits, FlashBody, FlashConfig, FlashPlan, Planes, FLASH_MAX_DIM, PLANES_ENV};
pub use quad::plain_body;

use cubecl::prelude::*;

/// The kernels' fast-math flags: on CUDA `exp`, `ln` and divisions compile to `__expf`,
/// `__logf` and `__fdividef` (a few ulp; the hardware instructions keep NaN and infinity)
/// instead of the exact library calls. cubecl uses these flags for that choice only; other
/// devices ignore them.
pub fn fast_exp() -> cubecl::ir::features::EnumSet<FastMath> {
    FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
}
