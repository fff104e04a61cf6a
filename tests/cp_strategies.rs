//! Every strategy × layout × mask × {MHA, GQA} × {even, ragged} batch: CP forward and backward
//! against the single-device run, and the single-device run against the naive dense oracle.

use crate::common;

use burn_dcp::diagnostics::harness::{
    run_context_parallel, run_single_device, PackedInputs, PackedOutputs,
};
use burn_dcp::kernels::{reference, AttentionShape, MaskSpec, VarlenAttention};
use burn_dcp::Strategy;
use common::*;

/// Even lengths (multiples of 2·cp) and ragged ones, including sequences shorter than cp.
const BATCHES: [&[usize]; 2] = [&[16, 8], &[13, 3, 1, 6]];
/// (heads, kv_heads): MHA and GQA with fewer kv heads than the Ulysses degree.
const HEADS: [(usize, usize); 2] = [(4, 4), (4, 2)];

fn naive(inputs: &PackedInputs, mask: &MaskSpec) -> PackedOutputs {
    let problem = VarlenAttention::packed(inputs.seq_lens.clone(), vec![mask.clone()]);
    let t = inputs.tokens();
    let shape = AttentionShape {
        q_tokens: t,
        kv_tokens: t,
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        head_dim: inputs.head_dim,
        value_dim: inputs.value_dim,
    };
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let fwd = reference::forward(q, k, v, &problem, &shape).unwrap();
    let grads = reference::backward(q, k, v, &inputs.dout, &problem, &shape).unwrap();
    PackedOutputs {
        out: fwd.out,
        lse: fwd.lse,
        dq: grads.dq,
        dk: grads.dk,
        dv: grads.dv,
    }
}

fn check_strategy(strategy: Strategy, cp: usize) {
    let device = Default::default();
    let mut seed = 0;
    for seq_lens in BATCHES {
        for (heads, kv_heads) in HEADS {
            for mask in masks() {
                seed += 1;
                let inputs = random_inputs(seq_lens, heads, kv_heads, 8, seed);
                let single =
                    run_single_device::<B>(&device, &inputs, std::slice::from_ref(&mask), None)
                        .unwrap();
                let what = format!("{strategy} cp {cp} H{heads} K{kv_heads} {seq_lens:?} {mask}");
                assert_close(
                    &single,
                    &naive(&inputs, &mask),
                    &format!("single device vs naive, {what}"),
                );
                for layout in layouts() {
                    let report = run_context_parallel::<B>(
                        &device,
                        &inputs,
                        &spec(cp, strategy, layout, &mask),
                    )
                    .unwrap();
                    assert_close(&report.outputs, &single, &format!("{what} {layout}"));
                }
            }
        }
    }
}

#[test]
fn ulysses_matches_single_device() {
    check_strategy(Strategy::Ulysses, 4);
    check_strategy(Strategy::Ulysses, 2);
}

#[test]
fn ring_matches_single_device() {
    check_strategy(Strategy::Ring, 4);
    check_strategy(Strategy::Ring, 3);
}

#[test]
fn all_gather_matches_single_device() {
    check_strategy(Strategy::AllGather, 4);
    check_strategy(Strategy::AllGather, 3);
}

#[test]
fn usp_matches_single_device() {
    check_strategy(USP_2X2, 4);
    check_strategy(
        Strategy::Usp {
            ulysses_degree: 4,
            ring_degree: 2,
        },
        8,
    );
    check_strategy(
        Strategy::Usp {
            ulysses_degree: 1,
            ring_degree: 2,
        },
        2,
    );
}

/// A general "≤ 2 key ranges" mask with fully masked queries, different per sequence: CP must give
/// out = 0 and lse = −∞ for those rows (never NaN) and match the oracle elsewhere.
#[test]
fn key_range_masks_with_fully_masked_rows() {
    use std::sync::Arc;

    use burn_dcp::kernels::KeyRanges;

    let device = Default::default();
    let seq_lens = [13usize, 6];
    let ranges = |len: usize| -> MaskSpec {
        let rows: Vec<KeyRanges> = (0..len)
            .map(|i| match i % 4 {
                0 => KeyRanges::default(),
                1 => KeyRanges::two(0..1, i.saturating_sub(2)..i + 1),
                2 => KeyRanges::one(i..len),
                _ => KeyRanges::two(len - 2..len, 0..i / 2),
            })
            .collect();
        MaskSpec::KeyRanges(Arc::<[KeyRanges]>::from(rows))
    };
    let masks = vec![ranges(seq_lens[0]), ranges(seq_lens[1])];
    let inputs = random_inputs(&seq_lens, 4, 2, 8, 99);
    let single = run_single_device::<B>(&device, &inputs, &masks, None).unwrap();
    assert!(
        single.lse.contains(&f32::NEG_INFINITY),
        "the mask must leave rows empty"
    );
    for (strategy, cp) in [
        (Strategy::Ulysses, 2),
        (Strategy::Ring, 4),
        (Strategy::AllGather, 3),
        (USP_2X2, 4),
    ] {
        for layout in layouts() {
            let mut run = spec(cp, strategy, layout, &MaskSpec::Full);
            run.masks = masks.clone();
            let report = run_context_parallel::<B>(&device, &inputs, &run).unwrap();
            assert_close(
                &report.outputs,
                &single,
                &format!("{strategy} {layout} key ranges"),
            );
            let t = inputs.tokens();
            for (index, lse) in report.outputs.lse.iter().enumerate() {
                if *lse == f32::NEG_INFINITY {
                    let token = index % t;
                    let h = index / t;
                    let row = &report.outputs.out[(token * 4 + h) * 8..(token * 4 + h + 1) * 8];
                    assert!(row.iter().all(|x| *x == 0.0), "fully masked row must be 0");
                }
            }
        }
    }
}

/// bf16 and f16 inputs (the LSE and every accumulator f32): every strategy and layout against
/// the single device in the same dtype, within TransformerEngine's CP-test tolerances
/// (`torch.allclose`, atol = rtol = 2.5e-2 for bf16, 5e-3 for f16:
/// tests/pytorch/attention/run_attention_with_cp.py). As there (and in ring-flash-attention),
/// each partial output comes from the kernel in the inputs' dtype and the partials merge in f32.
#[test]
fn half_precision_matches_single_device_within_transformer_engine_tolerances() {
    use burn::tensor::DType;
    use burn_dcp::diagnostics::harness::run_single_device_in;
    let device = Default::default();
    let usp = USP_2X2;
    let mut seed = 500;
    for (dtype, tolerance) in [(DType::BF16, 2.5e-2f32), (DType::F16, 5e-3)] {
        for mask in masks() {
            seed += 1;
            let inputs = random_inputs(&[13, 3, 1, 6, 21], 4, 2, 8, seed);
            let masks = std::slice::from_ref(&mask);
            let single = run_single_device_in::<B>(&device, &inputs, masks, None, dtype).unwrap();
            for strategy in [Strategy::Ulysses, Strategy::Ring, Strategy::AllGather, usp] {
                for layout in layouts() {
                    let mut run = spec(4, strategy, layout, &mask);
                    run.dtype = dtype;
                    let report = run_context_parallel::<B>(&device, &inputs, &run).unwrap();
                    let what = format!("{dtype:?} {strategy} {layout} {mask}");
                    assert_allclose(&report.outputs, &single, tolerance, &what);
                }
            }
        }
    }
}
