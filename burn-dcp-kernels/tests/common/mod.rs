//! Shared helpers of the kernel tests: the mask family, random inputs, the error measure and
//! ragged varlen cases with offset and strided segments.
#![allow(dead_code)]

use burn::prelude::{Backend, Tensor};
use burn::tensor::TensorData;
use burn_dcp_kernels::portable::{HostForward, HostGradients};
use burn_dcp_kernels::{
    reference, AttentionShape, FlashBackward, FlashOps, MaskSpec, Segment, VarlenAttention,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[cfg(feature = "cube")]
pub mod cube;

pub fn masks() -> Vec<MaskSpec> {
    vec![
        MaskSpec::Full,
        MaskSpec::Causal,
        MaskSpec::Sliding { window: 3 },
        MaskSpec::Lambda { sink: 2, window: 3 },
        MaskSpec::Blockwise {
            block: 3,
            local_blocks: 2,
        },
        MaskSpec::SharedQuestion {
            question_fraction: 0.2,
            answers: 4,
        },
        MaskSpec::SharedQuestion {
            question_fraction: 0.5,
            answers: 3,
        },
    ]
}

pub fn random(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

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

/// Random `q`, `k`, `v` and `dout` of a shape, drawn in that order.
#[derive(Debug)]
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dout: Vec<f32>,
}

pub fn inputs(rng: &mut SmallRng, s: &AttentionShape) -> Inputs {
    Inputs {
        q: random(rng, s.q_tokens * s.heads * s.head_dim),
        k: random(rng, s.kv_tokens * s.kv_heads * s.head_dim),
        v: random(rng, s.kv_tokens * s.kv_heads * s.value_dim),
        dout: random(rng, s.q_tokens * s.heads * s.value_dim),
    }
}

/// `values` as an f32 tensor `dims` on `device`.
pub fn upload<B: Backend>(values: &[f32], dims: [usize; 3], device: &B::Device) -> Tensor<B, 3> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

/// A tensor's values, read back as f32.
pub fn read<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
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

pub struct Case {
    pub problem: VarlenAttention,
    pub shape: AttentionShape,
}

impl Case {
    /// `problem` with `heads` query heads on `kv_heads`, head and value dims `dims`.
    pub fn new(
        problem: VarlenAttention,
        heads: usize,
        kv_heads: usize,
        (head_dim, value_dim): (usize, usize),
    ) -> Case {
        let shape = AttentionShape {
            q_tokens: problem.q_tokens(),
            kv_tokens: problem.kv_tokens(),
            heads,
            kv_heads,
            head_dim,
            value_dim,
        };
        Case { problem, shape }
    }

    /// This case with head and value dims `dims`.
    pub fn with_dims(self, dims: (usize, usize)) -> Case {
        Case::new(self.problem, self.shape.heads, self.shape.kv_heads, dims)
    }
}

/// Queries: a mix of contiguous, offset and strided segments; keys: the other tokens' layout.
pub fn ragged_case(mask: MaskSpec, heads: usize, kv_heads: usize) -> Case {
    let seq_lens = vec![11, 1, 6, 9];
    let q_segments = vec![
        Segment::contiguous(0, 3, 8),
        Segment::contiguous(1, 0, 1),
        Segment {
            seq: 2,
            start: 1,
            len: 3,
            stride: 2,
        },
        Segment::contiguous(3, 0, 9),
    ];
    let kv_segments = vec![
        Segment::contiguous(3, 0, 9),
        Segment {
            seq: 2,
            start: 0,
            len: 2,
            stride: 3,
        },
        Segment::contiguous(0, 0, 11),
        Segment::contiguous(1, 0, 1),
        Segment {
            seq: 2,
            start: 1,
            len: 2,
            stride: 4,
        },
        Segment {
            seq: 2,
            start: 4,
            len: 1,
            stride: 1,
        },
    ];
    let problem = VarlenAttention {
        seq_lens,
        masks: vec![mask],
        q_segments,
        kv_segments,
        scale: None,
    };
    Case::new(problem, heads, kv_heads, (12, 12))
}

/// One half of the keys of `all`, two packed sequences split at positions `at`: the problem
/// over that half (`first`: the keys before `at`) and the packed rows of its keys.
pub fn key_half(
    all: &VarlenAttention,
    at: [usize; 2],
    first: bool,
) -> (VarlenAttention, Vec<usize>) {
    let lens = &all.seq_lens;
    let ranges = match first {
        true => [0..at[0], 0..at[1]],
        false => [at[0]..lens[0], at[1]..lens[1]],
    };
    let mut problem = all.clone();
    problem.kv_segments = vec![
        Segment::contiguous(0, ranges[0].start, ranges[0].len()),
        Segment::contiguous(1, ranges[1].start, ranges[1].len()),
    ];
    let second = ranges[1].start + lens[0]..ranges[1].end + lens[0];
    let rows = ranges[0].clone().chain(second).collect();
    (problem, rows)
}

/// The `rows` of `x`, rows of `width` values.
pub fn pick_rows(x: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&t| x[t * width..(t + 1) * width].to_vec())
        .collect()
}

/// Masks at the scale of [`long_case`] (windows and blocks spanning several kernel tiles).
pub fn long_masks() -> Vec<MaskSpec> {
    vec![
        MaskSpec::Full,
        MaskSpec::Causal,
        MaskSpec::Sliding { window: 40 },
        MaskSpec::Lambda {
            sink: 8,
            window: 30,
        },
        MaskSpec::Blockwise {
            block: 16,
            local_blocks: 2,
        },
        MaskSpec::SharedQuestion {
            question_fraction: 0.25,
            answers: 3,
        },
    ]
}

/// One mask per sequence of [`long_case`], the first a general key-range mask.
pub fn long_mixed_masks() -> Vec<MaskSpec> {
    let ranges: std::sync::Arc<[burn_dcp_kernels::KeyRanges]> = (0..200)
        .map(|i: usize| burn_dcp_kernels::KeyRanges::two(i.saturating_sub(70)..i / 2 + 1, 150..170))
        .collect::<Vec<_>>()
        .into();
    vec![
        MaskSpec::KeyRanges(ranges),
        MaskSpec::Causal,
        MaskSpec::Sliding { window: 20 },
    ]
}

/// A ragged batch spanning several kernel tiles (sequences of 200, 37 and 130 tokens): queries at
/// an offset and strided, keys of one sequence in two segments out of order.
pub fn long_case(
    masks: Vec<MaskSpec>,
    heads: usize,
    kv_heads: usize,
    dims: (usize, usize),
) -> Case {
    let problem = VarlenAttention {
        seq_lens: vec![200, 37, 130],
        masks,
        q_segments: vec![
            Segment::contiguous(0, 50, 150),
            Segment::contiguous(1, 0, 37),
            Segment {
                seq: 2,
                start: 1,
                len: 65,
                stride: 2,
            },
        ],
        kv_segments: vec![
            Segment::contiguous(2, 0, 130),
            Segment::contiguous(0, 120, 80),
            Segment::contiguous(1, 0, 37),
            Segment::contiguous(0, 0, 120),
        ],
        scale: None,
    };
    Case::new(problem, heads, kv_heads, dims)
}

/// Queries at positions 0..4 against keys 5..8 under a causal mask: nothing is allowed.
/// Shapes: q `[4, 2, 4]`, k and v `[3, 1, 4]`.
pub fn fully_masked_case() -> Case {
    let problem = VarlenAttention::from_cu_seqlens(
        vec![8],
        vec![MaskSpec::Causal],
        &[0, 4],
        &[0],
        &[0, 3],
        &[5],
    )
    .unwrap();
    Case::new(problem, 2, 1, (4, 4))
}
