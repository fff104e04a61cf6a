//! Criterion micro-benchmarks of the attention ops on the CPU: the portable implementation
//! (`FlashOps` on burn Flex: forward with LSE, backward, merge) against burn 0.21's own
//! `attention` on Flex (forward) and on `Autodiff<Flex>` (forward + backward), over a table of
//! shapes: one causal sequence, a ragged causal batch, a sparse λ mask, and full attention.
//!
//! Throughput is `Throughput::Elements(FLOPs)` counting **unmasked work only**: `4·D` per allowed
//! (query, key) pair and query head forward, `1 + BACKWARD_FLOPS_FACTOR` (3.5) times that for
//! forward and backward. Burn's attention has no varlen or GQA support, so it runs each sequence
//! separately with kv heads repeated, and sparse masks as dense bool masks: it does the masked work
//! too, but is credited with the same unmasked FLOPs, so the ratio of throughputs is the ratio of
//! times.
//!
//!     cargo bench --bench attention -- --quick
//!
//! The group `peak` times a plain square f32 matmul on Flex in the same run, on one core and on
//! every core at once (one matmul per core): the attention GFLOP/s are read as a fraction of it.
//!
//! With `--features wgpu`, the group `wgpu` adds the cubecl kernels against burn's `attention` on
//! the same backend (`burn::backend::Wgpu`, no autotune: burn's fallback matmul/softmax path),
//! forward and forward + backward (burn's on `Autodiff<Wgpu>`), on smaller shapes (without a GPU,
//! wgpu runs on lavapipe):
//!
//!     cargo bench --features wgpu --bench attention -- --quick wgpu
//!
//! With `--features cuda` (an NVIDIA GPU), the group `cuda` times the GPU shape (1 × 32
//! heads × 8192 tokens × 128 dims, bf16, causal and full): our forward and forward + backward on
//! the flash kernels' plain bodies and on tensor cores, and burn's attention:
//!
//!     cargo bench --features cuda --bench attention -- cuda

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Distribution, TensorData};
use burn_dcp::planner::cost::BACKWARD_FLOPS_FACTOR;
use burn_dcp_kernels::{
    FlashBackward, FlashGradients, FlashOps, FlashOutput, MaskSpec, VarlenAttention,
};
use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};

/// One benchmark shape.
struct Shape {
    name: &'static str,
    seq_lens: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    mask: &'static str,
}

fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "causal-1x1024-h8k2-d64",
            seq_lens: vec![1024],
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            mask: "causal",
        },
        Shape {
            name: "causal-ragged-700+300+1200-h8k2-d64",
            seq_lens: vec![700, 300, 1200],
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            mask: "causal",
        },
        Shape {
            name: "lambda64,256-1x2048-h8k2-d64",
            seq_lens: vec![2048],
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            mask: "lambda:64,256",
        },
        Shape {
            name: "full-1x512-h4k4-d128",
            seq_lens: vec![512],
            heads: 4,
            kv_heads: 4,
            head_dim: 128,
            mask: "full",
        },
    ]
}

fn random<B: Backend>(shape: [usize; 3], seed: u64, device: &B::Device) -> Tensor<B, 3> {
    B::seed(device, seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

struct Inputs<B: Backend> {
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    dout: Tensor<B, 3>,
    problem: VarlenAttention,
}

fn inputs<B: Backend>(shape: &Shape, device: &B::Device) -> Inputs<B> {
    let t: usize = shape.seq_lens.iter().sum();
    let mask: MaskSpec = shape.mask.parse().expect("valid mask");
    Inputs {
        q: random([t, shape.heads, shape.head_dim], 1, device),
        k: random([t, shape.kv_heads, shape.head_dim], 2, device),
        v: random([t, shape.kv_heads, shape.head_dim], 3, device),
        dout: random([t, shape.heads, shape.head_dim], 4, device),
        problem: VarlenAttention::packed(shape.seq_lens.clone(), vec![mask]),
    }
}

/// burn's attention, sequence by sequence: `[1, H, T, D]`, kv heads repeated, the mask dense
/// unless it is causal or full.
fn burn_attention<B: Backend>(shape: &Shape, x: &Inputs<B>) -> Vec<Tensor<B, 4>> {
    let device = x.q.device();
    let mask: MaskSpec = shape.mask.parse().expect("valid mask");
    let repeat = shape.heads / shape.kv_heads;
    let mut start = 0;
    let mut outs = Vec::new();
    for &len in &shape.seq_lens {
        let to_bhtd = |t: Tensor<B, 3>, heads: usize| {
            t.narrow(0, start, len)
                .swap_dims(0, 1)
                .reshape([1, heads, len, shape.head_dim])
        };
        let q = to_bhtd(x.q.clone(), shape.heads);
        let k = to_bhtd(x.k.clone(), shape.kv_heads).repeat_dim(1, repeat);
        let v = to_bhtd(x.v.clone(), shape.kv_heads).repeat_dim(1, repeat);
        let (dense, is_causal) = match mask {
            MaskSpec::Causal => (None, true),
            MaskSpec::Full => (None, false),
            ref other => {
                let masked: Vec<bool> = (0..len)
                    .flat_map(|i| (0..len).map(move |j| (i, j)))
                    .map(|(i, j)| !other.allows(i, j, len))
                    .collect();
                let mask = Tensor::<B, 4, Bool>::from_data(
                    TensorData::new(masked, [1, 1, len, len]),
                    &device,
                );
                (Some(mask.expand([1, shape.heads, len, len])), false)
            }
        };
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal,
        };
        outs.push(attention(q, k, v, dense, None, options));
        start += len;
    }
    outs
}

/// burn's attention, each sequence's output read back to the host.
fn burn_forward<B: Backend>(shape: &Shape, x: &Inputs<B>) -> Vec<TensorData> {
    burn_attention(shape, x)
        .into_iter()
        .map(|o| o.into_data())
        .collect()
}

fn flops(shape: &Shape, x: &VarlenAttention) -> u64 {
    x.allowed_pairs() * 4 * shape.head_dim as u64 * shape.heads as u64
}

/// The FLOPs of a forward and its backward, from those of the forward.
fn forward_backward_flops(forward_flops: u64) -> u64 {
    ((1.0 + BACKWARD_FLOPS_FACTOR) * forward_flops as f64) as u64
}

/// This machine's practical f32 peak on the same run: a plain square matmul on Flex (burn's
/// CPU backend, the one burn's `attention` on Flex runs on), `2·n³` FLOPs per call. The
/// attention rows are reported as a fraction of the fastest of these.
fn peak(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("peak");
    group.sample_size(10);
    for n in [256usize, 512, 1024] {
        let a = random::<Flex>([1, n, n], 5, &device);
        let b = random::<Flex>([1, n, n], 6, &device);
        group.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
        group.bench_function(BenchmarkId::new("matmul-flex", n), |bench| {
            bench.iter(|| a.clone().matmul(b.clone()).into_data())
        });
    }
    // Flex's matmul runs on one core here (burn-flex without its `rayon` feature); the portable
    // kernels use every core. The machine's peak: one independent matmul per core at once.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = 512usize;
    let a = random::<Flex>([1, n, n], 5, &device);
    let b = random::<Flex>([1, n, n], 6, &device);
    group.throughput(Throughput::Elements(2 * (n as u64).pow(3) * cores as u64));
    group.bench_function(
        BenchmarkId::new(format!("matmul-flex-x{cores}-threads"), n),
        |bench| {
            bench.iter(|| {
                std::thread::scope(|scope| {
                    let runs: Vec<_> = (0..cores)
                        .map(|_| scope.spawn(|| a.clone().matmul(b.clone()).into_data()))
                        .collect();
                    runs.into_iter()
                        .map(|run| run.join().expect("matmul thread"))
                        .collect::<Vec<_>>()
                })
            })
        },
    );
    group.finish();
}

fn forward(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("forward");
    group.sample_size(10);
    for shape in shapes() {
        let x = inputs::<Flex>(&shape, &device);
        group.throughput(Throughput::Elements(flops(&shape, &x.problem)));
        group.bench_function(BenchmarkId::new("portable-flex", shape.name), |b| {
            b.iter(|| ours_forward(&x).out.into_data())
        });
        // The same on one thread, as burn's attention on Flex runs here.
        std::env::set_var(burn_dcp_kernels::portable::THREADS_VAR, "1");
        group.bench_function(
            BenchmarkId::new("portable-flex-1-thread", shape.name),
            |b| b.iter(|| ours_forward(&x).out.into_data()),
        );
        std::env::remove_var(burn_dcp_kernels::portable::THREADS_VAR);
        group.bench_function(BenchmarkId::new("burn-attention-flex", shape.name), |b| {
            b.iter(|| burn_forward(&shape, &x))
        });
    }
    group.finish();
}

/// Our forward, left on the device.
fn ours_forward<B: FlashOps>(x: &Inputs<B>) -> FlashOutput<B> {
    B::flash_forward(x.q.clone(), x.k.clone(), x.v.clone(), &x.problem).expect("valid problem")
}

/// Our forward then backward (what a CP step runs), left on the device.
fn ours_gradients<B: FlashOps>(x: &Inputs<B>) -> FlashGradients<B> {
    let inputs = FlashBackward::new(
        x.q.clone(),
        x.k.clone(),
        x.v.clone(),
        ours_forward(x),
        x.dout.clone(),
    );
    B::flash_backward(inputs, &x.problem).expect("valid problem")
}

/// [`ours_gradients`] read back to the host.
fn ours_forward_backward<B: FlashOps>(x: &Inputs<B>) -> [TensorData; 3] {
    let grads = ours_gradients(x);
    [
        grads.dq.into_data(),
        grads.dk.into_data(),
        grads.dv.into_data(),
    ]
}

/// The inputs of `x` as autodiff leaves (q, k, v require gradients).
fn autodiff_inputs<B: Backend>(x: &Inputs<B>) -> Inputs<Autodiff<B>> {
    Inputs {
        q: Tensor::from_inner(x.q.clone()).require_grad(),
        k: Tensor::from_inner(x.k.clone()).require_grad(),
        v: Tensor::from_inner(x.v.clone()).require_grad(),
        dout: Tensor::from_inner(x.dout.clone()),
        problem: x.problem.clone(),
    }
}

/// burn's attention forward then autodiff backward of `Σ out ∘ dout`, gradients read back.
fn burn_forward_backward<B: Backend>(
    shape: &Shape,
    xa: &Inputs<Autodiff<B>>,
) -> [Option<TensorData>; 3] {
    let outs = burn_attention(shape, xa);
    let out = Tensor::cat(
        outs.into_iter()
            .map(|o| {
                let [_, h, t, d] = o.dims();
                o.reshape([h, t, d]).swap_dims(0, 1)
            })
            .collect(),
        0,
    );
    let grads = (out * xa.dout.clone()).sum().backward();
    [
        xa.q.grad(&grads).map(|g| g.into_data()),
        xa.k.grad(&grads).map(|g| g.into_data()),
        xa.v.grad(&grads).map(|g| g.into_data()),
    ]
}

/// Ours (id `ours`) and burn's attention on `Autodiff<B>` (id `burn`), forward + backward.
fn bench_forward_backward<B: FlashOps>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    [ours, burn]: [&str; 2],
    shape: &Shape,
    x: &Inputs<B>,
) {
    group.throughput(Throughput::Elements(forward_backward_flops(flops(
        shape, &x.problem,
    ))));
    group.bench_function(BenchmarkId::new(ours, shape.name), |b| {
        b.iter(|| ours_forward_backward(x))
    });
    let xa = autodiff_inputs(x);
    group.bench_function(BenchmarkId::new(burn, shape.name), |b| {
        b.iter(|| burn_forward_backward(shape, &xa))
    });
}

fn forward_backward(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("forward+backward");
    group.sample_size(10);
    for shape in shapes() {
        let x = inputs::<Flex>(&shape, &device);
        let ids = ["portable-flex", "burn-attention-autodiff-flex"];
        bench_forward_backward(&mut group, ids, &shape, &x);
    }
    group.finish();
}

/// Our merge of two forwards over the same queries (the second with k and v swapped).
fn bench_merge<B: FlashOps>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    shape: &Shape,
    x: &Inputs<B>,
) {
    let a = ours_forward(x);
    let b_part =
        B::flash_forward(x.q.clone(), x.v.clone(), x.k.clone(), &x.problem).expect("valid problem");
    let [t, h, d] = a.out.dims();
    // bytes read and written per merge, as elements: two partial outs and lses in, one out
    group.throughput(Throughput::Elements((3 * t * h * d + 3 * t * h) as u64));
    group.bench_function(BenchmarkId::new(id, shape.name), |bench| {
        bench.iter(|| {
            B::flash_merge(a.clone(), b_part.clone())
                .expect("same shapes")
                .out
                .into_data()
        })
    });
}

fn merge(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("merge");
    group.sample_size(10);
    for shape in shapes() {
        let x = inputs::<Flex>(&shape, &device);
        bench_merge(&mut group, "portable-flex", &shape, &x);
    }
    group.finish();
}

/// Shapes of the wgpu group: small enough for lavapipe (a CPU), head dim ≤ 64.
#[cfg(feature = "wgpu")]
fn wgpu_shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "causal-1x512-h4k2-d64",
            seq_lens: vec![512],
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            mask: "causal",
        },
        Shape {
            name: "ragged-causal-300,129,77-h4k2-d64",
            seq_lens: vec![300, 129, 77],
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            mask: "causal",
        },
        Shape {
            name: "lambda-1x512-h4k2-d64",
            seq_lens: vec![512],
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            mask: "lambda:16,64",
        },
        Shape {
            name: "full-1x256-h4k4-d64",
            seq_lens: vec![256],
            heads: 4,
            kv_heads: 4,
            head_dim: 64,
            mask: "full",
        },
    ]
}

/// The cubecl kernels vs burn's attention, both on wgpu: forward, forward + backward, merge.
#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    use burn::backend::Wgpu;
    let device = Default::default();
    let mut group = c.benchmark_group("wgpu");
    group.sample_size(10);
    for shape in wgpu_shapes() {
        let x = inputs::<Wgpu>(&shape, &device);
        // Compile the kernels of this shape outside the timed region (on lavapipe a first call
        // compiles for tens of seconds).
        ours_forward_backward(&x);
        group.throughput(Throughput::Elements(flops(&shape, &x.problem)));
        group.bench_function(BenchmarkId::new("forward/cube-wgpu", shape.name), |b| {
            b.iter(|| {
                let out = ours_forward(&x);
                (out.out.into_data(), out.lse.into_data())
            })
        });
        group.bench_function(
            BenchmarkId::new("forward/burn-attention-wgpu", shape.name),
            |b| b.iter(|| burn_forward(&shape, &x)),
        );
        let ids = [
            "forward+backward/cube-wgpu",
            "forward+backward/burn-attention-autodiff-wgpu",
        ];
        bench_forward_backward(&mut group, ids, &shape, &x);
        bench_merge(&mut group, "merge/cube-wgpu", &shape, &x);
    }
    group.finish();
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

/// The GPU shape (FlashAttention-3 reports 740 TFLOP/s forward on an H100 in
/// bf16 at this size): 1 × 32 heads × 8192 tokens × 128 dims, bf16, causal and full. Our
/// forward and forward + backward on the plain bodies and on tensor cores, and burn's attention;
/// the throughput is in FLOP/s (criterion's "elem/s"). Each timed call ends with a device
/// sync, not a read-back. Results of an H100: `benches/RESULTS.md` ("CUDA").
#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::tensor::{DType, TensorPrimitive};
    use burn_dcp_kernels::backends::CudaPlain as B;
    use burn_dcp_kernels::cube::{backward_with, forward_with, AttentionKernel};
    use burn_dcp_kernels::BackwardTensors;
    let device = Default::default();
    let mut group = c.benchmark_group("cuda");
    group.sample_size(10);
    for mask in ["causal", "full"] {
        let shape = Shape {
            name: if mask == "causal" {
                "causal-1x8192-h32-d128-bf16"
            } else {
                "full-1x8192-h32-d128-bf16"
            },
            seq_lens: vec![8192],
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            mask,
        };
        let x = inputs::<B>(&shape, &device);
        let x = Inputs {
            q: x.q.cast(DType::BF16),
            k: x.k.cast(DType::BF16),
            v: x.v.cast(DType::BF16),
            dout: x.dout.cast(DType::BF16),
            problem: x.problem,
        };
        let forward_flops = flops(&shape, &x.problem);
        group.throughput(Throughput::Elements(forward_flops));
        let kernels = [
            (
                "flash-plain",
                AttentionKernel::Flash {
                    tensor_cores: false,
                },
            ),
            ("flash", AttentionKernel::Flash { tensor_cores: true }),
        ];
        let primitive = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
        let forward = |kernel| {
            let (q, k, v) = (primitive(&x.q), primitive(&x.k), primitive(&x.v));
            forward_with(q, k, v, &x.problem, kernel).expect("the device runs this kernel")
        };
        for (label, kernel) in kernels {
            let run = || {
                let (out, _lse) = forward(kernel);
                B::sync(&device).expect("device sync");
                Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
            };
            run();
            group.bench_function(
                BenchmarkId::new(format!("forward/{label}-cuda"), shape.name),
                |b| b.iter(run),
            );
        }
        group.bench_function(
            BenchmarkId::new("forward/burn-attention-cuda", shape.name),
            |b| {
                b.iter(|| {
                    let outs = burn_attention(&shape, &x);
                    B::sync(&device).expect("device sync");
                    outs
                })
            },
        );
        group.throughput(Throughput::Elements(forward_backward_flops(forward_flops)));
        let tensor_cores = AttentionKernel::Flash { tensor_cores: true };
        group.bench_function(
            BenchmarkId::new("forward+backward/flash-cuda", shape.name),
            |b| {
                b.iter(|| {
                    let (out, lse) = forward(tensor_cores);
                    let inputs = BackwardTensors {
                        q: primitive(&x.q),
                        k: primitive(&x.k),
                        v: primitive(&x.v),
                        out,
                        lse,
                        dout: primitive(&x.dout),
                    };
                    let grads = backward_with(inputs, &x.problem, tensor_cores)
                        .expect("the device runs this kernel");
                    B::sync(&device).expect("device sync");
                    grads
                })
            },
        );
        group.bench_function(
            BenchmarkId::new("forward+backward/auto-cuda", shape.name),
            |b| {
                b.iter(|| {
                    let grads = ours_gradients(&x);
                    B::sync(&device).expect("device sync");
                    grads
                })
            },
        );
    }
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, peak, forward, forward_backward, merge, wgpu, cuda);
criterion_main!(benches);
