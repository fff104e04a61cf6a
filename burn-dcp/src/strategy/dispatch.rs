//! The entry points: validate a call on every rank, agree on it, run the group's strategy, and
//! make a failure fail the peers at once.

use burn::prelude::Tensor;
use burn_dcp_kernels::{AttentionShape, FlashGradients, FlashOps, FlashOutput};

use super::agreement::{self, CallConfig};
use super::{BackwardInputs, CpBatch, CpGroup};
use crate::batch::placement::Placement;
use crate::error::CpError;
use crate::planner::bytes::{RankVolume, VolumeShape};
use crate::planner::{PlanInput, RoutedPlan};

/// One call of a CP attention strategy: the group it runs on and the batch it computes.
#[derive(Clone, Copy, Debug)]
pub struct CpCall<'a> {
    pub group: &'a CpGroup,
    pub batch: &'a CpBatch,
}

/// `q`, `k` and `v` of this rank's tokens: `[T, H, D]`, `[T, K, D]`, `[T, K, Dv]`.
pub type Qkv<B> = [Tensor<B, 3>; 3];

/// A CP attention algorithm, whole: its name, its planning — the block plan of a micro-batch as it
/// runs (where every tile is computed and what moves between which ranks, which the cost model
/// prices), its bytes per rank in closed form — and its execution, forward and backward over this
/// rank's shard, with the rules a call must meet beyond every strategy's.
///
/// The built-in strategies implement it in their own files ([`ring::Ring`](super::ring::Ring), [`ulysses::Ulysses`](super::ulysses::Ulysses),
/// [`usp::Usp`](super::usp::Usp), [`all_gather::AllGatherKv`](super::all_gather::AllGatherKv), [`dcp::Dcp`](super::dcp::Dcp)); [`with_strategy`](super::with_strategy) is the registry
/// that finds a [`Strategy`](super::Strategy)'s implementation, one line per strategy. A strategy of your own needs
/// no registry line: [`cp_attention_forward_with`], [`cp_attention_backward_with`] and
/// [`plan_with`] run and plan any implementation (the crate's `tests/custom_strategy.rs` defines
/// one in a test).
pub trait AttentionStrategy {
    /// The name in messages and in the ranks' agreement on a call (`ring`, `usp(2x2)`, …: a
    /// [`Strategy`](super::Strategy)'s `Display`).
    fn name(&self) -> String;

    /// The block plan of `input` as this strategy runs it (tokens in the zigzag layout), with its
    /// transfers: the planner's and the cost model's view ([`crate::planner::evaluate`]).
    /// `input` has been validated ([`plan_with`] does).
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError>;

    /// The bytes each rank of `placement` sends in forward and backward, in closed form
    /// ([`crate::diagnostics::volume`]'s byte model). Empty when the strategy moves what a plan
    /// says rather than what a formula does (DCP: its schedule predicts its bytes).
    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume>;

    /// Checks a call beyond the rules every strategy shares (the group, placement, masks and
    /// dtypes); run on every rank before the ranks agree, so an error fails them all.
    fn validate_call(&self, _call: CpCall<'_>, _shape: AttentionShape) -> Result<(), CpError> {
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

/// [`cp_attention_forward`](super::cp_attention_forward) with `strategy` instead of the group's own: the same checks,
/// agreement and failure handling around any [`AttentionStrategy`]. The group's
/// [`Strategy`](super::Strategy) still sets its mesh (USP's sub-groups).
pub fn cp_attention_forward_with<B: FlashOps, S: AttentionStrategy + ?Sized>(
    strategy: &S,
    group: &CpGroup,
    batch: &CpBatch,
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> Result<FlashOutput<B>, CpError> {
    let call = CpCall { group, batch };
    let local = validate_inputs(strategy, call, &q, &k, &v);
    let dims = [q.dims(), k.dims(), v.dims()];
    let config = CallConfig::new("forward", &strategy.name(), group, batch, dims, q.dtype());
    agreement::agree(group, &config, local)?;
    let result = strategy.forward(call, [q, k, v]);
    fail_fast(group, result)
}

/// [`cp_attention_backward`](super::cp_attention_backward) with `strategy` instead of the group's own (see
/// [`cp_attention_forward_with`]).
pub fn cp_attention_backward_with<B: FlashOps, S: AttentionStrategy + ?Sized>(
    strategy: &S,
    group: &CpGroup,
    batch: &CpBatch,
    inputs: BackwardInputs<B>,
) -> Result<FlashGradients<B>, CpError> {
    let call = CpCall { group, batch };
    let local = validate_backward_inputs(strategy, call, &inputs);
    let dims = [inputs.q.dims(), inputs.k.dims(), inputs.v.dims()];
    let config = CallConfig::new(
        "backward",
        &strategy.name(),
        group,
        batch,
        dims,
        inputs.q.dtype(),
    );
    agreement::agree(group, &config, local)?;
    let result = strategy.backward(call, inputs);
    fail_fast(group, result)
}

/// `strategy`'s block plan of `input`, after checking `input`.
pub fn plan_with<S: AttentionStrategy + ?Sized>(
    strategy: &S,
    input: &PlanInput,
) -> Result<RoutedPlan, CpError> {
    input.validate()?;
    strategy.plan(input)
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

fn validate_backward_inputs<B: FlashOps, S: AttentionStrategy + ?Sized>(
    strategy: &S,
    call: CpCall<'_>,
    inputs: &BackwardInputs<B>,
) -> Result<(), CpError> {
    validate_inputs(strategy, call, &inputs.q, &inputs.k, &inputs.v)?;
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

fn validate_inputs<B: FlashOps, S: AttentionStrategy + ?Sized>(
    strategy: &S,
    call: CpCall<'_>,
    q: &Tensor<B, 3>,
    k: &Tensor<B, 3>,
    v: &Tensor<B, 3>,
) -> Result<(), CpError> {
    let CpCall { group, batch } = call;
    let cp = group.cp();
    if batch.placement.cp() != cp {
        return Err(CpError::Config(format!(
            "the micro-batch is sharded over {} ranks but the CP group has {cp}",
            batch.placement.cp()
        )));
    }
    group.strategy.validate_mesh(cp)?;
    let shape = burn_dcp_kernels::AttentionShape::from_dims(&q.dims(), &k.dims(), &v.dims())?;
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
    strategy.validate_call(call, shape)?;
    if let Some(scale) = batch.scale {
        burn_dcp_kernels::validate_scale(scale)?;
    }
    Ok(())
}
