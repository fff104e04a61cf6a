//! Long-context GPT training with context parallelism, threads as ranks, on the CPU (burn Flex).
//!
//!     cargo run --release --example gpt_longctx      # defaults: cp 4, ring zigzag, Vim help corpus
//!     cargo run --release --example gpt_longctx -- --cp 4 --strategy usp --ulysses-degree 2 \
//!         --steps 30 --out runs/usp --json
//!
//! The model is an ordinary burn GPT; context parallelism comes from the backend type
//! `ContextParallel<Autodiff<Flex>>` and the per-rank CP context the training loop sets.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn_dcp::comm::WorldConfig;
#[cfg(feature = "wgpu")]
use burn_dcp::kernels::backends::{WgpuFusion, WgpuPlain};
use burn_dcp::kernels::FlashOps;
use burn_dcp_suite::launch::Ranks;
use burn_dcp_suite::train::hf::{ExportFlags, Exporting, HfExport};
use burn_dcp_suite::train::metrics::truncate_metrics;
use burn_dcp_suite::train::{
    check_resume, train_rank, write_json, Progress, RankOutcome, Recompute, StepMetrics,
    StepObserver, TrainConfig, TrainData, TrainError, TrainFlags, TrainMode,
};
use clap::Parser;
use serde_json::json;

/// Train a GPT on long packed documents with context parallelism (threads as ranks).
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    train: TrainFlags,
    #[command(flatten)]
    export: ExportFlags,
    /// flex (CPU) | wgpu | cuda
    #[arg(long, default_value = "flex")]
    backend: String,
    /// With --backend wgpu or cuda: burn's plain CubeBackend instead of the default Fusion<CubeBackend>
    /// (the type burn's default features make burn::backend::Wgpu and Cuda)
    #[arg(long)]
    no_fusion: bool,
    /// Write config.json, metrics.jsonl and a checkpoint here
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write a Chrome trace of every step here (JSON trace events; opens in Perfetto and
    /// chrome://tracing): one track per rank. Ranks that are processes (MPI, TCP) each write
    /// FILE with `.rank<r>` before its extension; `scripts/merge_traces.py FILE` merges them
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Continue the run saved in this directory (its config.json; --steps is the new total)
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Print the final summary as JSON on stdout
    #[arg(long)]
    json: bool,
}

/// Memory per rank where ranks are threads (`peak_memory_mb` in metrics.jsonl): every allocation
/// charged to the rank that makes it.
#[global_allocator]
static ALLOCATOR: burn_dcp::kernels::memory::TrackingAllocator =
    burn_dcp::kernels::memory::TrackingAllocator;

fn main() {
    burn_dcp_suite::launch::init_logging();
    let args = Args::parse();
    if let Err(message) = run(&args) {
        // With several processes (MPI or TCP) every rank finds the same configuration error:
        // rank 0 alone prints it (a rank's own failure during training is printed by that rank
        // as it aborts the job).
        if burn_dcp_suite::launch::launcher_rank() == 0 {
            eprintln!("error: {message}");
        }
        std::process::exit(2);
    }
}

/// `--out DIR` must not overwrite another run: a directory holding a run's files (config.json,
/// metrics.jsonl, a checkpoint) is only written to when it is the run being resumed.
fn refuse_overwrite(out: &Path, resume: Option<&Path>) -> Result<(), TrainError> {
    if resume.is_some_and(|dir| same_dir(dir, out)) {
        return Ok(());
    }
    let files = [
        "config.json",
        "metrics.jsonl",
        "checkpoint",
        "checkpoint.old",
    ];
    if let Some(found) = files.iter().find(|name| out.join(name).exists()) {
        return Err(TrainError::Config(format!(
            "--out {} already holds a run ({found} exists): use --resume {} to continue it, or choose another --out",
            out.display(),
            out.display()
        )));
    }
    Ok(())
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn run(args: &Args) -> Result<(), TrainError> {
    burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "--example gpt_longctx")
        .map_err(TrainError::Config)?;
    let mut config = match &args.resume {
        Some(dir) => args.train.resume(dir)?,
        None => args.train.config()?,
    };
    let export = args.export.plan(&mut config)?;
    config.validate()?;
    let saved_step = match &args.resume {
        Some(dir) => Some(check_resume(dir, &config)?),
        None => None,
    };
    if saved_step == Some(config.steps) {
        if burn_dcp_suite::launch::launcher_rank() != 0 {
            return Ok(());
        }
        eprintln!(
            "gpt_longctx: nothing to train: the checkpoint in {} is already at step {} (give a larger --steps to continue)",
            args.resume.as_deref().unwrap_or(Path::new("")).display(),
            config.steps
        );
        return summarize(args, &config, (&[], None), 0.0, args.resume.as_deref());
    }
    let ranks =
        Ranks::new(config.world_size(), world_config(&config)?).map_err(TrainError::Launch)?;
    if args.backend == "flex" {
        let here = if ranks.is_distributed() {
            1
        } else {
            config.world_size()
        };
        burn_dcp_suite::train::host_memory::check_host_memory(&config, here)?;
    }
    let result = train(args, &config, &ranks, saved_step, export.as_ref());
    if let Err(message) = &result {
        // With several processes a rank's own failure ends the job, naming this rank, so its
        // peers do not take it for a rank that finished.
        ranks.abort(&message.to_string());
    }
    result
}

/// `config.json`: the run's configuration and the backend type it ran on (`"backend"`, see
/// [`burn_dcp_suite::backend_type`]; a resumed run may continue on another backend).
#[derive(serde::Serialize)]
struct SavedConfig<'a> {
    #[serde(flatten)]
    config: &'a TrainConfig,
    backend: &'static str,
}

/// The run once its ranks exist: output files, data, training on the backend, the summary.
fn train(
    args: &Args,
    config: &TrainConfig,
    ranks: &Ranks,
    saved_step: Option<usize>,
    export: Option<&HfExport>,
) -> Result<(), TrainError> {
    // With several processes only rank 0 prints and writes files (the checkpoint's shards reach
    // it as messages); every rank trains.
    let leader = ranks.is_leader();
    if config.emulate_links.is_some() {
        let Ranks::InProcess(world) = ranks else {
            return Err(TrainError::Config(format!(
                "--emulate-links delays the messages of ranks that are threads of one process; these ranks are {} (their links are real)",
                ranks.describe()
            )));
        };
        let scale = burn_dcp_suite::train::links::emulate_links(config, world)?;
        eprintln!(
            "links: emulated as {} × {} nodes, slowed {scale:.0}× to this CPU's compute",
            config.topology, config.nodes
        );
    }
    // --export-hf converts the run's checkpoints: without --out they go to DIR.run/ (removed
    // after the last export).
    let scratch = export
        .filter(|_| args.out.is_none() && args.resume.is_none())
        .map(|e| e.dir.with_extension("run"));
    let out = args
        .out
        .clone()
        .or_else(|| args.resume.clone())
        .or(scratch.clone());
    if let (true, Some(out)) = (leader, &out) {
        refuse_overwrite(out, args.resume.as_deref())?;
        std::fs::create_dir_all(out).map_err(|e| TrainError::io("create", out, e))?;
        write_json(
            &out.join("config.json"),
            &SavedConfig {
                config,
                backend: burn_dcp_suite::backend_type(
                    &args.backend,
                    args.no_fusion,
                    "--example gpt_longctx",
                )
                .map_err(TrainError::Config)?,
            },
        )?;
    }
    let appending = match (&args.resume, &out) {
        (Some(resume), Some(out)) => same_dir(resume, out),
        _ => false,
    };
    if let (true, true, Some(out), Some(step)) = (leader, appending, &out, saved_step) {
        // A run killed after some steps logged metrics the checkpoint does not hold: drop them.
        truncate_metrics(&out.join("metrics.jsonl"), step)?;
    }
    let reporter = Progress::new(
        config.mesh_shape().to_string(),
        config.steps,
        out.as_deref().filter(|_| leader),
        appending,
    )?;
    let strategy = match &config.mode {
        TrainMode::Dynamic { settings, .. } => format!(
            "dynamic CP over a pool of {} ({} inside groups, {} tokens per rank, {:?} sizes)",
            config.pool_size(),
            config.mode.group_strategy(),
            settings.max_tokens_per_rank,
            settings.cp_sizes
        ),
        TrainMode::Auto { .. } => format!(
            "auto strategy: per micro-batch the lowest estimated attention time on {} × {} nodes",
            config.topology, config.nodes
        ),
        mode => format!("{} strategy", mode.group_strategy()),
    };
    let strategy = match config.pp {
        1 => strategy,
        _ => format!("{strategy}, {} pipeline schedule", config.pp_schedule),
    };
    let strategy = match config.recompute {
        Recompute::None => strategy,
        recompute => format!("{strategy}, recompute {recompute}"),
    };
    if leader {
        eprintln!(
            "gpt_longctx: {} model, world {} = {} ({strategy}, {} layout) on {}, {} tokens/micro-batch, {} micro-batches/step, mask {}",
            config.model_size, config.world_size(), config.mesh_shape(), config.mode.layout(), ranks.describe(), config.seq_len, config.micro_batches, config.mask
        );
    }
    let loading = Instant::now();
    let data = match config.eval_only {
        true => TrainData::eval_windows(config)?,
        false => TrainData::load(config)?,
    };
    if leader {
        eprintln!(
            "data: {} ({} tokenizer): {} micro-batches of at most {} tokens per pass (ready in {:.2} s)",
            config.data_name(),
            config.tokenizer()?.name(),
            data.len(),
            config.seq_len,
            loading.elapsed().as_secs_f64()
        );
    }
    let resume = args.resume.as_deref();
    let tracing = args.trace.clone().map(Tracing::new);
    let exporting = export.map(|export| Exporting {
        inner: &reporter,
        export,
    });
    let observer: &dyn StepObserver = match &exporting {
        Some(exporting) => exporting,
        None => &reporter,
    };
    let results = match args.backend.as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu" if args.no_fusion => {
            train_world::<WgpuPlain>(ranks, config, &data, resume, &out, observer, &tracing)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            train_world::<WgpuFusion>(ranks, config, &data, resume, &out, observer, &tracing)
        }
        #[cfg(feature = "cuda")]
        "cuda" if !args.no_fusion => match ranks.local_rank() {
            None => train_world::<burn_dcp::kernels::backends::CudaFusion>(
                ranks, config, &data, resume, &out, observer, &tracing,
            ),
            Some(_) => Err("--backend cuda with one process per rank moves tensors with NCCL, which reads the plain backend's device memory: add --no-fusion (burn-fusion's tensors at NCCL's collectives are not supported yet)".to_string()),
        },
        #[cfg(feature = "cuda")]
        "cuda" => train_world_cuda(ranks, config, &data, resume, &out, observer, &tracing),
        _ => train_world::<burn::backend::Flex>(
            ranks, config, &data, resume, &out, observer, &tracing,
        ),
    };
    if let Some(tracing) = &tracing {
        tracing.write_threads(ranks)?;
    }
    if leader {
        reporter.finish()?;
    }
    let outcome = results.map_err(TrainError::RankFailed)?;
    let Some(outcome) = outcome else {
        // Not rank 0 of a multi-process job: rank 0 reports.
        return Ok(());
    };
    let (metrics, eval_loss) = (outcome.metrics, outcome.eval_loss);
    if let (true, Some(scratch)) = (leader, &scratch) {
        std::fs::remove_dir_all(scratch).map_err(|e| TrainError::io("remove", scratch, e))?;
    }
    summarize(
        args,
        config,
        (&metrics, eval_loss),
        reporter.elapsed_seconds(),
        out.as_deref().filter(|_| scratch.is_none()),
    )
}

/// `--trace FILE`: the run's tracer and where it goes.
struct Tracing {
    path: PathBuf,
    tracer: std::sync::Arc<burn_dcp::diagnostics::trace::Tracer>,
}

impl Tracing {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            tracer: burn_dcp::diagnostics::trace::Tracer::new(),
        }
    }

    /// Records the calling rank thread's steps on the track of `rank`.
    fn enter(&self, rank: usize) -> burn_dcp::diagnostics::trace::RankTrace {
        burn_dcp::diagnostics::trace::RankTrace::enter(&self.tracer, rank)
    }

    /// The file of `rank` when ranks are processes: FILE with `.rank<r>` before its extension.
    fn rank_path(&self, rank: usize) -> PathBuf {
        let stem = self.path.file_stem().unwrap_or_default().to_string_lossy();
        let name = match self.path.extension() {
            Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
            None => format!("{stem}.rank{rank}"),
        };
        self.path.with_file_name(name)
    }

    /// Ranks that are processes write their own file when they finish.
    fn write_rank(&self, ranks_are_processes: bool, rank: usize) -> Result<(), TrainError> {
        if !ranks_are_processes {
            return Ok(());
        }
        let path = self.rank_path(rank);
        self.tracer
            .write(&path)
            .map_err(|e| TrainError::Config(format!("--trace {}: {e}", path.display())))
    }

    /// Ranks that are threads share one file, written once they all finished.
    fn write_threads(&self, ranks: &Ranks) -> Result<(), TrainError> {
        if ranks.is_distributed() {
            return Ok(());
        }
        self.tracer
            .write(&self.path)
            .map_err(|e| TrainError::Config(format!("--trace {}: {e}", self.path.display())))
    }
}

/// Runs every rank's training on `ContextParallel<Autodiff<B>>` (`B`'s default device).
fn train_world<B: FlashOps>(
    ranks: &Ranks,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: &Option<PathBuf>,
    reporter: &dyn StepObserver,
    tracing: &Option<Tracing>,
) -> Result<Option<RankOutcome>, String> {
    let device = B::Device::default();
    let processes = ranks.is_distributed();
    ranks.run(|comm| {
        let rank = comm.rank();
        let _trace = tracing.as_ref().map(|t| t.enter(rank));
        let outcome = train_rank::<B>(
            comm,
            config,
            data,
            resume,
            out.as_deref(),
            reporter,
            &device,
        )?;
        if let Some(tracing) = tracing {
            tracing.write_rank(processes, rank)?;
        }
        Ok::<_, TrainError>(outcome)
    })
}

/// [`train_world`] on burn-cuda's plain backend (`--no-fusion`). With one process per rank (MPI or TCP launch) each rank uses
/// the GPU of its local rank and moves tensors with NCCL, the launch's world carrying NCCL's
/// unique id and the message headers; threads share the default GPU and the in-process world.
#[cfg(feature = "cuda")]
fn train_world_cuda(
    ranks: &Ranks,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: &Option<PathBuf>,
    reporter: &dyn StepObserver,
    tracing: &Option<Tracing>,
) -> Result<Option<RankOutcome>, String> {
    type Cuda = burn_dcp::kernels::backends::CudaPlain;
    let Some(local_rank) = ranks.local_rank() else {
        return train_world::<Cuda>(ranks, config, data, resume, out, reporter, tracing);
    };
    let device = burn::backend::cuda::CudaDevice::new(local_rank);
    let world_config = world_config(config)?;
    ranks.run(|control| {
        let rank = control.rank();
        let _trace = tracing.as_ref().map(|t| t.enter(rank));
        let comm =
            burn_dcp::comm::NcclWorld::init::<Cuda>(control, device.clone(), world_config.clone())
                .map_err(|e| TrainError::Launch(format!("NCCL on GPU {local_rank}: {e}")))?;
        let outcome = train_rank::<Cuda>(
            comm,
            config,
            data,
            resume,
            out.as_deref(),
            reporter,
            &device,
        )?;
        if let Some(tracing) = tracing {
            tracing.write_rank(true, rank)?;
        }
        Ok::<_, TrainError>(outcome)
    })
}

/// The communication settings of a run: its timeout and nodes.
fn world_config(config: &TrainConfig) -> Result<WorldConfig, TrainError> {
    Ok(WorldConfig {
        timeout: Duration::from_secs(config.timeout_secs),
        ranks_per_node: Some(config.ranks_per_node()?),
    })
}

/// A per-step map (group sizes, strategy counts, bytes by axis) summed over the steps, starting
/// from `keys` at zero.
fn totals<'a, V: Copy + Default + std::ops::AddAssign + 'a>(
    keys: &[&str],
    maps: impl Iterator<Item = &'a std::collections::BTreeMap<String, V>>,
) -> std::collections::BTreeMap<String, V> {
    let mut totals: std::collections::BTreeMap<String, V> =
        keys.iter().map(|k| (k.to_string(), V::default())).collect();
    for (key, value) in maps.flatten() {
        *totals.entry(key.clone()).or_default() += *value;
    }
    totals
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if count == 0 {
        0.0
    } else {
        sum / count as f64
    }
}

fn summarize(
    args: &Args,
    config: &TrainConfig,
    (metrics, eval_loss): (&[StepMetrics], Option<f64>),
    wall: f64,
    out: Option<&Path>,
) -> Result<(), TrainError> {
    let tokens: usize = metrics.iter().map(|m| m.tokens).sum();
    let bytes: u64 = metrics.iter().map(|m| m.bytes_communicated).sum();
    let train_seconds: f64 = metrics.iter().map(|m| m.step_ms).sum::<f64>() / 1e3;
    let summary = json!({
        "config": config,
        "backend": burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "--example gpt_longctx")
            .map_err(TrainError::Config)?,
        "parameters": config.model_config().ok().map(|m| m.parameter_count()),
        "steps_run": metrics.len(),
        "first_step": metrics.first().map(|m| m.step),
        "last_step": metrics.last().map(|m| m.step),
        "losses": metrics.iter().map(|m| m.loss).collect::<Vec<_>>(),
        "step_ms": metrics.iter().map(|m| m.step_ms).collect::<Vec<_>>(),
        "final_loss": metrics.last().map(|m| m.loss),
        "tokens": tokens,
        "tokens_per_second": if train_seconds > 0.0 { tokens as f64 / train_seconds } else { 0.0 },
        "bytes_communicated": bytes,
        "bytes_by_link": {
            "intra_node": metrics.iter().map(|m| m.bytes_by_link.intra_node).sum::<u64>(),
            "inter_node": metrics.iter().map(|m| m.bytes_by_link.inter_node).sum::<u64>(),
        },
        "bytes_by_axis": totals(
            &burn_dcp_suite::train::AXES,
            metrics.iter().map(|m| &m.bytes_by_axis)
        ),
        "cp_group_sizes": totals(&[], metrics.iter().map(|m| &m.cp_group_sizes)),
        "strategy_counts": totals(&[], metrics.iter().map(|m| &m.strategy_counts)),
        "rank_workload_imbalance": mean(metrics.iter().map(|m| m.rank_workload_imbalance)),
        "attention_ms": metrics.iter().filter_map(|m| m.attention_ms).sum::<f64>(),
        "comm_wait_ms": metrics.iter().filter_map(|m| m.comm_wait_ms).sum::<f64>(),
        "optimizer_ms": metrics.iter().filter_map(|m| m.optimizer_ms).sum::<f64>(),
        // pp 1: the forwards and the backwards (device time with --sync-phases), summed over
        // the steps.
        "forward_ms": metrics.iter().map(|m| m.forward_ms).sum::<Option<f64>>(),
        "backward_ms": metrics.iter().map(|m| m.backward_ms).sum::<Option<f64>>(),
        "grad_sync_ms": metrics.iter().filter_map(|m| m.grad_sync_ms).sum::<f64>(),
        // Each step's phases (device time with --sync-phases), for the steps after the first.
        "phases_ms": metrics.iter().map(|m| json!({
            "forward": m.forward_ms, "backward": m.backward_ms, "grad_sync": m.grad_sync_ms,
            "optimizer": m.optimizer_ms, "attention": m.attention_ms, "step": m.step_ms,
        })).collect::<Vec<_>>(),
        // With a pipeline: the ranks' mean wait for other stages, summed over the steps.
        "pipeline_bubble_ms": metrics.iter().map(|m| m.pipeline_bubble_ms).sum::<Option<f64>>(),
        // The largest of every rank's peak (MiB), or null when the ranks cannot tell.
        "peak_memory_mb": metrics
            .iter()
            .filter_map(|m| m.peak_memory_mb.as_ref())
            .flatten()
            .copied()
            .reduce(f64::max),
        // The largest of every rank's device memory (MiB; CUDA, wgpu), or null on the CPU.
        "peak_gpu_memory_mb": metrics
            .iter()
            .filter_map(|m| m.peak_gpu_memory_mb.as_ref())
            .flatten()
            .copied()
            .reduce(f64::max),
        // The cost model's time of the same steps on the emulated machine (--emulate-links;
        // null without it, or where a step's strategy has no plan in the cost model).
        "predicted_attention_ms": metrics
            .iter()
            .map(|m| m.predicted_attention_ms)
            .sum::<Option<f64>>(),
        "plan_wait_ms": metrics.iter().filter_map(|m| m.plan_wait_ms).fold(0.0, |a, b| a + b),
        // This process's peak resident memory (MiB; VmHWM: heap and mapped file pages alike).
        "process_peak_rss_mb": burn_dcp::kernels::memory::process_peak_bytes()
            .map(|bytes| bytes as f64 / (1u64 << 20) as f64),
        "wall_seconds": wall,
        "out": out.map(|p| p.display().to_string()),
        "export_hf": args.export.export_hf,
        // --eval-only: the loss over the first eval_tokens tokens in file order.
        "val_loss": eval_loss,
        "eval_tokens": config.eval_only.then_some(config.eval_tokens),
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary)
                .map_err(|e| TrainError::Malformed(format!("the summary: {e}")))?
        );
    } else if let Some(loss) = eval_loss {
        println!(
            "val_loss {loss:.6} over the first {} tokens in windows of {}",
            config.eval_tokens, config.seq_len
        );
    } else if metrics.is_empty() {
        println!("done: 0 steps (nothing to train)");
    } else {
        let first = metrics.first().map_or(f64::NAN, |m| m.loss);
        let last = metrics.last().map_or(f64::NAN, |m| m.loss);
        println!(
            "done: {} steps, loss {first:.4} → {last:.4}, {tokens} tokens at {:.0} tok/s, {:.1} MB communicated, {wall:.1} s{}",
            metrics.len(),
            summary["tokens_per_second"].as_f64().unwrap_or(0.0),
            bytes as f64 / 1e6,
            out.map(|p| format!(", saved to {}", p.display())).unwrap_or_default()
        );
    }
    Ok(())
}
