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
//! ```

pub mod definition;
pub mod ops;
pub mod portable;
pub mod reference;
mod spans;
pub mod tiling;

#[cfg(feature = "cube")]
pub mod cube;

pub use definition::{
    mask_of, validate_cu_seqlens, validate_masks, validate_scale, AttentionShape, KernelError,
    KeyRanges, MaskSpec, MicroBatch, Piece, Segment, TokenPositions, VarlenAttention,
    MAX_SOFTMAX_SCALE,
};
pub use ops::{FlashGradients, FlashOps, FlashOutput};
