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
//! ([`batch`]: the [`Placement`] of its tokens, its rows, and the masks). [`planner`] plans
//! dynamic CP groups and DCP block placements. [`diagnostics`]: traces, and with the feature
//! `harness` the end-to-end runs against one device and the analytic bytes of each static
//! strategy (the tests check the measured bytes against them).
//!
//! The folders, bottom up: `comm` (communicators, and which node each rank is on), `batch` (the
//! micro-batch's vocabulary), `strategy` and `planner` (executing and planning CP attention; the
//! byte model in `planner::bytes`), `backend` (the decorator), `mesh` (the parallelism axes and
//! TP's ops), `nn` (the drop-ins), `diagnostics`.

pub mod backend;
pub mod batch;
pub mod comm;
pub mod diagnostics;
pub mod error;
pub mod mesh;
pub mod nn;
pub mod planner;
pub mod strategy;
mod tensors;

pub use backend::{set_context, ContextParallel, CpContext, CpContextGuard};
pub use batch::layout::Layout;
pub use batch::placement::{Placement, PlacementKind};
pub use batch::rows::{BatchRows, LocalRows};
pub use burn_dcp_kernels as kernels;
/// The head split and its rules (query and kv heads, shares over TP ranks, Ulysses, head units).
pub use burn_dcp_kernels::heads;
pub use error::CpError;
pub use mesh::{Axis, Mesh, MeshShape};
pub use strategy::{
    cp_attention_backward, cp_attention_forward, BackwardInputs, CpBatch, CpGroup, Strategy,
    StrategyKind,
};
