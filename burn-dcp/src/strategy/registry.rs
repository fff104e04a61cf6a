//! The registry: which implementation a [`Strategy`] runs (one line per strategy in
//! [`with_strategy`]), and everything that takes a strategy by value — a call of the group's
//! strategy ([`cp_attention_forward`], [`cp_attention_backward`]), its plan
//! ([`crate::planner::plan_strategy`]) and its bytes
//! ([`crate::diagnostics::volume::analytic_volume`]) go through it.

use burn::prelude::Tensor;
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput};

use super::dispatch::{cp_attention_backward_with, cp_attention_forward_with};
use super::{
    all_gather, dcp, ring, ulysses, usp, AttentionStrategy, BackwardInputs, CpBatch, CpCall,
    CpGroup, Qkv, Strategy,
};
use crate::error::CpError;

/// Context-parallel attention forward on this rank's shard: `q [T, H, D]`, `k`/`v [T, K, D]`
/// (this rank's tokens in [`Placement`](crate::batch::placement::Placement) order) → `out [T, H, Dv]`, `lse [H, T]`.
///
/// A collective call: every rank of the group calls it with the same configuration. The ranks
/// first agree on the configuration (see `agreement`): invalid inputs on any rank, or ranks that
/// disagree, fail on every rank before data moves. A failure after that marks this rank failed
/// (`Communicator::abort`) so that its peers fail at once, naming it.
pub fn cp_attention_forward<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> Result<FlashOutput<B>, CpError> {
    let call = CpCall { group, batch };
    with_strategy(
        group.strategy,
        Forward {
            call,
            qkv: [q, k, v],
        },
    )
}

/// Context-parallel attention backward on this rank's shard (see [`BackwardInputs`]); a
/// collective call like [`cp_attention_forward`].
pub fn cp_attention_backward<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    inputs: BackwardInputs<B>,
) -> Result<FlashGradients<B>, CpError> {
    let call = CpCall { group, batch };
    with_strategy(group.strategy, Backward { call, inputs })
}

/// What a call does with a strategy's implementation (see [`with_strategy`]).
pub trait WithStrategy {
    type Output;
    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output;
}

/// Applies `op` to the implementation of `strategy`: the registry, one line per strategy.
pub fn with_strategy<Op: WithStrategy>(strategy: Strategy, op: Op) -> Op::Output {
    match strategy {
        Strategy::Ulysses => op.apply(&ulysses::Ulysses),
        Strategy::Ring => op.apply(&ring::Ring),
        Strategy::AllGather => op.apply(&all_gather::AllGatherKv),
        Strategy::Usp {
            ulysses_degree,
            ring_degree,
        } => op.apply(&usp::Usp {
            ulysses_degree,
            ring_degree,
        }),
        Strategy::Dcp => op.apply(&dcp::Dcp),
    }
}

/// A forward call.
struct Forward<'a, B: FlashOps> {
    call: CpCall<'a>,
    qkv: Qkv<B>,
}

impl<B: FlashOps> WithStrategy for Forward<'_, B> {
    type Output = Result<FlashOutput<B>, CpError>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        let [q, k, v] = self.qkv;
        cp_attention_forward_with(strategy, self.call.group, self.call.batch, q, k, v)
    }
}

/// A backward call.
struct Backward<'a, B: FlashOps> {
    call: CpCall<'a>,
    inputs: BackwardInputs<B>,
}

impl<B: FlashOps> WithStrategy for Backward<'_, B> {
    type Output = Result<FlashGradients<B>, CpError>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        cp_attention_backward_with(strategy, self.call.group, self.call.batch, self.inputs)
    }
}
