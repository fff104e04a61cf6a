//! Context-parallel attention for burn.
//!
//! ```text
//! packed micro-batch ──layout──▶ Sharding (which (sequence, position) tokens each rank holds)
//!                    ──strategy─▶ Ulysses / ring / all-gather / USP, forward and backward
//!                    ──kernels──▶ burn-dcp-kernels FlashOps (attention with LSE, merge)
//!                    ──comm─────▶ Communicator (in-process threads; byte counts; timeouts)
//! ```
//!
//! Start with [`strategy::cp_attention_forward`] / [`strategy::cp_attention_backward`], a
//! [`strategy::CpGroup`] built from a [`comm::Comm`], and a [`strategy::CpBatch`] describing the
//! micro-batch ([`layout::Sharding`] and masks). [`volume`] gives the analytic bytes each strategy
//! sends.

pub mod backend;
pub mod comm;
pub mod error;
pub mod harness;
pub mod layout;
pub mod planner;
pub mod shard;
pub mod strategy;
pub mod volume;

pub use burn_dcp_kernels as kernels;
pub use error::CpError;
pub use layout::{Layout, Sharding};
pub use strategy::{
    cp_attention_backward, cp_attention_forward, BackwardInputs, CpBatch, CpGroup, Strategy,
};
