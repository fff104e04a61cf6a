//! The cubecl kernels on wgpu (Mesa's lavapipe without a GPU) against the naive f64 oracle and
//! the portable implementation: every mask, ragged GQA batches, offsets, strided segments,
//! several tiles, fully masked rows, the merge (in place and not), strided views and errors —
//! each on burn's plain `CubeBackend` and on burn-fusion's `Fusion<CubeBackend>` (burn's default
//! `Wgpu`), where the kernels run as custom operations of the fusion stream; head dims 64 and
//! 128 and the agreement with the portable implementation (the kernels' arithmetic, not the
//! backend's plumbing) on the plain backend only.
//!
//! Run with `cargo test -p burn-dcp-kernels --features wgpu`. Without a Vulkan/Metal/DX12
//! adapter these tests fail (they never pass silently); CI installs lavapipe.
#![cfg(feature = "wgpu")]

use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dcp_kernels::backends::{WgpuFusion, WgpuPlain};
use burn_dcp_kernels::{
    portable, reference, AttentionShape, BackwardTensors, FlashBackward, FlashOps, FlashOutput,
    MaskSpec, VarlenAttention,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

mod common;
use common::{
    assert_forward_near, assert_gradients_near, check_uploaded, fully_masked_case, inputs,
    key_half, long_case, long_masks, long_mixed_masks, masks, pick_rows, ragged_case, random, read,
    rel_err, Case,
};

/// The wgpu devices the tests run on, each test's thread leasing one for its whole run. This
/// suite's time is lavapipe compiling kernel shapes, one at a time per device (on its server's
/// thread): where every adapter is a CPU (Mesa's lavapipe, as in CI), a second device on it
/// (`WgpuDevice::Cpu`) lets two tests compile at once, and a shape one device built is in part a
/// hit in Mesa's disk cache on the other.
mod devices {
    use std::sync::{Mutex, OnceLock};

    use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use cubecl::Runtime;

    fn free() -> &'static Mutex<Vec<WgpuDevice>> {
        static FREE: OnceLock<Mutex<Vec<WgpuDevice>>> = OnceLock::new();
        FREE.get_or_init(|| {
            // Type 4 lists every adapter (without starting a device); a CPU's id has type 3.
            let adapters = WgpuRuntime::enumerate_devices(4, &AutoGraphicsApi::backend());
            let cpus_only = !adapters.is_empty() && adapters.iter().all(|id| id.type_id == 3);
            Mutex::new(match cpus_only {
                true => vec![WgpuDevice::DefaultDevice, WgpuDevice::Cpu],
                false => vec![WgpuDevice::DefaultDevice],
            })
        })
    }

    /// A device held by one test's thread, given back when the thread ends.
    struct Lease(WgpuDevice);

    impl Drop for Lease {
        fn drop(&mut self) {
            let mut free = free().lock().unwrap_or_else(|p| p.into_inner());
            free.push(self.0.clone());
        }
    }

    thread_local! {
        static LEASE: Lease = {
            let mut free = free().lock().unwrap_or_else(|p| p.into_inner());
            // More tests at once than devices: they share the default one.
            Lease(free.pop().unwrap_or_default())
        };
    }

    /// This test's device.
    pub fn device() -> WgpuDevice {
        LEASE.with(|lease| lease.0.clone())
    }
}
use devices::device;

/// The kernel tests on one backend type.
/// (`$kernel_only`: tests of the kernels' arithmetic rather than of the backend's plumbing, run
/// on one backend: each shape is another lavapipe build on each.)
macro_rules! suite {
    ($name:ident, $backend:ty $(, { $($kernel_only:item)* })?) => {
        mod $name {
            use super::*;

            type B = $backend;

            fn upload(values: &[f32], dims: [usize; 3]) -> Tensor<B, 3> {
                common::upload(values, dims, &device())
            }

            /// Forward and backward on wgpu against the f64 oracle (≤ 1e-5 relative, as the portable one).
            fn check_against_reference(case: &Case, seed: u64, what: &str) {
                check_uploaded(case, seed, what, upload);
            }

            #[test]
            fn small_ragged_gqa_batches_match_the_reference_for_every_mask() {
                // Groups of 1, 2 (two heads share a cube's key tiles), 3 (one head per cube)
                // and 4, at dim 16 (scripts/check_wgpu.py's: Mesa's disk cache shares the
                // builds; padded and unequal dims have their own tests).
                for (index, mask) in masks().into_iter().enumerate() {
                    for (heads, kv_heads) in [(2, 2), (4, 2), (3, 1), (4, 1)] {
                        let case = ragged_case(mask.clone(), heads, kv_heads).with_dims((16, 16));
                        check_against_reference(
                            &case,
                            index as u64,
                            &format!("{mask} H{heads} K{kv_heads}"),
                        );
                    }
                }
            }

            #[test]
            fn multi_tile_batches_match_the_reference_for_every_mask() {
                for (index, mask) in long_masks().into_iter().enumerate() {
                    let case = long_case(vec![mask.clone()], 4, 2, (16, 24));
                    check_against_reference(
                        &case,
                        10 + index as u64,
                        &format!("{mask} H4 K2 D16/24"),
                    );
                }
                let case = long_case(long_mixed_masks(), 2, 1, (32, 8));
                check_against_reference(
                    &case,
                    20,
                    "per-sequence masks with key ranges, H2 K1 D32/8",
                );
            }

            #[test]
            fn a_non_contiguous_last_dim_is_read_element_by_element() {
                // `[T, D, H]` swapped to `[T, H, D]`: the head dim has stride H.
                let transposed = |values: &[f32], [tokens, heads, dim]: [usize; 3]| {
                    let mut dim_major = vec![0.0; values.len()];
                    for t in 0..tokens {
                        for h in 0..heads {
                            for d in 0..dim {
                                dim_major[(t * dim + d) * heads + h] =
                                    values[(t * heads + h) * dim + d];
                            }
                        }
                    }
                    upload(&dim_major, [tokens, dim, heads]).swap_dims(1, 2)
                };
                let case = long_case(vec![MaskSpec::Sliding { window: 20 }], 2, 2, (8, 8));
                check_uploaded(&case, 80, "dim-strided views", transposed);
            }

            #[test]
            fn half_precision_inputs_accumulate_in_f32() {
                // f16 q/k/v/dout; the oracle runs in f64 on the same (f16-rounded) values. The
                // LSE is f32 from f32 accumulation: as exact as with f32 inputs. `out` and the
                // gradients are stored in f16: within half an f16 ulp of the largest magnitude
                // (2^-11 ≈ 4.9e-4 relative to it); the gradients also inherit the rounding of
                // `out` through delta = rowsum(dout ∘ out), as in FlashAttention's backward.
                let case = long_case(vec![MaskSpec::Causal], 4, 2, (16, 16));
                let Case { problem, shape: s } = &case;
                let x = inputs(&mut SmallRng::seed_from_u64(90), s);
                let half = |values: &[f32], dims: [usize; 3]| {
                    let tensor = upload(values, dims).cast(burn::tensor::DType::F16);
                    (read(tensor.clone()), tensor)
                };
                let (hq, q) = half(&x.q, [s.q_tokens, s.heads, s.head_dim]);
                let (hk, k) = half(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]);
                let (hv, v) = half(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]);
                let (hdout, dout) = half(&x.dout, [s.q_tokens, s.heads, s.value_dim]);
                let forward = B::flash_forward(q.clone(), k.clone(), v.clone(), problem).unwrap();
                assert_eq!(forward.out.dtype(), burn::tensor::DType::F16);
                assert_eq!(forward.lse.dtype(), burn::tensor::DType::F32);
                let want = reference::forward(&hq, &hk, &hv, problem, s).unwrap();
                let out_err = rel_err(&read(forward.out.clone()), &want.out);
                let lse_err = rel_err(&read(forward.lse.clone()), &want.lse);
                assert!(
                    out_err <= 4.9e-4 && lse_err <= 1e-5,
                    "out {out_err}, lse {lse_err}"
                );
                let grads =
                    B::flash_backward(FlashBackward::new(q, k, v, forward, dout), problem).unwrap();
                let want = reference::backward(&hq, &hk, &hv, &hdout, problem, s).unwrap();
                let [dq, dk, dv] = [grads.dq, grads.dk, grads.dv].map(read);
                assert_gradients_near([&dq, &dk, &dv], &want, 2e-3, "f16");
            }

            #[test]
            fn strided_views_are_read_without_copies() {
                // q/k/v handed over as `[H, T, D]` tensors swapped to `[T, H, D]` (the decorator's layout).
                let case = long_case(vec![MaskSpec::Causal], 2, 2, (8, 8));
                let Case { problem, shape: s } = &case;
                let x = inputs(&mut SmallRng::seed_from_u64(50), s);
                let swapped = |values: &[f32], tokens: usize, heads: usize, dim: usize| {
                    let mut head_major = Vec::with_capacity(values.len());
                    for h in 0..heads {
                        for t in 0..tokens {
                            let at = (t * heads + h) * dim;
                            head_major.extend_from_slice(&values[at..at + dim]);
                        }
                    }
                    upload(&head_major, [heads, tokens, dim]).swap_dims(0, 1)
                };
                let got = B::flash_forward(
                    swapped(&x.q, s.q_tokens, s.heads, s.head_dim),
                    swapped(&x.k, s.kv_tokens, s.kv_heads, s.head_dim),
                    swapped(&x.v, s.kv_tokens, s.kv_heads, s.value_dim),
                    problem,
                )
                .unwrap();
                let want = reference::forward(&x.q, &x.k, &x.v, problem, s).unwrap();
                assert_forward_near(&read(got.out), &read(got.lse), &want, 1e-5, "strided views");
            }

            #[test]
            fn fully_masked_rows_give_zero_and_minus_infinity() {
                let Case { problem, .. } = fully_masked_case();
                let mut rng = SmallRng::seed_from_u64(1);
                let q = upload(&random(&mut rng, 32), [4, 2, 4]);
                let k = upload(&random(&mut rng, 12), [3, 1, 4]);
                let v = upload(&random(&mut rng, 12), [3, 1, 4]);
                let forward = B::flash_forward(q.clone(), k.clone(), v.clone(), &problem).unwrap();
                let (out, lse) = (read(forward.out.clone()), read(forward.lse.clone()));
                assert!(out.iter().all(|&x| x == 0.0), "{out:?}");
                assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY), "{lse:?}");
                let dout = upload(&random(&mut rng, 32), [4, 2, 4]);
                let grads =
                    B::flash_backward(FlashBackward::new(q, k, v, forward, dout), &problem).unwrap();
                for (name, values) in [
                    ("dq", read(grads.dq)),
                    ("dk", read(grads.dk)),
                    ("dv", read(grads.dv)),
                ] {
                    assert!(values.iter().all(|&x| x == 0.0), "{name}: {values:?}");
                }
            }

            #[test]
            fn empty_key_sets_and_empty_query_sets() {
                let mut problem = VarlenAttention::packed(vec![5], vec![MaskSpec::Causal]);
                problem.kv_segments.clear();
                let q = upload(&[0.5; 20], [5, 2, 2]);
                let kv = Tensor::<B, 3>::empty([0, 1, 2], &device());
                let forward = B::flash_forward(q, kv.clone(), kv, &problem).unwrap();
                assert_eq!(read(forward.out), vec![0.0; 20]);
                assert_eq!(read(forward.lse), vec![f32::NEG_INFINITY; 10]);
            }

            #[test]
            fn merging_two_key_halves_equals_attention_over_all_keys() {
                let mut rng = SmallRng::seed_from_u64(3);
                let all = VarlenAttention::packed(vec![100, 70], vec![MaskSpec::Causal]);
                let shape = AttentionShape {
                    q_tokens: 170,
                    kv_tokens: 170,
                    heads: 2,
                    kv_heads: 2,
                    head_dim: 8,
                    value_dim: 8,
                };
                let (q, k, v) = (
                    random(&mut rng, 170 * 16),
                    random(&mut rng, 170 * 16),
                    random(&mut rng, 170 * 16),
                );
                let want = reference::forward(&q, &k, &v, &all, &shape).unwrap();
                let half = |first: bool| {
                    let (problem, rows) = key_half(&all, [50, 30], first);
                    let pick = |x: &[f32]| pick_rows(x, &rows, 16);
                    B::flash_forward(
                        upload(&q, [170, 2, 8]),
                        upload(&pick(&k), [rows.len(), 2, 8]),
                        upload(&pick(&v), [rows.len(), 2, 8]),
                        &problem,
                    )
                    .unwrap()
                };
                // In place (nothing else holds `a`) and into fresh buffers (a clone of `a` is alive).
                let merged = B::flash_merge(half(true), half(false)).unwrap();
                assert_forward_near(&read(merged.out), &read(merged.lse), &want, 1e-5, "in place");
                let a = half(true);
                let kept: FlashOutput<B> = a.clone();
                let merged = B::flash_merge(a, half(false)).unwrap();
                assert_forward_near(&read(merged.out), &read(merged.lse), &want, 1e-5, "fresh");
                let untouched = half(true);
                assert_eq!(
                    read(kept.lse),
                    read(untouched.lse),
                    "the merge wrote into a buffer still in use"
                );
            }

            #[test]
            fn merge_with_an_empty_part_keeps_the_other() {
                let out = upload(&[1.0, 2.0, 3.0, 4.0], [2, 1, 2]);
                let lse_a = Tensor::<B, 2>::from_data(
                    TensorData::new(vec![0.5f32, f32::NEG_INFINITY], [1, 2]),
                    &device(),
                );
                let lse_b = Tensor::<B, 2>::from_data(
                    TensorData::new(vec![f32::NEG_INFINITY; 2], [1, 2]),
                    &device(),
                );
                let b_out = upload(&[9.0; 4], [2, 1, 2]);
                let merged = B::flash_merge(
                    FlashOutput { out, lse: lse_a },
                    FlashOutput {
                        out: b_out,
                        lse: lse_b,
                    },
                )
                .unwrap();
                assert_eq!(read(merged.out), vec![1.0, 2.0, 0.0, 0.0]);
                assert_eq!(read(merged.lse), vec![0.5, f32::NEG_INFINITY]);
            }

            #[test]
            fn unsupported_inputs_are_rejected_with_the_rule() {
                let problem = VarlenAttention::packed(vec![3], vec![MaskSpec::Causal]);
                let big = upload(&[0.0; 3 * 300], [3, 1, 300]);
                let err = B::flash_forward(big.clone(), big.clone(), big, &problem)
                    .unwrap_err()
                    .to_string();
                assert!(err.contains("head dim 300") && err.contains("256"), "{err}");
                let q = upload(&[0.0; 12], [3, 2, 2]);
                let k = upload(&[0.0; 12], [3, 2, 2]);
                let err = B::flash_forward(
                    q,
                    k.clone(),
                    k,
                    &VarlenAttention::packed(vec![4], vec![MaskSpec::Causal]),
                )
                .unwrap_err()
                .to_string();
                assert!(err.contains("4 query"), "{err}");
            }

            /// A NaN in one query row stays visible on the kernels too (as in the portable implementation):
            /// NaN out, lse and dq for that row, NaN dk/dv for the keys it attends, finite elsewhere; a NaN
            /// part survives a merge with a part that saw no key.
            #[test]
            fn nan_inputs_propagate_and_never_look_masked() {
                let mut rng = SmallRng::seed_from_u64(7);
                let (heads, dim) = (2, 4);
                let problem = VarlenAttention::packed(vec![5, 3], vec![MaskSpec::Causal]);
                let mut q = random(&mut rng, 8 * heads * dim);
                let (k, v) = (
                    random(&mut rng, 8 * heads * dim),
                    random(&mut rng, 8 * heads * dim),
                );
                q[2 * heads * dim] = f32::NAN; // token 2 (sequence 0), head 0
                let (q, k, v) = (
                    upload(&q, [8, heads, dim]),
                    upload(&k, [8, heads, dim]),
                    upload(&v, [8, heads, dim]),
                );
                let forward = B::flash_forward(q.clone(), k.clone(), v.clone(), &problem).unwrap();
                let (out, lse) = (read(forward.out.clone()), read(forward.lse.clone()));
                let row = 2 * heads * dim;
                assert!(out[row..row + dim].iter().all(|x| x.is_nan()), "{out:?}");
                assert!(lse[2].is_nan(), "lse of the NaN row: {}", lse[2]);
                assert!(out[6 * heads * dim..7 * heads * dim]
                    .iter()
                    .all(|x| x.is_finite()));
                let dout = upload(&random(&mut rng, 8 * heads * dim), [8, heads, dim]);
                let inputs = FlashBackward::new(q, k, v, forward.clone(), dout);
                let grads = B::flash_backward(inputs, &problem).unwrap();
                let (dq, dk, dv) = (read(grads.dq), read(grads.dk), read(grads.dv));
                assert!(dq[row..row + dim].iter().all(|x| x.is_nan()), "{dq:?}");
                for key in 0..=2 {
                    let at = key * heads * dim;
                    assert!(
                        dk[at..at + dim].iter().all(|x| x.is_nan()),
                        "dk key {key}: {dk:?}"
                    );
                    assert!(
                        dv[at..at + dim].iter().all(|x| x.is_nan()),
                        "dv key {key}: {dv:?}"
                    );
                }
                assert!(dq[6 * heads * dim..7 * heads * dim]
                    .iter()
                    .all(|x| x.is_finite()));
                // Merge with a part whose queries saw no key (out 0, lse −∞).
                let empty = FlashOutput {
                    out: Tensor::<B, 3>::zeros([8, heads, dim], &device()),
                    lse: Tensor::<B, 2>::full([heads, 8], f32::NEG_INFINITY, &device()),
                };
                let merged = B::flash_merge(forward, empty).unwrap();
                let (out, lse) = (read(merged.out), read(merged.lse));
                assert!(lse[2].is_nan() && out[row..row + dim].iter().all(|x| x.is_nan()));
                assert!(lse[6].is_finite());
            }

            $($($kernel_only)*)?
        }
    };
}

suite!(plain, WgpuPlain, {
    #[test]
    fn head_dims_64_and_128_stay_exact() {
        // Each dim is its own kernel build (comptime shapes); Mesa's disk cache keeps them.
        let case = long_case(vec![MaskSpec::Causal], 2, 2, (64, 64));
        check_against_reference(&case, 30, "causal D64");
        let case = long_case(vec![MaskSpec::Causal], 2, 1, (128, 128));
        check_against_reference(&case, 31, "causal H2 K1 D128");
    }

    #[test]
    fn results_agree_with_the_portable_implementation() {
        let case = long_case(
            vec![MaskSpec::Lambda {
                sink: 4,
                window: 50,
            }],
            3,
            3,
            (20, 20),
        );
        let Case { problem, shape: s } = &case;
        let x = inputs(&mut SmallRng::seed_from_u64(40), s);
        let forward = B::flash_forward(
            upload(&x.q, [s.q_tokens, s.heads, s.head_dim]),
            upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]),
            upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]),
            problem,
        )
        .unwrap();
        let host = portable::forward(&x.q, &x.k, &x.v, s, problem).unwrap();
        assert_forward_near(
            &read(forward.out),
            &read(forward.lse),
            &host,
            1e-5,
            "portable",
        );
    }
});
suite!(fusion, WgpuFusion);

/// On the fusion backend the kernels sit in a stream of lazily recorded operations: element-wise
/// work before and after them (which burn-fusion fuses) must see their inputs and outputs exactly.
#[test]
fn fused_work_around_the_kernels_sees_their_inputs_and_outputs() {
    type B = WgpuFusion;
    let device = device();
    let case = long_case(vec![MaskSpec::Causal], 4, 2, (16, 16));
    let Case { problem, shape: s } = &case;
    let x = inputs(&mut SmallRng::seed_from_u64(60), s);
    let upload = |values: &[f32], dims| common::upload::<B>(values, dims, &device);
    // q is built by fused element-wise ops (q = (2·x − x)·1 = x); out goes through more of them.
    let q = upload(&x.q, [s.q_tokens, s.heads, s.head_dim]);
    let q = (q.clone() * 2.0 - q).mul_scalar(1.0);
    let k = upload(&x.k, [s.kv_tokens, s.kv_heads, s.head_dim]);
    let v = upload(&x.v, [s.kv_tokens, s.kv_heads, s.value_dim]);
    let forward = B::flash_forward(q.clone(), k.clone(), v.clone(), problem).unwrap();
    let out = (forward.out.clone() * 3.0 + 1.0) / 3.0 - 1.0 / 3.0;
    let want = reference::forward(&x.q, &x.k, &x.v, problem, s).unwrap();
    assert!(rel_err(&read(out), &want.out) <= 1e-5);
    let dout = upload(&x.dout, [s.q_tokens, s.heads, s.value_dim])
        .exp()
        .log();
    let grads = B::flash_backward(FlashBackward::new(q, k, v, forward, dout), problem).unwrap();
    let want = reference::backward(&x.q, &x.k, &x.v, &x.dout, problem, s).unwrap();
    assert!(rel_err(&read(grads.dq * 1.0), &want.dq) <= 1e-5);
    assert!(rel_err(&read(grads.dk + 0.0), &want.dk) <= 1e-5);
    assert!(rel_err(&read(grads.dv), &want.dv) <= 1e-5);
}

/// A bad call on the fusion backend fails at the call, with the kernels' rule, before anything
/// is queued (the queued operation could not return an error).
#[test]
fn fusion_rejects_bad_calls_before_queueing() {
    type B = WgpuFusion;
    let device = device();
    let problem = VarlenAttention::packed(vec![3], vec![MaskSpec::Causal]);
    let q = Tensor::<B, 3>::zeros([3, 2, 4], &device);
    let half = Tensor::<B, 3>::zeros([3, 2, 4], (&device, burn::tensor::DType::F16));
    let err = B::flash_forward(q.clone(), half.clone(), half, &problem)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("F16") && err.contains("share one dtype"),
        "{err}"
    );
    let forward = B::flash_forward(q.clone(), q.clone(), q.clone(), &problem).unwrap();
    let wrong_lse = Tensor::<B, 2>::zeros([2, 4], &device);
    let inputs = BackwardTensors {
        lse: wrong_lse,
        ..FlashBackward::new(
            q.clone(),
            q.clone(),
            q.clone(),
            forward.clone(),
            forward.out.clone(),
        )
    };
    let err = B::flash_backward(inputs, &problem).unwrap_err().to_string();
    assert!(err.contains("lse [2, 4]"), "{err}");
    let other = FlashOutput {
        out: Tensor::<B, 3>::zeros([4, 2, 4], &device),
        lse: Tensor::<B, 2>::zeros([2, 4], &device),
    };
    let err = B::flash_merge(forward, other).unwrap_err().to_string();
    assert!(err.contains("merge needs equal shapes"), "{err}");
}

#[path = "cube_wgpu/flash_plain.rs"]
mod flash_plain;
