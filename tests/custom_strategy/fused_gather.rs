//! A strategy defined outside burn-dcp, in its own file: all-gather KV with keys and values
//! travelling together — one all-gather of `[T, K, D + Dv]` per pass instead of two, and one
//! reduce-scatter of the fused dK/dV. Same bytes as the built-in all-gather, half the collectives.

use burn::prelude::Tensor;
use burn_dcp::comm::Payload;
use burn_dcp::diagnostics::volume::{analytic_volume, RankVolume, VolumeShape};
use burn_dcp::kernels::{FlashGradients, FlashOps, FlashOutput, VarlenAttention};
use burn_dcp::planner::{plan_strategy, PlanInput, RoutedPlan};
use burn_dcp::strategy::exchange::{
    all_gather, cat_tokens, checked_tensor, concat_segments, split_sizes,
};
use burn_dcp::strategy::{AttentionStrategy, BackwardInputs, CpCall, Qkv};
use burn_dcp::{CpError, Placement, Strategy, StrategyKind};

pub struct FusedAllGather;

impl FusedAllGather {
    /// This rank's queries against every rank's keys.
    fn problem(call: CpCall<'_>) -> VarlenAttention {
        let placement = &call.batch.placement;
        let mine = placement.segments(call.group.comm.rank()).to_vec();
        call.batch.problem(
            mine,
            concat_segments(placement.ranks.iter().map(Vec::as_slice)),
        )
    }

    /// Every rank's keys and values, `[ΣT, K, D]` and `[ΣT, K, Dv]`, from one all-gather.
    fn gather<B: FlashOps>(
        call: CpCall<'_>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) -> Result<[Tensor<B, 3>; 2], CpError> {
        let [_, kv_heads, head_dim] = k.dims();
        let value_dim = v.dims()[2];
        let fused = Tensor::cat(vec![k, v], 2);
        let placement = &call.batch.placement;
        let expected = |p: usize| [placement.tokens(p), kv_heads, head_dim + value_dim];
        let pieces = all_gather(&call.group.comm, fused, expected, "fused kv all-gather")?;
        let all = cat_tokens(pieces, 0);
        let [k, v] =
            <[_; 2]>::try_from(split_sizes(all, 2, &[head_dim, value_dim])).expect("two parts");
        Ok([k, v])
    }
}

impl AttentionStrategy for FusedAllGather {
    fn name(&self) -> String {
        "fused-all-gather".into()
    }

    /// The same tiles on the same ranks and the same bytes as the built-in all-gather's plan.
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        let mut routed = plan_strategy(StrategyKind::AllGather, input)?;
        routed.name = self.name();
        Ok(routed)
    }

    /// The built-in all-gather's bytes: fusing changes the number of messages, not their sum.
    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume> {
        analytic_volume(Strategy::AllGather, placement, shape)
    }

    fn forward<B: FlashOps>(
        &self,
        call: CpCall<'_>,
        [q, k, v]: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        let [k, v] = Self::gather(call, k, v)?;
        Ok(B::flash_forward(q, k, v, &Self::problem(call))?)
    }

    fn backward<B: FlashOps>(
        &self,
        call: CpCall<'_>,
        x: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let device = x.q.device();
        let [k, v] = Self::gather(call, x.k, x.v)?;
        let problem = Self::problem(call);
        let grads = B::flash_backward(BackwardInputs { k, v, ..x }, &problem)?;
        let [_, kv_heads, head_dim] = grads.dk.dims();
        let value_dim = grads.dv.dims()[2];
        let dtype = grads.dk.dtype();
        let comm = &call.group.comm;
        let sizes: Vec<usize> = (0..call.group.cp())
            .map(|r| call.batch.placement.tokens(r))
            .collect();
        let fused = Tensor::cat(vec![grads.dk, grads.dv], 2);
        let parts = split_sizes(fused, 0, &sizes)
            .into_iter()
            .map(Payload::device)
            .collect();
        let summed = comm.reduce_scatter(parts)?;
        let me = comm.rank();
        let expected = [sizes[me], kv_heads, head_dim + value_dim];
        let what = "fused dk/dv reduce-scatter";
        let mine = checked_tensor(comm, summed, me, expected, dtype, what, &device)?;
        let [dk, dv] =
            <[_; 2]>::try_from(split_sizes(mine, 2, &[head_dim, value_dim])).expect("two parts");
        Ok(FlashGradients {
            dq: grads.dq,
            dk,
            dv,
        })
    }
}
