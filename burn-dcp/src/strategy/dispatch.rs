//! The entry points: validate a call on every rank, agree on it, run the group's strategy, and
//! make a failure fail the peers at once.

use burn::prelude::Tensor;
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput};

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

/// A CP attention algorithm: forward and backward over this rank's shard.
pub trait AttentionStrategy {
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
    let result = match group.strategy {
        Strategy::Ulysses => ulysses::Ulysses.forward(call, [q, k, v]),
        Strategy::Ring => ring::Ring.forward(call, [q, k, v]),
        Strategy::AllGather => all_gather::AllGatherKv.forward(call, [q, k, v]),
        Strategy::Usp { .. } => usp::Usp.forward(call, [q, k, v]),
        Strategy::Dcp => batch
            .schedule()
            .and_then(|plan| dcp::forward(&group.comm, batch, plan, q, k, v)),
    };
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
    let result = match group.strategy {
        Strategy::Ulysses => ulysses::Ulysses.backward(call, inputs),
        Strategy::Ring => ring::Ring.backward(call, inputs),
        Strategy::AllGather => all_gather::AllGatherKv.backward(call, inputs),
        Strategy::Usp { .. } => usp::Usp.backward(call, inputs),
        Strategy::Dcp => batch
            .schedule()
            .and_then(|plan| dcp::backward(&group.comm, batch, plan, inputs)),
    };
    fail_fast(group, result)
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
    if group.strategy == Strategy::Dcp {
        validate_blocks(batch, shape)?;
    }
    if let Some(scale) = batch.scale {
        burn_dcp_kernels::validate_scale(scale)?;
    }
    Ok(())
}

/// Strategy dcp: the block plan covers this group and places the tokens as the batch says.
fn validate_blocks(
    batch: &CpBatch,
    shape: burn_dcp_kernels::AttentionShape,
) -> Result<(), CpError> {
    let schedule = batch.schedule()?;
    if schedule.placement() != &*batch.placement {
        return Err(CpError::Config(format!(
            "the block plan places the tokens differently from the micro-batch's {}",
            batch.placement
        )));
    }
    if shape.value_dim != shape.head_dim {
        return Err(CpError::Config(format!(
            "strategy dcp needs value dim {} = head dim {} (its byte model has one dim)",
            shape.value_dim, shape.head_dim
        )));
    }
    Ok(())
}
