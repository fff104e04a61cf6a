//! The cubecl kernels on CUDA, including the flash kernels on tensor cores, against the f64
//! oracle. They need an NVIDIA GPU, so every test is `#[ignore]`d (CI has none); run them with
//!
//! ```text
//! cargo test --release -p burn-dcp-kernels --features gpu-tests --test cube_cuda -- --ignored
//! ```
//!
//! **Status:** all pass on an NVIDIA H100 (2026-11-26, `scripts/gpu_check.sh`, 58 s). CI has no
//! GPU: there the same kernels with their plain bodies are tested on lavapipe (`cube_wgpu.rs`,
//! module `flash_plain`). (The run of 2026-11-26 was on the matrix-tile kernels these tests
//! named then; they were retired for the flash kernels, which these tests now run.)
#![cfg(feature = "gpu-tests")]

use burn::prelude::Tensor;
use burn::tensor::{DType, TensorData, TensorPrimitive};
use burn_dcp_kernels::backends::CudaPlain;
use burn_dcp_kernels::cube::{backward_with, forward_with, AttentionKernel};
use burn_dcp_kernels::{reference, FlashOps, MaskSpec};
use rand::rngs::SmallRng;
use rand::SeedableRng;

mod common;
use common::{long_case, long_masks, masks, ragged_case, random, rel_err, Case};

type B = CudaPlain;

fn upload(values: &[f32], dims: [usize; 3], dtype: DType) -> Tensor<B, 3> {
    Tensor::<B, 3>::from_data(TensorData::new(values.to_vec(), dims), &Default::default())
        .cast(dtype)
}

fn read<const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// Rounded inputs `(q, k, v)` of a case and the forward `(out, lse)` of `kernel` on them.
fn forward(
    case: &Case,
    seed: u64,
    dtype: DType,
    kernel: AttentionKernel,
) -> ([Vec<f32>; 3], Vec<f32>, Vec<f32>) {
    let s = &case.shape;
    let mut rng = SmallRng::seed_from_u64(seed);
    let q = upload(
        &random(&mut rng, s.q_tokens * s.heads * s.head_dim),
        [s.q_tokens, s.heads, s.head_dim],
        dtype,
    );
    let k = upload(
        &random(&mut rng, s.kv_tokens * s.kv_heads * s.head_dim),
        [s.kv_tokens, s.kv_heads, s.head_dim],
        dtype,
    );
    let v = upload(
        &random(&mut rng, s.kv_tokens * s.kv_heads * s.value_dim),
        [s.kv_tokens, s.kv_heads, s.value_dim],
        dtype,
    );
    let rounded = [read(q.clone()), read(k.clone()), read(v.clone())];
    let primitive = |t: Tensor<B, 3>| t.into_primitive().tensor();
    let (out, lse) = forward_with(
        primitive(q),
        primitive(k),
        primitive(v),
        &case.problem,
        kernel,
    )
    .unwrap();
    let out = read(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out)));
    let lse = read(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse)));
    (rounded, out, lse)
}

/// `out` within `u·(max|v| + max|out|)` of the oracle (P and `out` rounded to the dtype, unit
/// roundoff `u`; see `cube_wgpu.rs`), the f32 LSE within 1e-5.
fn check_half(case: &Case, seed: u64, dtype: DType, kernel: AttentionKernel, what: &str) {
    let unit_roundoff = match dtype {
        DType::F16 => 2f32.powi(-11),
        DType::BF16 => 2f32.powi(-8),
        other => panic!("not a half dtype: {other:?}"),
    };
    let ([q, k, v], out, lse) = forward(case, seed, dtype, kernel);
    let want = reference::forward(&q, &k, &v, &case.problem, &case.shape).unwrap();
    let max_v = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_out = want.out.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(out.iter().all(|x| !x.is_nan()), "{what}: NaN in out");
    let worst = out
        .iter()
        .zip(&want.out)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let bound = unit_roundoff * (max_v + max_out) * 1.01;
    assert!(worst <= bound, "{what}: |out - oracle| {worst} > {bound}");
    let lse_err = rel_err(&lse, &want.lse);
    assert!(lse_err <= 1e-5, "{what}: lse {lse_err}");
}

const TENSOR_CORES: AttentionKernel = AttentionKernel::Flash { tensor_cores: true };

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_cores_match_the_oracle_for_every_mask_in_f16_and_bf16() {
    for dtype in [DType::F16, DType::BF16] {
        for (index, mask) in masks().into_iter().enumerate() {
            let case = ragged_case(mask.clone(), 4, 2);
            let case = Case {
                shape: burn_dcp_kernels::AttentionShape {
                    head_dim: 64,
                    value_dim: 64,
                    ..case.shape
                },
                problem: case.problem,
            };
            check_half(
                &case,
                index as u64,
                dtype,
                TENSOR_CORES,
                &format!("{dtype:?} {mask}"),
            );
        }
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (40, 24), (256, 256)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                check_half(
                    &case,
                    20 + index as u64,
                    dtype,
                    TENSOR_CORES,
                    &format!("{dtype:?} {mask} dims {dims:?}"),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_cores_agree_with_the_same_kernels_on_plain_units() {
    let case = long_case(vec![MaskSpec::Causal], 8, 2, (128, 128));
    let plain = AttentionKernel::Flash {
        tensor_cores: false,
    };
    for (dtype, unit_roundoff) in [(DType::F16, 2f32.powi(-11)), (DType::BF16, 2f32.powi(-8))] {
        let (_, cores_out, cores_lse) = forward(&case, 40, dtype, TENSOR_CORES);
        let (_, plain_out, plain_lse) = forward(&case, 40, dtype, plain);
        // Same operands, same roundings (P and out); only the f32 summation order differs, which
        // may flip a rounding of P or out: at most an ulp (2u) of the largest output.
        assert!(rel_err(&cores_lse, &plain_lse) <= 1e-5, "{dtype:?} lse");
        let out_err = rel_err(&cores_out, &plain_out);
        assert!(out_err <= 2.0 * unit_roundoff, "{dtype:?} out {out_err}");
        check_half(&case, 40, dtype, TENSOR_CORES, "causal H8 K2 D128");
    }
}

/// `[dq, dk, dv]` of `kernel` (forward and backward) on `dtype` inputs, and the rounded inputs
/// `[q, k, v, dout]`.
fn gradients(
    case: &Case,
    seed: u64,
    dtype: DType,
    kernel: AttentionKernel,
) -> ([Vec<f32>; 3], [Vec<f32>; 4]) {
    let s = &case.shape;
    let mut rng = SmallRng::seed_from_u64(seed);
    let dims = [
        [s.q_tokens, s.heads, s.head_dim],
        [s.kv_tokens, s.kv_heads, s.head_dim],
        [s.kv_tokens, s.kv_heads, s.value_dim],
        [s.q_tokens, s.heads, s.value_dim],
    ];
    let [q, k, v, dout] = dims.map(|d| upload(&random(&mut rng, d.iter().product()), d, dtype));
    let rounded = [&q, &k, &v, &dout].map(|t| read(t.clone()));
    let primitive = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
    let (out, lse) = forward_with(
        primitive(&q),
        primitive(&k),
        primitive(&v),
        &case.problem,
        kernel,
    )
    .unwrap();
    let (dq, dk, dv) = backward_with(
        primitive(&q),
        primitive(&k),
        primitive(&v),
        out,
        lse,
        primitive(&dout),
        &case.problem,
        kernel,
    )
    .unwrap();
    let grads =
        [dq, dk, dv].map(|g| read(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(g))));
    (grads, rounded)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_gradients_match_the_oracle_in_f16_and_bf16() {
    // Gradients stored in the input dtype, P and dS rounded to it before their products: the
    // lavapipe test's bound for f16 (2e-3 relative), scaled by the unit roundoff for bf16.
    for (dtype, bound) in [(DType::F16, 2e-3), (DType::BF16, 2e-3 * 8.0)] {
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (40, 24)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                let seed = 80 + index as u64;
                let ([dq, dk, dv], [q, k, v, dout]) = gradients(&case, seed, dtype, TENSOR_CORES);
                let want =
                    reference::backward(&q, &k, &v, &dout, &case.problem, &case.shape).unwrap();
                let errors = [
                    rel_err(&dq, &want.dq),
                    rel_err(&dk, &want.dk),
                    rel_err(&dv, &want.dv),
                ];
                assert!(
                    errors.iter().all(|&e| e <= bound),
                    "{dtype:?} {mask} dims {dims:?}: dq/dk/dv errors {errors:?}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_vector_kernels_match_the_oracle_on_cuda() {
    for (index, mask) in masks().into_iter().enumerate() {
        let case = ragged_case(mask.clone(), 4, 2);
        let s = &case.shape;
        let mut rng = SmallRng::seed_from_u64(60 + index as u64);
        let q = random(&mut rng, s.q_tokens * s.heads * s.head_dim);
        let k = random(&mut rng, s.kv_tokens * s.kv_heads * s.head_dim);
        let v = random(&mut rng, s.kv_tokens * s.kv_heads * s.value_dim);
        let dout = random(&mut rng, s.q_tokens * s.heads * s.value_dim);
        let up = |x: &[f32], dims| upload(x, dims, DType::F32);
        let (tq, tk, tv) = (
            up(&q, [s.q_tokens, s.heads, s.head_dim]),
            up(&k, [s.kv_tokens, s.kv_heads, s.head_dim]),
            up(&v, [s.kv_tokens, s.kv_heads, s.value_dim]),
        );
        let forward = B::flash_forward(tq.clone(), tk.clone(), tv.clone(), &case.problem).unwrap();
        let want = reference::forward(&q, &k, &v, &case.problem, s).unwrap();
        assert!(
            rel_err(&read(forward.out.clone()), &want.out) <= 1e-5,
            "{mask}"
        );
        assert!(
            rel_err(&read(forward.lse.clone()), &want.lse) <= 1e-5,
            "{mask}"
        );
        let grads = B::flash_backward(
            tq,
            tk,
            tv,
            forward.out,
            forward.lse,
            up(&dout, [s.q_tokens, s.heads, s.value_dim]),
            &case.problem,
        )
        .unwrap();
        let want = reference::backward(&q, &k, &v, &dout, &case.problem, s).unwrap();
        assert!(rel_err(&read(grads.dq), &want.dq) <= 1e-5, "{mask} dq");
        assert!(rel_err(&read(grads.dk), &want.dk) <= 1e-5, "{mask} dk");
        assert!(rel_err(&read(grads.dv), &want.dv) <= 1e-5, "{mask} dv");
    }
}

const FLASH: AttentionKernel = AttentionKernel::Flash { tensor_cores: true };
const FLASH_PLAIN: AttentionKernel = AttentionKernel::Flash {
    tensor_cores: false,
};

/// `case` with head and value dims `dims`.
fn with_dims(case: Case, dims: (usize, usize)) -> Case {
    Case {
        shape: burn_dcp_kernels::AttentionShape {
            head_dim: dims.0,
            value_dim: dims.1,
            ..case.shape
        },
        problem: case.problem,
    }
}

/// The gradients of `kernel` against the oracle within `bound` (relative to the largest).
fn check_gradients(case: &Case, seed: u64, dtype: DType, kernel: AttentionKernel, what: &str) {
    // Gradients stored in the input dtype, P and dS rounded to it before their products: the
    // lavapipe test's bound for f16 (2e-3 relative), scaled by the unit roundoff for bf16.
    let bound = if dtype == DType::F16 {
        2e-3
    } else {
        2e-3 * 8.0
    };
    let ([dq, dk, dv], [q, k, v, dout]) = gradients(case, seed, dtype, kernel);
    let want = reference::backward(&q, &k, &v, &dout, &case.problem, &case.shape).unwrap();
    let errors = [
        rel_err(&dq, &want.dq),
        rel_err(&dk, &want.dk),
        rel_err(&dv, &want.dv),
    ];
    assert!(
        errors.iter().all(|&e| e <= bound),
        "{what}: dq/dk/dv errors {errors:?} > {bound}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn flash_kernels_match_the_oracle_for_every_mask_in_f16_and_bf16() {
    for dtype in [DType::F16, DType::BF16] {
        for (index, mask) in masks().into_iter().enumerate() {
            // Groups of 2 (two heads per cube), 4 (four) and 3 (one).
            for (heads, kv_heads) in [(4, 2), (8, 2), (3, 1)] {
                let case = with_dims(ragged_case(mask.clone(), heads, kv_heads), (64, 64));
                let what = format!("flash {dtype:?} {mask} H{heads} K{kv_heads}");
                check_half(&case, 100 + index as u64, dtype, FLASH, &what);
                check_gradients(&case, 100 + index as u64, dtype, FLASH, &what);
            }
        }
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (32, 96), (16, 16)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                let what = format!("flash {dtype:?} {mask} dims {dims:?}");
                check_half(&case, 120 + index as u64, dtype, FLASH, &what);
                check_gradients(&case, 120 + index as u64, dtype, FLASH, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn flash_tensor_cores_agree_with_their_plain_bodies() {
    // The same kernels with `ldmatrix`, `mma.sync`, `cp.async` and shuffles, or with plain
    // loads, products and reductions: only the f32 summation order differs.
    let case = long_case(vec![MaskSpec::Causal], 8, 2, (128, 128));
    for (dtype, unit_roundoff) in [(DType::F16, 2f32.powi(-11)), (DType::BF16, 2f32.powi(-8))] {
        let (_, cores_out, cores_lse) = forward(&case, 140, dtype, FLASH);
        let (_, plain_out, plain_lse) = forward(&case, 140, dtype, FLASH_PLAIN);
        assert!(rel_err(&cores_lse, &plain_lse) <= 1e-5, "{dtype:?} lse");
        let out_err = rel_err(&cores_out, &plain_out);
        assert!(out_err <= 2.0 * unit_roundoff, "{dtype:?} out {out_err}");
        let (cores, _) = gradients(&case, 141, dtype, FLASH);
        let (plain, _) = gradients(&case, 141, dtype, FLASH_PLAIN);
        for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(cores.iter().zip(&plain)) {
            let err = rel_err(a, b);
            assert!(err <= 8.0 * unit_roundoff, "{dtype:?} {name} {err}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn flash_reads_unaligned_views_and_auto_takes_it() {
    // q, k, v as views starting 4 elements into rows of 136: no 16-byte copies from there, so
    // the launch makes them contiguous first, and the result is that of contiguous inputs.
    // `Auto` picks the flash kernels for bf16.
    let case = long_case(vec![MaskSpec::Causal], 4, 2, (128, 128));
    let s = &case.shape;
    let mut rng = SmallRng::seed_from_u64(150);
    let mut view = |tokens: usize, heads: usize| {
        let wide = upload(
            &random(&mut rng, tokens * heads * 136),
            [tokens, heads, 136],
            DType::BF16,
        );
        wide.narrow(2, 4, 128)
    };
    let views = [
        view(s.q_tokens, s.heads),
        view(s.kv_tokens, s.kv_heads),
        view(s.kv_tokens, s.kv_heads),
    ];
    let copies = views.clone().map(|t| {
        let dims = t.dims();
        upload(&read(t), dims, DType::BF16)
    });
    let run = |[q, k, v]: &[Tensor<B, 3>; 3], kernel| {
        let primitive = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
        let (out, lse) = forward_with(
            primitive(q),
            primitive(k),
            primitive(v),
            &case.problem,
            kernel,
        )
        .unwrap();
        (
            read(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))),
            read(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse))),
        )
    };
    let on_views = run(&views, FLASH);
    assert_eq!(on_views, run(&copies, FLASH));
    assert_eq!(on_views, run(&views, AttentionKernel::Auto));
}
