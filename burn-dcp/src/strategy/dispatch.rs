//! The entry points: validate a call on every rank, agree on it, run the group's strategy, and
//! make a failure fail the peers at once.

use burn::prelude::Tensor;
use burn_dcp_kernels::{AttentionShape, FlashGradients, FlashOps, FlashOutput};

use super::agreement::{self, CallConfig};
use super::{all_gather, dcp, ring, ulysses, usp, BackwardInputs, CpBatch, CpGroup, Strategy};
use crate::error::CpError;

/// One call of a CP attention strategy: the group it runs on and the batch it computes.
#[derive(Clone, Copy, Debug)]
pub struct CpCall<'a> {
    pub group: &'a CpGroup,
    pub batch: &'a CpBatch,
}

/// `q`, `k` and `v` of this rank's tokens: `[T, H, D]`, `[T, K, D]`, `[T, K, Dv]`.
pub type Qkv<B> = [Tensor<B, 3>; 3];

/// A CP attention algorithm: the rules of a call it adds to every strategy's (its own file's),
/// and forward and backward over this rank's shard. [`with_strategy`] is where a [`Strategy`]
/// finds its implementation.
pub trait AttentionStrategy {
    /// Checks a call beyond the rules every strategy shares (the group, placement, heads, masks
    /// and dtypes); run on every rank before the ranks agree, so an error fails them all.
    fn validate_call(&self, _batch: &CpBatch, _shape: AttentionShape) -> Result<(), CpError> {
        Ok(())
    }

    fn forward<B: FlashOps>(
        &self,
        call: CpCall<'_>,
        qkv: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError>;

    fn backward<B: FlashOps>(
        &self,
        call: CpCall<'_>,
        inputs: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError>;
}

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
    let local = validate_inputs(group, batch, &q, &k, &v);
    let dims = [q.dims(), k.dims(), v.dims()];
    let config = CallConfig::new("forward", group, batch, dims, q.dtype());
    agreement::agree(group, &config, local)?;
    let call = CpCall { group, batch };
    let result = with_strategy(
        group.strategy,
        Forward {
            call,
            qkv: [q, k, v],
        },
    );
    fail_fast(group, result)
}

/// Context-parallel attention backward on this rank's shard (see [`BackwardInputs`]); a
/// collective call like [`cp_attention_forward`].
pub fn cp_attention_backward<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    inputs: BackwardInputs<B>,
) -> Result<FlashGradients<B>, CpError> {
    let local = validate_backward_inputs(group, batch, &inputs);
    let dims = [inputs.q.dims(), inputs.k.dims(), inputs.v.dims()];
    let config = CallConfig::new("backward", group, batch, dims, inputs.q.dtype());
    agreement::agree(group, &config, local)?;
    let call = CpCall { group, batch };
    let result = with_strategy(group.strategy, Backward { call, inputs });
    fail_fast(group, result)
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
        Strategy::Usp { .. } => op.apply(&usp::Usp),
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
        strategy.forward(self.call, self.qkv)
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
        strategy.backward(self.call, self.inputs)
    }
}

/// A strategy's own rules of a call ([`AttentionStrategy::validate_call`]).
struct ValidateCall<'a> {
    batch: &'a CpBatch,
    shape: AttentionShape,
}

impl WithStrategy for ValidateCall<'_> {
    type Output = Result<(), CpError>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        strategy.validate_call(self.batch, self.shape)
    }
}

/// Once data moves, an error leaves peers mid-protocol: mark this rank failed (with the error as
/// the reason) so they fail at once, naming it, instead of at the timeout. An error that only
/// reports another rank's failure changes nothing (the root cause is already recorded).
fn fail_fast<T>(group: &CpGroup, result: Result<T, CpError>) -> Result<T, CpError> {
    if let Err(error) = &result {
        if !matches!(error, CpError::Comm(comm) if comm.is_peer_failure()) {
            group.comm.abort(&error.to_string());
        }
    }
    result
}

fn validate_backward_inputs<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    inputs: &BackwardInputs<B>,
) -> Result<(), CpError> {
    validate_inputs(group, batch, &inputs.q, &inputs.k, &inputs.v)?;
    let tokens = inputs.q.dims()[0];
    let [heads, value_dim] = [inputs.q.dims()[1], inputs.v.dims()[2]];
    let expected = [tokens, heads, value_dim];
    if inputs.out.dims() != expected
        || inputs.dout.dims() != expected
        || inputs.lse.dims() != [heads, tokens]
    {
        return Err(CpError::Input(format!(
            "out {:?}, dout {:?} and lse {:?} must be {expected:?}, {expected:?} and {:?}",
            inputs.out.dims(),
            inputs.dout.dims(),
            inputs.lse.dims(),
            [heads, tokens]
        )));
    }
    Ok(())
}

fn validate_inputs<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    q: &Tensor<B, 3>,
    k: &Tensor<B, 3>,
    v: &Tensor<B, 3>,
) -> Result<(), CpError> {
    let cp = group.cp();
    if batch.placement.cp() != cp {
        return Err(CpError::Config(format!(
            "the micro-batch is sharded over {} ranks but the CP group has {cp}",
            batch.placement.cp()
        )));
    }
    group.strategy.validate_mesh(cp)?;
    let shape = burn_dcp_kernels::AttentionShape::from_dims(&q.dims(), &k.dims(), &v.dims())?;
    group
        .strategy
        .validate_heads(shape.heads, shape.kv_heads, cp)?;
    burn_dcp_kernels::ops::common_float_dtype(&[
        ("q", q.dtype()),
        ("k", k.dtype()),
        ("v", v.dtype()),
    ])?;
    let rank = group.comm.rank();
    let expected = batch.placement.tokens(rank);
    if shape.q_tokens != expected || shape.kv_tokens != expected {
        return Err(CpError::Input(format!(
            "rank {rank} holds {expected} tokens under the {}, but q has {} and k/v have {} tokens",
            batch.placement.kind, shape.q_tokens, shape.kv_tokens
        )));
    }
    burn_dcp_kernels::validate_masks(&batch.masks, &batch.placement.seq_lens)?;
    with_strategy(group.strategy, ValidateCall { batch, shape })?;
    if let Some(scale) = batch.scale {
        burn_dcp_kernels::validate_scale(scale)?;
    }
    Ok(())
}
