//! Attention kernels for context parallelism: forward with log-sum-exp, backward from
//! `(out, lse)`, and the merge of partial results, over packed variable-length sequences with
//! global query/key positions, grouped-query attention and the mask family of [`MaskSpec`].
//!
//! ```text
//! definition  problem (VarlenAttention), packing (Segment), masks (MaskSpec), errors, and the
//!             packed micro-batch (MicroBatch) shared by the datasets and the CP library
//! ops         FlashOps: the backend extension trait every CP strategy calls
//! portable    host implementation (CPU backends, e.g. burn Flex)
//! reference   naive dense f64 oracle for tests
//! tiling      host-built launch tables of the tiled kernels (spans, non-empty tile lists)
//! cube        cubecl kernels for burn's CubeBackend (wgpu, CUDA), feature `cube`
//! fusion      the same on burn-fusion's Fusion<B> (burn's default Wgpu / Cuda), feature `fusion`
//! ```

pub mod definition;
pub mod heads;
pub mod memory;
pub mod ops;
pub mod portable;
pub mod reference;
mod spans;
pub mod tiling;

#[cfg(feature = "cube")]
pub mod cube;
#[cfg(feature = "fusion")]
pub mod fusion;

pub use definition::{
    mask_of, validate_cu_seqlens, validate_masks, validate_scale, AttentionShape, BackwardTensors,
    KernelError, KeyRanges, MaskSpec, MicroBatch, Piece, Segment, TokenPositions, VarlenAttention,
    MAX_SOFTMAX_SCALE,
};
pub use ops::{
    check_backward, check_forward, check_merge, filled, DeviceMemory, FlashBackward,
    FlashGradients, FlashOps, FlashOutput, KernelLimits, Operand,
};

/// burn's GPU backends spelled out, whichever of them burn's own `fusion` feature makes
/// `burn::backend::Wgpu` / `burn::backend::Cuda` (with burn's default features: the fusion ones).
#[cfg(feature = "fusion")]
pub mod backends {
    /// wgpu without fusion: each op runs as it is called.
    #[cfg(feature = "wgpu")]
    pub type WgpuPlain = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    /// wgpu with burn-fusion (burn's default `Wgpu`).
    #[cfg(feature = "wgpu")]
    pub type WgpuFusion = burn_fusion::Fusion<WgpuPlain>;
    /// CUDA without fusion.
    #[cfg(feature = "cuda")]
    pub type CudaPlain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    /// CUDA with burn-fusion (burn's default `Cuda`).
    #[cfg(feature = "cuda")]
    pub type CudaFusion = burn_fusion::Fusion<CudaPlain>;
}
