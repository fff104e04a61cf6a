//! The flash kernels ([`burn_dcp_kernels::cube::flash`]) with their plain bodies (products,
//! fragment loads and row reductions on ordinary units, plain copies): everything but
//! `ldmatrix`, `mma.sync` and `cp.async`, which `cube_cuda.rs` runs on a GPU. The products and
//! row reductions exchange by plane shuffles (lavapipe's planes of 8 shuffle) and, chosen by
//! name, through shared memory.

use super::*;
use burn::tensor::DType;
use burn_dcp_kernels::cube::{forward_with, AttentionKernel};
use common::cube::{tensor, KernelRun};

type B = WgpuPlain;
const FLASH: AttentionKernel = AttentionKernel::Flash {
    tensor_cores: false,
};

/// A run of `kernel` on this test's device.
fn on(case: &Case, seed: u64, dtype: DType, kernel: AttentionKernel) -> KernelRun<'_, B> {
    KernelRun::new(case, seed, dtype, kernel, device())
}

/// Forward and gradients in f32 within 1e-5 of the oracle.
fn check_f32(case: &Case, seed: u64, what: &str) {
    check_f32_on(case, seed, what, FLASH);
}

/// [`check_f32`] on `kernel`.
fn check_f32_on(case: &Case, seed: u64, what: &str, kernel: AttentionKernel) {
    let run = on(case, seed, DType::F32, kernel);
    let (out, lse, x) = run.forward().unwrap();
    let want = reference::forward(&x.q, &x.k, &x.v, &case.problem, &case.shape).unwrap();
    let what = format!("flash {what}");
    assert_forward_near(&out, &lse, &want, 1e-5, &what);
    run.check_gradients(1e-5, &what);
}

/// The shared-memory body (devices whose planes do not shuffle; here chosen by name): a ragged
/// batch over several tiles (whole and partial), GQA 2:1, under a key-range, a causal and a
/// sliding mask, forward and gradients within 1e-5 of the oracle. (One shape: lavapipe compiles
/// this body about 50 s per shape.)
#[test]
fn the_shared_memory_body_matches_the_reference() {
    let case = long_case(long_mixed_masks(), 2, 1, (16, 16));
    let what = "shared memory, key ranges, causal, sliding";
    check_f32_on(&case, 300, what, AttentionKernel::FlashShared);
}

#[test]
fn several_tiles_whole_and_partial_match_the_reference() {
    // Sequences of 200, 37 and 130 tokens: several cubes and key tiles, runs of whole and
    // partial tiles (a diagonal, a window with a sink: two spans, blocks); two heads per
    // cube (group 2), by name rather than `auto` (the suite's shapes: the same kernel builds).
    let masks = long_masks().into_iter().filter(|mask| {
        matches!(
            mask,
            MaskSpec::Causal | MaskSpec::Lambda { .. } | MaskSpec::Blockwise { .. }
        )
    });
    for (index, mask) in masks.enumerate() {
        let case = long_case(vec![mask.clone()], 4, 2, (16, 24));
        check_f32(&case, 210 + index as u64, &format!("{mask} long"));
    }
    let case = long_case(long_mixed_masks(), 2, 1, (32, 8));
    check_f32(&case, 220, "per-sequence masks with key ranges, D32/8");
}

#[test]
fn half_precision_rounds_only_where_tensor_cores_would() {
    // P and dS are rounded to f16 before their products, the LSE and every accumulator stay
    // f32 (the suite's f16 shape: the same kernel builds; f16 at padded dims below).
    let case = long_case(vec![MaskSpec::Causal], 4, 2, (16, 16));
    check_f16(&case, 230, "f16 causal D16");
}

#[test]
fn dims_that_are_not_multiples_of_16_are_padded_inside() {
    // Zeros fill the columns up to the next multiple of 16 in shared memory; the writes
    // skip them. Plain loads hold each plane's own rows in registers, so on lavapipe's
    // 32 KiB f32 fits K and V side by side up to about dim 220, f16 up to 256; above, f32
    // stages them in turn (FlashConfig::in_turn): 256/256 here, over several tiles.
    let dims = [(40, 24), (200, 136)];
    for (index, (head_dim, value_dim)) in dims.into_iter().enumerate() {
        let case = ragged_case(MaskSpec::Causal, 4, 2).with_dims((head_dim, value_dim));
        let what = format!("causal D{head_dim}/{value_dim}");
        check_f32(&case, 270 + index as u64, &what);
    }
    let case = long_case(long_mixed_masks(), 2, 1, (40, 8));
    check_f32(&case, 275, "per-sequence masks with key ranges, D40/8");
    let case = long_case(vec![MaskSpec::Causal], 2, 1, (256, 256));
    check_f32(&case, 277, "causal D256/256, K and V in turn");
    let case = ragged_case(MaskSpec::Causal, 2, 1).with_dims((256, 248));
    check_f16(&case, 276, "f16 causal D256/248");
}

/// Forward within f16's rounding of P (the oracle's f64 result), gradients within 2e-3.
fn check_f16(case: &Case, seed: u64, what: &str) {
    let run = on(case, seed, DType::F16, FLASH);
    run.check_half_forward(what);
    run.check_gradients(2e-3, &format!("flash {what}"));
}

#[test]
fn fully_masked_rows_and_nan_scores_keep_their_meaning() {
    let case = fully_masked_case().with_dims((16, 16));
    let run = on(&case, 240, DType::F32, FLASH);
    let (out, lse, _) = run.forward().unwrap();
    assert!(out.iter().all(|&x| x == 0.0), "{out:?}");
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY), "{lse:?}");
    let (grads, _) = run.backward().unwrap();
    for (name, values) in ["dq", "dk", "dv"].iter().zip(&grads) {
        assert!(values.iter().all(|&x| x == 0.0), "{name}: {values:?}");
    }

    // Two query heads on one kv head: the launch of the fully masked case above.
    let (heads, dim) = (2, 16);
    let problem = VarlenAttention::packed(vec![5, 3], vec![MaskSpec::Causal]);
    let mut rng = SmallRng::seed_from_u64(241);
    let mut q = random(&mut rng, 8 * heads * dim);
    let (k, v) = (random(&mut rng, 8 * dim), random(&mut rng, 8 * dim));
    q[2 * heads * dim] = f32::NAN; // token 2 (sequence 0), head 0
    let primitive = |values: &[f32], heads| {
        let tensor = common::upload::<B>(values, [8, heads, dim], &device());
        tensor.into_primitive().tensor()
    };
    let (out, lse) = forward_with(
        primitive(&q, heads),
        primitive(&k, 1),
        primitive(&v, 1),
        &problem,
        FLASH,
    )
    .unwrap();
    let (out, lse) = (read(tensor::<B, 3>(out)), read(tensor::<B, 2>(lse)));
    let row = 2 * heads * dim;
    assert!(out[row..row + dim].iter().all(|x| x.is_nan()), "{out:?}");
    assert!(lse[2].is_nan(), "lse of the NaN row: {}", lse[2]);
    // Sequence 1 shares the cube but not the NaN query's keys.
    assert!(out[5 * heads * dim..].iter().all(|x| x.is_finite()));
}

#[test]
fn cube_sizes_change_the_time_never_the_result() {
    // The forward's cube size differs by device and by BURN_DCP_FLASH_PLANES (8 planes on
    // tensor cores, 4 elsewhere): every size must give the same bits. Here 1 and 2 planes
    // per cube (one and two query tiles of 32 rows), causal and per-sequence masks, GQA.
    use burn_dcp_kernels::cube::flash::{forward_flash, FlashBody, FlashPlan, Planes};
    use burn_dcp_kernels::tiling::DenseSpans;
    let cases = [
        long_case(vec![MaskSpec::Causal], 4, 2, (16, 16)),
        long_case(long_mixed_masks(), 2, 1, (32, 16)),
    ];
    for (index, case) in cases.iter().enumerate() {
        let mut rng = SmallRng::seed_from_u64(260 + index as u64);
        let x = inputs(&mut rng, &case.shape);
        let s = &case.shape;
        let dense = DenseSpans::build(&case.problem).unwrap();
        let results: Vec<(Vec<f32>, Vec<f32>)> = [1, 2]
            .into_iter()
            .map(|planes| {
                let plan = FlashPlan::sized_with_planes(
                    32_768,
                    DType::F32,
                    s,
                    dense.max_spans,
                    FlashBody::Shuffles,
                    Planes::both(planes),
                )
                .unwrap();
                assert_eq!(plan.forward.planes, planes);
                let primitive = |values: &[f32], dims| {
                    let tensor = common::upload::<B>(values, dims, &device());
                    tensor.into_primitive().tensor()
                };
                let (out, lse) = forward_flash(
                    primitive(&x.q, [s.q_tokens, s.heads, s.head_dim]),
                    primitive(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]),
                    primitive(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]),
                    &case.problem,
                    s,
                    DType::F32,
                    &dense,
                    &plan,
                );
                (read(tensor::<B, 3>(out)), read(tensor::<B, 2>(lse)))
            })
            .collect();
        assert!(results[0].0.iter().all(|x| x.is_finite()));
        assert_eq!(
            results[0], results[1],
            "case {index}: 1 and 2 planes differ"
        );
    }
}

#[test]
fn what_the_flash_kernels_cannot_run_is_refused_with_the_reason() {
    let case = long_case(vec![MaskSpec::Causal], 2, 1, (16, 16));
    let cores = AttentionKernel::Flash { tensor_cores: true };
    let refusal = |case, dtype, kernel| on(case, 250, dtype, kernel).forward().unwrap_err();
    let err = refusal(&case, DType::F16, cores).to_string();
    assert!(err.contains("mma.sync") && err.contains("F16"), "{err}");
    let err = refusal(&case, DType::F32, cores).to_string();
    assert!(err.contains("f16 or bf16") && err.contains("F32"), "{err}");
    let wide = long_case(vec![MaskSpec::Causal], 2, 1, (16, 264));
    let err = refusal(&wide, DType::F32, FLASH).to_string();
    assert!(err.contains("1 to 256") && err.contains("264"), "{err}");
    // Auto takes the plain bodies where there are no tensor cores, with the same result as
    // asking for them.
    let (auto, _, _) = on(&case, 251, DType::F32, AttentionKernel::Auto)
        .forward()
        .unwrap();
    let (plain, _, _) = on(&case, 251, DType::F32, FLASH).forward().unwrap();
    assert_eq!(auto, plain);
}

#[test]
fn the_plain_bodies_shuffle_on_lavapipe() {
    // cubecl advertises no plane operations on CPU adapters; the device's own answer (its
    // planes of 8 shuffle within rows of four lanes) picks the barrier-free body.
    use burn::backend::wgpu::WgpuRuntime;
    use burn_dcp_kernels::cube::flash::{plain_body, FlashBody};
    use cubecl::Runtime;
    let client = WgpuRuntime::client(&device());
    assert_eq!(plain_body(&client), FlashBody::Shuffles);
}
