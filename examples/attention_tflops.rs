//! Attention throughput on a CUDA GPU, one implementation per run, as JSON lines: the
//! side-by-side shapes in bf16 — 1 × 32 heads × 8192 tokens × 128 dims (causal and full) and a GQA shape
//! (32 query / 8 kv heads, 16384 tokens, causal) — forward and forward + backward.
//!
//! ```text
//! cargo run --release --features cuda --example attention_tflops -- --impl ours
//! ```
//!
//! `--impl` is `ours` (the flash kernels) or `burn`
//! (burn's `attention` on `[1, H, T, D]`, kv heads repeated for GQA; forward + backward under
//! `Autodiff`, where burn runs matmul, softmax, matmul). Each line: `shape`, `pass`
//! (`forward`, `forward+backward`), `impl`, `ms` (median of `--reps` timed calls after
//! `--warmup`, each ended by a device sync), `ms_min`, `tflops` by FlashAttention's count
//! (`4·T²·H·D`, halved when causal; forward + backward 3.5 times that). A pass that fails (out
//! of memory, say) prints a line with `error` instead and the run goes on.
//! `scripts/gpu_attention.py` runs every implementation and torch's flash attention and writes
//! `docs/gpu-runs/<date>-<gpu>.json`.
// Without `cuda`, `main` only says which feature is missing: the shapes and timers are unused.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::time::Instant;

/// One benchmark shape.
#[derive(Clone, Copy, Debug)]
struct Shape {
    name: &'static str,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "causal-1x8192-h32-d128",
        tokens: 8192,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        causal: true,
    },
    Shape {
        name: "full-1x8192-h32-d128",
        tokens: 8192,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        causal: false,
    },
    Shape {
        name: "gqa-causal-1x16384-h32k8-d128",
        tokens: 16384,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        causal: true,
    },
];

impl Shape {
    /// FlashAttention's forward FLOP count.
    fn forward_flops(&self) -> f64 {
        let f = 4.0 * (self.tokens as f64).powi(2) * self.heads as f64 * self.head_dim as f64;
        if self.causal {
            f / 2.0
        } else {
            f
        }
    }
}

/// The passes and their FLOP multipliers (FlashAttention's: backward 2.5 × forward).
const PASSES: [(&str, f64); 2] = [("forward", 1.0), ("forward+backward", 3.5)];

struct Args {
    implementation: String,
    reps: usize,
    warmup: usize,
    shapes: Vec<Shape>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        implementation: String::new(),
        reps: 20,
        warmup: 3,
        shapes: SHAPES.to_vec(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--impl" => args.implementation = value()?,
            "--reps" => args.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--warmup" => args.warmup = value()?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--shapes" => {
                let names = value()?;
                args.shapes = names
                    .split(',')
                    .map(|name| {
                        SHAPES
                            .iter()
                            .copied()
                            .find(|s| s.name == name)
                            .ok_or_else(|| {
                                let known: Vec<_> = SHAPES.iter().map(|s| s.name).collect();
                                format!("unknown shape {name:?}; known: {}", known.join(", "))
                            })
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => {
                return Err(format!(
                    "unknown flag {other:?} (--impl, --reps, --warmup, --shapes)"
                ))
            }
        }
    }
    if !["ours", "burn"].contains(&args.implementation.as_str()) {
        return Err(format!(
            "--impl {:?}: expected ours or burn",
            args.implementation
        ));
    }
    if args.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    Ok(args)
}

/// Median and minimum milliseconds of `reps` calls of `run` after `warmup` calls.
fn time(warmup: usize, reps: usize, mut run: impl FnMut()) -> (f64, f64) {
    for _ in 0..warmup {
        run();
    }
    let mut ms: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[ms.len() / 2], ms[0])
}

fn report(
    shape: &Shape,
    pass: (&str, f64),
    implementation: &str,
    result: Result<(f64, f64), String>,
) {
    let mut line = serde_json::json!({
        "shape": shape.name,
        "pass": pass.0,
        "impl": implementation,
    });
    match result {
        Ok((ms, ms_min)) => {
            line["ms"] = ms.into();
            line["ms_min"] = ms_min.into();
            line["tflops"] = (shape.forward_flops() * pass.1 / (ms * 1e-3) / 1e12).into();
        }
        Err(error) => line["error"] = error.into(),
    }
    println!("{line}");
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("attention_tflops: {error}");
            std::process::exit(2);
        }
    };
    run(&args);
}

#[cfg(not(feature = "cuda"))]
fn run(_: &Args) {
    eprintln!("attention_tflops: built without the `cuda` feature (cargo run --features cuda …)");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn run(args: &Args) {
    use burn::backend::Autodiff;
    use burn::prelude::*;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{DType, Distribution};
    use burn_dcp_kernels::backends::CudaPlain as B;
    use burn_dcp_kernels::cube::{backward_with, forward_with, AttentionKernel};
    use burn_dcp_kernels::{BackwardTensors, MaskSpec, VarlenAttention};

    let device = Default::default();
    let sync = || B::sync(&device).expect("device sync");
    let random = |dims: [usize; 3]| {
        Tensor::<B, 3>::random(dims, Distribution::Uniform(-1.0, 1.0), &device).cast(DType::BF16)
    };
    let catch = |f: &mut dyn FnMut() -> (f64, f64)| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into())
        })
    };
    for shape in &args.shapes {
        let (t, h, kh, d) = (shape.tokens, shape.heads, shape.kv_heads, shape.head_dim);
        let [q, k, v, dout] = [[t, h, d], [t, kh, d], [t, kh, d], [t, h, d]].map(random);
        let mask = if shape.causal {
            MaskSpec::Causal
        } else {
            MaskSpec::Full
        };
        let problem = VarlenAttention::packed(vec![t], vec![mask]);
        let primitive = |x: &Tensor<B, 3>| x.clone().into_primitive().tensor();
        match args.implementation.as_str() {
            "ours" => {
                let kernel = AttentionKernel::Flash { tensor_cores: true };
                let forward = || {
                    forward_with(
                        primitive(&q),
                        primitive(&k),
                        primitive(&v),
                        &problem,
                        kernel,
                    )
                    .expect("the device runs this kernel")
                };
                let result = catch(&mut || {
                    time(args.warmup, args.reps, || {
                        forward();
                        sync();
                    })
                });
                report(shape, PASSES[0], &args.implementation, result);
                let result = catch(&mut || {
                    time(args.warmup, args.reps, || {
                        let (out, lse) = forward();
                        let inputs = BackwardTensors {
                            q: primitive(&q),
                            k: primitive(&k),
                            v: primitive(&v),
                            out,
                            lse,
                            dout: primitive(&dout),
                        };
                        let grads = backward_with(inputs, &problem, kernel)
                            .expect("the device runs this kernel");
                        sync();
                        drop(grads);
                    })
                });
                report(shape, PASSES[1], &args.implementation, result);
            }
            _ => {
                // burn's layout [1, H, T, D], contiguous, kv heads repeated (no GQA there).
                let bhtd = |x: &Tensor<B, 3>, heads: usize| {
                    x.clone()
                        .swap_dims(0, 1)
                        .reshape([1, heads, t, d])
                        .repeat_dim(1, h / heads)
                };
                let (bq, bk, bv, bdout) = (bhtd(&q, h), bhtd(&k, kh), bhtd(&v, kh), bhtd(&dout, h));
                sync();
                let options = AttentionModuleOptions {
                    scale: None,
                    softcap: None,
                    is_causal: shape.causal,
                };
                let result = catch(&mut || {
                    time(args.warmup, args.reps, || {
                        let out =
                            attention(bq.clone(), bk.clone(), bv.clone(), None, None, options);
                        sync();
                        drop(out);
                    })
                });
                report(shape, PASSES[0], "burn", result);
                type A = Autodiff<B>;
                let grad = |x: &Tensor<B, 4>| Tensor::<A, 4>::from_inner(x.clone()).require_grad();
                let result = catch(&mut || {
                    time(args.warmup, args.reps, || {
                        let (aq, ak, av) = (grad(&bq), grad(&bk), grad(&bv));
                        let out =
                            attention(aq.clone(), ak.clone(), av.clone(), None, None, options);
                        let loss = (out * Tensor::<A, 4>::from_inner(bdout.clone())).sum();
                        let grads = loss.backward();
                        let dq = aq.grad(&grads);
                        sync();
                        drop((dq, grads));
                    })
                });
                report(shape, PASSES[1], "burn", result);
            }
        }
    }
}
