//! What an attention call computes: masks, the packing of tokens into sequences, the problem —
//! and the packed micro-batch those describe.

pub mod batch;
pub mod error;
pub mod mask;
pub mod packing;
pub mod problem;

pub use batch::{MicroBatch, Piece};
pub use error::KernelError;
pub use mask::{mask_of, validate_masks, KeyRanges, MaskSpec};
pub use packing::{validate_cu_seqlens, Segment, TokenPositions};
pub use problem::{
    validate_scale, AttentionShape, BackwardTensors, VarlenAttention, MAX_SOFTMAX_SCALE,
};
