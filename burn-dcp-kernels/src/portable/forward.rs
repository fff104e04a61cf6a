//! The portable forward, tiled as flash-attention is on a GPU, with matrix products on the `gemm`
//! crate (the one burn Flex's matmul uses; it picks AVX2/AVX-512/NEON kernels at run time).
//!
//! Work is split into *items*: one key/value head × one block of consecutive query tokens. An
//! item stacks the query rows of every query head that reads that key/value head (GQA), so each
//! key/value tile loaded serves the whole group. Per item, key tiles of [`KEY_TILE`] packed key
//! tokens are swept over the extent of the block's allowed keys, and each tile is classified
//! from the block's key spans:
//! - **empty** (no row may attend any of its keys): skipped, never computed;
//! - **dense** (every row attends every key): `S = scale·Q·Kᵀ` and `O += P·V` are two gemm calls;
//! - **partial**: the same, with disallowed scores set to −∞ before the softmax, so their weights
//!   are exactly 0. Should a value row of the tile be non-finite, `0·NaN` would leak a masked key
//!   into a row, so such tiles accumulate `P·V` row by row over the allowed keys only.
//!
//! The softmax is online (running maximum `m` and sum `l` per row, rescaled as tiles arrive), and
//! `exp` is a vectorisable polynomial ([`exp_shifted`]) accurate to a few ulp. A NaN score among a
//! row's allowed keys makes the row's output and LSE NaN; a row without any allowed key gets a zero
//! output and an LSE of −∞.

use std::ops::Range;

use super::{axpy, nan_max, parallel_map};
use crate::definition::{AttentionShape, VarlenAttention};
use crate::spans::QuerySpans;

/// Packed key tokens per tile.
pub(super) const KEY_TILE: usize = 64;

/// Everything the forward reads: token-major `q [q_tokens, heads, head_dim]`,
/// `k [kv_tokens, kv_heads, head_dim]`, `v [kv_tokens, kv_heads, value_dim]`.
pub(super) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub spans: &'a QuerySpans,
    pub problem: &'a VarlenAttention,
    pub shape: &'a AttentionShape,
    pub scale: f32,
    /// Threads to run the work items on.
    pub threads: usize,
}

/// Query tokens per block for `group` query heads per key/value head: a block stacks
/// `tokens × group` rows, 64 to 128 of them where the sequence is long enough.
pub(super) fn block_tokens(group: usize) -> usize {
    (128 / group.max(1)).clamp(16, 64)
}

/// Packed query token blocks of at most `size` tokens. A new block starts at a query segment's
/// first token when the open block already holds half a block, so long segments get blocks of
/// their own (their tiles line up with causal diagonals) and short ones share.
pub(super) fn query_blocks(problem: &VarlenAttention, size: usize) -> Vec<Range<usize>> {
    let (mut blocks, mut start, mut at) = (Vec::new(), 0, 0);
    for segment in &problem.q_segments {
        if at - start >= size / 2 {
            blocks.push(start..at);
            start = at;
        }
        for _ in 0..segment.len {
            if at - start == size {
                blocks.push(start..at);
                start = at;
            }
            at += 1;
        }
    }
    if at > start {
        blocks.push(start..at);
    }
    blocks
}

/// Forward attention: `(out [q_tokens, heads, value_dim], lse [heads, q_tokens])`.
pub(super) fn tiled(x: Inputs<'_>) -> (Vec<f32>, Vec<f32>) {
    let s = x.shape;
    let group = s.group_size();
    let blocks = query_blocks(x.problem, block_tokens(group));
    let nonfinite_v = nonfinite_prefix(x.v, s.kv_tokens, s.kv_heads, s.value_dim);
    let items = parallel_map(x.threads, s.kv_heads * blocks.len(), |item| {
        let (kv, block) = (item % s.kv_heads, &blocks[item / s.kv_heads]);
        block_forward(&x, &nonfinite_v[kv], kv, block.clone())
    });
    let mut out = vec![0.0f32; s.q_tokens * s.heads * s.value_dim];
    let mut lse = vec![f32::NEG_INFINITY; s.heads * s.q_tokens];
    for (item, (rows_out, rows_lse)) in items.into_iter().enumerate() {
        let (kv, block) = (item % s.kv_heads, &blocks[item / s.kv_heads]);
        let width = group * s.value_dim;
        for (r, t) in block.clone().enumerate() {
            let at = (t * s.heads + kv * group) * s.value_dim;
            out[at..at + width].copy_from_slice(&rows_out[r * width..(r + 1) * width]);
            for g in 0..group {
                lse[(kv * group + g) * s.q_tokens + t] = rows_lse[r * group + g];
            }
        }
    }
    (out, lse)
}

/// Per key/value head, how many of the rows `0..j` of token-major `data [tokens, kv_heads,
/// width]` hold a non-finite entry (index `j`): a range of rows is finite when its two ends agree.
pub(super) fn nonfinite_prefix(
    data: &[f32],
    tokens: usize,
    kv_heads: usize,
    width: usize,
) -> Vec<Vec<u32>> {
    (0..kv_heads)
        .map(|kv| {
            let mut prefix = Vec::with_capacity(tokens + 1);
            let mut count = 0u32;
            prefix.push(count);
            for j in 0..tokens {
                let at = (j * kv_heads + kv) * width;
                count += u32::from(!data[at..at + width].iter().all(|e| e.is_finite()));
                prefix.push(count);
            }
            prefix
        })
        .collect()
}

/// The extent of the allowed keys of `spans` (key ranges of some queries): from the first allowed
/// key to past the last; empty when none is allowed.
pub(super) fn key_extent<'a>(spans: impl IntoIterator<Item = &'a Range<usize>>) -> Range<usize> {
    let (lo, hi) = spans
        .into_iter()
        .filter(|r| !r.is_empty())
        .fold((usize::MAX, 0), |(lo, hi), r| {
            (lo.min(r.start), hi.max(r.end))
        });
    if lo < hi {
        lo..hi
    } else {
        0..0
    }
}

/// The rows of `block` in token-major `data [tokens, heads, width]` that key/value head `kv`'s
/// `group` query heads own, stacked (token, head of the group): per token they are adjacent.
pub(super) fn group_rows(
    data: &[f32],
    block: &Range<usize>,
    heads: usize,
    kv: usize,
    group: usize,
    width: usize,
) -> Vec<f32> {
    let mut rows = Vec::with_capacity(block.len() * group * width);
    for t in block.clone() {
        let at = (t * heads + kv * group) * width;
        rows.extend_from_slice(&data[at..at + group * width]);
    }
    rows
}

/// How a key tile meets a query block.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum TileKind {
    Empty,
    Dense,
    Partial,
}

/// Classifies the tile `keys` for the block's key spans (one slice per query token) and, for a
/// partial tile, fills `allowed [tokens, keys.len()]`.
pub(super) fn classify(
    spans: &[&[Range<usize>]],
    keys: &Range<usize>,
    allowed: &mut [bool],
) -> TileKind {
    let width = keys.len();
    let overlap = |span: &Range<usize>| {
        span.end
            .min(keys.end)
            .saturating_sub(span.start.max(keys.start))
    };
    let counts = spans
        .iter()
        .map(|own| own.iter().map(overlap).sum::<usize>());
    let (mut any, mut all) = (false, true);
    for count in counts {
        any |= count > 0;
        all &= count == width;
    }
    if !any {
        return TileKind::Empty;
    }
    if all {
        return TileKind::Dense;
    }
    let allowed = &mut allowed[..spans.len() * width];
    allowed.fill(false);
    for (r, own) in spans.iter().enumerate() {
        for span in own.iter() {
            let (lo, hi) = (span.start.max(keys.start), span.end.min(keys.end));
            if lo < hi {
                allowed[r * width + lo - keys.start..r * width + hi - keys.start].fill(true);
            }
        }
    }
    TileKind::Partial
}

with_avx2! {
    /// One key/value head × one query block: the block's rows, ordered (token, head of the
    /// group), as `(out [tokens · group, value_dim], lse [tokens · group])`.
    fn block_forward / block_forward_avx2 => block_forward_any(
        x: &Inputs<'_>,
        nonfinite_v: &[u32],
        kv: usize,
        block: Range<usize>,
    ) -> (Vec<f32>, Vec<f32>)
}

#[inline(always)]
fn block_forward_any(
    x: &Inputs<'_>,
    nonfinite_v: &[u32],
    kv: usize,
    block: Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let s = x.shape;
    let (group, d, dv) = (s.group_size(), s.head_dim, s.value_dim);
    let rows = block.len() * group;
    let spans: Vec<&[Range<usize>]> = block.clone().map(|t| x.spans.of(t)).collect();
    let mut out = vec![0.0f32; rows * dv];
    let mut lse = vec![f32::NEG_INFINITY; rows];
    let extent = key_extent(spans.iter().flat_map(|own| own.iter()));
    if extent.is_empty() {
        return (out, lse);
    }
    let q = group_rows(x.q, &block, s.heads, kv, group, d);
    let q = Strided::rows(&q, rows, d, d);
    let mut state = Softmax::new(rows);
    let mut scores = vec![0.0f32; rows * KEY_TILE];
    let mut allowed = vec![false; block.len() * KEY_TILE];
    for first in extent.clone().step_by(KEY_TILE) {
        let keys = first..(first + KEY_TILE).min(extent.end);
        let width = keys.len();
        let kind = classify(&spans, &keys, &mut allowed);
        if kind == TileKind::Empty {
            continue;
        }
        let scores = &mut scores[..rows * width];
        // Kᵀ of the tile: element (dim c, key j) at k[((first + j) · kv_heads + kv) · d + c].
        let k_at = (keys.start * s.kv_heads + kv) * d;
        let k_tile = Strided::rows(&x.k[k_at..], width, d, s.kv_heads * d).t();
        matmul(scores, q, k_tile, x.scale, false);
        let mask = (kind == TileKind::Partial).then(|| &allowed[..block.len() * width]);
        state.absorb(scores, width, group, mask, &mut out, dv);
        let v_at = (keys.start * s.kv_heads + kv) * dv;
        let v_tile = Strided::rows(&x.v[v_at..], width, dv, s.kv_heads * dv);
        let v_finite = nonfinite_v[keys.end] == nonfinite_v[keys.start];
        match mask {
            Some(mask) if !v_finite => {
                for (row, out_row) in out.chunks_exact_mut(dv).enumerate() {
                    let (weights, allowed) = (
                        &scores[row * width..(row + 1) * width],
                        &mask[row / group * width..(row / group + 1) * width],
                    );
                    for (j, (&p, &ok)) in weights.iter().zip(allowed).enumerate() {
                        if ok {
                            axpy(p, &x.v[v_at + j * s.kv_heads * dv..][..dv], out_row);
                        }
                    }
                }
            }
            _ => matmul(
                &mut out,
                Strided::rows(scores, rows, width, width),
                v_tile,
                1.0,
                true,
            ),
        }
    }
    state.finish(&mut out, &mut lse, dv);
    (out, lse)
}

/// The online softmax's running state per row: maximum `m` and sum `l` of `exp(s − m)`.
struct Softmax {
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Softmax {
    fn new(rows: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
        }
    }

    /// Takes in one tile's scores `[rows, width]`: masks them (`mask [rows / group, width]`),
    /// turns them into weights `exp(s − m_new)` in place, rescales each row's `out` and sum to the
    /// new maximum. A row without allowed keys in the tile gets all-zero weights.
    #[inline(always)]
    fn absorb(
        &mut self,
        scores: &mut [f32],
        width: usize,
        group: usize,
        mask: Option<&[bool]>,
        out: &mut [f32],
        dv: usize,
    ) {
        for (row, weights) in scores.chunks_exact_mut(width).enumerate() {
            if let Some(mask) = mask {
                let allowed = &mask[row / group * width..(row / group + 1) * width];
                for (w, &ok) in weights.iter_mut().zip(allowed) {
                    *w = if ok { *w } else { f32::NEG_INFINITY };
                }
            }
            let tile_max = row_max(weights);
            if tile_max == f32::NEG_INFINITY {
                weights.fill(0.0);
                continue;
            }
            let old = self.max[row];
            let new = nan_max(old, tile_max);
            let tile_sum = exp_shifted(weights, new);
            if old == f32::NEG_INFINITY {
                self.sum[row] = tile_sum;
            } else {
                let correction = (old - new).exp();
                if correction != 1.0 {
                    out[row * dv..(row + 1) * dv]
                        .iter_mut()
                        .for_each(|o| *o *= correction);
                }
                self.sum[row] = self.sum[row] * correction + tile_sum;
            }
            self.max[row] = new;
        }
    }

    /// Normalises the rows of `out` and writes their LSE; rows that never saw a key keep a zero
    /// output and an LSE of −∞.
    fn finish(&self, out: &mut [f32], lse: &mut [f32], dv: usize) {
        for (row, out_row) in out.chunks_exact_mut(dv).enumerate() {
            let (max, sum) = (self.max[row], self.sum[row]);
            if max == f32::NEG_INFINITY {
                continue;
            }
            out_row.iter_mut().for_each(|o| *o /= sum);
            lse[row] = max + sum.ln();
        }
    }
}

/// The largest of `x`, NaN if any is NaN, −∞ if `x` is empty or all −∞.
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut nan = [false; 8];
    let chunks = x.chunks_exact(8);
    for &e in chunks.remainder() {
        lanes[0] = if e > lanes[0] { e } else { lanes[0] };
        nan[0] |= e.is_nan();
    }
    for chunk in chunks {
        for i in 0..8 {
            lanes[i] = if chunk[i] > lanes[i] {
                chunk[i]
            } else {
                lanes[i]
            };
            nan[i] |= chunk[i].is_nan();
        }
    }
    if nan.iter().any(|&n| n) {
        return f32::NAN;
    }
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `x ← exp(x − shift)` in place (−∞ ↦ exactly 0, NaN stays NaN); returns the sum.
#[inline(always)]
pub(super) fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    let mut sums = [0.0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for i in 0..8 {
            chunk[i] = exp(chunk[i] - shift);
            sums[i] += chunk[i];
        }
    }
    let mut tail = 0.0f32;
    for e in chunks.into_remainder() {
        *e = exp(*e - shift);
        tail += *e;
    }
    sums.iter().sum::<f32>() + tail
}

/// `eʸ` for `y ≤ 0`-ish softmax arguments, branch-free so loops over it vectorise: range
/// reduction `y = n·ln 2 + r` (`|r| ≤ ln 2 / 2`, `ln 2` split in two for exactness), a degree-5
/// minimax polynomial for `eʳ` (Cephes' `expf` coefficients), and `2ⁿ` built from its exponent
/// bits. Relative error within a few ulp over the normal range; below `ln(2⁻¹²⁶)` the result is 0
/// (f32 subnormals are not produced), above 88 it saturates at `e⁸⁸`; NaN propagates.
#[inline(always)]
fn exp(y: f32) -> f32 {
    const LOWEST: f32 = -87.33;
    const HIGHEST: f32 = 88.0;
    // 1.5·2²³: adding it rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    let c = if y < LOWEST { LOWEST } else { y };
    let c = if c > HIGHEST { HIGHEST } else { c };
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = P
        .iter()
        .fold(0.0f32, |acc, &coefficient| acc * r + coefficient);
    let e = p * r * r + r + 1.0;
    // n ∈ [−126, 127]: its biased exponent n + 127 is a normal float's.
    let bits = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23;
    let power = f32::from_bits(bits);
    if y < LOWEST {
        0.0
    } else {
        e * power
    }
}

/// A read-only strided matrix: element `(i, j)` at `data[i · row_stride + j · col_stride]`.
#[derive(Clone, Copy)]
pub(super) struct Strided<'a> {
    pub(super) data: &'a [f32],
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_stride: usize,
    pub(super) col_stride: usize,
}

impl<'a> Strided<'a> {
    /// Rows of `cols` contiguous values, `row_stride` apart.
    pub(super) fn rows(data: &'a [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        }
    }

    /// The transpose: the same elements, rows and columns swapped.
    pub(super) fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Whether every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// `dst [m, n]` (row-major, contiguous) `← (dst if accumulate) + alpha · lhs [m, k] · rhs [k, n]`,
/// single-threaded (the callers already run one task per core).
pub(super) fn matmul(
    dst: &mut [f32],
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    alpha: f32,
    accumulate: bool,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert!(
        rhs.rows == k && dst.len() >= m * n && lhs.in_bounds() && rhs.in_bounds(),
        "matmul operands out of bounds (an internal tiling bug)"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    // SAFETY: every element gemm reads or writes lies inside the slices (checked above); `dst`
    // is borrowed mutably, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_exact_at_the_edges() {
        let mut worst = 0.0f64;
        let mut y = -87.0f32;
        while y <= 10.0 {
            let (got, want) = (exp(y) as f64, (y as f64).exp());
            worst = worst.max((got - want).abs() / want);
            y += 0.013;
        }
        assert!(
            worst < 4.0 * f32::EPSILON as f64,
            "worst relative error {worst}"
        );
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn row_max_propagates_nan_and_sees_every_lane() {
        for len in [0usize, 1, 7, 8, 9, 23] {
            for at in 0..len {
                let mut x = vec![-1.0f32; len];
                x[at] = 5.0;
                assert_eq!(row_max(&x), 5.0, "len {len} at {at}");
                x[at] = f32::NAN;
                assert!(row_max(&x).is_nan(), "len {len} at {at}");
            }
        }
        assert_eq!(row_max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn query_blocks_cover_every_token_once() {
        let problem = VarlenAttention::packed(vec![100, 3, 5, 70], vec![crate::MaskSpec::Causal]);
        let blocks = query_blocks(&problem, 64);
        let tokens: Vec<usize> = blocks.iter().flat_map(|b| b.clone()).collect();
        assert_eq!(tokens, (0..178).collect::<Vec<_>>());
        assert!(blocks.iter().all(|b| !b.is_empty() && b.len() <= 64));
        // The 100-token sequence ends its second block (36 ≥ 32 tokens) at its last token; the
        // short ones share a block that then takes the next sequence's first tokens.
        assert_eq!(blocks, vec![0..64, 64..100, 100..164, 164..178]);
    }
}
