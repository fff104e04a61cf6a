//! The portable kernels against the naive dense oracle, for every mask, ragged GQA batches,
//! strided and offset segments, plus mask-form agreement and the merge.

use std::sync::Arc;

use burn_dcp_kernels::portable::{self, HostForward};
use burn_dcp_kernels::{reference, AttentionShape, KeyRanges, MaskSpec, Segment, VarlenAttention};
use rand::rngs::SmallRng;
use rand::SeedableRng;

mod common;
use common::{
    assert_forward_near, assert_gradients_near, fully_masked_case, inputs, key_half, long_case,
    long_masks, long_mixed_masks, masks, pick_rows, ragged_case, random, Case,
};

/// The portable forward and backward on `case` against the naive reference (≤ 1e-5 relative).
fn check_against_reference(rng: &mut SmallRng, case: &Case, what: &str) {
    let Case { problem, shape: s } = case;
    let x = inputs(rng, s);
    let got = portable::forward(&x.q, &x.k, &x.v, s, problem).unwrap();
    let want = reference::forward(&x.q, &x.k, &x.v, problem, s).unwrap();
    assert_forward_near(&got.out, &got.lse, &want, 1e-5, what);
    let grads = portable::backward(&x.q, &x.k, &x.v, &got.out, &got.lse, &x.dout, s, problem);
    let want = reference::backward(&x.q, &x.k, &x.v, &x.dout, problem, s).unwrap();
    let grads = grads.unwrap();
    assert_gradients_near([&grads.dq, &grads.dk, &grads.dv], &want, 1e-5, what);
}

#[test]
fn key_ranges_agree_with_the_mask_rule() {
    let custom: Arc<[KeyRanges]> = (0..13)
        .map(|i| KeyRanges::two(i / 2..i + 1, 0..(i % 3)))
        .collect::<Vec<_>>()
        .into();
    let mut all = masks();
    all.push(MaskSpec::KeyRanges(custom));
    all.push(MaskSpec::SharedQuestion {
        question_fraction: 0.0,
        answers: 20,
    });
    all.push(MaskSpec::SharedQuestion {
        question_fraction: 1.0,
        answers: 2,
    });
    for mask in &all {
        for len in [1usize, 2, 7, 13] {
            if matches!(mask, MaskSpec::KeyRanges(r) if r.len() != len) {
                continue;
            }
            for i in 0..len {
                let ranges = mask.key_ranges(i, len);
                for j in 0..len {
                    assert_eq!(
                        ranges.contains(j),
                        mask.allows(i, j, len),
                        "{mask} len {len} i {i} j {j}"
                    );
                }
            }
        }
    }
}

#[test]
fn mask_parsing_round_trips_and_rejects_bad_specs() {
    for mask in masks() {
        assert_eq!(mask.to_string().parse::<MaskSpec>().unwrap(), mask);
    }
    for bad in [
        "sliding:0",
        "lambda:4",
        "blockwise:0,2",
        "shared-question:1.5,2",
        "diagonal",
        "causal:3",
    ] {
        let err = bad.parse::<MaskSpec>().unwrap_err().to_string();
        assert!(err.contains(bad.split(':').next().unwrap()), "{bad}: {err}");
    }
}

#[test]
fn forward_and_backward_match_the_naive_reference() {
    let mut rng = SmallRng::seed_from_u64(7);
    for mask in masks() {
        for (heads, kv_heads) in [(2, 2), (4, 2), (3, 1)] {
            let case = ragged_case(mask.clone(), heads, kv_heads);
            check_against_reference(&mut rng, &case, &format!("{mask} H{heads} K{kv_heads}"));
        }
    }
}

/// Long segments: the blocked forward (several queries sharing one key sweep) and its
/// per-query fallback, over every mask, several head and value widths (including widths that
/// are not a multiple of the vector lanes) and a mask per sequence.
#[test]
fn long_segments_match_the_naive_reference() {
    let mut rng = SmallRng::seed_from_u64(11);
    let mut cases: Vec<(String, Case)> = Vec::new();
    for mask in long_masks() {
        for dims in [(16, 24), (13, 5), (64, 64)] {
            cases.push((
                format!("{mask} {dims:?}"),
                long_case(vec![mask.clone()], 4, 2, dims),
            ));
        }
    }
    cases.push(("mixed".into(), long_case(long_mixed_masks(), 2, 1, (33, 8))));
    // The tiled backward: dense and partial tiles, several parts per kv head.
    for (what, case) in cases {
        check_against_reference(&mut rng, &case, &what);
    }
}

/// A NaN key or value reaches exactly the queries that attend it, also where the query block
/// around it has queries that do not (a causal diagonal tile of the tiled forward).
#[test]
fn a_nan_key_or_value_reaches_only_the_queries_that_attend_it() {
    let (tokens, heads, dim, bad) = (100, 2, 8, 50);
    let problem = VarlenAttention::packed(vec![tokens], vec![MaskSpec::Causal]);
    let shape = AttentionShape {
        q_tokens: tokens,
        kv_tokens: tokens,
        heads,
        kv_heads: 1,
        head_dim: dim,
        value_dim: dim,
    };
    let mut rng = SmallRng::seed_from_u64(5);
    let q = random(&mut rng, tokens * heads * dim);
    for poisoned in ["k", "v"] {
        let (mut k, mut v) = (
            random(&mut rng, tokens * dim),
            random(&mut rng, tokens * dim),
        );
        let target = if poisoned == "k" { &mut k } else { &mut v };
        target[bad * dim + 3] = f32::NAN;
        let HostForward { out, lse } = portable::forward(&q, &k, &v, &shape, &problem).unwrap();
        for t in 0..tokens {
            let row = &out[t * heads * dim..(t + 1) * heads * dim];
            if t < bad {
                assert!(row.iter().all(|x| x.is_finite()), "{poisoned}: query {t}");
                assert!(lse[t].is_finite() && lse[tokens + t].is_finite());
            } else {
                assert!(row.iter().any(|x| x.is_nan()), "{poisoned}: query {t}");
            }
        }
        // The backward's diagonal tile holds the NaN key and queries that do not attend it:
        // their dq stays finite, the others' is NaN.
        let dout = random(&mut rng, tokens * heads * dim);
        let grads = portable::backward(&q, &k, &v, &out, &lse, &dout, &shape, &problem).unwrap();
        for t in 0..tokens {
            let row = &grads.dq[t * heads * dim..(t + 1) * heads * dim];
            match t < bad {
                true => assert!(row.iter().all(|x| x.is_finite()), "{poisoned}: dq {t}"),
                false => assert!(row.iter().any(|x| x.is_nan()), "{poisoned}: dq {t}"),
            }
        }
    }
}

#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    let Case { problem, shape } = fully_masked_case();
    let mut rng = SmallRng::seed_from_u64(1);
    let (q, k, v) = (
        random(&mut rng, 32),
        random(&mut rng, 12),
        random(&mut rng, 12),
    );
    let HostForward { out, lse } = portable::forward(&q, &k, &v, &shape, &problem).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(!problem.has_work());
    let grads = portable::backward(
        &q,
        &k,
        &v,
        &out,
        &lse,
        &random(&mut rng, 32),
        &shape,
        &problem,
    )
    .unwrap();
    assert!(grads
        .dq
        .iter()
        .chain(&grads.dk)
        .chain(&grads.dv)
        .all(|&x| x == 0.0));
}

#[test]
fn merging_two_key_halves_equals_attention_over_all_keys() {
    let mut rng = SmallRng::seed_from_u64(3);
    let seq_lens = vec![10, 7];
    let shape_all = AttentionShape {
        q_tokens: 17,
        kv_tokens: 17,
        heads: 2,
        kv_heads: 2,
        head_dim: 8,
        value_dim: 8,
    };
    for mask in masks() {
        let all = VarlenAttention::packed(seq_lens.clone(), vec![mask.clone()]);
        let q = random(&mut rng, 17 * 16);
        let k = random(&mut rng, 17 * 16);
        let v = random(&mut rng, 17 * 16);
        let want = portable::forward(&q, &k, &v, &shape_all, &all).unwrap();
        // First half of the keys: positions 0..5 of seq 0 and 0..3 of seq 1 (8 tokens).
        let split = |first: bool| {
            let (problem, rows) = key_half(&all, [5, 3], first);
            let pick = |x: &[f32]| pick_rows(x, &rows, 16);
            let shape = AttentionShape {
                kv_tokens: rows.len(),
                ..shape_all
            };
            portable::forward(&q, &pick(&k), &pick(&v), &shape, &problem).unwrap()
        };
        let (mut a, b) = (split(true), split(false));
        portable::merge(&mut a.out, &mut a.lse, &b.out, &b.lse, 2, 8).unwrap();
        assert_forward_near(&a.out, &a.lse, &want, 1e-5, &mask.to_string());
    }
}

#[test]
fn invalid_problems_are_rejected_with_the_rule() {
    let shape = AttentionShape {
        q_tokens: 4,
        kv_tokens: 4,
        heads: 2,
        kv_heads: 2,
        head_dim: 4,
        value_dim: 4,
    };
    let mut problem = VarlenAttention::packed(vec![4], vec![MaskSpec::Causal]);
    problem.kv_segments = vec![Segment::contiguous(0, 0, 3), Segment::contiguous(0, 2, 1)];
    assert!(problem
        .validate(&shape)
        .unwrap_err()
        .to_string()
        .contains("appears twice"));
    let problem = VarlenAttention::packed(vec![5], vec![MaskSpec::Causal]);
    assert!(problem
        .validate(&shape)
        .unwrap_err()
        .to_string()
        .contains("5 query"));
    let problem = VarlenAttention::packed(vec![2, 2], vec![MaskSpec::Causal; 3]);
    assert!(problem
        .validate(&shape)
        .unwrap_err()
        .to_string()
        .contains("3 masks for 2 sequences"));
    assert!(
        AttentionShape::from_dims(&[4, 6, 4], &[4, 4, 4], &[4, 4, 4])
            .unwrap_err()
            .to_string()
            .contains("must divide")
    );
}

/// A NaN in one query row must stay visible: that row's out and LSE are NaN, its dq row and the
/// dk/dv rows of the keys it attends are NaN; a row of another sequence stays finite. It never
/// looks like a fully masked row (out 0, LSE −∞, zero gradient).
#[test]
fn nan_inputs_propagate_and_never_look_masked() {
    let mut rng = SmallRng::seed_from_u64(7);
    let (heads, dim) = (2, 4);
    let problem = VarlenAttention::packed(vec![5, 3], vec![MaskSpec::Causal]);
    let shape = AttentionShape {
        q_tokens: 8,
        kv_tokens: 8,
        heads,
        kv_heads: heads,
        head_dim: dim,
        value_dim: dim,
    };
    let mut q = random(&mut rng, 8 * heads * dim);
    let (k, v) = (
        random(&mut rng, 8 * heads * dim),
        random(&mut rng, 8 * heads * dim),
    );
    // Token 2 (sequence 0), head 0.
    q[2 * heads * dim] = f32::NAN;
    let HostForward { out, lse } = portable::forward(&q, &k, &v, &shape, &problem).unwrap();
    assert!(out[2 * heads * dim..2 * heads * dim + dim]
        .iter()
        .all(|x| x.is_nan()));
    assert!(lse[2].is_nan(), "lse of the NaN row: {}", lse[2]);
    // Token 6 (sequence 1) is untouched.
    assert!(out[6 * heads * dim..7 * heads * dim]
        .iter()
        .all(|x| x.is_finite()));
    let dout = random(&mut rng, 8 * heads * dim);
    let grads = portable::backward(&q, &k, &v, &out, &lse, &dout, &shape, &problem).unwrap();
    assert!(grads.dq[2 * heads * dim..2 * heads * dim + dim]
        .iter()
        .all(|x| x.is_nan()));
    // Keys 0..=2 of head 0 are attended by the NaN query.
    for key in 0..=2 {
        let at = key * heads * dim;
        assert!(
            grads.dk[at..at + dim].iter().all(|x| x.is_nan()),
            "dk key {key}"
        );
        assert!(
            grads.dv[at..at + dim].iter().all(|x| x.is_nan()),
            "dv key {key}"
        );
    }
    assert!(grads.dq[6 * heads * dim..7 * heads * dim]
        .iter()
        .all(|x| x.is_finite()));

    // Merging a NaN part with a part that saw no key keeps the NaN.
    let (mut out_a, mut lse_a) = (vec![f32::NAN; dim], vec![f32::NAN]);
    portable::merge(
        &mut out_a,
        &mut lse_a,
        &[0.0; 4],
        &[f32::NEG_INFINITY],
        1,
        dim,
    )
    .unwrap();
    assert!(lse_a[0].is_nan() && out_a.iter().all(|x| x.is_nan()));
    let (mut out_b, mut lse_b) = (vec![0.0; dim], vec![f32::NEG_INFINITY]);
    portable::merge(&mut out_b, &mut lse_b, &[f32::NAN; 4], &[f32::NAN], 1, dim).unwrap();
    assert!(lse_b[0].is_nan() && out_b.iter().all(|x| x.is_nan()));
}

#[test]
fn shapes_and_scales_are_validated_first() {
    let err = AttentionShape::from_dims(&[4, 0, 8], &[4, 0, 8], &[4, 0, 8]).unwrap_err();
    assert!(err.to_string().contains("q heads (0)"), "{err}");
    let err = AttentionShape::from_dims(&[4, 2, 0], &[4, 2, 0], &[4, 2, 0]).unwrap_err();
    assert!(err.to_string().contains("head dim (0)"), "{err}");
    for scale in [f64::NAN, f64::INFINITY, 0.0, -1.0, 1e38] {
        let err = burn_dcp_kernels::validate_scale(scale).unwrap_err();
        assert!(err.to_string().contains("softmax scale"), "{err}");
    }
    burn_dcp_kernels::validate_scale(0.125).unwrap();
}

/// Tiny pieces of sequences, as ring steps see them: one or two tokens of queries against keys
/// elsewhere in the sequence (offsets, strides), every mask; the tiled backward equals the
/// reference.
#[test]
fn tiny_offset_pieces_match_the_naive_reference() {
    use burn_dcp_kernels::Segment;
    let mut rng = SmallRng::seed_from_u64(21);
    for mask in masks() {
        for (len, q, kv) in [
            (2, (1, 1, 1), (0, 1, 1)),
            (2, (0, 1, 1), (0, 2, 1)),
            (3, (2, 1, 1), (0, 2, 1)),
            (5, (1, 2, 3), (0, 2, 2)),
            (8, (7, 1, 1), (0, 8, 1)),
        ] {
            let seg = |(start, len, stride): (usize, usize, usize)| Segment {
                seq: 0,
                start,
                len,
                stride,
            };
            let problem = VarlenAttention {
                seq_lens: vec![len],
                masks: vec![mask.clone()],
                q_segments: vec![seg(q)],
                kv_segments: vec![seg(kv)],
                scale: None,
            };
            for (heads, kv_heads) in [(4, 2), (2, 2), (4, 1)] {
                let s = AttentionShape {
                    q_tokens: q.1,
                    kv_tokens: kv.1,
                    heads,
                    kv_heads,
                    head_dim: 8,
                    value_dim: 8,
                };
                let x = inputs(&mut rng, &s);
                let got = portable::forward(&x.q, &x.k, &x.v, &s, &problem).unwrap();
                let grads =
                    portable::backward(&x.q, &x.k, &x.v, &got.out, &got.lse, &x.dout, &s, &problem);
                let want = reference::backward(&x.q, &x.k, &x.v, &x.dout, &problem, &s).unwrap();
                let what = format!("{mask} len {len} H{heads}/{kv_heads}");
                let grads = grads.unwrap();
                assert_gradients_near([&grads.dq, &grads.dk, &grads.dv], &want, 1e-5, &what);
            }
        }
    }
}

/// Ring steps: the backward over each key piece from the *final* out and LSE sums to the
/// gradients over all keys (pieces of one or a few tokens, two sequences, every mask).
#[test]
fn backward_over_key_pieces_sums_to_the_whole() {
    use burn_dcp_kernels::Segment;
    let mut rng = SmallRng::seed_from_u64(23);
    for mask in masks() {
        for lens in [vec![2usize], vec![1, 1], vec![3, 2], vec![70, 9]] {
            let (heads, kv_heads, d) = (4, 2, 8);
            let whole = VarlenAttention::packed(lens.clone(), vec![mask.clone()]);
            let t: usize = lens.iter().sum();
            let s = AttentionShape {
                q_tokens: t,
                kv_tokens: t,
                heads,
                kv_heads,
                head_dim: d,
                value_dim: d,
            };
            let q = random(&mut rng, t * heads * d);
            let k = random(&mut rng, t * kv_heads * d);
            let v = random(&mut rng, t * kv_heads * d);
            let dout = random(&mut rng, t * heads * d);
            let full = portable::forward(&q, &k, &v, &s, &whole).unwrap();
            let want = reference::backward(&q, &k, &v, &dout, &whole, &s).unwrap();
            let mut dq = vec![0.0f32; t * heads * d];
            let mut dk = vec![0.0f32; t * kv_heads * d];
            let mut dv = vec![0.0f32; t * kv_heads * d];
            // Key pieces of 1 token (and of 8 for the long case).
            let piece = if t > 20 { 8 } else { 1 };
            let mut first = 0;
            let mut at = 0;
            for (seq, &len) in lens.iter().enumerate() {
                let mut start = 0;
                while start < len {
                    let n = piece.min(len - start);
                    let problem = VarlenAttention {
                        kv_segments: vec![Segment::contiguous(seq, start, n)],
                        ..whole.clone()
                    };
                    let ks = AttentionShape { kv_tokens: n, ..s };
                    let k_part = &k[at * kv_heads * d..(at + n) * kv_heads * d];
                    let v_part = &v[at * kv_heads * d..(at + n) * kv_heads * d];
                    let g = portable::backward(
                        &q, k_part, v_part, &full.out, &full.lse, &dout, &ks, &problem,
                    )
                    .unwrap();
                    dq.iter_mut().zip(&g.dq).for_each(|(a, b)| *a += b);
                    let range = at * kv_heads * d..(at + n) * kv_heads * d;
                    dk[range.clone()]
                        .iter_mut()
                        .zip(&g.dk)
                        .for_each(|(a, b)| *a += b);
                    dv[range].iter_mut().zip(&g.dv).for_each(|(a, b)| *a += b);
                    start += n;
                    at += n;
                }
                first += len;
            }
            let _ = first;
            assert_gradients_near([&dq, &dk, &dv], &want, 1e-5, &format!("{mask} {lens:?}"));
        }
    }
}
