//! Context-parallel attention strategies: how ranks holding shards of a packed micro-batch
//! cooperate to compute exact attention (forward and backward).
//!
//! | strategy   | file            | communication |
//! |------------|-----------------|---------------|
//! | Ulysses    | `ulysses.rs`    | all-to-all sequence ↔ heads |
//! | ring       | `ring.rs`       | P−1 point-to-point KV passes, merged with LSE |
//! | all-gather | `all_gather.rs` | all-gather KV, reduce-scatter dK/dV |
//! | USP        | `usp.rs`        | Ulysses inside, ring outside (2D mesh) |
//! | DCP        | `dcp.rs`, `block_plan.rs` | a planner's block plan: each block once to each rank that needs it, results home |
//!
//! Every strategy works with every [`Placement`](crate::batch::placement::Placement) — a static layout's or a planner's: tokens are
//! described by (sequence, position) segments, so the kernels apply masks on global positions
//! whatever the placement. The placement decides balance (zigzag balances causal work), not
//! correctness.
//!
//! `kind.rs` ([`StrategyKind`]: every strategy's name, parsed and printed there only), `spec.rs`
//! (the [`Strategy`] and its [`CpGroup`]), `batch.rs` ([`CpBatch`], [`BackwardInputs`]) and
//! `dispatch.rs` are the base every strategy file builds on. `dispatch.rs` holds the
//! [`AttentionStrategy`] trait — a strategy whole: name, plan, closed-form bytes, call rules,
//! forward and backward — which every strategy file implements (DCP's too), [`with_strategy`],
//! the registry (one line per [`Strategy`]), and the entry points [`cp_attention_forward`] /
//! [`cp_attention_backward`] (the group's strategy) and [`cp_attention_forward_with`] /
//! [`cp_attention_backward_with`] / [`plan_with`] (any implementation, one written outside this
//! crate too).

pub(crate) mod agreement;
pub mod all_gather;
mod batch;
pub mod block_plan;
pub mod dcp;
mod dispatch;
pub mod exchange;
mod kind;
pub mod registry;
pub mod ring;
mod spec;
pub mod ulysses;
pub mod usp;

pub use batch::{BackwardInputs, CpBatch};
pub use dispatch::{
    cp_attention_backward_with, cp_attention_forward_with, plan_with, AttentionStrategy, CpCall,
    Qkv,
};
pub use kind::StrategyKind;
pub use registry::{cp_attention_backward, cp_attention_forward, with_strategy, WithStrategy};
pub use spec::{CpGroup, Strategy};
