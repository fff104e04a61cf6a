//! Portable attention with LSE on host memory (f32), for CPU backends such as burn Flex.
//!
//! Exact attention over packed varlen sequences. Only the keys the mask allows (per query, the at
//! most two key ranges of [`MaskSpec::key_ranges`](crate::MaskSpec::key_ranges)) contribute, and
//! work on masked keys is skipped, not computed and discarded: the forward (`forward`)
//! is tiled like flash-attention, skipping key tiles no query of a block may attend and running
//! the others as `gemm` matrix products; the backward visits each query's allowed keys. Work runs
//! in parallel on scoped threads (one task per key/value head and query block, or per key/value
//! head in the backward).
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

mod forward;

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

/// The environment variable that caps the portable kernels' threads (default: every core).
pub const THREADS_VAR: &str = "BURN_DCP_CPU_THREADS";

/// Threads the portable kernels use: `BURN_DCP_CPU_THREADS` when set (a positive integer, else
/// an error naming the value), else every core (`available_parallelism`).
pub fn threads() -> Result<usize, KernelError> {
    match std::env::var(THREADS_VAR) {
        Ok(value) => match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(KernelError::InvalidValue(format!(
                "{THREADS_VAR}={value:?}: the portable kernels' thread count must be a positive \
                 integer"
            ))),
        },
        Err(_) => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// Runs `task(i)` for `i in 0..count` on up to `threads` scoped threads, in order.
fn parallel_map<T: Send>(threads: usize, count: usize, task: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let workers = threads.min(count).max(1);
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
    let (out, lse) = forward::tiled(forward::Inputs {
        q,
        k,
        v,
        spans: &spans,
        problem,
        shape: s,
        scale,
        threads: threads()?,
    });
    Ok(HostForward { out, lse })
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
    let per_kv_head = parallel_map(threads()?, s.kv_heads, |kv| {
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
