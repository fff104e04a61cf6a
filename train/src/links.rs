//! `--emulate-links`: the in-process world's messages delayed as over the `--topology` preset's
//! links (`burn_dcp::comm::links`), slowed to the speed of this machine's compute.
//!
//! **The scale factor.** A preset's links sit beside GPUs that compute attention
//! `device FLOP/s` (e.g. 187 TFLOP/s for a100-p4d); a rank here computes it at the CPU's
//! attention FLOP/s divided among the process's ranks. Links slowed by
//! `time_scale = device FLOP/s ÷ CPU FLOP/s per rank` (bandwidth ÷ scale, latency × scale) keep
//! communication's share of the step's time. `--link-scale F` sets it; by default it comes from
//! this machine's calibration ([`time_scale`]): the best of three runs of the portable
//! flash-attention forward (1024 tokens, causal, 8 heads of dim 128, every core), its FLOP/s
//! divided by the ranks of the process (they share the cores when they compute at once),
//! measured once per machine and kept in [`calibration_file`] so that every run slows its links
//! alike. Both rates are
//! sustained rates at a large head dim (the presets' 60 % of peak is one), so a small model
//! (the tiny GPT's head dim 16) is as inefficient here as it would be on the GPUs, and a small
//! model is as communication-bound here as it would be there.

use std::sync::Mutex;
use std::time::Instant;

use burn::backend::flex::FlexDevice;
use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor};
use burn_dcp::comm::{InProcessWorld, LinkEmulation};
use burn_dcp::kernels::{BackwardTensors, FlashOps, MaskSpec, VarlenAttention};
use burn_dcp::planner::cost::ComputeModel;
use burn_dcp::planner::topology::Topology;

use crate::config::TrainConfig;
use crate::error::TrainError;
pub use crate::settings::EmulatedLinks;

/// Tokens of the calibration forward.
const CALIBRATION_TOKENS: usize = 1024;

/// Heads and head dim of the calibration forward.
const CALIBRATION_HEADS: usize = 8;
const CALIBRATION_HEAD_DIM: usize = 128;

/// This machine's sustained attention FLOP/s per rank when `ranks` ranks of one process compute
/// at once (see the module docs): [`machine_attention_flops`] ÷ `ranks`.
pub fn cpu_attention_flops_per_rank(ranks: usize) -> Result<f64, TrainError> {
    Ok(machine_attention_flops()?.flops / ranks.max(1) as f64)
}

/// The calibration forward's FLOP/s on every core, measured now (best of three).
fn measure_attention_flops() -> Result<f64, TrainError> {
    let (heads, head_dim) = (CALIBRATION_HEADS, CALIBRATION_HEAD_DIM);
    let n = CALIBRATION_TOKENS;
    let (forward, _) = best_causal_times(heads, heads, head_dim, n, false)?;
    Ok(causal_forward_flops(n, heads, head_dim) / forward)
}

/// This machine's calibration: the portable forward's FLOP/s on every core, and where it came
/// from.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub flops: f64,
    /// The cache file it was read from or written to; `None`: no cache directory.
    pub cache: Option<std::path::PathBuf>,
    /// Whether it was measured by this process (else read from `cache`).
    pub measured_now: bool,
}

impl Calibration {
    /// Where the calibration came from, for a run's log.
    pub fn describe(&self) -> String {
        let when = if self.measured_now {
            "calibrated now"
        } else {
            "calibration"
        };
        match &self.cache {
            Some(path) => format!("{when}: {}", path.display()),
            None => format!("{when}, not cached: no cache directory"),
        }
    }
}

/// The environment variable naming the directory of the calibration cache (default:
/// `$XDG_CACHE_HOME/burn-dcp`, else `$HOME/.cache/burn-dcp`).
pub const CACHE_DIR_ENV: &str = "BURN_DCP_CACHE_DIR";

/// The calibration file: one per machine, so that every emulated run on it slows its links by
/// the same factor (a calibration per run moved the links' speed, hence the measured
/// attention time, by a few percent from run to run). Delete it to measure again, or pass
/// `--link-scale`.
pub fn calibration_file() -> Option<std::path::PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    let dir = var(CACHE_DIR_ENV)
        .map(std::path::PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| std::path::Path::new(&d).join("burn-dcp")))
        .or_else(|| var("HOME").map(|d| std::path::Path::new(&d).join(".cache/burn-dcp")))?;
    Some(dir.join("link-calibration.json"))
}

/// What a cached calibration must match to be used: the CPU, its cores and the calibration's
/// shape.
fn machine_key() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!(
        "{cpu}; {cores} cores; causal forward {CALIBRATION_TOKENS} tokens × {CALIBRATION_HEADS} \
         heads × dim {CALIBRATION_HEAD_DIM}"
    )
}

/// This machine's attention FLOP/s, measured once per machine: read from
/// [`calibration_file`] when it holds this machine's, else measured and written there (once per
/// process either way). A cache that cannot be read or written is measured around.
pub fn machine_attention_flops() -> Result<Calibration, TrainError> {
    static CALIBRATION: Mutex<Option<Calibration>> = Mutex::new(None);
    let mut cached = CALIBRATION.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(calibration) = cached.as_ref() {
        return Ok(calibration.clone());
    }
    let calibration = calibrate(calibration_file(), &machine_key())?;
    *cached = Some(calibration.clone());
    Ok(calibration)
}

/// The calibration of the machine `key` names: read from `file` when it holds that machine's,
/// else measured and written there.
fn calibrate(file: Option<std::path::PathBuf>, key: &str) -> Result<Calibration, TrainError> {
    let read = file.as_ref().and_then(|path| {
        let value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
        let flops = value["attention_flops"].as_f64()?;
        (value["machine"].as_str() == Some(key) && flops.is_finite() && flops > 0.0)
            .then_some(flops)
    });
    Ok(match read {
        Some(flops) => Calibration {
            flops,
            cache: file,
            measured_now: false,
        },
        None => {
            let flops = measure_attention_flops()?;
            let text = serde_json::json!({"machine": key, "attention_flops": flops}).to_string();
            // Through a file of this process's own and a rename: processes calibrating at
            // once never read a half-written file.
            let written = file.filter(|path| {
                let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
                path.parent()
                    .is_some_and(|dir| std::fs::create_dir_all(dir).is_ok())
                    && std::fs::write(&tmp, &text).is_ok()
                    && std::fs::rename(&tmp, path).is_ok()
            });
            Calibration {
                flops,
                cache: written,
                measured_now: true,
            }
        }
    })
}

/// Forward FLOPs of causal attention over `n` tokens: 2 matmuls of 2·D FLOPs per allowed
/// (query, key) pair and query head.
fn causal_forward_flops(n: usize, heads: usize, head_dim: usize) -> f64 {
    let pairs = (n * (n + 1) / 2) as f64;
    4.0 * pairs * (heads * head_dim) as f64
}

/// The best of three seconds of the portable flash-attention forward (and, with `backward`, of
/// its backward; otherwise 0) over `n` causal tokens of random inputs.
fn best_causal_times(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    n: usize,
    backward: bool,
) -> Result<(f64, f64), TrainError> {
    let device = FlexDevice;
    let tensor = |h: usize| {
        Tensor::<Flex, 3>::random([n, h, head_dim], Distribution::Normal(0.0, 1.0), &device)
    };
    let (q, k, v) = (tensor(heads), tensor(kv_heads), tensor(kv_heads));
    let problem = VarlenAttention::packed(vec![n], vec![MaskSpec::Causal]);
    let failed = |e: burn_dcp::kernels::KernelError| {
        TrainError::Config(format!("the compute calibration's attention: {e}"))
    };
    let (mut best_forward, mut best_backward) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let started = Instant::now();
        let out = Flex::flash_forward(q.clone(), k.clone(), v.clone(), &problem).map_err(failed)?;
        let _ = out.out.clone().into_data();
        best_forward = best_forward.min(started.elapsed().as_secs_f64());
        if backward {
            let dout = tensor(heads);
            let started = Instant::now();
            let inputs = BackwardTensors {
                q: q.clone(),
                k: k.clone(),
                v: v.clone(),
                out: out.out,
                lse: out.lse,
                dout,
            };
            let grads = Flex::flash_backward(inputs, &problem).map_err(failed)?;
            let _ = grads.dq.into_data();
            best_backward = best_backward.min(started.elapsed().as_secs_f64());
        }
    }
    let backward = if backward {
        best_backward.max(1e-9)
    } else {
        0.0
    };
    Ok((best_forward.max(1e-9), backward))
}

/// How the ranks of this process compute attention of one shape, measured: what the cost model
/// needs to predict an emulated run's attention time ([`emulated_topology`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuCompute {
    /// Forward FLOP/s of one rank while every rank computes (the machine's ÷ the ranks).
    pub flops_per_rank: f64,
    pub model: ComputeModel,
}

/// Share of a partially masked block's masked pairs the portable kernels compute anyway: they
/// skip empty key tiles and compute partial ones whole, with tiles of 64 keys × 16–64 queries,
/// so about half of a plan block's masked pairs on a causal diagonal or a window's edge.
pub const CPU_MASKED_PAIR_COST: f64 = 0.5;

/// Measures the portable kernels on this machine for `heads` query heads, `kv_heads` kv heads of
/// dim `head_dim`, `ranks` ranks computing at once: the forward's FLOP/s on 1024 causal tokens,
/// the backward's time per forward time, and a call's fixed cost (forward and backward of 16
/// tokens, halved); best of three each.
pub fn cpu_compute(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ranks: usize,
) -> Result<CpuCompute, TrainError> {
    burn_dcp::heads::Heads::new(heads, kv_heads)
        .map_err(|e| TrainError::Config(format!("the compute calibration: {e}")))?;
    if head_dim == 0 {
        return Err(TrainError::Config(
            "the compute calibration needs a head dim ≥ 1, got 0".into(),
        ));
    }
    let n = CALIBRATION_TOKENS;
    let (forward, backward) = best_causal_times(heads, kv_heads, head_dim, n, true)?;
    let (small_forward, small_backward) = best_causal_times(heads, kv_heads, head_dim, 16, true)?;
    let flops = causal_forward_flops(n, heads, head_dim);
    let ranks = ranks.max(1);
    Ok(CpuCompute {
        flops_per_rank: flops / forward / ranks as f64,
        model: ComputeModel {
            backward_factor: backward / forward,
            call_overhead: (small_forward + small_backward) / 2.0,
            masked_pair_cost: CPU_MASKED_PAIR_COST,
            shared_processor: ranks > 1,
        },
    })
}

/// The machine an emulated run is: `topology`'s nodes, its links slowed by `time_scale`
/// ([`Topology::slowed`], as [`LinkEmulation::of_topology`] delays messages), and devices
/// computing `flops_per_rank`.
pub fn emulated_topology(topology: &Topology, time_scale: f64, flops_per_rank: f64) -> Topology {
    Topology {
        device_flops: flops_per_rank,
        ..topology.slowed(time_scale)
    }
}

/// The time scale of emulated `links` beside `topology`'s devices: `--link-scale`, or from this
/// machine's calibration ([`machine_attention_flops`]: measured once per machine) for `ranks`
/// ranks of this process (the links and the prediction of one run use the same value).
pub fn time_scale(
    links: EmulatedLinks,
    topology: &Topology,
    ranks: usize,
) -> Result<f64, TrainError> {
    match links.scale {
        Some(scale) => Ok(scale),
        None => Ok(topology.device_flops / cpu_attention_flops_per_rank(ranks)?),
    }
}

/// Sets `config`'s emulated links on `world` (ranks as threads); returns the time scale used.
pub fn emulate_links(config: &TrainConfig, world: &InProcessWorld) -> Result<f64, TrainError> {
    let links = config
        .emulate_links
        .ok_or_else(|| TrainError::Config("the run does not emulate links".into()))?;
    let ranks = config.world_size();
    let topology = Topology::for_ranks(&config.topology, config.nodes, ranks)?;
    let scale = time_scale(links, &topology, ranks)?;
    let links = LinkEmulation::of_topology(&topology, scale)
        .map_err(|e| TrainError::Config(format!("--link-scale {scale}: {e}")))?;
    world.emulate_links(links)?;
    Ok(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_is_calibrated_once_and_its_cache_checked() {
        let dir = std::env::temp_dir().join(format!("burn-dcp-calibration-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("nested").join("link-calibration.json");
        // The first run measures and writes; the next reads the same value.
        let first = calibrate(Some(file.clone()), "machine A").unwrap();
        assert!(first.measured_now && first.flops > 0.0, "{first:?}");
        assert_eq!(first.cache.as_deref(), Some(file.as_path()));
        let second = calibrate(Some(file.clone()), "machine A").unwrap();
        // The cached value, not a new measurement (those differ by percents): serde_json's
        // parser (without its `float_roundtrip` feature) may read the last bit differently.
        assert!(!second.measured_now, "{second:?}");
        assert!(
            (second.flops - first.flops).abs() <= 1e-12 * first.flops,
            "{second:?} against {first:?}"
        );
        // Another machine's file, or a damaged one, is measured around and replaced.
        let other = calibrate(Some(file.clone()), "machine B").unwrap();
        assert!(other.measured_now);
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("machine B"), "{text}");
        std::fs::write(&file, "{ not json").unwrap();
        assert!(
            calibrate(Some(file.clone()), "machine B")
                .unwrap()
                .measured_now
        );
        // No cache directory: measured, nothing written.
        let none = calibrate(None, "machine A").unwrap();
        assert!(none.measured_now && none.cache.is_none());
        assert!(none.describe().contains("not cached"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
