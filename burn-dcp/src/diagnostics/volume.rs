//! Analytic communication volume: the bytes each rank sends, per strategy, forward and backward.
//!
//! Notation: `P` ranks, rank `p` holds `T_p` tokens, `H`/`K` query/kv heads, `D`/`Dv` head and
//! value dims, `b` bytes per element of the inputs (the LSE is always f32, 4 bytes). Only bytes
//! sent to *other* ranks count. `kv(p) = T_p·K·(D + Dv)·b` is rank `p`'s key/value block.
//!
//! - **Ulysses** (`Hs = H/P`, `K_p` = kv heads rank `p` computes, see
//!   [`HeadSplit::kv_heads`](crate::strategy::ulysses::HeadSplit::kv_heads)): forward sends, for every peer `p ≠ r`,
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
pub use crate::planner::bytes::{RankVolume, VolumeShape};
use crate::strategy::registry::{with_strategy, WithStrategy};
use crate::strategy::{AttentionStrategy, Strategy};

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
