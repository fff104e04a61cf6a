//! Naive dense attention in f64: the oracle for tests.
//!
//! It materialises every (query, key) score, decides each with [`MaskSpec::allows`] (the mask rule
//! as written, not the key-range form the kernels use) and applies softmax row by row. Slow and
//! simple on purpose: it shares no code with the kernels beyond the problem description.
//!
//! [`MaskSpec::allows`]: crate::MaskSpec::allows

use crate::definition::{AttentionShape, KernelError, TokenPositions, VarlenAttention};
use crate::portable::{HostForward, HostGradients};

/// Dense probabilities `p[h][i][j]` (0 where masked) and the LSE of every (head, query).
struct Dense {
    p: Vec<Vec<Vec<f64>>>,
    lse: Vec<Vec<f64>>,
}

fn row(data: &[f32], token: usize, head: usize, heads: usize, dim: usize) -> &[f32] {
    let at = (token * heads + head) * dim;
    &data[at..at + dim]
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn dense(q: &[f32], k: &[f32], s: &AttentionShape, problem: &VarlenAttention) -> Dense {
    let qp = TokenPositions::of(&problem.q_segments);
    let kp = TokenPositions::of(&problem.kv_segments);
    let scale = problem.softmax_scale(s.head_dim);
    let mut p = vec![vec![vec![0.0; s.kv_tokens]; s.q_tokens]; s.heads];
    let mut lse = vec![vec![f64::NEG_INFINITY; s.q_tokens]; s.heads];
    for h in 0..s.heads {
        let kv = h / s.group_size();
        for i in 0..s.q_tokens {
            let (seq, len) = (qp.seq[i], problem.seq_lens[qp.seq[i]]);
            let allowed: Vec<usize> = (0..s.kv_tokens)
                .filter(|&j| {
                    kp.seq[j] == seq && problem.mask(seq).allows(qp.pos[i], kp.pos[j], len)
                })
                .collect();
            if allowed.is_empty() {
                continue;
            }
            let q_row = row(q, i, h, s.heads, s.head_dim);
            let scores: Vec<f64> = allowed
                .iter()
                .map(|&j| scale * dot64(q_row, row(k, j, kv, s.kv_heads, s.head_dim)))
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
            lse[h][i] = max + sum.ln();
            for (&j, score) in allowed.iter().zip(&scores) {
                p[h][i][j] = (score - lse[h][i]).exp();
            }
        }
    }
    Dense { p, lse }
}

/// Naive forward: `out [q_tokens, heads, value_dim]`, `lse [heads, q_tokens]`.
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    problem: &VarlenAttention,
    shape: &AttentionShape,
) -> Result<HostForward, KernelError> {
    problem.validate(shape)?;
    let s = shape;
    let dense = dense(q, k, s, problem);
    let mut out = vec![0.0f32; s.q_tokens * s.heads * s.value_dim];
    for h in 0..s.heads {
        let kv = h / s.group_size();
        for i in 0..s.q_tokens {
            for c in 0..s.value_dim {
                let value: f64 = (0..s.kv_tokens)
                    .map(|j| dense.p[h][i][j] * row(v, j, kv, s.kv_heads, s.value_dim)[c] as f64)
                    .sum();
                out[(i * s.heads + h) * s.value_dim + c] = value as f32;
            }
        }
    }
    let lse = dense.lse.iter().flatten().map(|&x| x as f32).collect();
    Ok(HostForward { out, lse })
}

/// Naive backward of `loss = Σ out ∘ dout` by the dense softmax Jacobian (no LSE tricks).
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    problem: &VarlenAttention,
    shape: &AttentionShape,
) -> Result<HostGradients, KernelError> {
    problem.validate(shape)?;
    let s = shape;
    let dense = dense(q, k, s, problem);
    let scale = problem.softmax_scale(s.head_dim);
    let (d, dv_dim) = (s.head_dim, s.value_dim);
    let mut dq = vec![0.0f64; s.q_tokens * s.heads * d];
    let mut dk = vec![0.0f64; s.kv_tokens * s.kv_heads * d];
    let mut dv = vec![0.0f64; s.kv_tokens * s.kv_heads * dv_dim];
    for h in 0..s.heads {
        let kv = h / s.group_size();
        for i in 0..s.q_tokens {
            let p = &dense.p[h][i];
            let dout_row = row(dout, i, h, s.heads, dv_dim);
            // dP_ij = dout_i · v_j; dS_ij = P_ij (dP_ij − Σ_l P_il dP_il).
            let dp: Vec<f64> = (0..s.kv_tokens)
                .map(|j| dot64(dout_row, row(v, j, kv, s.kv_heads, dv_dim)))
                .collect();
            let weighted: f64 = (0..s.kv_tokens).map(|j| p[j] * dp[j]).sum();
            for j in (0..s.kv_tokens).filter(|&j| p[j] != 0.0) {
                let ds = p[j] * (dp[j] - weighted) * scale;
                let (q_row, k_row) = (row(q, i, h, s.heads, d), row(k, j, kv, s.kv_heads, d));
                for c in 0..d {
                    dq[(i * s.heads + h) * d + c] += ds * k_row[c] as f64;
                    dk[(j * s.kv_heads + kv) * d + c] += ds * q_row[c] as f64;
                }
                for c in 0..dv_dim {
                    dv[(j * s.kv_heads + kv) * dv_dim + c] += p[j] * dout_row[c] as f64;
                }
            }
        }
    }
    let to_f32 = |x: Vec<f64>| x.into_iter().map(|v| v as f32).collect();
    Ok(HostGradients {
        dq: to_f32(dq),
        dk: to_f32(dk),
        dv: to_f32(dv),
    })
}
