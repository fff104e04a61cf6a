//! DCP's masks, checked pair by pair against a brute-force transcription of their definitions.
//!
//! The definitions below are written independently of `MaskSpec` (sets of keys built element by
//! element, as DCP's paper and code state them, for query `i` of a sequence of `len` tokens):
//! - λ(S, W): keys `[0, min(S, i+1)) ∪ [max(0, i−W+1), i]`;
//! - causal-blockwise(B, k): block `b = ⌊i/B⌋` of `n = ⌈len/B⌉`; `b = 0` or `b = n−1`: keys
//!   `[0, i]`; otherwise `[0, B) ∪ [max(B, i − k·B), i]` (a window of `k·B` tokens);
//! - shared-question(F, N): `q = ⌊F·len⌋` question tokens, causal among themselves; answers of
//!   `⌊(len − q)/N⌋` tokens, the last one taking the rest; an answer token sees the whole question
//!   and its own answer causally.
//!
//! Both `MaskSpec::allows` and `MaskSpec::key_ranges` must give exactly these sets.

use std::collections::BTreeSet;

use burn_dcp_kernels::MaskSpec;

fn lambda_keys(i: usize, sink: usize, window: usize) -> BTreeSet<usize> {
    let mut keys = BTreeSet::new();
    for j in 0..sink.min(i + 1) {
        keys.insert(j);
    }
    let start = (i + 1).saturating_sub(window);
    for j in start..=i {
        keys.insert(j);
    }
    keys
}

fn blockwise_keys(i: usize, len: usize, block: usize, local: usize) -> BTreeSet<usize> {
    let blocks = len.div_ceil(block);
    let b = i / block;
    if b == 0 || b == blocks - 1 {
        return (0..=i).collect();
    }
    let mut keys: BTreeSet<usize> = (0..block).collect();
    let start = if i >= local * block {
        (i - local * block).max(block)
    } else {
        block
    };
    for j in start..=i {
        keys.insert(j);
    }
    keys
}

fn shared_question_keys(i: usize, len: usize, fraction: f64, answers: usize) -> BTreeSet<usize> {
    let question = (fraction * len as f64).floor() as usize;
    if i < question {
        return (0..=i).collect();
    }
    let answer_len = (len - question) / answers;
    // Starts of the answers; the last answer runs to the end of the sequence.
    let starts: Vec<usize> = (0..answers).map(|a| question + a * answer_len).collect();
    let own_start = *starts.iter().rev().find(|&&s| s <= i).expect("an answer");
    let mut keys: BTreeSet<usize> = (0..question).collect();
    for j in own_start..=i {
        keys.insert(j);
    }
    keys
}

/// Checks `mask` against `expected(i)` for every query and key of a `len`-token sequence.
fn check(mask: &MaskSpec, len: usize, expected: impl Fn(usize) -> BTreeSet<usize>) {
    for i in 0..len {
        let want = expected(i);
        let from_ranges: BTreeSet<usize> = mask.key_ranges(i, len).iter().flatten().collect();
        assert_eq!(from_ranges, want, "{mask} len {len} query {i}: key_ranges");
        for j in 0..len {
            assert_eq!(
                mask.allows(i, j, len),
                want.contains(&j),
                "{mask} len {len} query {i} key {j}: allows"
            );
        }
    }
}

#[test]
fn lambda_is_sink_plus_window() {
    for len in [1, 2, 7, 16, 33, 80] {
        for sink in [0, 1, 3, 8, 100] {
            for window in [1, 2, 5, 16, 200] {
                let mask = MaskSpec::Lambda { sink, window };
                check(&mask, len, |i| lambda_keys(i, sink, window));
            }
        }
    }
}

#[test]
fn blockwise_is_dcps_causal_blockwise() {
    for len in [1, 2, 5, 8, 9, 16, 17, 31, 64, 70] {
        for block in [1, 2, 3, 4, 8, 16, 100] {
            for local in [1, 2, 3, 5] {
                let mask = MaskSpec::Blockwise {
                    block,
                    local_blocks: local,
                };
                check(&mask, len, |i| blockwise_keys(i, len, block, local));
            }
        }
    }
}

#[test]
fn shared_question_is_question_then_answers() {
    for len in [1, 2, 3, 5, 10, 11, 29, 50, 64] {
        for fraction in [0.0, 0.1, 0.2, 0.25, 0.29, 0.5, 0.7, 1.0] {
            for answers in [1, 2, 3, 4, 7, 100] {
                let mask = MaskSpec::SharedQuestion {
                    question_fraction: fraction,
                    answers,
                };
                check(&mask, len, |i| {
                    shared_question_keys(i, len, fraction, answers)
                });
            }
        }
    }
}

/// The paper's configuration (block 256, 2 local blocks) on a 4352-token sequence (17 blocks):
/// the window is `k·B` tokens, so a query deep in block 5 sees part of block 3, and the last
/// block is fully causal.
#[test]
fn blockwise_paper_configuration_spot_checks() {
    let mask: MaskSpec = "blockwise:256,2".parse().unwrap();
    let len = 4352;
    // Query 1300 (block 5): sink [0, 256) and the window [1300 − 512, 1300] = [788, 1300].
    let ranges: Vec<_> = mask.key_ranges(1300, len).iter().collect();
    assert_eq!(ranges, vec![0..256, 788..1301]);
    // Query 300 (block 1): the window would start at −212, so it starts after the sink.
    let ranges: Vec<_> = mask.key_ranges(300, len).iter().collect();
    assert_eq!(ranges, vec![0..301]);
    // Query 4200 (block 16, the last): causal over the whole sequence.
    let ranges: Vec<_> = mask.key_ranges(4200, len).iter().collect();
    assert_eq!(ranges, vec![0..4201]);
    // Allowed pairs of the whole sequence, counted from the brute-force definition.
    let pairs: usize = (0..len).map(|i| mask.key_ranges(i, len).count()).sum();
    let brute: usize = (0..len).map(|i| blockwise_keys(i, len, 256, 2).len()).sum();
    assert_eq!(pairs, brute);
    assert_eq!(pairs, 3_936_000);
}
