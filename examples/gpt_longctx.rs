//! Long-context GPT training with context parallelism, threads as ranks, on the CPU (burn Flex).
//!
//! ```text
//! cargo run --release --example gpt_longctx      # defaults: cp 4, ring zigzag, Vim help corpus
//! cargo run --release --example gpt_longctx -- --cp 4 --strategy usp --ulysses-degree 2 \
//!     --steps 30 --out runs/usp --json
//! ```
//!
//! The model is an ordinary burn GPT; context parallelism comes from the backend type
//! `ContextParallel<Autodiff<Flex>>` and the per-rank CP context the training loop sets.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn_dcp::comm::{Comm, WorldConfig};
#[cfg(feature = "wgpu")]
use burn_dcp::kernels::backends::{WgpuFusion, WgpuPlain};
use burn_dcp::kernels::FlashOps;
use burn_dcp_suite::launch::{Ranks, Tracing};
use burn_dcp_suite::train::hf::{ExportFlags, Exporting, HfExport};
use burn_dcp_suite::train::metrics::truncate_metrics;
use burn_dcp_suite::train::{
    check_resume, refuse_overwrite, run_summary, same_dir, train_rank, write_json, Progress,
    RankOutcome, Recompute, StepMetrics, StepObserver, TrainConfig, TrainData, TrainError,
    TrainFlags, TrainMode,
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
    /// With --backend wgpu or cuda: burn's plain `CubeBackend` instead of the default `Fusion<CubeBackend>`
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
    burn_dcp_suite::launch::exit_on_error(run(&Args::parse()));
}

fn run(args: &Args) -> Result<(), TrainError> {
    backend_type(args)?;
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
    let ranks = Ranks::new(config.world_size(), world_config(&config)?)?;
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
    /// The model's parameter count (as transformers counts it, tied embeddings once).
    parameters: Option<usize>,
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
        use burn_dcp_suite::train::links;
        let scale = links::emulate_links(config, world)?;
        let source = match config.emulate_links.and_then(|l| l.scale) {
            Some(_) => "--link-scale".to_string(),
            None => links::machine_attention_flops()?.describe(),
        };
        eprintln!(
            "links: emulated as {} × {} nodes, slowed {scale:.0}× to this CPU's compute ({source})",
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
                parameters: config.model_config().ok().map(|m| m.parameter_count()),
                backend: backend_type(args)?,
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
    let tracing = args.trace.clone().map(Tracing::new);
    let exporting = export.map(|export| Exporting {
        inner: &reporter,
        export,
    });
    let observer: &dyn StepObserver = match &exporting {
        Some(exporting) => exporting,
        None => &reporter,
    };
    let inputs = RankInputs {
        config,
        data: &data,
        resume: args.resume.as_deref(),
        out: out.as_deref(),
        reporter: observer,
        tracing: tracing.as_ref(),
    };
    let results = match args.backend.as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu" if args.no_fusion => train_world::<WgpuPlain>(ranks, &inputs),
        #[cfg(feature = "wgpu")]
        "wgpu" => train_world::<WgpuFusion>(ranks, &inputs),
        #[cfg(feature = "cuda")]
        "cuda" if !args.no_fusion => match ranks.local_rank() {
            None => train_world::<burn_dcp::kernels::backends::CudaFusion>(ranks, &inputs),
            Some(_) => Err(TrainError::Config("--backend cuda with one process per rank moves tensors with NCCL, which reads the plain backend's device memory: add --no-fusion (burn-fusion's tensors at NCCL's collectives are not supported yet)".to_string())),
        },
        #[cfg(feature = "cuda")]
        "cuda" => train_world_cuda(ranks, &inputs),
        _ => train_world::<burn::backend::Flex>(ranks, &inputs),
    };
    if let Some(tracing) = &tracing {
        tracing.write_threads(ranks)?;
    }
    if leader {
        reporter.finish()?;
    }
    let outcome = results?;
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

/// What every rank of a run trains with.
struct RankInputs<'a> {
    config: &'a TrainConfig,
    data: &'a TrainData,
    resume: Option<&'a Path>,
    out: Option<&'a Path>,
    reporter: &'a dyn StepObserver,
    tracing: Option<&'a Tracing>,
}

impl RankInputs<'_> {
    /// Rank `rank`'s training on `device`, over the communicator `comm` makes (traced from
    /// there on); its trace written where ranks are processes.
    fn train<B: FlashOps>(
        &self,
        rank: usize,
        device: &B::Device,
        processes: bool,
        comm: impl FnOnce() -> Result<Comm, TrainError>,
    ) -> Result<RankOutcome, TrainError> {
        let _trace = self.tracing.map(|t| t.enter(rank));
        let (config, data, resume, out) = (self.config, self.data, self.resume, self.out);
        let outcome = train_rank::<B>(comm()?, config, data, resume, out, self.reporter, device)?;
        if let Some(tracing) = self.tracing {
            tracing.write_rank(processes, rank)?;
        }
        Ok(outcome)
    }
}

/// Runs every rank's training on `ContextParallel<Autodiff<B>>` (`B`'s default device).
fn train_world<B: FlashOps>(
    ranks: &Ranks,
    inputs: &RankInputs<'_>,
) -> Result<Option<RankOutcome>, TrainError> {
    let device = B::Device::default();
    let processes = ranks.is_distributed();
    ranks.run(|comm| inputs.train::<B>(comm.rank(), &device, processes, || Ok(comm)))
}

/// [`train_world`] on burn-cuda's plain backend (`--no-fusion`). With one process per rank (MPI or TCP launch) each rank uses
/// the GPU of its local rank and moves tensors with NCCL, the launch's world carrying NCCL's
/// unique id and the message headers; threads share the default GPU and the in-process world.
#[cfg(feature = "cuda")]
fn train_world_cuda(
    ranks: &Ranks,
    inputs: &RankInputs<'_>,
) -> Result<Option<RankOutcome>, TrainError> {
    type Cuda = burn_dcp::kernels::backends::CudaPlain;
    let Some(local_rank) = ranks.local_rank() else {
        return train_world::<Cuda>(ranks, inputs);
    };
    let device = burn::backend::cuda::CudaDevice::new(local_rank);
    let world_config = world_config(inputs.config)?;
    ranks.run(|control| {
        inputs.train::<Cuda>(control.rank(), &device, true, || {
            burn_dcp::comm::NcclWorld::init::<Cuda>(control, device.clone(), world_config.clone())
                .map_err(|e| TrainError::Launch(format!("NCCL on GPU {local_rank}: {e}")))
        })
    })
}

/// The communication settings of a run: its timeout and nodes.
fn world_config(config: &TrainConfig) -> Result<WorldConfig, TrainError> {
    Ok(WorldConfig {
        timeout: Duration::from_secs(config.timeout_secs),
        ranks_per_node: Some(config.ranks_per_node()?),
    })
}

/// The backend type `--backend` and `--no-fusion` name (config.json's and the summary's
/// `"backend"`).
fn backend_type(args: &Args) -> Result<&'static str, TrainError> {
    burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "--example gpt_longctx")
        .map_err(TrainError::Config)
}

fn summarize(
    args: &Args,
    config: &TrainConfig,
    (metrics, eval_loss): (&[StepMetrics], Option<f64>),
    wall: f64,
    out: Option<&Path>,
) -> Result<(), TrainError> {
    let mut summary = run_summary(config, (metrics, eval_loss), wall, out);
    summary["backend"] = json!(backend_type(args)?);
    summary["export_hf"] = json!(args.export.export_hf);
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
            "done: {} steps, loss {first:.4} → {last:.4}, {} tokens at {:.0} tok/s, {:.1} MB communicated, {wall:.1} s{}",
            metrics.len(),
            summary["tokens"],
            summary["tokens_per_second"].as_f64().unwrap_or(0.0),
            summary["bytes_communicated"].as_f64().unwrap_or(0.0) / 1e6,
            out.map(|p| format!(", saved to {}", p.display())).unwrap_or_default()
        );
    }
    Ok(())
}
