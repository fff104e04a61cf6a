//! Long-context GPT training with context parallelism, threads as ranks, on the CPU (burn Flex).
//!
//!     cargo run --release --example gpt_longctx      # defaults: cp 4, ring zigzag, Vim help corpus
//!     cargo run --release --example gpt_longctx -- --cp 4 --strategy usp --ulysses-degree 2 \
//!         --steps 30 --out runs/usp --json
//!
//! The model is an ordinary burn GPT; context parallelism comes from the backend type
//! `ContextParallel<Autodiff<Flex>>` and the per-rank CP context the training loop sets.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn_dcp::comm::WorldConfig;
#[cfg(feature = "wgpu")]
use burn_dcp::kernels::backends::{WgpuFusion, WgpuPlain};
use burn_dcp::kernels::FlashOps;
use burn_dcp::{Layout, Strategy};
use burn_dcp_suite::launch::Ranks;
use burn_dcp_suite::train::metrics::truncate_metrics;
use burn_dcp_suite::train::{
    check_resume, read_json, train_rank, write_json, AutoSettings, CpSizes, DcpSettings,
    DynamicSettings, PpSchedule, Progress, RankOutcome, StepMetrics, TrainConfig, TrainData,
    TrainError, DEFAULT_PLAN_AHEAD, MAX_SEQ_LEN,
};
use clap::Parser;
use serde_json::json;

/// Train a GPT on long packed documents with context parallelism (threads as ranks).
#[derive(Parser, Debug)]
struct Args {
    /// Context-parallel ranks per replica [default: 4]
    #[arg(long)]
    cp: Option<usize>,
    /// Data-parallel replicas [default: 1]
    #[arg(long)]
    dp: Option<usize>,
    /// Tensor-parallel ranks (Megatron-style; innermost axis of the tp × cp × dp × pp mesh) [default: 1]
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline stages (outermost axis of the mesh; must divide the layers) [default: 1]
    #[arg(long)]
    pp: Option<usize>,
    /// Pipeline schedule over each step's micro-batches, 1f1b | gpipe [default: 1f1b]
    #[arg(long)]
    pp_schedule: Option<String>,
    /// ulysses | ring | all-gather | usp | dcp, or ring-zigzag | ring-contiguous | ring-stripe, or dynamic (Megatron-style dynamic CP over the dp × cp pool), or auto (per micro-batch the strategy with the lowest estimated attention time) [default: ring]
    #[arg(long)]
    strategy: Option<String>,
    /// Dynamic CP: the strategy inside each group, ring | ulysses | usp | all-gather [default: ring]
    #[arg(long)]
    inner_strategy: Option<String>,
    /// Dynamic CP: smallest CP group [default: 1]
    #[arg(long)]
    min_cp_size: Option<usize>,
    /// Dynamic CP: group sizes, pow2 (Megatron) | any [default: pow2]
    #[arg(long)]
    cp_sizes: Option<String>,
    /// dcp and auto: tokens per block of each micro-batch's DCP plan [default: 128, or --seq-len if less]
    #[arg(long)]
    block: Option<usize>,
    /// dcp and auto: communication stages of each DCP plan [default: 4]
    #[arg(long)]
    stages: Option<usize>,
    /// auto: the strategies it may choose, comma-separated, of ring-zigzag, ulysses, usp, all-gather, dynamic, dcp [default: all]
    #[arg(long)]
    auto_candidates: Option<String>,
    /// Topology preset the ranks model, a100-p4d | h100-dgx (dcp plans for it; bytes are counted
    /// per link class) [default: a100-p4d]
    #[arg(long)]
    topology: Option<String>,
    /// Virtual nodes the ranks are spread over (consecutive ranks share a node) [default: 1]
    #[arg(long)]
    nodes: Option<usize>,
    /// Steps planned ahead on a background thread (any strategy) [default: 2]
    #[arg(long)]
    plan_ahead: Option<usize>,
    /// contiguous | zigzag | stripe [default: zigzag]
    #[arg(long)]
    layout: Option<String>,
    /// Ulysses degree of USP (ring degree = cp / ulysses degree)
    #[arg(long)]
    ulysses_degree: Option<usize>,
    /// Optimizer steps (the total, also when resuming) [default: 30]
    #[arg(long)]
    steps: Option<usize>,
    /// Tokens per packed micro-batch (at most; documents are packed, longer ones split) [default: 4096]
    #[arg(long)]
    seq_len: Option<usize>,
    /// Tokens each CP rank holds: static CP sets --seq-len to this × cp (give one of the two);
    /// dynamic CP uses it as the scheduler's per-rank budget [default: ⌈seq-len / cp⌉]
    #[arg(long)]
    max_tokens_per_rank: Option<usize>,
    /// Micro-batches per optimizer step over all replicas (the global batch; a multiple of dp) [default: 2]
    #[arg(long)]
    micro_batches: Option<usize>,
    /// tiny | small | base [default: tiny]
    #[arg(long)]
    model_size: Option<String>,
    /// Seed of the weights and the data [default: 0]
    #[arg(long)]
    seed: Option<u64>,
    /// AdamW learning rate [default: 0.003]
    #[arg(long)]
    lr: Option<f64>,
    /// Mask of every sequence: causal | lambda | blockwise | shared-question (DCP defaults) | mixed (one of those per sequence) | full | a spec such as lambda:64,4096 [default: causal]
    #[arg(long)]
    mask: Option<String>,
    /// Training text: default (Vim help files, Debian vim-runtime) | builtin (burn-dcp-train's README and sources) | a directory of text files | a .jsonl file [default: default]
    #[arg(long)]
    corpus: Option<String>,
    /// bytes | gpt2 (r50k BPE; its 50257-token LM head makes CPU steps ~8x slower) [default: bytes]
    #[arg(long)]
    tokenizer: Option<String>,
    /// Timeout of every communication wait, seconds [default: 60]
    #[arg(long)]
    timeout_secs: Option<u64>,
    /// flex (CPU) | wgpu | cuda
    #[arg(long, default_value = "flex")]
    backend: String,
    /// With --backend wgpu: burn's plain CubeBackend instead of the default Fusion<CubeBackend>
    /// (the type burn's default features make burn::backend::Wgpu)
    #[arg(long)]
    no_fusion: bool,
    /// Write config.json, metrics.jsonl and a checkpoint here
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run saved in this directory (its config.json; --steps is the new total)
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Print the final summary as JSON on stdout
    #[arg(long)]
    json: bool,
}

fn main() {
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

/// Strategy and layout from the flags (`ring-zigzag` is ring with the zigzag layout).
fn strategy_and_layout(args: &Args, cp: usize) -> Result<(Strategy, Layout), TrainError> {
    let name = args.strategy.as_deref().unwrap_or("ring");
    if name == "auto" {
        // Auto's static candidates run zigzag, the layout its cost model plans them with.
        if let Some(layout) = args.layout.as_deref().filter(|l| *l != "zigzag") {
            return Err(TrainError::Config(format!(
                "--strategy auto places its static candidates zigzag (as its cost model plans them); --layout {layout} is not supported with it"
            )));
        }
        if let Some(degree) = args.ulysses_degree {
            return Err(TrainError::Config(format!(
                "--ulysses-degree {degree} does not apply to --strategy auto: its usp candidate takes the largest degree that fits a node and the heads"
            )));
        }
        return Ok((Strategy::Ring, Layout::Zigzag));
    }
    let (name, implied_layout) = match name.strip_prefix("ring-") {
        Some(layout) => ("ring", Some(layout.parse::<Layout>()?)),
        None => (name, None),
    };
    let layout = match (&args.layout, implied_layout) {
        (Some(given), Some(implied)) if given.parse::<Layout>()? != implied => {
            return Err(TrainError::Config(format!(
                "--strategy {} implies the {implied} layout but --layout is {given}",
                args.strategy.as_deref().unwrap_or_default()
            )))
        }
        (Some(given), _) => given
            .parse()
            .map_err(|e: burn_dcp::CpError| TrainError::from(e))?,
        (None, Some(implied)) => implied,
        (None, None) => Layout::Zigzag,
    };
    let strategy = Strategy::parse(name, args.ulysses_degree, cp)?;
    Ok((strategy, layout))
}

/// `--strategy dynamic`: the inner strategy and the scheduler settings; `None` for static CP (then
/// the dynamic-only flags are an error).
fn dynamic_settings(
    args: &Args,
    cp: usize,
    seq_len: usize,
) -> Result<Option<(Strategy, DynamicSettings)>, TrainError> {
    if args.strategy.as_deref() != Some("dynamic") {
        let given = [
            ("--inner-strategy", args.inner_strategy.is_some()),
            ("--min-cp-size", args.min_cp_size.is_some()),
            ("--cp-sizes", args.cp_sizes.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            return Err(TrainError::Config(format!(
                "{flag} only applies to --strategy dynamic"
            )));
        }
        return Ok(None);
    }
    let name = args.inner_strategy.as_deref().unwrap_or("ring");
    // USP keeps its Ulysses degree; the ring degree follows each group's size.
    let degree_cp = args.ulysses_degree.unwrap_or(1);
    let inner = Strategy::parse(name, args.ulysses_degree, degree_cp)?;
    if inner == Strategy::Dcp {
        return Err(TrainError::Config("--inner-strategy dcp is not supported yet: dynamic CP groups run ring, ulysses, usp or all-gather".into()));
    }
    let settings = DynamicSettings {
        max_tokens_per_rank: args
            .max_tokens_per_rank
            .unwrap_or(seq_len.div_ceil(cp.max(1))),
        min_cp_size: args.min_cp_size.unwrap_or(1),
        cp_sizes: args
            .cp_sizes
            .as_deref()
            .unwrap_or("pow2")
            .parse::<CpSizes>()?,
    };
    Ok(Some((inner, settings)))
}

/// `--strategy dcp` and `auto`: the block plans' settings; `None` otherwise (then
/// `--block`/`--stages` are an error).
fn dcp_settings(args: &Args, strategy: Strategy) -> Result<Option<DcpSettings>, TrainError> {
    let auto = args.strategy.as_deref() == Some("auto");
    if strategy != Strategy::Dcp && !auto {
        if let Some(flag) = [("--block", args.block), ("--stages", args.stages)]
            .iter()
            .find_map(|(flag, value)| value.map(|_| flag))
        {
            return Err(TrainError::Config(format!(
                "{flag} only applies to --strategy dcp or auto"
            )));
        }
        return Ok(None);
    }
    Ok(Some(DcpSettings {
        // The default block never exceeds a micro-batch.
        block: args
            .block
            .unwrap_or(128.min(args.seq_len.unwrap_or(128).max(1))),
        stages: args.stages.unwrap_or(4),
    }))
}

fn config_from_args(args: &Args) -> Result<TrainConfig, TrainError> {
    let cp = args.cp.unwrap_or(4);
    let dynamic = args.strategy.as_deref() == Some("dynamic");
    if !dynamic && args.seq_len.is_some() && args.max_tokens_per_rank.is_some() {
        return Err(TrainError::Config("give --seq-len or --max-tokens-per-rank (= seq-len / cp), not both (with --strategy dynamic, --max-tokens-per-rank is the scheduler's per-rank budget)".into()));
    }
    let (strategy, layout) = if dynamic {
        (Strategy::Ring, layout_flag(args)?)
    } else {
        strategy_and_layout(args, cp)?
    };
    let seq_len = match (args.seq_len, args.max_tokens_per_rank) {
        (Some(n), _) => n,
        (None, _) if dynamic => 4096,
        (None, Some(per_rank)) => match per_rank.checked_mul(cp) {
            Some(tokens) if tokens <= MAX_SEQ_LEN => tokens,
            product => {
                return Err(TrainError::Config(format!(
                    "--max-tokens-per-rank {per_rank} × --cp {cp} {} the limit of {MAX_SEQ_LEN} tokens per micro-batch",
                    if product.is_some() { "exceeds" } else { "overflows, far beyond" }
                )))
            }
        },
        (None, None) => 4096,
    };
    Ok(TrainConfig {
        cp,
        dp: args.dp.unwrap_or(1),
        tp: args.tp.unwrap_or(1),
        pp: args.pp.unwrap_or(1),
        pp_schedule: args
            .pp_schedule
            .as_deref()
            .map(PpSchedule::parse)
            .transpose()?
            .unwrap_or_default(),
        strategy,
        layout,
        seq_len,
        micro_batches: args.micro_batches.unwrap_or(2),
        steps: args.steps.unwrap_or(30),
        model_size: args.model_size.clone().unwrap_or_else(|| "tiny".into()),
        seed: args.seed.unwrap_or(0),
        learning_rate: args.lr.unwrap_or(3e-3),
        mask: args.mask.clone().unwrap_or_else(|| "causal".into()),
        corpus: args.corpus.clone().unwrap_or_else(|| "default".into()),
        tokenizer: args.tokenizer.clone().unwrap_or_else(|| "bytes".into()),
        timeout_secs: args.timeout_secs.unwrap_or(60),
        dynamic: None,
        plan_ahead: args.plan_ahead.unwrap_or(DEFAULT_PLAN_AHEAD),
        dcp: None,
        topology: args.topology.clone().unwrap_or_else(|| "a100-p4d".into()),
        nodes: args.nodes.unwrap_or(1),
        auto: auto_settings(args)?,
        model_shape: None,
    })
    .and_then(|mut config| {
        config.dcp = dcp_settings(args, config.strategy)?;
        if let Some((inner, settings)) = dynamic_settings(args, cp, config.seq_len)? {
            config.strategy = inner;
            config.dynamic = Some(settings);
        }
        Ok(config)
    })
}

/// `--strategy auto`: the candidates; `None` otherwise (then `--auto-candidates` is an error).
fn auto_settings(args: &Args) -> Result<Option<AutoSettings>, TrainError> {
    if args.strategy.as_deref() != Some("auto") {
        if args.auto_candidates.is_some() {
            return Err(TrainError::Config(
                "--auto-candidates only applies to --strategy auto".into(),
            ));
        }
        return Ok(None);
    }
    let candidates = match &args.auto_candidates {
        Some(text) => burn_dcp::planner::auto::parse_candidates(text)
            .map_err(|e| TrainError::Config(format!("--auto-candidates {text}: {e}")))?,
        None => burn_dcp::planner::auto::AutoCandidate::ALL.to_vec(),
    };
    Ok(Some(AutoSettings { candidates }))
}

/// `--layout` alone (dynamic CP: the layout inside each group) [default: zigzag].
fn layout_flag(args: &Args) -> Result<Layout, TrainError> {
    args.layout
        .as_deref()
        .unwrap_or("zigzag")
        .parse()
        .map_err(|e: burn_dcp::CpError| TrainError::from(e))
}

/// On resume: the saved config, with `--steps` as the new total; any other flag must agree.
fn resumed_config(args: &Args, dir: &Path) -> Result<TrainConfig, TrainError> {
    let saved: TrainConfig = read_json(&dir.join("config.json"))?;
    let mut config = saved.clone();
    if let Some(steps) = args.steps {
        config.steps = steps;
    }
    // Planning ahead changes when plans are made, not what they are; the pipeline schedule the
    // order of the passes, not their results.
    if let Some(plan_ahead) = args.plan_ahead {
        config.plan_ahead = plan_ahead;
    }
    let given = config_from_args(args)?;
    if args.pp_schedule.is_some() {
        config.pp_schedule = given.pp_schedule;
    }
    let checks: [(&str, bool, String, String); 13] = [
        (
            "--corpus",
            args.corpus.is_some() && given.corpus != saved.corpus,
            given.corpus.clone(),
            saved.corpus.clone(),
        ),
        (
            "--tokenizer",
            args.tokenizer.is_some() && given.tokenizer != saved.tokenizer,
            given.tokenizer.clone(),
            saved.tokenizer.clone(),
        ),
        (
            "--cp",
            args.cp.is_some() && given.cp != saved.cp,
            given.cp.to_string(),
            saved.cp.to_string(),
        ),
        (
            "--dp",
            args.dp.is_some() && given.dp != saved.dp,
            given.dp.to_string(),
            saved.dp.to_string(),
        ),
        (
            "--tp",
            args.tp.is_some() && given.tp != saved.tp,
            given.tp.to_string(),
            saved.tp.to_string(),
        ),
        (
            "--pp",
            args.pp.is_some() && given.pp != saved.pp,
            given.pp.to_string(),
            saved.pp.to_string(),
        ),
        (
            "--strategy",
            args.strategy.is_some()
                && (given.strategy != saved.strategy
                    || given.auto.is_some() != saved.auto.is_some()),
            given.strategy_name(),
            saved.strategy_name(),
        ),
        (
            "--layout",
            args.layout.is_some() && given.layout != saved.layout,
            given.layout.to_string(),
            saved.layout.to_string(),
        ),
        (
            "--seq-len",
            (args.seq_len.is_some()
                || (args.max_tokens_per_rank.is_some() && saved.dynamic.is_none()))
                && given.seq_len != saved.seq_len,
            given.seq_len.to_string(),
            saved.seq_len.to_string(),
        ),
        (
            "--micro-batches",
            args.micro_batches.is_some() && given.micro_batches != saved.micro_batches,
            given.micro_batches.to_string(),
            saved.micro_batches.to_string(),
        ),
        (
            "--model-size",
            args.model_size.is_some() && given.model_size != saved.model_size,
            given.model_size.clone(),
            saved.model_size.clone(),
        ),
        (
            "--seed",
            args.seed.is_some() && given.seed != saved.seed,
            given.seed.to_string(),
            saved.seed.to_string(),
        ),
        (
            "--mask",
            args.mask.is_some() && given.mask != saved.mask,
            given.mask.clone(),
            saved.mask.clone(),
        ),
    ];
    let dynamic_flags = args.inner_strategy.is_some()
        || args.min_cp_size.is_some()
        || args.cp_sizes.is_some()
        || (args.max_tokens_per_rank.is_some() && saved.dynamic.is_some());
    if (args.strategy.is_some() || dynamic_flags) && given.dynamic != saved.dynamic {
        return Err(TrainError::Config(format!(
            "the dynamic CP settings {:?} differ from the resumed run's {:?} (saved in {})",
            given.dynamic,
            saved.dynamic,
            dir.display()
        )));
    }
    if args.auto_candidates.is_some() && given.auto != saved.auto {
        return Err(TrainError::Config(format!(
            "the auto settings {:?} differ from the resumed run's {:?} (saved in {})",
            given.auto,
            saved.auto,
            dir.display()
        )));
    }
    if (args.block.is_some() || args.stages.is_some()) && given.dcp != saved.dcp {
        return Err(TrainError::Config(format!(
            "the DCP settings {:?} differ from the resumed run's {:?} (saved in {})",
            given.dcp,
            saved.dcp,
            dir.display()
        )));
    }
    // The topology changes DCP's plans and the byte counts by link; given, it must agree.
    if (args.topology.is_some() && given.topology != saved.topology)
        || (args.nodes.is_some() && given.nodes != saved.nodes)
    {
        return Err(TrainError::Config(format!(
            "--topology {} --nodes {} differ from the resumed run's {} × {} nodes (saved in {})",
            given.topology,
            given.nodes,
            saved.topology,
            saved.nodes,
            dir.display()
        )));
    }
    if let Some((flag, _, value, saved_value)) = checks.into_iter().find(|c| c.1) {
        return Err(TrainError::Config(format!(
            "{flag} {value} differs from the resumed run's {saved_value} (saved in {})",
            dir.display()
        )));
    }
    if args.lr.is_some_and(|lr| lr != saved.learning_rate) {
        return Err(TrainError::Config(format!(
            "--lr differs from the resumed run's {}",
            saved.learning_rate
        )));
    }
    Ok(config)
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
    burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "gpt_longctx")
        .map_err(TrainError::Config)?;
    let config = match &args.resume {
        Some(dir) => resumed_config(args, dir)?,
        None => config_from_args(args)?,
    };
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
        return summarize(args, &config, &[], 0.0, args.resume.as_deref());
    }
    let ranks =
        Ranks::new(config.world_size(), world_config(&config)?).map_err(TrainError::Launch)?;
    let result = train(args, &config, &ranks, saved_step);
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
) -> Result<(), TrainError> {
    // With several processes only rank 0 prints and writes files (the checkpoint's shards reach
    // it as messages); every rank trains.
    let leader = ranks.is_leader();
    let out = args.out.clone().or_else(|| args.resume.clone());
    if let (true, Some(out)) = (leader, &out) {
        refuse_overwrite(out, args.resume.as_deref())?;
        std::fs::create_dir_all(out).map_err(|e| TrainError::io("create", out, e))?;
        write_json(
            &out.join("config.json"),
            &SavedConfig {
                config,
                backend: burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "gpt_longctx")
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
    let strategy = match &config.dynamic {
        Some(d) => format!(
            "dynamic CP over a pool of {} ({} inside groups, {} tokens per rank, {:?} sizes)",
            config.pool_size(),
            config.strategy,
            d.max_tokens_per_rank,
            d.cp_sizes
        ),
        None if config.auto.is_some() => format!(
            "auto strategy: per micro-batch the lowest estimated attention time on {} × {} nodes",
            config.topology, config.nodes
        ),
        None => format!("{} strategy", config.strategy),
    };
    let strategy = match config.pp {
        1 => strategy,
        _ => format!("{strategy}, {} pipeline schedule", config.pp_schedule),
    };
    if leader {
        eprintln!(
            "gpt_longctx: {} model, world {} = {} ({strategy}, {} layout) on {}, {} tokens/micro-batch, {} micro-batches/step, mask {}",
            config.model_size, config.world_size(), config.mesh_shape(), config.layout, ranks.describe(), config.seq_len, config.micro_batches, config.mask
        );
    }
    let data = TrainData::load(config)?;
    if leader {
        eprintln!(
            "data: corpus {} ({} tokenizer) packed into {} micro-batches of at most {} tokens",
            config.corpus,
            config.tokenizer,
            data.len(),
            config.seq_len
        );
    }
    let resume = args.resume.as_deref();
    let results = match args.backend.as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu" if args.no_fusion => {
            train_world::<WgpuPlain>(ranks, config, &data, resume, &out, &reporter)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => train_world::<WgpuFusion>(ranks, config, &data, resume, &out, &reporter),
        #[cfg(feature = "cuda")]
        "cuda" => train_world_cuda(ranks, config, &data, resume, &out, &reporter),
        _ => train_world::<burn::backend::Flex>(ranks, config, &data, resume, &out, &reporter),
    };
    if leader {
        reporter.finish()?;
    }
    let outcome = results.map_err(TrainError::RankFailed)?;
    let Some(outcome) = outcome else {
        // Not rank 0 of a multi-process job: rank 0 reports.
        return Ok(());
    };
    let metrics = outcome.metrics;
    summarize(
        args,
        config,
        &metrics,
        reporter.elapsed_seconds(),
        out.as_deref(),
    )
}

/// Runs every rank's training on `ContextParallel<Autodiff<B>>` (`B`'s default device).
fn train_world<B: FlashOps>(
    ranks: &Ranks,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: &Option<PathBuf>,
    reporter: &Progress,
) -> Result<Option<RankOutcome>, String> {
    let device = B::Device::default();
    ranks.run(|comm| {
        train_rank::<B>(
            comm,
            config,
            data,
            resume,
            out.as_deref(),
            reporter,
            &device,
        )
    })
}

/// [`train_world`] on burn-cuda. With one process per rank (MPI or TCP launch) each rank uses
/// the GPU of its local rank and moves tensors with NCCL, the launch's world carrying NCCL's
/// unique id and the message headers; threads share the default GPU and the in-process world.
#[cfg(feature = "cuda")]
fn train_world_cuda(
    ranks: &Ranks,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: &Option<PathBuf>,
    reporter: &Progress,
) -> Result<Option<RankOutcome>, String> {
    type Cuda = burn::backend::Cuda;
    let Some(local_rank) = ranks.local_rank() else {
        return train_world::<Cuda>(ranks, config, data, resume, out, reporter);
    };
    let device = burn::backend::cuda::CudaDevice::new(local_rank);
    let world_config = world_config(config)?;
    ranks.run(|control| {
        let comm =
            burn_dcp::comm::NcclWorld::init::<Cuda>(control, device.clone(), world_config.clone())
                .map_err(|e| TrainError::Launch(format!("NCCL on GPU {local_rank}: {e}")))?;
        train_rank::<Cuda>(
            comm,
            config,
            data,
            resume,
            out.as_deref(),
            reporter,
            &device,
        )
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
    metrics: &[StepMetrics],
    wall: f64,
    out: Option<&Path>,
) -> Result<(), TrainError> {
    let tokens: usize = metrics.iter().map(|m| m.tokens).sum();
    let bytes: u64 = metrics.iter().map(|m| m.bytes_communicated).sum();
    let train_seconds: f64 = metrics.iter().map(|m| m.step_ms).sum::<f64>() / 1e3;
    let summary = json!({
        "config": config,
        "backend": burn_dcp_suite::backend_type(&args.backend, args.no_fusion, "gpt_longctx")
            .map_err(TrainError::Config)?,
        "steps_run": metrics.len(),
        "first_step": metrics.first().map(|m| m.step),
        "last_step": metrics.last().map(|m| m.step),
        "losses": metrics.iter().map(|m| m.loss).collect::<Vec<_>>(),
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
        "plan_wait_ms": metrics.iter().filter_map(|m| m.plan_wait_ms).fold(0.0, |a, b| a + b),
        "wall_seconds": wall,
        "out": out.map(|p| p.display().to_string()),
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary)
                .map_err(|e| TrainError::Malformed(format!("the summary: {e}")))?
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
