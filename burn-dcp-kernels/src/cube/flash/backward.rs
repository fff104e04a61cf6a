//! The backward, FlashAttention-2's split: `delta = rowsum(dO ∘ O)` first (`elementwise.rs`'s
//! prepass), then a dk/dv kernel per key tile walking the query tiles of every query
//! head of its GQA group, and a dq kernel per query tile walking the key tiles, both on the
//! forward's pieces. Recomputing `S` in both costs one extra `Q·Kᵀ` per pair; in exchange there
//! are no atomics and the results are deterministic.
//!
//! This file holds the pieces both kernels use; the kernels are in `dq.rs` (the forward's cubes
//! and key tiles) and `dkdv.rs` (a cube per key tile), re-exported here.

use cubecl::prelude::*;

use super::fragment::*;
use super::stage::*;
use crate::cube::elementwise::{NONE, NONE_LIMIT};

/// Turns scaled, masked scores `s` into `P = exp(s − lse)` (0 where masked) and `dp` into
/// `dS = P ∘ (dP − delta)`, in place. `row_values`: the lane's rows' `(lse, delta)`
/// (`per_row`), or the tile's columns' in shared memory at `column_at` (`!per_row`).
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
pub fn probabilities_and_ds(
    s: &mut Array<Pair<f32>>,
    dp: &mut Array<Pair<f32>>,
    row_lse: &Array<f32>,
    row_delta: &Array<f32>,
    column_lse: &SharedMemory<f32>,
    column_delta: &SharedMemory<f32>,
    column_at: usize,
    #[comptime] block: usize,
    #[comptime] per_row: bool,
    #[comptime] unrolled: bool,
) {
    let (_lane, _g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        // Pair `i`: fragment `i / 2`, row `i % 2`.
        let mut p = s[i];
        let mut ds = dp[i];
        #[unroll]
        for e in 0..2usize {
            let mut lse = 0.0f32;
            let mut delta = 0.0f32;
            if per_row {
                lse = row_lse[i % 2];
                delta = row_delta[i % 2];
            } else {
                let at = column_at + 8 * (i / 2) + 2 * t + e;
                lse = column_lse[at];
                delta = column_delta[at];
            }
            let prob = select(p[e] < NONE_LIMIT, 0.0f32, (p[e] - lse).exp());
            p[e] = prob;
            ds[e] = prob * (ds[e] - delta);
        }
        s[i] = p;
        dp[i] = ds;
    }
}

/// Sets the scores of the pairs the spans do not allow to `NONE` where the lane's rows are keys
/// `first_key + g + 8v` and its columns queries `8n + 2t + e` of a tile whose spans start at
/// `spans_at` of `spans`.
#[cube]
pub fn mask_columns(
    s: &mut Array<Pair<f32>>,
    spans: &SharedMemory<u32>,
    spans_at: usize,
    first_key: usize,
    #[comptime] block: usize,
    #[comptime] max_spans: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        let mut pair = s[i];
        #[unroll]
        for e in 0..2usize {
            let at = spans_at + (8 * (i / 2) + 2 * t + e) * 2 * max_spans;
            if !allowed(spans, at, first_key + g + 8 * (i % 2), max_spans) {
                pair[e] = NONE;
            }
        }
        s[i] = pair;
    }
}

/// Writes `factor ·` the plane's accumulators (`dim / 8` fragments, rows `first + g + 8v`) to
/// `target [tokens, heads, dim]` at head `head`, skipping rows past the end and, unless
/// `exact` (the target's dim is `dim`), the padding columns past the target's dim.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_rows<F: Float>(
    acc: &Array<Pair<f32>>,
    target: &mut Tensor<F>,
    first: usize,
    head: usize,
    factor: f32,
    #[comptime] dim: usize,
    #[comptime] exact: bool,
    #[comptime] unrolled: bool,
) {
    let (_lane, g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..dim / 4 {
        let token = first + g + 8 * (i % 2);
        if token < target.shape(0) {
            let base = token * target.stride(0) + head * target.stride(1);
            let pair = acc[i];
            #[unroll]
            for e in 0..2usize {
                let col = 8 * (i / 2) + 2 * t + e;
                if exact || col < target.shape(2) {
                    target[base + col * target.stride(2)] = F::cast_from(pair[e] * factor);
                }
            }
        }
    }
}

pub use super::dkdv::flash_dkdv_kernel;
pub use super::dq::flash_dq_kernel;
