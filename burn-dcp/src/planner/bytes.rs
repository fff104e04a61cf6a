//! The one byte model: what one copy of a block costs per token, by side (the query/output side or
//! the key/value side of a tile) and pass. The planner's cost model (`f64` per head unit,
//! [`crate::planner::cost`]), the DCP executor's predictions ([`crate::strategy::block_plan`]) and
//! the analytic per-rank volumes of the static strategies (each strategy's `volume`; exact
//! `u64`) are all written with [`TokenBytes::hop`].
//!
//! | pass     | to the compute rank            | back to the home rank |
//! |----------|--------------------------------|-----------------------|
//! | forward  | Q: q; KV: kv                   | O and LSE: o; —       |
//! | backward | Q, dO, O and LSE: q + dout + o; KV: kv | dQ: q; dK, dV: kv |

use std::ops::Add;

use crate::error::CpError;
use crate::planner::topology::attention_flops;
use burn_dcp_kernels::heads::{HeadParts, HeadSplitError, Heads};

/// Bytes of the LSE per query head and token (always f32).
pub const LSE_BYTES: u64 = 4;

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    Backward,
}

/// Which side of a tile a data block feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// Q goes out; the partial O (forward) and dQ (backward) come back.
    QueryOutput,
    /// K and V go out; dK and dV (backward) come back.
    KeyValue,
}

/// Bytes per token of the tensors context parallelism moves, for some query heads and the kv
/// heads they read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenBytes<T> {
    /// Q (and dQ).
    pub q: T,
    /// K and V together (and dK, dV).
    pub kv: T,
    /// The output and its LSE.
    pub o: T,
    /// dO.
    pub dout: T,
}

impl TokenBytes<u64> {
    /// Exact bytes for `q_heads` query heads and `kv_heads` kv heads of dims `head_dim` (q, k) and
    /// `value_dim` (v, out) at `element_bytes` per element, the LSE in f32.
    pub fn exact(
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        value_dim: usize,
        element_bytes: usize,
    ) -> Self {
        let (hq, hk) = (q_heads as u64, kv_heads as u64);
        let (d, dv, b) = (head_dim as u64, value_dim as u64, element_bytes as u64);
        Self {
            q: hq * d * b,
            kv: hk * (d + dv) * b,
            o: hq * (dv * b + LSE_BYTES),
            dout: hq * dv * b,
        }
    }
}

impl<T: Copy + Add<Output = T> + Default> TokenBytes<T> {
    /// Bytes per token of one copy of a `side` block in `pass`: (to the compute rank, back home).
    pub fn hop(&self, side: Side, pass: Pass) -> (T, T) {
        match (side, pass) {
            (Side::QueryOutput, Pass::Forward) => (self.q, self.o),
            (Side::QueryOutput, Pass::Backward) => (self.q + self.dout + self.o, self.q),
            (Side::KeyValue, Pass::Forward) => (self.kv, T::default()),
            (Side::KeyValue, Pass::Backward) => (self.kv, self.kv),
        }
    }

    /// Bytes per token of both sides of a token at once in `pass` (an all-to-all moving a head
    /// unit to the rank that computes it): (to the compute rank, back home).
    pub fn both_sides(&self, pass: Pass) -> (T, T) {
        let (query_to, query_back) = self.hop(Side::QueryOutput, pass);
        let (kv_to, kv_back) = self.hop(Side::KeyValue, pass);
        (query_to + kv_to, query_back + kv_back)
    }

    /// Bytes per token of a `side` block out and back, forward plus backward.
    pub fn round_trips(&self, side: Side) -> T {
        let (forward_to, forward_back) = self.hop(side, Pass::Forward);
        let (backward_to, backward_back) = self.hop(side, Pass::Backward);
        (forward_to + forward_back) + (backward_to + backward_back)
    }
}

/// Bytes one rank sends in the forward and in the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankVolume {
    pub forward: u64,
    pub backward: u64,
}

impl RankVolume {
    /// The bytes of `pass`.
    pub fn pass_mut(&mut self, pass: Pass) -> &mut u64 {
        match pass {
            Pass::Forward => &mut self.forward,
            Pass::Backward => &mut self.backward,
        }
    }
}

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

/// The tokens each rank of `placement` holds.
pub(crate) fn rank_tokens(placement: &crate::batch::placement::Placement) -> Vec<u64> {
    (0..placement.cp())
        .map(|r| placement.tokens(r) as u64)
        .collect()
}

/// Key/value bytes per token of `kv_heads` heads.
pub(crate) fn kv_bytes(s: &VolumeShape, kv_heads: usize) -> TokenBytes<u64> {
    TokenBytes::exact(0, kv_heads, s.head_dim, s.value_dim, s.element_bytes)
}

/// Attention dimensions of the planned layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes per element of Q, K, V, O and their gradients (2 for bf16).
    pub element_bytes: usize,
}

/// Per-token, per-head-unit sizes of a plan whose problem has `units` head units.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitSizes {
    pub q: f64,
    pub kv: f64,
    pub o: f64,
    /// dO (the planner's dims have the value dim equal to the head dim: as many bytes as Q).
    pub dout: f64,
    /// Forward FLOPs per unmasked (query, key) pair of one unit.
    pub forward_flops_per_pair: f64,
}

impl AttentionDims {
    pub fn validate(&self) -> Result<(), CpError> {
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.element_bytes == 0 {
            return Err(CpError::Config(format!(
                "heads ({}), kv heads ({}), head dim ({}) and element bytes ({}) must be at least 1",
                self.heads, self.kv_heads, self.head_dim, self.element_bytes
            )));
        }
        let token_bytes = [self.heads, self.head_dim, self.element_bytes]
            .iter()
            .try_fold(1usize, |product, &x| product.checked_mul(x));
        if token_bytes.is_none_or(|bytes| bytes > 1 << 32) {
            return Err(CpError::Config(format!(
                "heads ({}) × head dim ({}) × element bytes ({}) exceed 4 GiB per token",
                self.heads, self.head_dim, self.element_bytes
            )));
        }
        self.head_pair()?;
        Ok(())
    }

    /// The query and kv heads ([`Heads`]: kv heads divide the query heads). The planner's
    /// refusals keep the words plan_sim has always reported (its JSON is compared byte for byte
    /// across changes); the rules are `Heads`'.
    pub fn head_pair(&self) -> Result<Heads, CpError> {
        Heads::new(self.heads, self.kv_heads).map_err(|_| {
            CpError::Config(format!(
                "heads ({}) must be a multiple of kv heads ({})",
                self.heads, self.kv_heads
            ))
        })
    }

    /// Sizes for `units` head units. A unit holds `heads / units` query heads and, when there are
    /// more units than kv heads, a replica of its kv head (as Ulysses does past the kv head count).
    pub fn unit_sizes(&self, units: usize) -> Result<UnitSizes, CpError> {
        self.validate()?;
        let unit = self
            .head_pair()?
            .split(HeadParts::Units(units))
            .map_err(|e| {
                CpError::Config(match e {
                    HeadSplitError::KeyValues { .. } => format!(
                        "{units} head units and {} kv heads: one must divide the other",
                        self.kv_heads
                    ),
                    _ => format!(
                        "{units} head units do not divide {} query heads",
                        self.heads
                    ),
                })
            })?;
        let q_heads = unit.heads();
        let kv_heads = unit.kv_heads() as f64;
        let d = self.head_dim as f64;
        let e = self.element_bytes as f64;
        Ok(UnitSizes {
            q: q_heads as f64 * d * e,
            kv: 2.0 * kv_heads * d * e,
            o: q_heads as f64 * (d * e + 4.0),
            dout: q_heads as f64 * d * e,
            forward_flops_per_pair: attention_flops(1, q_heads, self.head_dim).0,
        })
    }
}

impl UnitSizes {
    /// Bytes of the (query, output) side of one token on the way to a compute rank and back,
    /// forward plus backward: the weight of a q/o hyperedge per token.
    pub fn qo_traffic(&self) -> f64 {
        self.token_bytes().round_trips(Side::QueryOutput)
    }

    /// Bytes of the kv side of one token, forward plus backward.
    pub fn kv_traffic(&self) -> f64 {
        self.token_bytes().round_trips(Side::KeyValue)
    }

    /// The sizes as the byte model's per-token bytes.
    pub fn token_bytes(&self) -> TokenBytes<f64> {
        TokenBytes {
            q: self.q,
            kv: self.kv,
            o: self.o,
            dout: self.dout,
        }
    }

    /// Memory one token's Q, KV and O occupy on their home.
    pub fn resident(&self) -> f64 {
        self.q + self.kv + self.o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_bytes_follow_the_tensors() {
        // 4 query heads, 2 kv heads, d 8, dv 6, bf16
        let bytes = TokenBytes::exact(4, 2, 8, 6, 2);
        assert_eq!(bytes.q, 4 * 8 * 2);
        assert_eq!(bytes.kv, 2 * (8 + 6) * 2);
        assert_eq!(bytes.o, 4 * (6 * 2 + 4));
        assert_eq!(bytes.dout, 4 * 6 * 2);
        assert_eq!(bytes.hop(Side::QueryOutput, Pass::Forward), (64, 64));
        assert_eq!(
            bytes.hop(Side::QueryOutput, Pass::Backward),
            (64 + 48 + 64, 64)
        );
        assert_eq!(bytes.hop(Side::KeyValue, Pass::Forward), (56, 0));
        assert_eq!(bytes.hop(Side::KeyValue, Pass::Backward), (56, 56));
        assert_eq!(bytes.round_trips(Side::KeyValue), 3 * 56);
        assert_eq!(bytes.both_sides(Pass::Forward), (64 + 56, 64));
        assert_eq!(
            bytes.both_sides(Pass::Backward),
            (64 + 48 + 64 + 56, 64 + 56)
        );
    }
}
