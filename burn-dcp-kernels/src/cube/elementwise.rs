//! The element-wise kernels beside the flash kernels, one unit per (head, query): the
//! backward's `delta = rowsum(dO ∘ O)` and the merge of two partial results `(out, lse)`.
//!
//! No infinity is ever written as a literal (WGSL forbids it): "no key yet" is the finite
//! sentinel [`NONE`], and the `-inf` of fully masked rows comes in as a runtime scalar.

use cubecl::prelude::*;

/// The running maximum before any key: far below any real score, still finite.
pub(crate) const NONE: f32 = -3.0e38;
/// Scores and LSE values below this are "no key" (the sentinel or `-inf`).
pub(crate) const NONE_LIMIT: f32 = -1.0e38;

/// This unit's `(head, query)` of a `[tokens, heads, ..]` tensor, and whether the launch's
/// `tokens · heads` units reach it (the last cube's extra units do not): one unit per row.
#[cube]
fn unit_row<F: Float>(rows: &Tensor<F>) -> (usize, usize, bool) {
    let tokens = rows.shape(0);
    let index = ABSOLUTE_POS;
    (
        index / tokens,
        index % tokens,
        index < tokens * rows.shape(1),
    )
}

/// Backward preprocess: `delta [H, Tq] = rowsum(dout ∘ out)` in f32. One unit per (head, query).
#[cube(launch_unchecked)]
pub fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    dout: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (head, query, live) = unit_row::<F>(out);
    if !live {
        terminate!();
    }
    let out_base = query * out.stride(0) + head * out.stride(1);
    let dout_base = query * dout.stride(0) + head * dout.stride(1);
    let mut total = f32::new(0.0);
    #[unroll]
    for d in 0..value_dim {
        total += f32::cast_from(out[out_base + d * out.stride(2)])
            * f32::cast_from(dout[dout_base + d * dout.stride(2)]);
    }
    delta[head * delta.stride(0) + query * delta.stride(1)] = total;
}

/// The merge weights of two partial results: `(w_a, w_b, lse)` with `w_a + w_b = 1`, or zeros
/// and the (−∞) input when neither part saw a key.
#[cube]
fn merge_weights(lse_a: f32, lse_b: f32) -> (f32, f32, f32) {
    let high = max(lse_a, lse_b);
    let mut weight_a = f32::new(0.0);
    let mut weight_b = f32::new(0.0);
    let mut merged = high;
    // A NaN part poisons the merge (NaN out and lse) instead of being weighted away.
    let poisoned = lse_a.is_nan() || lse_b.is_nan();
    if poisoned {
        merged = lse_a + lse_b;
        weight_a = merged;
        weight_b = merged;
    } else if high > NONE_LIMIT {
        if lse_a > NONE_LIMIT {
            weight_a = (lse_a - high).exp();
        }
        if lse_b > NONE_LIMIT {
            weight_b = (lse_b - high).exp();
        }
        let total = weight_a + weight_b;
        merged = high + total.ln();
        weight_a /= total;
        weight_b /= total;
    }
    (weight_a, weight_b, merged)
}

/// Merge into fresh outputs: `out`, `lse` ← merge of `(out_a, lse_a)` and `(out_b, lse_b)`.
/// One unit per (head, query).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn merge_kernel<F: Float>(
    out_a: &Tensor<F>,
    lse_a: &Tensor<f32>,
    out_b: &Tensor<F>,
    lse_b: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (head, query, live) = unit_row::<F>(out_a);
    if !live {
        terminate!();
    }
    let a = lse_a[head * lse_a.stride(0) + query * lse_a.stride(1)];
    let b = lse_b[head * lse_b.stride(0) + query * lse_b.stride(1)];
    let (weight_a, weight_b, merged) = merge_weights(a, b);
    let base_a = query * out_a.stride(0) + head * out_a.stride(1);
    let base_b = query * out_b.stride(0) + head * out_b.stride(1);
    let base = query * out.stride(0) + head * out.stride(1);
    #[unroll]
    for d in 0..value_dim {
        let value = weight_a * f32::cast_from(out_a[base_a + d * out_a.stride(2)])
            + weight_b * f32::cast_from(out_b[base_b + d * out_b.stride(2)]);
        out[base + d * out.stride(2)] = F::cast_from(value);
    }
    lse[head * lse.stride(0) + query * lse.stride(1)] = merged;
}

/// Merge in place: `(out, lse)` ← merge of `(out, lse)` and `(out_b, lse_b)`.
#[cube(launch_unchecked)]
pub fn merge_in_place_kernel<F: Float>(
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    out_b: &Tensor<F>,
    lse_b: &Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (head, query, live) = unit_row::<F>(out);
    if !live {
        terminate!();
    }
    let lse_at = head * lse.stride(0) + query * lse.stride(1);
    let a = lse[lse_at];
    let b = lse_b[head * lse_b.stride(0) + query * lse_b.stride(1)];
    let (weight_a, weight_b, merged) = merge_weights(a, b);
    let base = query * out.stride(0) + head * out.stride(1);
    let base_b = query * out_b.stride(0) + head * out_b.stride(1);
    #[unroll]
    for d in 0..value_dim {
        let at = base + d * out.stride(2);
        let value = weight_a * f32::cast_from(out[at])
            + weight_b * f32::cast_from(out_b[base_b + d * out_b.stride(2)]);
        out[at] = F::cast_from(value);
    }
    lse[lse_at] = merged;
}
