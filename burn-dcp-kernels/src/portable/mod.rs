//! Portable attention with LSE on host memory (f32), for CPU backends such as burn Flex.
//!
//! Exact attention over packed varlen sequences. Only the keys the mask allows (per query, the at
//! most two key ranges of [`MaskSpec::key_ranges`](crate::MaskSpec::key_ranges)) contribute, and
//! work on masked keys is skipped, not computed and discarded: the forward (`forward`)
//! is tiled like flash-attention, skipping key tiles no query of a block may attend and running
//! the others as `gemm` matrix products; the backward is tiled the same way (flash-attention 2's
//! five products per tile). Work runs on a persistent pool, as many workers per call as the
//! thread budget gives ([`threads`]: the process's cores shared among its ranks, or
//! `BURN_DCP_CPU_THREADS`): one task per key/value head and query block in the forward, per
//! key/value head and part of the query blocks in the backward.
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

use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::spans::QuerySpans;

mod backward;
mod forward;
mod pool;

use pool::parallel_map;
pub use pool::{cores, threads, RankThreads, THREADS_VAR};

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
    let (dq, dk, dv) = backward::tiled(backward::Inputs {
        q,
        k,
        v,
        out,
        lse,
        dout,
        spans: &spans,
        problem,
        shape: s,
        scale,
        threads: threads()?,
    });
    Ok(HostGradients { dq, dk, dv })
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
