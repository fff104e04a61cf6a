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
use burn::tensor::DType;
use burn_dcp_kernels::backends::CudaPlain;
use burn_dcp_kernels::cube::{forward_with, AttentionKernel};
use burn_dcp_kernels::MaskSpec;
use rand::rngs::SmallRng;
use rand::SeedableRng;

mod common;
use common::cube::{tensor, KernelRun};
use common::{
    check_uploaded, long_case, long_masks, masks, ragged_case, random, read, rel_err,
    unit_roundoff, upload, Case,
};

type B = CudaPlain;

/// The flash kernels on tensor cores, and with their plain bodies.
const FLASH: AttentionKernel = AttentionKernel::Flash { tensor_cores: true };
const FLASH_PLAIN: AttentionKernel = AttentionKernel::Flash {
    tensor_cores: false,
};

/// A run of `kernel` on the GPU (checks of the forward: `out` within the dtype's rounding of the
/// oracle's, see `cube_wgpu.rs`; the f32 LSE within 1e-5).
fn on(case: &Case, seed: u64, dtype: DType, kernel: AttentionKernel) -> KernelRun<'_, B> {
    KernelRun::new(case, seed, dtype, kernel, Default::default())
}

/// The gradients of `run` against the oracle. Gradients stored in the input dtype, P and dS
/// rounded to it before their products: the lavapipe test's bound for f16 (2e-3 relative),
/// scaled by the unit roundoff for bf16.
fn check_gradients(run: &KernelRun<'_, B>, what: &str) {
    let bound = if run.dtype == DType::F16 {
        2e-3
    } else {
        2e-3 * 8.0
    };
    run.check_gradients(bound, what);
}

/// The forwards on tensor cores and on plain units from the same inputs: only the f32 summation
/// order differs, which may flip a rounding of P or out: at most an ulp (2u) of the largest
/// output.
fn assert_forwards_agree(case: &Case, seed: u64, dtype: DType) {
    let (cores_out, cores_lse, _) = on(case, seed, dtype, FLASH).forward().unwrap();
    let (plain_out, plain_lse, _) = on(case, seed, dtype, FLASH_PLAIN).forward().unwrap();
    assert!(rel_err(&cores_lse, &plain_lse) <= 1e-5, "{dtype:?} lse");
    let out_err = rel_err(&cores_out, &plain_out);
    assert!(
        out_err <= 2.0 * unit_roundoff(dtype),
        "{dtype:?} out {out_err}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_cores_match_the_oracle_for_every_mask_in_f16_and_bf16() {
    for dtype in [DType::F16, DType::BF16] {
        for (index, mask) in masks().into_iter().enumerate() {
            let case = ragged_case(mask.clone(), 4, 2).with_dims((64, 64));
            on(&case, index as u64, dtype, FLASH).check_half_forward(&format!("{dtype:?} {mask}"));
        }
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (40, 24), (256, 256)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                let what = format!("{dtype:?} {mask} dims {dims:?}");
                on(&case, 20 + index as u64, dtype, FLASH).check_half_forward(&what);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_cores_agree_with_the_same_kernels_on_plain_units() {
    let case = long_case(vec![MaskSpec::Causal], 8, 2, (128, 128));
    for dtype in [DType::F16, DType::BF16] {
        assert_forwards_agree(&case, 40, dtype);
        on(&case, 40, dtype, FLASH).check_half_forward("causal H8 K2 D128");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_gradients_match_the_oracle_in_f16_and_bf16() {
    for dtype in [DType::F16, DType::BF16] {
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (40, 24)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                let what = format!("{dtype:?} {mask} dims {dims:?}");
                check_gradients(&on(&case, 80 + index as u64, dtype, FLASH), &what);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_vector_kernels_match_the_oracle_on_cuda() {
    let device = Default::default();
    for (index, mask) in masks().into_iter().enumerate() {
        let case = ragged_case(mask.clone(), 4, 2);
        let upload = |values: &[f32], dims| upload::<B>(values, dims, &device);
        check_uploaded(&case, 60 + index as u64, &mask.to_string(), upload);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn flash_kernels_match_the_oracle_for_every_mask_in_f16_and_bf16() {
    for dtype in [DType::F16, DType::BF16] {
        for (index, mask) in masks().into_iter().enumerate() {
            // Groups of 2 (two heads per cube), 4 (four) and 3 (one).
            for (heads, kv_heads) in [(4, 2), (8, 2), (3, 1)] {
                let case = ragged_case(mask.clone(), heads, kv_heads).with_dims((64, 64));
                let what = format!("flash {dtype:?} {mask} H{heads} K{kv_heads}");
                let run = on(&case, 100 + index as u64, dtype, FLASH);
                run.check_half_forward(&what);
                check_gradients(&run, &what);
            }
        }
        for (index, mask) in long_masks().into_iter().enumerate() {
            for dims in [(64, 64), (128, 128), (32, 96), (16, 16)] {
                let case = long_case(vec![mask.clone()], 4, 2, dims);
                let what = format!("flash {dtype:?} {mask} dims {dims:?}");
                let run = on(&case, 120 + index as u64, dtype, FLASH);
                run.check_half_forward(&what);
                check_gradients(&run, &what);
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
    for dtype in [DType::F16, DType::BF16] {
        assert_forwards_agree(&case, 140, dtype);
        let (cores, _) = on(&case, 141, dtype, FLASH).backward().unwrap();
        let (plain, _) = on(&case, 141, dtype, FLASH_PLAIN).backward().unwrap();
        for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(cores.iter().zip(&plain)) {
            let err = rel_err(a, b);
            assert!(err <= 8.0 * unit_roundoff(dtype), "{dtype:?} {name} {err}");
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
    let device = Default::default();
    let bf16 = |values: &[f32], dims| upload::<B>(values, dims, &device).cast(DType::BF16);
    let mut rng = SmallRng::seed_from_u64(150);
    let mut view = |tokens: usize, heads: usize| {
        let wide = bf16(
            &random(&mut rng, tokens * heads * 136),
            [tokens, heads, 136],
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
        bf16(&read(t), dims)
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
        (read(tensor::<B, 3>(out)), read(tensor::<B, 2>(lse)))
    };
    let on_views = run(&views, FLASH);
    assert_eq!(on_views, run(&copies, FLASH));
    assert_eq!(on_views, run(&views, AttentionKernel::Auto));
}
