//! Scalar helpers of the portable kernels.

#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub(super) fn axpy(alpha: f32, x: &[f32], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(x) {
        *o += alpha * x;
    }
}

/// The larger of `a` and `b`, NaN if either is NaN (unlike `f32::max`).
pub(super) fn nan_max(a: f32, b: f32) -> f32 {
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
