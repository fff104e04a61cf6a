//! The portable kernels' entry points on host slices: forward, backward, merge, with their
//! shape checks.

use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::spans::QuerySpans;

use super::log_add_exp;
use super::pool::threads;

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

fn check_len(name: &str, data: &[f32], expected: usize) -> Result<(), KernelError> {
    if data.len() != expected {
        return Err(KernelError::InvalidShape(format!(
            "{name} holds {} values, expected {expected}",
            data.len()
        )));
    }
    Ok(())
}

/// Checks the problem against the shape, then the lengths of `q`, `k` and `v` against it.
fn check_inputs(
    problem: &VarlenAttention,
    s: &AttentionShape,
    [q, k, v]: [&[f32]; 3],
) -> Result<(), KernelError> {
    problem.validate(s)?;
    check_len("q", q, s.q_tokens * s.heads * s.head_dim)?;
    check_len("k", k, s.kv_tokens * s.kv_heads * s.head_dim)?;
    check_len("v", v, s.kv_tokens * s.kv_heads * s.value_dim)
}

/// Forward attention with LSE. Inputs are token-major f32 (see [`VarlenAttention`]).
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    problem: &VarlenAttention,
) -> Result<HostForward, KernelError> {
    let s = shape;
    check_inputs(problem, s, [q, k, v])?;
    let spans = QuerySpans::build(problem);
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let (out, lse) = super::forward::tiled(super::forward::Inputs {
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
    let s = shape;
    check_inputs(problem, s, [q, k, v])?;
    check_len("out", out, s.q_tokens * s.heads * s.value_dim)?;
    check_len("dout", dout, s.q_tokens * s.heads * s.value_dim)?;
    check_len("lse", lse, s.heads * s.q_tokens)?;
    let spans = QuerySpans::build(problem);
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let (dq, dk, dv) = super::backward::tiled(super::backward::Inputs {
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
