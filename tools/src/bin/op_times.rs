//! Times the operations of a training step at a model's shapes, one by one, on a backend: the
//! projections' matrix products (forward, and the two products of their backward, on the
//! transposed views autodiff passes), RMSNorm, SwiGLU's product, the loss's cast and
//! log-softmax over the vocabulary, and the f32 → bf16 cast of a weight. Each is run `--reps`
//! times after `--warmup` runs and the device waited for; the median is printed with its rate
//! (TFLOP/s for products, GB/s of the fewest bytes for the rest). `scripts/torch_ops.py` times
//! the same operations in PyTorch: together they say which primitive a step's time goes to.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --features cuda --bin op_times -- --backend cuda --model-size llama-1b --json
//! ```

use std::time::Instant;

use burn::nn::RmsNormConfig;
use burn::prelude::{Backend, Tensor};
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::{Distribution, FloatDType};
use burn_dcp_models::preset;
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// flex | cuda | wgpu
    #[arg(long, default_value = "flex")]
    backend: String,
    /// burn's plain `CubeBackend` instead of `Fusion<CubeBackend>`
    #[arg(long)]
    no_fusion: bool,
    /// A model preset (tiny, small, base, llama-125m, llama-350m, llama-1b)
    #[arg(long, default_value = "llama-125m")]
    model_size: String,
    /// Tokens of the micro-batch
    #[arg(long, default_value_t = 8192)]
    seq_len: usize,
    /// bf16 | f32
    #[arg(long, default_value = "bf16")]
    precision: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

/// One operation's median time and rate.
struct Timed {
    name: String,
    ms: f64,
    rate: f64,
    unit: &'static str,
}

fn time<B: Backend, T>(
    args: &Args,
    device: &B::Device,
    mut op: impl FnMut() -> T,
) -> Result<f64, String> {
    let sync = || B::sync(device).map_err(|e| format!("waiting for the device: {e:?}"));
    for _ in 0..args.warmup {
        drop(op());
    }
    sync()?;
    let mut times: Vec<f64> = (0..args.reps.max(1))
        .map(|_| {
            let started = Instant::now();
            let out = op();
            sync()?;
            drop(out);
            Ok(started.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_, String>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn run_on<B: Backend>(args: &Args, device: &B::Device) -> Result<Vec<Timed>, String> {
    let model = preset(&args.model_size, 256)?;
    let dtype = match args.precision.as_str() {
        "bf16" => FloatDType::BF16,
        "f32" => FloatDType::F32,
        other => return Err(format!("--precision {other}: expected bf16 or f32")),
    };
    let bytes = if dtype == FloatDType::BF16 { 2.0 } else { 4.0 };
    let t = args.seq_len;
    let d = model.d_model;
    let random = |dims: [usize; 3]| {
        Tensor::<B, 3>::random(dims, Distribution::Normal(0.0, 1.0), device).cast(dtype)
    };
    let mut out = Vec::new();
    let projections = [
        ("q", d, model.n_heads * model.head_dim()),
        ("k/v", d, model.n_kv_heads * model.head_dim()),
        ("o", model.n_heads * model.head_dim(), d),
        ("gate/up", d, model.d_ff),
        ("down", model.d_ff, d),
        ("lm head", d, model.vocab_size),
    ];
    for (name, n_in, n_out) in projections {
        let x = random([1, t, n_in]);
        let w = random([1, n_in, n_out]);
        let dy = random([1, t, n_out]);
        let flops = 2.0 * (t * n_in * n_out) as f64;
        let mut product =
            |label: &str, op: &mut dyn FnMut() -> Tensor<B, 3>| -> Result<(), String> {
                let ms = time::<B, _>(args, device, op)?;
                eprintln!("matmul {name} {label}: {ms:.3} ms");
                out.push(Timed {
                    name: format!("matmul {name} {label}"),
                    ms,
                    rate: flops / ms / 1e9,
                    unit: "TFLOP/s",
                });
                Ok(())
            };
        product("x·W", &mut || x.clone().matmul(w.clone()))?;
        product("dY·Wᵀ", &mut || {
            dy.clone().matmul(w.clone().swap_dims(1, 2))
        })?;
        product("Xᵀ·dY", &mut || {
            x.clone().swap_dims(1, 2).matmul(dy.clone())
        })?;
    }
    let mut elementwise =
        |name: &str, moved: f64, op: &mut dyn FnMut() -> Tensor<B, 3>| -> Result<(), String> {
            let ms = time::<B, _>(args, device, op)?;
            eprintln!("{name}: {ms:.3} ms");
            out.push(Timed {
                name: name.into(),
                ms,
                rate: moved / ms / 1e6,
                unit: "GB/s",
            });
            Ok(())
        };
    let h = random([1, t, d]);
    let mut norm = RmsNormConfig::new(d).init::<B>(device);
    norm.gamma = norm.gamma.map(|gamma| gamma.cast(dtype));
    let norm_bytes = 2.0 * (t * d) as f64 * bytes;
    elementwise("rmsnorm [T, d]", norm_bytes, &mut || {
        norm.forward(h.clone())
    })?;
    let (a, b) = (random([1, t, model.d_ff]), random([1, t, model.d_ff]));
    let glu_bytes = 3.0 * (t * model.d_ff) as f64 * bytes;
    elementwise("silu(a)·b [T, ff]", glu_bytes, &mut || {
        silu(a.clone()) * b.clone()
    })?;
    elementwise(
        "residual add [T, d]",
        3.0 * (t * d) as f64 * bytes,
        &mut || h.clone() + h.clone(),
    )?;
    let logits = random([1, t, model.vocab_size]);
    let loss_bytes = (t * model.vocab_size) as f64 * (bytes + 4.0);
    elementwise("cast + log_softmax [T, V]", loss_bytes, &mut || {
        log_softmax(logits.clone().cast(FloatDType::F32), 2)
    })?;
    let weight = Tensor::<B, 3>::random([1, model.d_ff, d], Distribution::Default, device);
    elementwise(
        "cast f32→bf16 [ff, d]",
        (model.d_ff * d) as f64 * (4.0 + bytes),
        &mut || weight.clone().cast(dtype),
    )?;
    Ok(out)
}

fn run(args: Args) -> Result<(), String> {
    burn_dcp_tools::backend_type(&args.backend, args.no_fusion, "--bin op_times")?;
    let timed = burn_dcp_tools::on_backend!(args.backend.as_str(), args.no_fusion, B => {
        run_on::<B>(&args, &Default::default())?
    });
    if args.json {
        let ops: Vec<_> = timed
            .iter()
            .map(|t| json!({"op": t.name, "ms": t.ms, "rate": t.rate, "unit": t.unit}))
            .collect();
        let summary = json!({"backend": args.backend, "fusion": !args.no_fusion,
            "model": args.model_size, "seq_len": args.seq_len, "precision": args.precision, "ops": ops});
        println!("{summary}");
    } else {
        for t in &timed {
            println!("{:<32} {:>9.3} ms {:>9.1} {}", t.name, t.ms, t.rate, t.unit);
        }
    }
    Ok(())
}

fn main() {
    burn_dcp_tools::exit_on_error(run(Args::parse()));
}
