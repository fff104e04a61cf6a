//! Context-parallel attention for burn: a sequence too long for one device is split across the
//! ranks of a CP group, and attention — the one op that needs the whole sequence — communicates.
//!
//! # Start here
//!
//! - [`ContextParallel`]: a backend decorator. Use `ContextParallel<Autodiff<B>>` as your
//!   model's backend; every op forwards to `B`, and burn's `attention` op runs context-parallel
//!   while a CP context is set ([`set_context`]; [`CpContextGuard::finish`] checks the model's
//!   attention really went through the op). Batches of several rows ([`BatchRows`]) and
//!   grouped-query K/V (fewer heads than Q) are accepted.
//! - [`nn`]: drop-ins for burn-nn 0.21's `MultiHeadAttention`, `TransformerEncoder`,
//!   `RotaryEncoding` and `PositionalEncoding` (same API and record layout). burn-nn's own
//!   attention modules compute attention without the op, and its position modules use local
//!   positions: both are wrong under CP.
//!
//! ```
//! use burn::backend::{Autodiff, Flex};
//! use burn::prelude::*;
//! use burn_dcp::comm::{InProcessWorld, WorldConfig};
//! use burn_dcp::kernels::MaskSpec;
//! use burn_dcp::nn::{MhaInput, MultiHeadAttentionConfig};
//! use burn_dcp::{set_context, ContextParallel, CpBatch, CpContext, CpGroup, Layout, Placement, Strategy};
//!
//! type B = ContextParallel<Autodiff<Flex>>;
//!
//! let world = InProcessWorld::new(2, WorldConfig::default())?;
//! for rank in world.run(|comm| -> Result<usize, burn_dcp::CpError> {
//!     let device = Default::default();
//!     let mha = MultiHeadAttentionConfig::new(16, 4).with_dropout(0.0).init::<B>(&device);
//!     // One packed row of two sequences (9 and 5 tokens), zigzag over the 2 ranks.
//!     let batch = CpBatch::new(Placement::of_layout(&[9, 5], 2, Layout::Zigzag)?, vec![MaskSpec::Causal]);
//!     let tokens = batch.placement.tokens(comm.rank());
//!     let x = Tensor::<B, 3>::ones([1, tokens, 16], &device);
//!     let context = set_context(CpContext { group: CpGroup::new(comm, Strategy::Ring)?, batch });
//!     let out = mha.forward(MhaInput::self_attn(x).causal());
//!     assert_eq!(out.context.dims(), [1, tokens, 16]);
//!     context.finish() // Ok(1): one attention call ran context-parallel
//! }) {
//!     assert_eq!(rank?, 1);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Underneath
//!
//! ```text
//! packed micro-batch ──placement─▶ which (sequence, position) tokens each rank holds: a static
//!                                  layout, a dynamic-CP group's, or a planner's own; shard.rs cuts
//!                                  a rank's tokens out (rows.rs: the rows of [B, S] batches)
//!                    ──strategy─▶ Ulysses / ring / all-gather / USP / DCP, forward and backward
//!                    ──kernels──▶ burn-dcp-kernels FlashOps (attention with LSE, merge)
//!                    ──comm─────▶ Communicator (in-process threads, TCP, MPI, NCCL; byte counts;
//!                                  timeouts)
//! ```
//!
//! [`mesh`] arranges a world as TP × CP × DP × PP (Megatron's rank order) with one communicator
//! per axis group. Below the op: [`strategy::cp_attention_forward`] /
//! [`strategy::cp_attention_backward`] on token-major tensors, a [`strategy::CpGroup`] built
//! from a [`comm::Comm`], and a [`strategy::CpBatch`] describing the micro-batch
//! ([`placement::Placement`] and masks). [`planner`] plans dynamic CP groups and DCP block
//! placements. With the feature `harness`, `volume` gives the analytic bytes each static
//! strategy sends (the tests check the measured bytes against it).

pub mod backend;
pub mod bytes;
pub mod comm;
pub mod error;
#[cfg(feature = "harness")]
pub mod harness;
pub mod layout;
pub mod mesh;
pub mod nn;
pub mod nodes;
pub mod placement;
pub mod planner;
pub mod rows;
pub mod shard;
pub mod strategy;
pub mod tensor_parallel;
pub mod trace;
#[cfg(feature = "harness")]
pub mod volume;

pub use backend::{set_context, ContextParallel, CpContext, CpContextGuard};
pub use burn_dcp_kernels as kernels;
/// The head split and its rules (query and kv heads, shares over TP ranks, Ulysses, head units).
pub use burn_dcp_kernels::heads;
pub use error::CpError;
pub use layout::Layout;
pub use mesh::{Axis, Mesh, MeshShape};
pub use placement::{Placement, PlacementKind};
pub use rows::{BatchRows, LocalRows};
pub use strategy::{
    cp_attention_backward, cp_attention_forward, BackwardInputs, CpBatch, CpGroup, Strategy,
    StrategyKind,
};
