//! Analytic communication volume: the bytes each rank sends, per strategy, forward and backward.
//!
//! Notation: `P` ranks, rank `p` holds `T_p` tokens, `H`/`K` query/kv heads, `D`/`Dv` head and
//! value dims, `b` bytes per element of the inputs (the LSE is always f32, 4 bytes). Only bytes
//! sent to *other* ranks count. `kv(p) = T_p·K·(D + Dv)·b` is rank `p`'s key/value block.
//!
//! - **Ulysses** (`Hs = H/P`, `K_p` = kv heads rank `p` computes, see
//!   [`HeadSplit::kv_heads`]): forward sends, for every peer `p ≠ r`,
//!   `T_r·(Hs·D + K_p·(D+Dv))·b` (q, k, v to heads) and `T_p·Hs·(Dv·b + 4)` (out and lse back).
//!   Backward: `T_r·(Hs·(D + 2·Dv)·b + Hs·4 + K_p·(D+Dv)·b)` (q, out, dout, lse, k, v to heads)
//!   plus `T_p·(Hs·D + K_r·(D+Dv))·b` (dq, dk, dv back).
//! - **Ring**: forward sends the blocks of steps `0..P−1`: `Σ_{s=0}^{P−2} kv(r−s)` = every block
//!   but `kv(r+1)`. Backward: the same plus the dK/dV accumulators at every step,
//!   `Σ_{s=0}^{P−1} kv(r−s)` = every block (for `P > 1`).
//! - **All-gather**: forward `(P−1)·kv(r)`; backward `(P−1)·kv(r) + Σ_{p≠r} kv(p)` (gather again,
//!   reduce-scatter dK/dV).
//! - **USP** (`U × R`): the Ulysses formulas inside the Ulysses group (degree `U`, its members'
//!   token counts) plus the ring formulas across the ring group, whose member `g` holds
//!   `T_g = Σ_u T_{g,u}` tokens with `Hs = H/U` heads and `K_u` kv heads.
//!
//! Each term is a per-token size of the one byte model ([`crate::planner::bytes::TokenBytes::hop`], the
//! planner's too) times a token count. The all-to-alls of Ulysses move exactly the tensors, nothing
//! else; ring steps that are skipped
//! for lack of unmasked work still pass their block on (the next rank may need it).

use crate::batch::placement::Placement;
pub use crate::planner::bytes::RankVolume;
use crate::planner::bytes::{Pass, Side, TokenBytes};
use crate::strategy::ulysses::HeadSplit;
use crate::strategy::{with_strategy, AttentionStrategy, Strategy, WithStrategy};

/// Tensor sizes entering the volume formulas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// Bytes per element of q, k, v, out and their gradients.
    pub element_bytes: usize,
}

/// Analytic bytes per rank (index = CP rank) for `strategy` on `placement`: its
/// [`AttentionStrategy::volume`]. Strategy dcp moves what its plan says: use
/// `BlockSchedule::predicted_volume` (here: an empty list).
pub fn analytic_volume(
    strategy: Strategy,
    placement: &Placement,
    shape: &VolumeShape,
) -> Vec<RankVolume> {
    with_strategy(strategy, Volume { placement, shape })
}

/// A strategy's [`AttentionStrategy::volume`] through the registry.
struct Volume<'a> {
    placement: &'a Placement,
    shape: &'a VolumeShape,
}

impl WithStrategy for Volume<'_> {
    type Output = Vec<RankVolume>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        strategy.volume(self.placement, self.shape)
    }
}

/// The tokens each rank of `placement` holds.
pub(crate) fn rank_tokens(placement: &Placement) -> Vec<u64> {
    (0..placement.cp())
        .map(|r| placement.tokens(r) as u64)
        .collect()
}

pub(crate) fn ulysses(
    tokens: &[u64],
    s: &VolumeShape,
    heads: usize,
    degree: usize,
) -> Vec<RankVolume> {
    let split = HeadSplit {
        heads,
        kv_heads: s.kv_heads,
        degree,
    };
    // per rank, the bytes per token of the heads it computes
    let computed_by: Vec<TokenBytes<u64>> = (0..degree)
        .map(|p| {
            let kv_heads = split.kv_heads(p).len();
            TokenBytes::exact(
                heads / degree,
                kv_heads,
                s.head_dim,
                s.value_dim,
                s.element_bytes,
            )
        })
        .collect();
    (0..degree)
        .map(|r| {
            let mut volume = RankVolume::default();
            for p in (0..degree).filter(|&p| p != r) {
                let (mine, theirs) = (tokens[r], tokens[p]);
                // my tokens' q, k, v (backward: also out, lse, dout) to p's heads; the results
                // of my heads for p's tokens back to p
                for pass in [Pass::Forward, Pass::Backward] {
                    let (out, _) = computed_by[p].both_sides(pass);
                    let (_, back) = computed_by[r].both_sides(pass);
                    *volume.pass_mut(pass) += mine * out + theirs * back;
                }
            }
            volume
        })
        .collect()
}

/// Key/value bytes per token of `kv_heads` heads.
fn kv_bytes(s: &VolumeShape, kv_heads: usize) -> TokenBytes<u64> {
    TokenBytes::exact(0, kv_heads, s.head_dim, s.value_dim, s.element_bytes)
}

pub(crate) fn ring(tokens: &[u64], s: &VolumeShape, kv_heads: u64) -> Vec<RankVolume> {
    let size = tokens.len();
    let kv = kv_bytes(s, kv_heads as usize);
    let (forward_kv, _) = kv.hop(Side::KeyValue, Pass::Forward);
    let (backward_kv, accumulators) = kv.hop(Side::KeyValue, Pass::Backward);
    let owner_tokens = |r: usize, step: usize| tokens[(r + size - step) % size];
    (0..size)
        .map(|r| {
            if size == 1 {
                return RankVolume::default();
            }
            // KV passes on at steps 0..P−1; backward the dK/dV accumulators at every step
            let passes: u64 = (0..size - 1).map(|step| owner_tokens(r, step)).sum();
            let every: u64 = (0..size).map(|step| owner_tokens(r, step)).sum();
            RankVolume {
                forward: passes * forward_kv,
                backward: passes * backward_kv + every * accumulators,
            }
        })
        .collect()
}

pub(crate) fn all_gather(tokens: &[u64], s: &VolumeShape) -> Vec<RankVolume> {
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

pub(crate) fn usp(
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
            let inner = ulysses(group_tokens(g), s, s.heads, ulysses_degree)[u];
            let outer = ring(&ring_tokens, &ring_shape, split.kv_heads(u).len() as u64)[g];
            RankVolume {
                forward: inner.forward + outer.forward,
                backward: inner.backward + outer.backward,
            }
        })
        .collect()
}
