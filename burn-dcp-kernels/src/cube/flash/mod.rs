//! FlashAttention-2-class kernels: forward with LSE, dq, dk/dv on `m16n8k16` register fragments.
//!
//! Each plane (warp) owns 16 rows; its operands and accumulators stay in registers across the
//! loop over the other side's tiles (`S = Q·Kᵀ`, the online softmax, `O += P·V`; the backward's
//! `dP`, `dS` and gradients likewise), which are staged in shared memory — double-buffered
//! `cp.async` copies on CUDA — and read with `ldmatrix`. Only the tiles the mask leaves anything
//! in are visited, and only the partial ones are masked ([`crate::tiling::TileRuns`]). The
//! pieces are in [`fragment`] (loads, product, row reductions) and [`stage`] (copies, spans,
//! tile cursor); [`forward`] and [`backward`] compose them. Each piece has a tensor-core body
//! and a plain one that runs on any device, so CI runs these kernels on lavapipe; see
//! `docs/flash-kernels.md` for the layouts, the choices and what has run where.

pub mod backward;
mod dkdv;
mod dq;
pub mod forward;
pub mod fragment;
mod launch;
pub mod stage;

pub use launch::{
    backward_flash, flash_fits, forward_flash, FlashPlan, Planes, FLASH_MAX_DIM, PLANES_ENV,
};

use cubecl::prelude::*;

/// The kernels' fast-math flags: on CUDA `exp`, `ln` and divisions compile to `__expf`,
/// `__logf` and `__fdividef` (a few ulp; the hardware instructions keep NaN and infinity)
/// instead of the exact library calls. cubecl uses these flags for that choice only; other
/// devices ignore them.
pub fn fast_exp() -> cubecl::ir::features::EnumSet<FastMath> {
    FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
}

/// The comptime shape of one launch.
#[derive(CubeType, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashConfig {
    /// Head dim of q and k, a multiple of 16.
    pub head_dim: usize,
    /// Head dim of v, a multiple of 16.
    pub value_dim: usize,
    /// Planes (warps of 32 units) per cube, each owning `16 · row_tiles` rows.
    pub planes: usize,
    /// Row tiles of 16 per plane (forward: 1 or 2; the backward kernels: 1). Two halve the
    /// shared-memory reads per product (each K and V fragment serves both) at the price of
    /// reading Q from shared memory per tile.
    pub row_tiles: usize,
    /// Query heads of one kv head per cube (forward and dq): the planes split over them, and
    /// the cube's key and value tiles serve all of them.
    pub heads_per_cube: usize,
    /// Rows of the other side per staged tile (keys, or queries in the dk/dv kernel): a
    /// multiple of 16.
    pub block: usize,
    /// Span slots per query of the launch tables.
    pub max_spans: usize,
    /// `ldmatrix` and `mma.sync` (CUDA, sm_80+), or the plain bodies.
    pub tensor_cores: bool,
    /// Double-buffered `cp.async` copies (CUDA, sm_80+), or plain loads.
    pub async_copy: bool,
    /// Row reductions by plane shuffles, or through shared memory.
    pub shuffles: bool,
}

impl FlashConfig {
    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes
    }

    /// Tokens per cube on the 16-row side (each of its `heads_per_cube` heads has them all).
    pub fn tokens_per_cube(&self) -> usize {
        16 * self.row_tiles * self.planes / self.heads_per_cube
    }

    /// Buffers per staged tile: two when copies overlap the products.
    pub fn buffers(&self) -> usize {
        if self.async_copy {
            2
        } else {
            1
        }
    }
}
