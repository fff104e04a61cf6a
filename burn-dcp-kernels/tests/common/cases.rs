//! The problems the kernel tests run: ragged varlen batches with offset and strided segments,
//! long ones spanning several kernel tiles, halves of the keys, a fully masked one.

use burn_dcp_kernels::{AttentionShape, MaskSpec, Segment, VarlenAttention};

/// The mask family at the scale of the small cases.
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
