//! Portable attention with LSE on host memory (f32), for CPU backends such as burn Flex.
//!
//! Exact attention over packed varlen sequences, visiting only the keys the mask allows (per
//! query, the at most two key ranges of [`MaskSpec::key_ranges`](crate::MaskSpec::key_ranges)),
//! so masked work is skipped, not computed and discarded. Heads run in parallel on scoped threads.
//!
//! Numerics (f32 throughout, as flash-attention accumulates):
//! - forward: `lse_i = m_i + ln Σ_j exp(s_ij − m_i)` with `s_ij = scale·q_i·k_j`, `m_i = max_j s_ij`;
//!   `out_i = Σ_j exp(s_ij − lse_i) v_j`. A query with no allowed key gets `out = 0`, `lse = −∞`.
//! - backward (from the *final* `out`, `lse`): `p_ij = exp(s_ij − lse_i)`,
//!   `δ_i = dout_i·out_i`, `ds_ij = p_ij (dout_i·v_j − δ_i)`, `dq_i = scale Σ_j ds_ij k_j`,
//!   `dk_j = scale Σ_i ds_ij q_i`, `dv_j = Σ_i p_ij dout_i`. Because `lse` and `out` are final, the
//!   gradients of a partial key set (a ring step) are exact partial sums of the full gradients.
//! - merge: `lse = ln(e^{lse_a} + e^{lse_b})`, `out = e^{lse_a − lse} out_a + e^{lse_b − lse} out_b`
//!   (both parts are softmax-normalised over disjoint key sets, so re-weighting by their share of
//!   the total mass gives the softmax over the union).

use std::ops::Range;

use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::spans::QuerySpans;

/// Output of the forward pass: `out [q_tokens, heads, value_dim]`, `lse [heads, q_tokens]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostForward {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

/// Gradients: `dq [q_tokens, heads, head_dim]`, `dk [kv_tokens, kv_heads, head_dim]`,
/// `dv [kv_tokens, kv_heads, value_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostGradients {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// `[tokens, heads, dim]` → `[heads][tokens, dim]` (head-major, so inner loops are contiguous).
fn to_head_major(data: &[f32], tokens: usize, heads: usize, dim: usize) -> Vec<Vec<f32>> {
    (0..heads)
        .map(|h| {
            let mut out = Vec::with_capacity(tokens * dim);
            for t in 0..tokens {
                let at = (t * heads + h) * dim;
                out.extend_from_slice(&data[at..at + dim]);
            }
            out
        })
        .collect()
}

/// `[heads][tokens, dim]` → `[tokens, heads, dim]`.
fn to_token_major(per_head: &[Vec<f32>], tokens: usize, dim: usize) -> Vec<f32> {
    let heads = per_head.len();
    let mut out = vec![0.0; tokens * heads * dim];
    for (h, data) in per_head.iter().enumerate() {
        for t in 0..tokens {
            let at = (t * heads + h) * dim;
            out[at..at + dim].copy_from_slice(&data[t * dim..(t + 1) * dim]);
        }
    }
    out
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn axpy(alpha: f32, x: &[f32], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(x) {
        *o += alpha * x;
    }
}

/// [`dot`] of four rows with one `b`, each with `dot`'s exact arithmetic, `b` read once.
#[inline(always)]
fn dot4(a: [&[f32]; QUERY_BLOCK], b: &[f32]) -> [f32; QUERY_BLOCK] {
    let n = b.len();
    let a = a.map(|row| &row[..n]);
    let body = n - n % 8;
    let mut acc = [[0.0f32; 8]; QUERY_BLOCK];
    for c in (0..body).step_by(8) {
        let y: [f32; 8] = b[c..c + 8].try_into().expect("eight values");
        for (r, row) in a.iter().enumerate() {
            let x: [f32; 8] = row[c..c + 8].try_into().expect("eight values");
            for i in 0..8 {
                acc[r][i] += x[i] * y[i];
            }
        }
    }
    std::array::from_fn(|r| {
        let tail: f32 = a[r][body..]
            .iter()
            .zip(&b[body..])
            .map(|(x, y)| x * y)
            .sum();
        acc[r].iter().sum::<f32>() + tail
    })
}

/// [`axpy`] of one `x` into four rows, `x` read once.
#[inline(always)]
fn axpy4(alpha: [f32; QUERY_BLOCK], x: &[f32], out: &mut [&mut [f32]; QUERY_BLOCK]) {
    let n = x.len();
    let [o0, o1, o2, o3] = out;
    let (o0, o1, o2, o3) = (&mut o0[..n], &mut o1[..n], &mut o2[..n], &mut o3[..n]);
    for i in 0..n {
        let xi = x[i];
        o0[i] += alpha[0] * xi;
        o1[i] += alpha[1] * xi;
        o2[i] += alpha[2] * xi;
        o3[i] += alpha[3] * xi;
    }
}

/// Runs `task(i)` for `i in 0..count` on up to `available_parallelism` scoped threads, in order.
fn parallel_map<T: Send>(count: usize, task: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(count)
        .max(1);
    if workers == 1 {
        return (0..count).map(task).collect();
    }
    let task = &task;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    (w..count)
                        .step_by(workers)
                        .map(|i| (i, task(i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut results: Vec<(usize, T)> = handles
            .into_iter()
            .flat_map(|h| h.join().expect("attention worker thread panicked"))
            .collect();
        results.sort_by_key(|(i, _)| *i);
        results.into_iter().map(|(_, r)| r).collect()
    })
}

fn check_len(name: &str, data: &[f32], expected: usize) -> Result<(), KernelError> {
    if data.len() != expected {
        return Err(KernelError::InvalidShape(format!(
            "{name} holds {} values, expected {expected}",
            data.len()
        )));
    }
    Ok(())
}

/// Forward attention with LSE. Inputs are token-major f32 (see [`VarlenAttention`]).
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    problem: &VarlenAttention,
) -> Result<HostForward, KernelError> {
    problem.validate(shape)?;
    let s = shape;
    check_len("q", q, s.q_tokens * s.heads * s.head_dim)?;
    check_len("k", k, s.kv_tokens * s.kv_heads * s.head_dim)?;
    check_len("v", v, s.kv_tokens * s.kv_heads * s.value_dim)?;
    let spans = QuerySpans::build(problem);
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let (qh, kh, vh) = (
        to_head_major(q, s.q_tokens, s.heads, s.head_dim),
        to_head_major(k, s.kv_tokens, s.kv_heads, s.head_dim),
        to_head_major(v, s.kv_tokens, s.kv_heads, s.value_dim),
    );
    let per_head = parallel_map(s.heads, |h| {
        let kv = h / s.group_size();
        forward_head(&qh[h], &kh[kv], &vh[kv], &spans, s, scale)
    });
    let (outs, lses): (Vec<_>, Vec<_>) = per_head.into_iter().unzip();
    Ok(HostForward {
        out: to_token_major(&outs, s.q_tokens, s.value_dim),
        lse: lses.concat(),
    })
}

/// One query head: `(out [q_tokens, value_dim], lse [q_tokens])`, compiled for AVX2 where the CPU
/// has it (the same arithmetic, eight lanes wide instead of four: the same bits).
fn forward_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &QuerySpans,
    s: &AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { forward_head_avx2(q, k, v, spans, s, scale) };
    }
    forward_head_any(q, k, v, spans, s, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn forward_head_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &QuerySpans,
    s: &AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    forward_head_any(q, k, v, spans, s, scale)
}

/// Queries of one register block: each key and value row loaded serves all of them.
const QUERY_BLOCK: usize = 4;

/// [`forward_head`] for the caller's target features: blocks of [`QUERY_BLOCK`] queries whose
/// key sets nearly coincide share every key/value row load ([`KeyBlock`]); other queries run one
/// at a time. Both paths compute each query's result with the same arithmetic.
#[inline(always)]
fn forward_head_any(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &QuerySpans,
    s: &AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (d, dv) = (s.head_dim, s.value_dim);
    let mut out = vec![0.0f32; s.q_tokens * dv];
    let mut lse = vec![f32::NEG_INFINITY; s.q_tokens];
    let mut scores = Vec::new();
    let mut block = KeyBlock::default();
    let mut first = 0;
    while first < s.q_tokens {
        let end = (first + QUERY_BLOCK).min(s.q_tokens);
        if end - first == QUERY_BLOCK && block.plan(spans, first) {
            let rows = &mut out[first * dv..end * dv];
            let lse_rows = &mut lse[first..end];
            block.forward(&q[first * d..end * d], k, v, d, dv, scale, rows, lse_rows);
        } else {
            for t in first..end {
                let row = &mut out[t * dv..(t + 1) * dv];
                lse[t] = forward_query(
                    &q[t * d..(t + 1) * d],
                    k,
                    v,
                    spans.of(t),
                    d,
                    dv,
                    scale,
                    &mut scores,
                    row,
                );
            }
        }
        first = end;
    }
    (out, lse)
}

/// One query: writes its `out` row, returns its LSE (`−∞` and a zero row without keys).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn forward_query(
    q_row: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &[Range<usize>],
    d: usize,
    dv: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out_row: &mut [f32],
) -> f32 {
    scores.clear();
    for span in spans {
        scores.extend(
            span.clone()
                .map(|j| scale * dot(q_row, &k[j * d..(j + 1) * d])),
        );
    }
    if scores.is_empty() {
        return f32::NEG_INFINITY;
    }
    // `f32::max` ignores NaN; a NaN score must poison the row (NaN out and LSE), never look
    // like a masked row, so the maximum propagates it.
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, nan_max);
    let mut sum = 0.0f32;
    let keys = spans.iter().flat_map(|span| span.clone());
    for (j, &score) in keys.zip(scores.iter()) {
        let weight = (score - max).exp();
        sum += weight;
        axpy(weight, &v[j * dv..(j + 1) * dv], out_row);
    }
    out_row.iter_mut().for_each(|o| *o /= sum);
    max + sum.ln()
}

/// The union of the key spans of a block of [`QUERY_BLOCK`] queries, which of its keys each query
/// may attend, and the block's scores.
#[derive(Default)]
struct KeyBlock {
    /// Sorted, merged runs of packed key indices: the union of the queries' spans.
    keys: Vec<Range<usize>>,
    /// Keys in the union.
    len: usize,
    /// `[QUERY_BLOCK, len]`: whether query `r` may attend the union's key `u`.
    allowed: Vec<bool>,
    /// Per key of the union: every query of the block may attend it.
    shared: Vec<bool>,
    /// `[QUERY_BLOCK, len]`: scores, then softmax weights.
    scores: Vec<f32>,
}

impl KeyBlock {
    /// Plans the block of queries `first..first + QUERY_BLOCK`; false when the union of their
    /// keys exceeds the largest single key set by more than a quarter (plus 8): then computing
    /// the union for every query would waste work, and the queries run one at a time.
    #[inline(always)]
    fn plan(&mut self, spans: &QuerySpans, first: usize) -> bool {
        self.keys.clear();
        let mut largest = 0;
        for t in first..first + QUERY_BLOCK {
            let own = spans.of(t);
            largest = largest.max(own.iter().map(ExactSizeIterator::len).sum::<usize>());
            self.keys.extend(own.iter().cloned());
        }
        self.keys.sort_unstable_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(self.keys.len());
        for range in self.keys.drain(..) {
            match merged.last_mut() {
                Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
                _ => merged.push(range),
            }
        }
        self.keys = merged;
        self.len = self.keys.iter().map(ExactSizeIterator::len).sum();
        if largest == 0 || self.len > largest + largest / 4 + 8 {
            return false;
        }
        let len = self.len;
        self.allowed.clear();
        self.allowed.resize(QUERY_BLOCK * len, false);
        for r in 0..QUERY_BLOCK {
            for span in spans.of(first + r) {
                // A span lies inside one run of the union (the runs are merged unions of spans).
                let mut at = 0;
                for run in &self.keys {
                    if run.start <= span.start && span.end <= run.end {
                        let u = at + span.start - run.start;
                        self.allowed[r * len + u..r * len + u + span.len()].fill(true);
                        break;
                    }
                    at += run.len();
                }
            }
        }
        self.shared.clear();
        self.shared
            .extend((0..len).map(|u| (0..QUERY_BLOCK).all(|r| self.allowed[r * len + u])));
        true
    }

    /// The block's forward: each key row is read once for the block's four dot products, each
    /// value row once for the four accumulations where all four queries attend it. Per query the
    /// arithmetic is [`forward_query`]'s, over its keys in ascending order.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        q_rows: &[f32],
        k: &[f32],
        v: &[f32],
        d: usize,
        dv: usize,
        scale: f32,
        out_rows: &mut [f32],
        lse: &mut [f32],
    ) {
        let len = self.len;
        self.scores.clear();
        self.scores.resize(QUERY_BLOCK * len, 0.0);
        let q: [&[f32]; QUERY_BLOCK] = std::array::from_fn(|r| &q_rows[r * d..(r + 1) * d]);
        let mut u = 0;
        for run in &self.keys {
            for j in run.clone() {
                let dots = dot4(q, &k[j * d..(j + 1) * d]);
                for (r, value) in dots.into_iter().enumerate() {
                    self.scores[r * len + u] = scale * value;
                }
                u += 1;
            }
        }
        let mut sums = [0.0f32; QUERY_BLOCK];
        let mut maxima = [f32::NEG_INFINITY; QUERY_BLOCK];
        let mut seen = [false; QUERY_BLOCK];
        for r in 0..QUERY_BLOCK {
            let (scores, allowed) = (
                &mut self.scores[r * len..(r + 1) * len],
                &self.allowed[r * len..(r + 1) * len],
            );
            let mut max = f32::NEG_INFINITY;
            for (score, &ok) in scores.iter().zip(allowed) {
                if ok {
                    max = nan_max(max, *score);
                    seen[r] = true;
                }
            }
            let mut sum = 0.0f32;
            for (score, &ok) in scores.iter_mut().zip(allowed) {
                *score = if ok { (*score - max).exp() } else { 0.0 };
                sum += *score;
            }
            (sums[r], maxima[r]) = (sum, max);
        }
        let (o0, rest) = out_rows.split_at_mut(dv);
        let (o1, rest) = rest.split_at_mut(dv);
        let (o2, o3) = rest.split_at_mut(dv);
        let mut rows = [o0, o1, o2, o3];
        let mut u = 0;
        for run in &self.keys {
            for j in run.clone() {
                let v_row = &v[j * dv..(j + 1) * dv];
                if self.shared[u] {
                    let weights = std::array::from_fn(|r| self.scores[r * len + u]);
                    axpy4(weights, v_row, &mut rows);
                } else {
                    for (r, row) in rows.iter_mut().enumerate() {
                        if self.allowed[r * len + u] {
                            axpy(self.scores[r * len + u], v_row, row);
                        }
                    }
                }
                u += 1;
            }
        }
        for (r, row) in rows.into_iter().enumerate() {
            if seen[r] {
                row.iter_mut().for_each(|o| *o /= sums[r]);
                lse[r] = maxima[r] + sums[r].ln();
            }
        }
    }
}

/// Backward attention from the final `out` and `lse` of the forward pass and `dout`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    shape: &AttentionShape,
    problem: &VarlenAttention,
) -> Result<HostGradients, KernelError> {
    problem.validate(shape)?;
    let s = shape;
    check_len("q", q, s.q_tokens * s.heads * s.head_dim)?;
    check_len("k", k, s.kv_tokens * s.kv_heads * s.head_dim)?;
    check_len("v", v, s.kv_tokens * s.kv_heads * s.value_dim)?;
    check_len("out", out, s.q_tokens * s.heads * s.value_dim)?;
    check_len("dout", dout, s.q_tokens * s.heads * s.value_dim)?;
    check_len("lse", lse, s.heads * s.q_tokens)?;
    let spans = QuerySpans::build(problem);
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let qh = to_head_major(q, s.q_tokens, s.heads, s.head_dim);
    let kh = to_head_major(k, s.kv_tokens, s.kv_heads, s.head_dim);
    let vh = to_head_major(v, s.kv_tokens, s.kv_heads, s.value_dim);
    let outh = to_head_major(out, s.q_tokens, s.heads, s.value_dim);
    let douth = to_head_major(dout, s.q_tokens, s.heads, s.value_dim);
    let per_kv_head = parallel_map(s.kv_heads, |kv| {
        let inputs = HeadInputs {
            k: &kh[kv],
            v: &vh[kv],
            spans: &spans,
            shape: s,
            scale,
        };
        let heads = kv * s.group_size()..(kv + 1) * s.group_size();
        backward_kv_head(&inputs, heads, &qh, &outh, &douth, lse)
    });
    let mut dq_heads = Vec::with_capacity(s.heads);
    let (mut dk_heads, mut dv_heads) = (Vec::new(), Vec::new());
    for (dq, dk, dv) in per_kv_head {
        dq_heads.extend(dq);
        dk_heads.push(dk);
        dv_heads.push(dv);
    }
    Ok(HostGradients {
        dq: to_token_major(&dq_heads, s.q_tokens, s.head_dim),
        dk: to_token_major(&dk_heads, s.kv_tokens, s.head_dim),
        dv: to_token_major(&dv_heads, s.kv_tokens, s.value_dim),
    })
}

/// The key/value side of one backward task.
struct HeadInputs<'a> {
    k: &'a [f32],
    v: &'a [f32],
    spans: &'a QuerySpans,
    shape: &'a AttentionShape,
    scale: f32,
}

/// Gradients of one key/value head and the query heads that read it:
/// `(dq per query head, dk [kv_tokens, head_dim], dv [kv_tokens, value_dim])`.
fn backward_kv_head(
    inputs: &HeadInputs,
    heads: Range<usize>,
    q: &[Vec<f32>],
    out: &[Vec<f32>],
    dout: &[Vec<f32>],
    lse: &[f32],
) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let s = inputs.shape;
    let (d, dv_dim) = (s.head_dim, s.value_dim);
    let mut dk = vec![0.0f32; s.kv_tokens * d];
    let mut dv = vec![0.0f32; s.kv_tokens * dv_dim];
    let mut dqs = Vec::with_capacity(heads.len());
    for h in heads {
        let mut dq = vec![0.0f32; s.q_tokens * d];
        for t in 0..s.q_tokens {
            // Only a query without any allowed key has no gradient (its LSE is −∞). A NaN or
            // infinite LSE with keys comes from non-finite inputs and must reach the gradients.
            if inputs.spans.of(t).iter().all(|span| span.is_empty()) {
                continue;
            }
            let row_lse = lse[h * s.q_tokens + t];
            let q_row = &q[h][t * d..(t + 1) * d];
            let dout_row = &dout[h][t * dv_dim..(t + 1) * dv_dim];
            let delta = dot(dout_row, &out[h][t * dv_dim..(t + 1) * dv_dim]);
            let dq_row = &mut dq[t * d..(t + 1) * d];
            for j in inputs.spans.of(t).iter().flat_map(|span| span.clone()) {
                let k_row = &inputs.k[j * d..(j + 1) * d];
                let p = (inputs.scale * dot(q_row, k_row) - row_lse).exp();
                let dp = dot(dout_row, &inputs.v[j * dv_dim..(j + 1) * dv_dim]);
                let ds = inputs.scale * p * (dp - delta);
                axpy(ds, k_row, dq_row);
                axpy(ds, q_row, &mut dk[j * d..(j + 1) * d]);
                axpy(p, dout_row, &mut dv[j * dv_dim..(j + 1) * dv_dim]);
            }
        }
        dqs.push(dq);
    }
    (dqs, dk, dv)
}

/// Merges partial results over disjoint key sets: `(out_b, lse_b)` into `(out_a, lse_a)`.
/// `out [tokens, heads, value_dim]`, `lse [heads, tokens]`.
pub fn merge(
    out_a: &mut [f32],
    lse_a: &mut [f32],
    out_b: &[f32],
    lse_b: &[f32],
    heads: usize,
    value_dim: usize,
) -> Result<(), KernelError> {
    if out_a.len() != out_b.len() || lse_a.len() != lse_b.len() || heads * value_dim == 0 {
        return Err(KernelError::InvalidShape(format!(
            "merge of out {} / {} values and lse {} / {} values with {heads} heads of dim {value_dim}",
            out_a.len(),
            out_b.len(),
            lse_a.len(),
            lse_b.len()
        )));
    }
    let tokens = lse_a.len() / heads;
    check_len("out", out_a, tokens * heads * value_dim)?;
    for h in 0..heads {
        for t in 0..tokens {
            let (a, b) = (lse_a[h * tokens + t], lse_b[h * tokens + t]);
            let merged = log_add_exp(a, b);
            let (wa, wb) = if merged == f32::NEG_INFINITY {
                (0.0, 0.0)
            } else {
                ((a - merged).exp(), (b - merged).exp())
            };
            let at = (t * heads + h) * value_dim;
            let rows = out_a[at..at + value_dim]
                .iter_mut()
                .zip(&out_b[at..at + value_dim]);
            for (oa, ob) in rows {
                *oa = wa * *oa + wb * ob;
            }
            lse_a[h * tokens + t] = merged;
        }
    }
    Ok(())
}

/// The larger of `a` and `b`, NaN if either is NaN (unlike `f32::max`).
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// `ln(eᵃ + eᵇ)`, exact at −∞; NaN if either input is NaN (a NaN partial result must not vanish
/// when merged with a part that saw no key).
pub fn log_add_exp(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        return f32::NAN;
    }
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if hi == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    hi + (lo - hi).exp().ln_1p()
}
