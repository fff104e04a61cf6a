//! USP (unified sequence parallelism, a.k.a. hierarchical a2a+p2p): a 2D mesh of
//! `ulysses_degree × ring_degree = cp` ranks. Rank `r` is Ulysses rank `u = r mod U` of Ulysses
//! group `g = ⌊r/U⌋` (ranks `g·U .. g·U+U`, typically one node) and ring rank `g` of ring group `u`.
//!
//! 1. Ulysses all-to-all inside the Ulysses group: this rank now holds all tokens of its group
//!    (the group members' segments, in member order) for query heads `u·H/U .. (u+1)·H/U`.
//! 2. Ring attention across the ring group (same head slice on every member): member `g'` holds
//!    the tokens of Ulysses group `g'`.
//! 3. Ulysses all-to-all back.
//!
//! Backward mirrors it: all-to-all of q, k, v, out, dout and lse to heads, ring backward, dq and
//! dk/dv back to sequence shards.

use burn_dcp_kernels::{AttentionShape, FlashGradients, FlashOps, FlashOutput};

use crate::batch::placement::Placement;
use crate::error::CpError;
use crate::planner::bytes::{rank_tokens, RankVolume, VolumeShape};
use crate::planner::{strategies, PlanInput, RoutedPlan};
use crate::strategy::exchange::concat_segments;
use crate::strategy::ring::{ring_volume, RingPass};
use crate::strategy::ulysses::{ulysses_volume, HeadSplit, UlyssesStage};
use crate::strategy::{
    AttentionStrategy, BackwardInputs, CpBatch, CpCall, CpGroup, Qkv, Strategy, StrategyKind,
};
use burn_dcp_kernels::heads::HeadParts;

/// Ulysses inside groups of `ulysses_degree` ranks, ring across `ring_degree` such groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usp {
    pub ulysses_degree: usize,
    pub ring_degree: usize,
}

struct Mesh<'a> {
    stage: UlyssesStage<'a>,
    ring: RingPass<'a>,
}

impl Usp {
    fn mesh<'a>(
        &self,
        group: &'a CpGroup,
        batch: &'a CpBatch,
        heads: usize,
        kv_heads: usize,
    ) -> Result<Mesh<'a>, CpError> {
        let Self {
            ulysses_degree,
            ring_degree,
        } = *self;
        let mine = Strategy::Usp {
            ulysses_degree,
            ring_degree,
        };
        if group.strategy != mine {
            return Err(CpError::Config(format!(
                "{mine} called on a group built for strategy {} (its sub-groups are that mesh's)",
                group.strategy
            )));
        }
        let (ulysses, ring) = group.usp_groups.as_ref().ok_or_else(|| {
            CpError::Config(
                "USP needs its Ulysses and ring sub-groups; build the group with CpGroup::new"
                    .into(),
            )
        })?;
        let placement = &batch.placement;
        let ranks_of = |g: usize| g * ulysses_degree..(g + 1) * ulysses_degree;
        let g = group.comm.rank() / ulysses_degree;
        let stage = UlyssesStage {
            comm: ulysses,
            split: HeadSplit {
                heads,
                kv_heads,
                degree: ulysses_degree,
            },
            member_tokens: ranks_of(g).map(|r| placement.tokens(r)).collect(),
        };
        let members = (0..ring_degree)
            .map(|g| concat_segments(ranks_of(g).map(|r| placement.segments(r))))
            .collect();
        Ok(Mesh {
            stage,
            ring: RingPass {
                comm: ring,
                batch,
                members,
            },
        })
    }
}

impl AttentionStrategy for Usp {
    fn name(&self) -> String {
        Strategy::Usp {
            ulysses_degree: self.ulysses_degree,
            ring_degree: self.ring_degree,
        }
        .to_string()
    }

    /// USP of this Ulysses degree over the topology's ranks (Ulysses inside groups of
    /// `ulysses_degree` consecutive ranks, a ring across them).
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        let degree = self.ulysses_degree;
        let heads = input.dims.head_pair()?;
        if heads.split_queries(HeadParts::Ulysses(degree)).is_err() {
            return Err(CpError::Config(format!(
                "usp: Ulysses degree {degree} must divide the {} query heads",
                heads.heads()
            )));
        }
        strategies::usp(input, degree, StrategyKind::Usp)
    }

    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume> {
        let tokens = rank_tokens(placement);
        usp_volume(&tokens, shape, self.ulysses_degree, self.ring_degree)
    }

    /// The query heads split evenly over a Ulysses group ([`burn_dcp_kernels::heads`]' rule).
    fn validate_call(&self, call: CpCall<'_>, shape: AttentionShape) -> Result<(), CpError> {
        let strategy = Strategy::Usp {
            ulysses_degree: self.ulysses_degree,
            ring_degree: self.ring_degree,
        };
        strategy.validate_heads(shape.heads, shape.kv_heads, call.group.cp())
    }

    fn forward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        [q, k, v]: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        let Mesh { stage, ring } = self.mesh(group, batch, q.dims()[1], k.dims()[1])?;
        let [q, k, v] = stage.inputs_to_heads([q, k, v])?;
        stage.output_to_sequence(ring.forward(q, k, v)?)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        x: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let Mesh { stage, ring } = self.mesh(group, batch, x.q.dims()[1], x.k.dims()[1])?;
        let grads = ring.backward(stage.backward_inputs_to_heads(x)?)?;
        stage.gradients_to_sequence(grads)
    }
}

/// USP's bytes per rank ([`crate::diagnostics::volume`]'s formula): Ulysses inside each group,
/// ring across them.
fn usp_volume(
    tokens: &[u64],
    s: &VolumeShape,
    ulysses_degree: usize,
    ring_degree: usize,
) -> Vec<RankVolume> {
    let split = HeadSplit {
        heads: s.heads,
        kv_heads: s.kv_heads,
        degree: ulysses_degree,
    };
    let group_tokens = |g: usize| &tokens[g * ulysses_degree..(g + 1) * ulysses_degree];
    let ring_tokens: Vec<u64> = (0..ring_degree)
        .map(|g| group_tokens(g).iter().sum())
        .collect();
    let ring_shape = VolumeShape {
        heads: s.heads / ulysses_degree,
        ..*s
    };
    (0..tokens.len())
        .map(|r| {
            let (g, u) = (r / ulysses_degree, r % ulysses_degree);
            let inner = ulysses_volume(group_tokens(g), s, s.heads, ulysses_degree)[u];
            let outer = ring_volume(&ring_tokens, &ring_shape, split.kv_heads(u).len() as u64)[g];
            RankVolume {
                forward: inner.forward + outer.forward,
                backward: inner.backward + outer.backward,
            }
        })
        .collect()
}
