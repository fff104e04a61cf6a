//! Shared helpers of the kernel tests: the mask family, random inputs, the error measure and
//! ragged varlen cases with offset and strided segments.
#![allow(dead_code)]

use burn_dcp_kernels::{AttentionShape, MaskSpec, Segment, VarlenAttention};
use rand::rngs::SmallRng;
use rand::Rng;

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

pub struct Case {
    pub problem: VarlenAttention,
    pub shape: AttentionShape,
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
    let shape = AttentionShape {
        q_tokens: problem.q_tokens(),
        kv_tokens: problem.kv_tokens(),
        heads,
        kv_heads,
        head_dim: 12,
        value_dim: 12,
    };
    Case { problem, shape }
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
    let shape = AttentionShape {
        q_tokens: problem.q_tokens(),
        kv_tokens: problem.kv_tokens(),
        heads,
        kv_heads,
        head_dim: dims.0,
        value_dim: dims.1,
    };
    Case { problem, shape }
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
    let shape = AttentionShape {
        q_tokens: 4,
        kv_tokens: 3,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        value_dim: 4,
    };
    Case { problem, shape }
}
