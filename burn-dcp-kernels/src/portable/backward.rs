//! The portable backward, tiled like the forward ([`super::forward`]): flash-attention 2's
//! backward with the matrix products on the `gemm` crate.
//!
//! Work items are one key/value head × one *part* of the query blocks (the forward's blocks, cut
//! into at most [`PARTS`] contiguous runs of about equal unmasked work). Per query block — its
//! rows stacked as the forward stacks them, (token, head of the group) — and per key tile of
//! [`KEY_TILE`] keys over the block's allowed extent, classified as the forward classifies them
//! (empty tiles skipped):
//!
//! ```text
//! S  = scale · Q Kᵀ            P  = exp(S − lse)  (0 where masked)
//! dV += Pᵀ dO                  dP = dO Vᵀ
//! dS = scale · P ⊙ (dP − Δ)    (Δ = rowsum(dO ⊙ O))
//! dQ += dS K                   dK += dSᵀ Q
//! ```
//!
//! five gemm calls per tile, accumulated in f32. A block's `dQ` rows belong to its item; `dK`,
//! `dV` accumulate per item over the part's key extent and the parts are summed in order, so the
//! result does not depend on the thread count.
//!
//! Non-finite inputs keep the rule of the per-query loop this replaces: a query without any
//! allowed key has no gradient, and a NaN reaches exactly the gradients of the (query, key)
//! pairs that are allowed. A gemm would multiply masked zeros by a NaN, so a partial tile whose
//! keys or values hold a non-finite entry, or of a block whose query-side rows do, is computed
//! pair by pair over its allowed pairs only.

use std::ops::Range;

use super::forward::{
    block_tokens, classify, exp_shifted, group_rows, key_extent, matmul, nonfinite_prefix,
    query_blocks, Strided, TileKind, KEY_TILE,
};
use super::{axpy, dot, parallel_map};
use crate::definition::{AttentionShape, VarlenAttention};
use crate::spans::QuerySpans;

/// The most parts each key/value head's query blocks are cut into (a constant, so the sums do
/// not depend on the thread count).
const PARTS: usize = 8;

/// Everything the backward reads: token-major `q`, `dout`, `out` `[q_tokens, heads, ·]`, `k`,
/// `v` `[kv_tokens, kv_heads, ·]`, and `lse [heads, q_tokens]`.
pub(super) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub out: &'a [f32],
    pub lse: &'a [f32],
    pub dout: &'a [f32],
    pub spans: &'a QuerySpans,
    pub problem: &'a VarlenAttention,
    pub shape: &'a AttentionShape,
    pub scale: f32,
    /// Threads to run the work items on.
    pub threads: usize,
}

/// Gradients, token-major: `(dq [q_tokens, heads, head_dim], dk [kv_tokens, kv_heads, head_dim],
/// dv [kv_tokens, kv_heads, value_dim])`.
pub(super) fn tiled(x: Inputs<'_>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let s = x.shape;
    let group = s.group_size();
    let blocks = query_blocks(x.problem, block_tokens(group));
    let parts = parts(&blocks, x.spans);
    let nonfinite = NonFinite::of(&x);
    let items = parallel_map(x.threads, s.kv_heads * parts.len(), |item| {
        let (kv, part) = (item % s.kv_heads, &parts[item / s.kv_heads]);
        part_backward(&x, &nonfinite, kv, &blocks[part.clone()])
    });
    let (d, dvd) = (s.head_dim, s.value_dim);
    let mut dq = vec![0.0f32; s.q_tokens * s.heads * d];
    let mut dk = vec![0.0f32; s.kv_tokens * s.kv_heads * d];
    let mut dv = vec![0.0f32; s.kv_tokens * s.kv_heads * dvd];
    for (item, result) in items.into_iter().enumerate() {
        let (kv, part) = (item % s.kv_heads, &parts[item / s.kv_heads]);
        for (block, rows) in blocks[part.clone()].iter().zip(&result.dq) {
            let width = group * d;
            for (r, t) in block.clone().enumerate() {
                let at = (t * s.heads + kv * group) * d;
                dq[at..at + width].copy_from_slice(&rows[r * width..(r + 1) * width]);
            }
        }
        for (j, key) in result.keys.clone().enumerate() {
            let at = key * s.kv_heads + kv;
            let pairs = dk[at * d..(at + 1) * d]
                .iter_mut()
                .zip(&result.dk[j * d..(j + 1) * d]);
            pairs.for_each(|(sum, part)| *sum += part);
            let pairs = dv[at * dvd..(at + 1) * dvd]
                .iter_mut()
                .zip(&result.dv[j * dvd..(j + 1) * dvd]);
            pairs.for_each(|(sum, part)| *sum += part);
        }
    }
    (dq, dk, dv)
}

/// The query blocks cut into at most [`PARTS`] contiguous runs of about equal unmasked pairs.
fn parts(blocks: &[Range<usize>], spans: &QuerySpans) -> Vec<Range<usize>> {
    let work: Vec<usize> = blocks
        .iter()
        .map(|block| {
            let pairs: usize = block
                .clone()
                .map(|t| spans.of(t).iter().map(|r| r.len()).sum::<usize>())
                .sum();
            pairs.max(1)
        })
        .collect();
    let total: usize = work.iter().sum();
    let mut parts = Vec::new();
    let (mut start, mut done) = (0, 0);
    for (i, w) in work.iter().enumerate() {
        done += w;
        // Close a part once it reaches its share of the work done so far.
        if done * PARTS >= total * (parts.len() + 1) && parts.len() + 1 < PARTS {
            parts.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < blocks.len() {
        parts.push(start..blocks.len());
    }
    parts
}

/// Per key/value head, where `k` and `v` hold non-finite rows ([`nonfinite_prefix`]).
struct NonFinite {
    k: Vec<Vec<u32>>,
    v: Vec<Vec<u32>>,
}

impl NonFinite {
    fn of(x: &Inputs<'_>) -> Self {
        let s = x.shape;
        Self {
            k: nonfinite_prefix(x.k, s.kv_tokens, s.kv_heads, s.head_dim),
            v: nonfinite_prefix(x.v, s.kv_tokens, s.kv_heads, s.value_dim),
        }
    }

    /// Whether every key and value row of `keys` of key/value head `kv` is finite.
    fn finite(&self, kv: usize, keys: &Range<usize>) -> bool {
        let clean = |prefix: &[u32]| prefix[keys.end] == prefix[keys.start];
        clean(&self.k[kv]) && clean(&self.v[kv])
    }
}

/// What one item computes: its blocks' `dq` rows (as stacked), and its `dk`, `dv` over `keys`.
struct PartGradients {
    dq: Vec<Vec<f32>>,
    keys: Range<usize>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

with_avx2! {
    fn part_backward / part_backward_avx2 => part_backward_any(
        x: &Inputs<'_>,
        nonfinite: &NonFinite,
        kv: usize,
        blocks: &[Range<usize>],
    ) -> PartGradients
}

#[inline(always)]
fn part_backward_any(
    x: &Inputs<'_>,
    nonfinite: &NonFinite,
    kv: usize,
    blocks: &[Range<usize>],
) -> PartGradients {
    let s = x.shape;
    let tokens = blocks.iter().flat_map(|block| block.clone());
    let keys = key_extent(tokens.flat_map(|t| x.spans.of(t).iter()));
    let mut part = PartGradients {
        dq: Vec::with_capacity(blocks.len()),
        dk: vec![0.0; keys.len() * s.head_dim],
        dv: vec![0.0; keys.len() * s.value_dim],
        keys,
    };
    let mut scratch = Scratch::default();
    for block in blocks {
        let dq = block_backward(x, nonfinite, kv, block.clone(), &mut part, &mut scratch);
        part.dq.push(dq);
    }
    part
}

/// Buffers reused across a part's tiles.
#[derive(Default)]
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    allowed: Vec<bool>,
}

/// The query side of one block, its rows stacked (token, head of the group).
struct Rows {
    q: Vec<f32>,
    dout: Vec<f32>,
    /// `Δ = rowsum(dO ⊙ O)`.
    delta: Vec<f32>,
    lse: Vec<f32>,
    /// Whether every query-side value of the rows that have keys is finite.
    finite: bool,
}

fn block_rows(x: &Inputs<'_>, kv: usize, block: &Range<usize>, spans: &[&[Range<usize>]]) -> Rows {
    let s = x.shape;
    let (group, d, dv) = (s.group_size(), s.head_dim, s.value_dim);
    let rows = block.len() * group;
    let q = group_rows(x.q, block, s.heads, kv, group, d);
    let dout = group_rows(x.dout, block, s.heads, kv, group, dv);
    let mut delta = Vec::with_capacity(rows);
    let mut lse = Vec::with_capacity(rows);
    let mut finite = true;
    for (r, t) in block.clone().enumerate() {
        let o_at = (t * s.heads + kv * group) * dv;
        let has_keys = spans[r].iter().any(|span| !span.is_empty());
        for g in 0..group {
            let row = o_at + g * dv..o_at + (g + 1) * dv;
            let row_delta = dot(&x.dout[row.clone()], &x.out[row]);
            let row_lse = x.lse[(kv * group + g) * s.q_tokens + t];
            delta.push(row_delta);
            lse.push(row_lse);
            if has_keys {
                finite &= row_delta.is_finite() && row_lse.is_finite();
            }
        }
        if has_keys {
            finite &= q[r * group * d..(r + 1) * group * d]
                .iter()
                .all(|e| e.is_finite())
                && dout[r * group * dv..(r + 1) * group * dv]
                    .iter()
                    .all(|e| e.is_finite());
        }
    }
    Rows {
        q,
        dout,
        delta,
        lse,
        finite,
    }
}

/// One key/value head × one query block: returns the block's `dq` rows and adds its `dk`, `dv`
/// into the part's.
fn block_backward(
    x: &Inputs<'_>,
    nonfinite: &NonFinite,
    kv: usize,
    block: Range<usize>,
    part: &mut PartGradients,
    scratch: &mut Scratch,
) -> Vec<f32> {
    let s = x.shape;
    let (group, d, dvd) = (s.group_size(), s.head_dim, s.value_dim);
    let rows = block.len() * group;
    let mut dq = vec![0.0f32; rows * d];
    let spans: Vec<&[Range<usize>]> = block.clone().map(|t| x.spans.of(t)).collect();
    let extent = key_extent(spans.iter().flat_map(|own| own.iter()));
    if extent.is_empty() {
        return dq;
    }
    let side = block_rows(x, kv, &block, &spans);
    scratch.p.resize(rows * KEY_TILE, 0.0);
    scratch.ds.resize(rows * KEY_TILE, 0.0);
    scratch.allowed.resize(block.len() * KEY_TILE, false);
    for first in extent.clone().step_by(KEY_TILE) {
        let keys = first..(first + KEY_TILE).min(extent.end);
        let width = keys.len();
        let kind = classify(&spans, &keys, &mut scratch.allowed);
        let tile_finite = nonfinite.finite(kv, &keys);
        match kind {
            TileKind::Empty => continue,
            TileKind::Partial if !(side.finite && tile_finite) => {
                let allowed = &scratch.allowed[..block.len() * width];
                pairwise_tile(x, kv, &side, &keys, allowed, &mut dq, part);
                continue;
            }
            _ => {}
        }
        let mask = (kind == TileKind::Partial).then(|| &scratch.allowed[..block.len() * width]);
        let p = &mut scratch.p[..rows * width];
        let ds = &mut scratch.ds[..rows * width];
        // S = scale · Q Kᵀ, then P = exp(S − lse), 0 where masked.
        let k_at = (keys.start * s.kv_heads + kv) * d;
        let k_rows = Strided::rows(&x.k[k_at..], width, d, s.kv_heads * d);
        let q_rows = Strided::rows(&side.q, rows, d, d);
        matmul(p, q_rows, k_rows.t(), x.scale, false);
        for (row, weights) in p.chunks_exact_mut(width).enumerate() {
            exp_shifted(weights, side.lse[row]);
            if let Some(mask) = mask {
                let allowed = &mask[row / group * width..(row / group + 1) * width];
                for (w, &ok) in weights.iter_mut().zip(allowed) {
                    *w = if ok { *w } else { 0.0 };
                }
            }
        }
        // dV += Pᵀ dO
        let key_offset = keys.start - part.keys.start;
        let p_rows = Strided::rows(p, rows, width, width);
        let dout_rows = Strided::rows(&side.dout, rows, dvd, dvd);
        matmul(
            &mut part.dv[key_offset * dvd..],
            p_rows.t(),
            dout_rows,
            1.0,
            true,
        );
        // dP = dO Vᵀ, then dS = scale · P ⊙ (dP − Δ)
        let v_at = (keys.start * s.kv_heads + kv) * dvd;
        let v_rows = Strided::rows(&x.v[v_at..], width, dvd, s.kv_heads * dvd);
        matmul(ds, dout_rows, v_rows.t(), 1.0, false);
        for ((ds_row, p_row), &delta) in ds
            .chunks_exact_mut(width)
            .zip(p.chunks_exact(width))
            .zip(&side.delta)
        {
            for (g, &w) in ds_row.iter_mut().zip(p_row) {
                *g = x.scale * w * (*g - delta);
            }
        }
        // dQ += dS K, dK += dSᵀ Q
        let ds_rows = Strided::rows(ds, rows, width, width);
        matmul(&mut dq, ds_rows, k_rows, 1.0, true);
        matmul(
            &mut part.dk[key_offset * d..],
            ds_rows.t(),
            q_rows,
            1.0,
            true,
        );
    }
    dq
}

/// A tile computed pair by pair over its allowed pairs only (non-finite values somewhere in it),
/// with the per-query loop's arithmetic.
fn pairwise_tile(
    x: &Inputs<'_>,
    kv: usize,
    side: &Rows,
    keys: &Range<usize>,
    allowed: &[bool],
    dq: &mut [f32],
    part: &mut PartGradients,
) {
    let s = x.shape;
    let (group, d, dvd) = (s.group_size(), s.head_dim, s.value_dim);
    let width = keys.len();
    for row in 0..side.lse.len() {
        let allowed = &allowed[row / group * width..(row / group + 1) * width];
        let q_row = &side.q[row * d..(row + 1) * d];
        let dout_row = &side.dout[row * dvd..(row + 1) * dvd];
        let dq_row = &mut dq[row * d..(row + 1) * d];
        let allowed_keys = keys.clone().zip(allowed).filter(|(_, &ok)| ok);
        for key in allowed_keys.map(|(key, _)| key) {
            let k_row = &x.k[(key * s.kv_heads + kv) * d..][..d];
            let v_row = &x.v[(key * s.kv_heads + kv) * dvd..][..dvd];
            let p = (x.scale * dot(q_row, k_row) - side.lse[row]).exp();
            let dp = dot(dout_row, v_row);
            let ds = x.scale * p * (dp - side.delta[row]);
            let at = key - part.keys.start;
            axpy(ds, k_row, dq_row);
            axpy(ds, q_row, &mut part.dk[at * d..(at + 1) * d]);
            axpy(p, dout_row, &mut part.dv[at * dvd..(at + 1) * dvd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_block_once_and_balance_the_work() {
        let problem = VarlenAttention::packed(vec![2000], vec![crate::MaskSpec::Causal]);
        let spans = QuerySpans::build(&problem);
        let blocks = query_blocks(&problem, 32);
        let parts = parts(&blocks, &spans);
        assert!(parts.len() <= PARTS && !parts.is_empty());
        let covered: Vec<usize> = parts.iter().flat_map(|p| p.clone()).collect();
        assert_eq!(covered, (0..blocks.len()).collect::<Vec<_>>());
        let work = |part: &Range<usize>| -> usize {
            blocks[part.clone()]
                .iter()
                .flat_map(|b| b.clone())
                .map(|t| t + 1)
                .sum()
        };
        let (most, total) = (
            parts.iter().map(work).max().unwrap(),
            parts.iter().map(work).sum::<usize>(),
        );
        assert!(most * PARTS < total * 2, "{parts:?}");
    }
}
