//! Results against the f64 oracle: the error measure and the bounds of f32 and half precision.

use burn::prelude::Tensor;
use burn_dcp_kernels::portable::{HostForward, HostGradients};
use burn_dcp_kernels::{reference, FlashBackward, FlashOps};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::{inputs, read, Case, Inputs};

/// max |a − b| / max |b| over finite entries; infinities must match exactly.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut scale = 0.0f32;
    let mut diff = 0.0f32;
    for (&x, &y) in a.iter().zip(b) {
        if y.is_finite() {
            scale = scale.max(y.abs());
            diff = diff.max((x - y).abs());
        } else {
            assert_eq!(x, y, "non-finite entries must match");
        }
        assert!(!x.is_nan(), "NaN in result");
    }
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// Forward and backward of [`FlashOps`] on `B` against the f64 oracle (≤ 1e-5 relative), on a
/// case's random inputs (drawn from `seed`) put on the device as `[tokens, heads, dim]` by
/// `upload` (which may hand over any strided view of them).
pub fn check_uploaded<B: FlashOps>(
    case: &Case,
    seed: u64,
    what: &str,
    upload: impl Fn(&[f32], [usize; 3]) -> Tensor<B, 3>,
) {
    let Case { problem, shape: s } = case;
    let x = inputs(&mut SmallRng::seed_from_u64(seed), s);
    let q = upload(&x.q, [s.q_tokens, s.heads, s.head_dim]);
    let k = upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]);
    let v = upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]);
    let forward = B::flash_forward(q.clone(), k.clone(), v.clone(), problem).unwrap();
    let (out, lse) = (read(forward.out.clone()), read(forward.lse.clone()));
    let want = reference::forward(&x.q, &x.k, &x.v, problem, s).unwrap();
    assert_forward_near(&out, &lse, &want, 1e-5, &format!("forward {what}"));

    let dout = upload(&x.dout, [s.q_tokens, s.heads, s.value_dim]);
    let grads = B::flash_backward(FlashBackward::new(q, k, v, forward, dout), problem).unwrap();
    let [dq, dk, dv] = [grads.dq, grads.dk, grads.dv].map(read);
    let want = reference::backward(&x.q, &x.k, &x.v, &x.dout, problem, s).unwrap();
    assert_gradients_near([&dq, &dk, &dv], &want, 1e-5, &format!("backward {what}"));
}

/// `out` and `lse` within `bound` (relative, [`rel_err`]) of `want`.
pub fn assert_forward_near(out: &[f32], lse: &[f32], want: &HostForward, bound: f32, what: &str) {
    let errors = [rel_err(out, &want.out), rel_err(lse, &want.lse)];
    assert!(
        errors.iter().all(|&e| e <= bound),
        "{what}: out/lse errors {errors:?} > {bound}"
    );
}

/// `[dq, dk, dv]` within `bound` (relative, [`rel_err`]) of `want`.
pub fn assert_gradients_near(got: [&[f32]; 3], want: &HostGradients, bound: f32, what: &str) {
    let errors = [
        rel_err(got[0], &want.dq),
        rel_err(got[1], &want.dk),
        rel_err(got[2], &want.dv),
    ];
    assert!(
        errors.iter().all(|&e| e <= bound),
        "{what}: dq/dk/dv errors {errors:?} > {bound}"
    );
}

/// The unit roundoff of a half dtype.
pub fn unit_roundoff(dtype: burn::tensor::DType) -> f32 {
    match dtype {
        burn::tensor::DType::F16 => 2f32.powi(-11),
        burn::tensor::DType::BF16 => 2f32.powi(-8),
        other => panic!("not a half dtype: {other:?}"),
    }
}

/// A forward of `dtype` inputs `x` (as rounded to it) against the oracle: `out` within
/// `u·(max|v| + max|out|)` (P and `out` rounded to the dtype, unit roundoff `u`), the f32 LSE
/// within 1e-5.
pub fn assert_half_forward(
    (out, lse): (&[f32], &[f32]),
    x: &Inputs,
    case: &Case,
    dtype: burn::tensor::DType,
    what: &str,
) {
    let want = reference::forward(&x.q, &x.k, &x.v, &case.problem, &case.shape).unwrap();
    let max_v = x.v.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_out = want.out.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(out.iter().all(|x| !x.is_nan()), "{what}: NaN in out");
    let worst = out
        .iter()
        .zip(&want.out)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let bound = unit_roundoff(dtype) * (max_v + max_out) * 1.01;
    assert!(worst <= bound, "{what}: |out - oracle| {worst} > {bound}");
    let lse_err = rel_err(lse, &want.lse);
    assert!(lse_err <= 1e-5, "{what}: lse {lse_err}");
}
