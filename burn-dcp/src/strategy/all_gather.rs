//! All-gather KV (llama3-style): every rank gathers all keys/values, computes its queries against
//! them, and in backward reduce-scatters dK/dV back to their owners.
//!
//! Friendly to varlen: no step structure, one kernel call per pass; the kernel skips masked work.
//! Backward gathers the keys/values again instead of keeping the gathered copy from forward
//! (memory of one shard, not of the whole sequence, between the passes).

use burn::prelude::Tensor;
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput, VarlenAttention};

use crate::batch::placement::Placement;
use crate::comm::Payload;
use crate::error::CpError;
use crate::planner::bytes::{kv_bytes, rank_tokens, Pass, RankVolume, Side, VolumeShape};
use crate::planner::{strategies, PlanInput, RoutedPlan};
use crate::strategy::exchange::{
    all_gather, cat_tokens, checked_tensor, concat_segments, split_sizes,
};
use crate::strategy::{AttentionStrategy, BackwardInputs, CpBatch, CpCall, CpGroup, Qkv};

/// All-gather KV over the whole CP group.
pub struct AllGatherKv;

impl AllGatherKv {
    fn problem(group: &CpGroup, batch: &CpBatch) -> VarlenAttention {
        let placement = &batch.placement;
        let mine = placement.segments(group.comm.rank()).to_vec();
        batch.problem(
            mine,
            concat_segments(placement.ranks.iter().map(Vec::as_slice)),
        )
    }
}

impl AttentionStrategy for AllGatherKv {
    fn name(&self) -> String {
        "all-gather".into()
    }

    /// All-gather KV with the tokens in the zigzag layout.
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        strategies::all_gather(input)
    }

    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume> {
        all_gather_volume(&rank_tokens(placement), shape)
    }

    fn forward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        [q, k, v]: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        let (k, v) = (
            gather_tokens(group, batch, k, "k")?,
            gather_tokens(group, batch, v, "v")?,
        );
        Ok(B::flash_forward(q, k, v, &Self::problem(group, batch))?)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        x: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let device = x.q.device();
        let k = gather_tokens(group, batch, x.k, "k")?;
        let v = gather_tokens(group, batch, x.v, "v")?;
        let x = BackwardInputs { k, v, ..x };
        let grads = B::flash_backward(x, &Self::problem(group, batch))?;
        let sizes: Vec<usize> = (0..group.cp()).map(|r| batch.placement.tokens(r)).collect();
        let scatter = |full: Tensor<B, 3>, what: &str| -> Result<Tensor<B, 3>, CpError> {
            let [_, heads, dim] = full.dims();
            let dtype = full.dtype();
            let parts = split_sizes(full, 0, &sizes)
                .into_iter()
                .map(Payload::device)
                .collect();
            let summed = group.comm.reduce_scatter(parts)?;
            let me = group.comm.rank();
            let expected = [sizes[me], heads, dim];
            Ok(checked_tensor(
                &group.comm,
                summed,
                me,
                expected,
                dtype,
                what,
                &device,
            )?)
        };
        Ok(FlashGradients {
            dq: grads.dq,
            dk: scatter(grads.dk, "dk reduce-scatter")?,
            dv: scatter(grads.dv, "dv reduce-scatter")?,
        })
    }
}

/// All of the group's keys (or values) `[ΣT_p, K, D]` in rank order, from this rank's `[T_me, K, D]`.
fn gather_tokens<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    x: Tensor<B, 3>,
    what: &str,
) -> Result<Tensor<B, 3>, CpError> {
    let [_, heads, dim] = x.dims();
    let expected = |p: usize| [batch.placement.tokens(p), heads, dim];
    let pieces = all_gather(&group.comm, x, expected, &format!("{what} all-gather"))?;
    Ok(cat_tokens(pieces, 0))
}

/// All-gather's bytes per rank ([`crate::diagnostics::volume`]'s formula).
fn all_gather_volume(tokens: &[u64], s: &VolumeShape) -> Vec<RankVolume> {
    let peers = tokens.len() as u64 - 1;
    let kv = kv_bytes(s, s.kv_heads);
    let (forward_kv, _) = kv.hop(Side::KeyValue, Pass::Forward);
    let (backward_kv, partials) = kv.hop(Side::KeyValue, Pass::Backward);
    let total: u64 = tokens.iter().sum();
    tokens
        .iter()
        .map(|&t| RankVolume {
            // my KV to every peer; backward again, and every peer's partial dK/dV of its tokens
            forward: peers * t * forward_kv,
            backward: peers * t * backward_kv + (total - t) * partials,
        })
        .collect()
}
