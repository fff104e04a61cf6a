//! Context-parallel attention for burn.
//!
//! ```text
//! packed micro-batch ──placement─▶ which (sequence, position) tokens each rank holds: a static
//!                                  layout, a dynamic-CP group's, or a planner's own; shard.rs cuts
//!                                  a rank's tokens out
//!                    ──strategy─▶ Ulysses / ring / all-gather / USP / DCP, forward and backward
//!                    ──kernels──▶ burn-dcp-kernels FlashOps (attention with LSE, merge)
//!                    ──comm─────▶ Communicator (in-process threads; byte counts; timeouts)
//! ```
//!
//! [`mesh`] arranges a world as TP × CP × DP × PP (Megatron's rank order) with one communicator
//! per axis group.
//!
//! Start with [`strategy::cp_attention_forward`] / [`strategy::cp_attention_backward`], a
//! [`strategy::CpGroup`] built from a [`comm::Comm`], and a [`strategy::CpBatch`] describing the
//! micro-batch ([`placement::Placement`] and masks). With the feature `harness`, `volume` gives
//! the analytic bytes each static strategy sends (the tests check the measured bytes against it).

pub mod backend;
pub mod bytes;
pub mod comm;
pub mod error;
#[cfg(feature = "harness")]
pub mod harness;
pub mod layout;
pub mod mesh;
pub mod placement;
pub mod planner;
pub mod shard;
pub mod strategy;
#[cfg(feature = "harness")]
pub mod volume;

pub use burn_dcp_kernels as kernels;
pub use error::CpError;
pub use layout::Layout;
pub use mesh::{Axis, Mesh, MeshShape};
pub use placement::{Placement, PlacementKind};
pub use strategy::{
    cp_attention_backward, cp_attention_forward, BackwardInputs, CpBatch, CpGroup, Strategy,
};
