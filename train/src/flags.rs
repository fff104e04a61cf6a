//! The examples' training flags ([`TrainFlags`]) and how they become a [`TrainConfig`]: for a new
//! run ([`TrainFlags::config`]) or to continue a saved one ([`TrainFlags::resume`], where every
//! given flag must agree with the saved configuration).

use std::fmt::Debug;
use std::path::Path;

use burn_dcp::{Layout, Strategy, StrategyKind};

use crate::checkpoint::read_json;
use crate::config::{
    AutoSettings, DcpSettings, GroupStrategy, PpSchedule, Precision, Recompute, TrainConfig,
    TrainMode, MAX_SEQ_LEN,
};
use crate::error::TrainError;
use crate::optim::{LrScheduleKind, LrScheduleSettings, OptimizerKind, OptimizerSettings};
use crate::settings::EmulatedLinks;
use crate::settings::{CpSizes, DynamicSettings};

/// The training flags of the examples (`gpt_longctx`'s command line), each optional: what is
/// not given takes [`TrainConfig::default`]'s value (the one home of the defaults), or on resume
/// the saved run's. With the feature `cli` it is a `clap::Args` to flatten into a parser.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct TrainFlags {
    /// Context-parallel ranks per replica [default: 4]
    #[cfg_attr(feature = "cli", arg(long))]
    pub cp: Option<usize>,
    /// Data-parallel replicas [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub dp: Option<usize>,
    /// Tensor-parallel ranks (Megatron-style; innermost axis of the tp × cp × dp × pp mesh) [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub tp: Option<usize>,
    /// Pipeline stages (outermost axis of the mesh; must divide the layers) [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub pp: Option<usize>,
    /// Pipeline schedule over each step's micro-batches, 1f1b | gpipe [default: 1f1b]
    #[cfg_attr(feature = "cli", arg(long))]
    pub pp_schedule: Option<String>,
    /// ulysses | ring | all-gather | usp | dcp, or ring-zigzag | ring-contiguous | ring-stripe, or dynamic (Megatron-style dynamic CP over the dp × cp pool), or auto (per micro-batch the strategy with the lowest estimated attention time) [default: ring]
    #[cfg_attr(feature = "cli", arg(long))]
    pub strategy: Option<String>,
    /// Dynamic CP: the strategy inside each group, ring | ulysses | usp | all-gather [default: ring]
    #[cfg_attr(feature = "cli", arg(long))]
    pub inner_strategy: Option<String>,
    /// Dynamic CP: smallest CP group [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub min_cp_size: Option<usize>,
    /// Dynamic CP: group sizes, pow2 (Megatron) | any [default: pow2]
    #[cfg_attr(feature = "cli", arg(long))]
    pub cp_sizes: Option<String>,
    /// dcp and auto: tokens per block of each micro-batch's DCP plan [default: 128, or --seq-len if less]
    #[cfg_attr(feature = "cli", arg(long))]
    pub block: Option<usize>,
    /// dcp and auto: communication stages of each DCP plan [default: 4]
    #[cfg_attr(feature = "cli", arg(long))]
    pub stages: Option<usize>,
    /// auto: the strategies it may choose, comma-separated, of ring-zigzag, ulysses, usp, all-gather, dynamic, dcp [default: all]
    #[cfg_attr(feature = "cli", arg(long))]
    pub auto_candidates: Option<String>,
    /// Topology preset the ranks model, a100-p4d | h100-dgx (dcp plans for it; bytes are counted
    /// per link class) [default: a100-p4d]
    #[cfg_attr(feature = "cli", arg(long))]
    pub topology: Option<String>,
    /// Virtual nodes the ranks are spread over (consecutive ranks share a node) [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub nodes: Option<usize>,
    /// Delay every message between ranks (threads) as over the --topology preset's links on --nodes nodes, slowed to this machine's compute (bytes unchanged; see docs/training.md)
    #[cfg_attr(feature = "cli", arg(long))]
    pub emulate_links: bool,
    /// --emulate-links: the links' time scale (bandwidth ÷ F, latency × F) [default: measured: the preset's device FLOP/s ÷ this CPU's attention FLOP/s per rank]
    #[cfg_attr(feature = "cli", arg(long))]
    pub link_scale: Option<f64>,
    /// Steps planned ahead on a background thread (any strategy) [default: 2]
    #[cfg_attr(feature = "cli", arg(long))]
    pub plan_ahead: Option<usize>,
    /// contiguous | zigzag | stripe [default: zigzag]
    #[cfg_attr(feature = "cli", arg(long))]
    pub layout: Option<String>,
    /// Ulysses degree of USP (ring degree = cp / ulysses degree)
    #[cfg_attr(feature = "cli", arg(long))]
    pub ulysses_degree: Option<usize>,
    /// Optimizer steps (the total, also when resuming) [default: 30]
    #[cfg_attr(feature = "cli", arg(long))]
    pub steps: Option<usize>,
    /// Tokens per packed micro-batch (at most; documents are packed, longer ones split) [default: 4096]
    #[cfg_attr(feature = "cli", arg(long))]
    pub seq_len: Option<usize>,
    /// Tokens each CP rank holds: static CP sets --seq-len to this × cp (give one of the two);
    /// dynamic CP uses it as the scheduler's per-rank budget [default: ⌈seq-len / cp⌉]
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_tokens_per_rank: Option<usize>,
    /// Micro-batches per optimizer step over all replicas (the global batch; a multiple of dp) [default: 2]
    #[cfg_attr(feature = "cli", arg(long))]
    pub micro_batches: Option<usize>,
    /// tiny | small | base [default: tiny]
    #[cfg_attr(feature = "cli", arg(long))]
    pub model_size: Option<String>,
    /// Seed of the weights and the data [default: 0]
    #[cfg_attr(feature = "cli", arg(long))]
    pub seed: Option<u64>,
    /// Peak learning rate (the schedule's) [default: 0.003]
    #[cfg_attr(feature = "cli", arg(long))]
    pub lr: Option<f64>,
    /// adamw | adam | sgd [default: adamw]
    #[cfg_attr(feature = "cli", arg(long))]
    pub optimizer: Option<String>,
    /// Weight decay (adamw: decoupled; adam, sgd: L2) [default: 1e-4 for adamw, 0 otherwise]
    #[cfg_attr(feature = "cli", arg(long))]
    pub weight_decay: Option<f64>,
    /// adam, adamw: β₁ [default: 0.9]
    #[cfg_attr(feature = "cli", arg(long))]
    pub adam_beta1: Option<f64>,
    /// adam, adamw: β₂ [default: 0.999]
    #[cfg_attr(feature = "cli", arg(long))]
    pub adam_beta2: Option<f64>,
    /// adam, adamw: ε [default: 1e-5]
    #[cfg_attr(feature = "cli", arg(long))]
    pub adam_eps: Option<f64>,
    /// sgd: momentum, 0 for none [default: 0.9]
    #[cfg_attr(feature = "cli", arg(long))]
    pub sgd_momentum: Option<f64>,
    /// constant | cosine | linear: the learning rate after the warm-up, down to --min-lr at the
    /// last step [default: constant]
    #[cfg_attr(feature = "cli", arg(long))]
    pub lr_schedule: Option<String>,
    /// Steps of linear warm-up to --lr [default: 0]
    #[cfg_attr(feature = "cli", arg(long))]
    pub warmup_steps: Option<usize>,
    /// Where cosine and linear end [default: 0]
    #[cfg_attr(feature = "cli", arg(long))]
    pub min_lr: Option<f64>,
    /// The step at which the decay reaches --min-lr [default: --steps]; give it to continue a
    /// run past its first --steps on the same schedule
    #[cfg_attr(feature = "cli", arg(long))]
    pub lr_decay_steps: Option<usize>,
    /// Validation loss after every N-th step and the last, on documents held out of training
    /// [default: no validation]
    #[cfg_attr(feature = "cli", arg(long))]
    pub eval_every: Option<usize>,
    /// Tokens of whole documents held out for validation (at least) [default: 4096]
    #[cfg_attr(feature = "cli", arg(long))]
    pub eval_tokens: Option<usize>,
    /// With --out: also save a checkpoint after every N-th step [default: only after the last]
    #[cfg_attr(feature = "cli", arg(long))]
    pub checkpoint_every: Option<usize>,
    /// Checkpoints kept: the newest in `checkpoint/`, older ones in `checkpoint-STEP/` [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub keep_checkpoints: Option<usize>,
    /// The largest message of a checkpoint: shards travel to rank 0 in chunks of at most this
    /// many bytes [default: 268435456]
    #[cfg_attr(feature = "cli", arg(long))]
    pub checkpoint_chunk_bytes: Option<usize>,
    /// How long the other ranks wait, in all, for rank 0 to write a checkpoint, seconds
    /// [default: 3600]
    #[cfg_attr(feature = "cli", arg(long))]
    pub checkpoint_timeout_secs: Option<u64>,
    /// Clip the gradients' global norm (every parameter once, across TP, PP, DP and CP) to this
    /// [default: no clipping]
    #[cfg_attr(feature = "cli", arg(long))]
    pub clip_grad_norm: Option<f64>,
    /// Mask of every sequence: causal | lambda | blockwise | shared-question (DCP defaults) | mixed (one of those per sequence) | full | a spec such as lambda:64,4096 [default: causal]
    #[cfg_attr(feature = "cli", arg(long))]
    pub mask: Option<String>,
    /// Training text: default (Vim help files, Debian vim-runtime) | builtin (burn-dcp-train's README and sources) | a directory of text files | a .jsonl file [default: default]
    #[cfg_attr(feature = "cli", arg(long))]
    pub corpus: Option<String>,
    /// Recut the corpus into documents of a long-tailed dataset's lengths, longalign-like | ldc-like (the dataset's sampler scaled so its longest length is --seq-len; documents stay whole when packed) [default: the corpus's own documents]
    #[cfg_attr(feature = "cli", arg(long))]
    pub lengths_from: Option<String>,
    /// bytes | gpt2 (r50k BPE; its 50257-token LM head makes CPU steps ~8x slower) [default: bytes]
    #[cfg_attr(feature = "cli", arg(long))]
    pub tokenizer: Option<String>,
    /// What the backward recomputes instead of keeping it: none | attention (burn's BalancedCheckpointing: memory-bound activations and the CP attention's output, which communicates once more) | block (every transformer block from its input) [default: none]
    #[cfg_attr(feature = "cli", arg(long))]
    pub recompute: Option<String>,
    /// The dtype the forward and backward compute in: f32 | bf16 | f16 (parameters, gradients, optimizer moments and checkpoints stay f32; attention accumulates in f32; CP messages travel in this dtype) [default: f32]
    #[cfg_attr(feature = "cli", arg(long))]
    pub precision: Option<String>,
    /// Timeout of every communication wait, seconds [default: 60]
    #[cfg_attr(feature = "cli", arg(long))]
    pub timeout_secs: Option<u64>,
}

impl TrainFlags {
    /// The configuration of a new run.
    pub fn config(&self) -> Result<TrainConfig, TrainError> {
        config_from_args(self)
    }

    /// The configuration of the run saved in `dir` (its `config.json`), `--steps` the new total;
    /// every other flag given must agree with it (an error names the flag and both values).
    pub fn resume(&self, dir: &Path) -> Result<TrainConfig, TrainError> {
        resumed_config(self, dir)
    }
}

/// Strategy and layout from the flags (`ring-zigzag` is ring with the zigzag layout).
fn strategy_and_layout(args: &TrainFlags, cp: usize) -> Result<(Strategy, Layout), TrainError> {
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
    // `ring` takes its layout from --layout; `ring-zigzag` names it (then --layout must agree).
    let kind = match name {
        "ring" => None,
        other => Some(other.parse::<StrategyKind>().map_err(|e| match other {
            // A ring's layout: the layout's own error.
            ring if ring.starts_with("ring-") => TrainError::from(e),
            _ => TrainError::Config(format!("{e} (or ring, auto)")),
        })?),
    };
    let implied_layout = kind.and_then(StrategyKind::layout);
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
    let strategy = kind
        .unwrap_or(StrategyKind::Ring(layout))
        .strategy(args.ulysses_degree, cp)?;
    Ok((strategy, layout))
}

/// `--strategy dynamic`: the inner strategy and the scheduler settings; `None` for static CP (then
/// the dynamic-only flags are an error).
fn dynamic_settings(
    args: &TrainFlags,
    cp: usize,
    seq_len: usize,
) -> Result<Option<(Strategy, DynamicSettings)>, TrainError> {
    if args.strategy.as_deref() != Some(StrategyKind::Dynamic.name()) {
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
fn dcp_settings(args: &TrainFlags, strategy: Strategy) -> Result<Option<DcpSettings>, TrainError> {
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

fn config_from_args(args: &TrainFlags) -> Result<TrainConfig, TrainError> {
    let defaults = TrainConfig::default();
    let cp = args.cp.unwrap_or(defaults.cp);
    let dynamic = args.strategy.as_deref() == Some(StrategyKind::Dynamic.name());
    if !dynamic && args.seq_len.is_some() && args.max_tokens_per_rank.is_some() {
        return Err(TrainError::Config("give --seq-len or --max-tokens-per-rank (= seq-len / cp), not both (with --strategy dynamic, --max-tokens-per-rank is the scheduler's per-rank budget)".into()));
    }
    let seq_len = match (args.seq_len, args.max_tokens_per_rank) {
        (Some(n), _) => n,
        (None, _) if dynamic => defaults.seq_len,
        (None, Some(per_rank)) => match per_rank.checked_mul(cp) {
            Some(tokens) if tokens <= MAX_SEQ_LEN => tokens,
            product => {
                return Err(TrainError::Config(format!(
                    "--max-tokens-per-rank {per_rank} × --cp {cp} {} the limit of {MAX_SEQ_LEN} tokens per micro-batch",
                    if product.is_some() { "exceeds" } else { "overflows, far beyond" }
                )))
            }
        },
        (None, None) => defaults.seq_len,
    };
    Ok(TrainConfig {
        cp,
        dp: args.dp.unwrap_or(defaults.dp),
        tp: args.tp.unwrap_or(defaults.tp),
        pp: args.pp.unwrap_or(defaults.pp),
        pp_schedule: args
            .pp_schedule
            .as_deref()
            .map(PpSchedule::parse)
            .transpose()?
            .unwrap_or_default(),
        mode: TrainMode::default(),
        seq_len,
        micro_batches: args.micro_batches.unwrap_or(defaults.micro_batches),
        steps: args.steps.unwrap_or(defaults.steps),
        model_size: args
            .model_size
            .clone()
            .unwrap_or(defaults.model_size.clone()),
        seed: args.seed.unwrap_or(defaults.seed),
        learning_rate: args.lr.unwrap_or(defaults.learning_rate),
        optimizer: optimizer_settings(args)?,
        lr_schedule: LrScheduleSettings {
            kind: match &args.lr_schedule {
                Some(name) => LrScheduleKind::parse(name)?,
                None => LrScheduleKind::default(),
            },
            warmup_steps: args.warmup_steps.unwrap_or(0),
            min_lr: args.min_lr.unwrap_or(0.0),
            decay_steps: args.lr_decay_steps,
        },
        clip_grad_norm: args.clip_grad_norm,
        eval_every: args.eval_every,
        eval_tokens: args.eval_tokens.unwrap_or(defaults.eval_tokens),
        checkpoint_every: args.checkpoint_every,
        keep_checkpoints: args.keep_checkpoints.unwrap_or(defaults.keep_checkpoints),
        checkpoint_chunk_bytes: args
            .checkpoint_chunk_bytes
            .unwrap_or(defaults.checkpoint_chunk_bytes),
        checkpoint_timeout_secs: args
            .checkpoint_timeout_secs
            .unwrap_or(defaults.checkpoint_timeout_secs),
        mask: args.mask.clone().unwrap_or(defaults.mask.clone()),
        corpus: args.corpus.clone().unwrap_or(defaults.corpus.clone()),
        tokenizer: args.tokenizer.clone().unwrap_or(defaults.tokenizer.clone()),
        lengths_from: args.lengths_from.clone().or(defaults.lengths_from.clone()),
        timeout_secs: args.timeout_secs.unwrap_or(defaults.timeout_secs),
        plan_ahead: args.plan_ahead.unwrap_or(defaults.plan_ahead),
        topology: args.topology.clone().unwrap_or(defaults.topology.clone()),
        nodes: args.nodes.unwrap_or(defaults.nodes),
        emulate_links: emulated_links(args)?,
        model_shape: None,
        recompute: args
            .recompute
            .as_deref()
            .map(Recompute::parse)
            .transpose()?
            .unwrap_or_default(),
        precision: args
            .precision
            .as_deref()
            .map(Precision::parse)
            .transpose()?
            .unwrap_or_default(),
    })
    .and_then(|mut config| {
        config.mode = mode_from_args(args, cp, config.seq_len)?;
        Ok(config)
    })
}

/// The mode the flags name: `--strategy` with its layout and settings (`--strategy dynamic`'s
/// `--inner-strategy`, DCP's `--block`/`--stages`, auto's `--auto-candidates`); the flags of
/// another mode are an error.
fn mode_from_args(args: &TrainFlags, cp: usize, seq_len: usize) -> Result<TrainMode, TrainError> {
    let auto = auto_settings(args)?;
    if let Some((inner, settings)) = dynamic_settings(args, cp, seq_len)? {
        let inner = match dcp_settings(args, inner)? {
            Some(dcp) => {
                no_layout(args, "--inner-strategy dcp")?;
                GroupStrategy::Dcp(dcp)
            }
            None => GroupStrategy::Static {
                strategy: inner,
                layout: layout_flag(args)?,
            },
        };
        return Ok(TrainMode::Dynamic { settings, inner });
    }
    let (strategy, layout) = strategy_and_layout(args, cp)?;
    let dcp = dcp_settings(args, strategy)?;
    Ok(match (auto, dcp) {
        (Some(settings), Some(dcp)) => TrainMode::Auto { settings, dcp },
        (None, Some(dcp)) => {
            no_layout(args, "--strategy dcp")?;
            TrainMode::Dcp(dcp)
        }
        _ => TrainMode::Static { strategy, layout },
    })
}

/// DCP places tokens where its plan homes them: a `--layout` beside it would be ignored.
fn no_layout(args: &TrainFlags, what: &str) -> Result<(), TrainError> {
    match &args.layout {
        Some(layout) => Err(TrainError::Config(format!(
            "--layout {layout} does not apply to {what}: DCP places every token where its block plan homes it"
        ))),
        None => Ok(()),
    }
}

/// `--optimizer` and its hyper-parameters (each flag only for the optimizers that have it).
fn optimizer_settings(args: &TrainFlags) -> Result<OptimizerSettings, TrainError> {
    let kind = match &args.optimizer {
        Some(name) => OptimizerKind::parse(name)?,
        None => OptimizerKind::default(),
    };
    let adam = kind != OptimizerKind::Sgd;
    let given = [
        ("--adam-beta1", args.adam_beta1.is_some() && !adam),
        ("--adam-beta2", args.adam_beta2.is_some() && !adam),
        ("--adam-eps", args.adam_eps.is_some() && !adam),
        ("--sgd-momentum", args.sgd_momentum.is_some() && adam),
    ];
    if let Some((flag, _)) = given.iter().find(|(_, wrong)| *wrong) {
        return Err(TrainError::Config(format!(
            "{flag} does not apply to --optimizer {kind}"
        )));
    }
    let defaults = OptimizerSettings::of(kind);
    Ok(OptimizerSettings {
        kind,
        weight_decay: args.weight_decay.unwrap_or(defaults.weight_decay),
        beta1: args.adam_beta1.unwrap_or(defaults.beta1),
        beta2: args.adam_beta2.unwrap_or(defaults.beta2),
        epsilon: args.adam_eps.unwrap_or(defaults.epsilon),
        momentum: args.sgd_momentum.unwrap_or(defaults.momentum),
    })
}

/// `Some` of both shown (`{:?}`) when `given` and `saved` differ.
fn differ<T: PartialEq + Debug>(given: &T, saved: &T) -> Option<(String, String)> {
    (given != saved).then(|| (format!("{given:?}"), format!("{saved:?}")))
}

/// `--emulate-links` and `--link-scale`.
fn emulated_links(args: &TrainFlags) -> Result<Option<EmulatedLinks>, TrainError> {
    if !args.emulate_links {
        return match args.link_scale {
            Some(scale) => Err(TrainError::Config(format!(
                "--link-scale {scale} only applies with --emulate-links"
            ))),
            None => Ok(None),
        };
    }
    if let Some(scale) = args.link_scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(TrainError::Config(format!(
            "--link-scale {scale} must be a positive number (the links' time scale)"
        )));
    }
    Ok(Some(EmulatedLinks {
        scale: args.link_scale,
    }))
}

/// `--strategy auto`: the candidates; `None` otherwise (then `--auto-candidates` is an error).
fn auto_settings(args: &TrainFlags) -> Result<Option<AutoSettings>, TrainError> {
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
        None => burn_dcp::StrategyKind::ALL.to_vec(),
    };
    Ok(Some(AutoSettings { candidates }))
}

/// `--layout` alone (dynamic CP: the layout inside each group) [default: zigzag].
fn layout_flag(args: &TrainFlags) -> Result<Layout, TrainError> {
    args.layout
        .as_deref()
        .unwrap_or("zigzag")
        .parse()
        .map_err(|e: burn_dcp::CpError| TrainError::from(e))
}

/// On resume: the saved config, with `--steps` as the new total; any other flag must agree.
fn resumed_config(args: &TrainFlags, dir: &Path) -> Result<TrainConfig, TrainError> {
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
    // Emulated links change when messages arrive, not what they hold: this run's flags decide.
    config.emulate_links = given.emulate_links;
    // When checkpoints are written, how many are kept, in what messages and how long their
    // waits may take changes no result.
    if args.checkpoint_every.is_some() {
        config.checkpoint_every = given.checkpoint_every;
    }
    if args.keep_checkpoints.is_some() {
        config.keep_checkpoints = given.keep_checkpoints;
    }
    if args.checkpoint_chunk_bytes.is_some() {
        config.checkpoint_chunk_bytes = given.checkpoint_chunk_bytes;
    }
    if args.checkpoint_timeout_secs.is_some() {
        config.checkpoint_timeout_secs = given.checkpoint_timeout_secs;
    }
    if args.pp_schedule.is_some() {
        config.pp_schedule = given.pp_schedule;
    }
    // What the backward recomputes changes memory and time, not results: this run's flag decides.
    if args.recompute.is_some() {
        config.recompute = given.recompute;
    }
    // The master weights and the optimizer's moments are f32 whatever the precision: a resumed
    // run may compute in another one (this run's flag decides).
    if args.precision.is_some() {
        config.precision = given.precision;
    }
    let saved_in = format!("(saved in {})", dir.display());
    let settings = |what: &str, given: String, saved: String| {
        TrainError::Config(format!(
            "the {what} settings {given} differ from the resumed run's {saved} {saved_in}"
        ))
    };
    let dynamic_flags = args.inner_strategy.is_some()
        || args.min_cp_size.is_some()
        || args.cp_sizes.is_some()
        || (args.max_tokens_per_rank.is_some() && saved.mode.dynamic().is_some());
    // Settings whose flags were given must equal the saved run's.
    let agree = |what: &str, flags_given: bool, differ: Option<(String, String)>| match (
        flags_given,
        differ,
    ) {
        (true, Some((given, saved))) => Err(settings(what, given, saved)),
        _ => Ok(()),
    };
    agree(
        "dynamic CP",
        args.strategy.is_some() || dynamic_flags,
        differ(&given.mode.dynamic(), &saved.mode.dynamic()),
    )?;
    if args.auto_candidates.is_some() && given.mode.auto() != saved.mode.auto() {
        let show = |c: &TrainConfig| match c.mode.auto() {
            Some(auto) => format!("candidates {}", StrategyKind::names(&auto.candidates)),
            None => "none (not auto)".to_string(),
        };
        return Err(settings("auto", show(&given), show(&saved)));
    }
    agree(
        "DCP",
        args.block.is_some() || args.stages.is_some(),
        differ(&given.mode.dcp(), &saved.mode.dcp()),
    )?;
    // The optimizer's state and the schedule continue from the checkpoint.
    let optimizer_flags = args.optimizer.is_some()
        || args.weight_decay.is_some()
        || args.adam_beta1.is_some()
        || args.adam_beta2.is_some()
        || args.adam_eps.is_some()
        || args.sgd_momentum.is_some();
    agree(
        "optimizer",
        optimizer_flags,
        differ(&given.optimizer, &saved.optimizer),
    )?;
    let schedule_flags = args.lr_schedule.is_some()
        || args.warmup_steps.is_some()
        || args.min_lr.is_some()
        || args.lr_decay_steps.is_some();
    agree(
        "learning-rate schedule",
        schedule_flags,
        differ(&given.lr_schedule, &saved.lr_schedule),
    )?;
    // The topology changes DCP's plans and the byte counts by link; given, it must agree.
    if (args.topology.is_some() && given.topology != saved.topology)
        || (args.nodes.is_some() && given.nodes != saved.nodes)
    {
        return Err(TrainError::Config(format!(
            "--topology {} --nodes {} differ from the resumed run's {} × {} nodes {saved_in}",
            given.topology, given.nodes, saved.topology, saved.nodes
        )));
    }
    // Every other flag that was given: (flag, given?, the value compared and shown).
    type Value = fn(&TrainConfig) -> String;
    let seq_len_given = args.seq_len.is_some()
        || (args.max_tokens_per_rank.is_some() && saved.mode.dynamic().is_none());
    let checks: [(&str, bool, Value); 14] = [
        ("--corpus", args.corpus.is_some(), |c| c.corpus.clone()),
        ("--lengths-from", args.lengths_from.is_some(), |c| {
            c.lengths_from.clone().unwrap_or("none".into())
        }),
        ("--tokenizer", args.tokenizer.is_some(), |c| {
            c.tokenizer.clone()
        }),
        ("--cp", args.cp.is_some(), |c| c.cp.to_string()),
        ("--dp", args.dp.is_some(), |c| c.dp.to_string()),
        ("--tp", args.tp.is_some(), |c| c.tp.to_string()),
        ("--pp", args.pp.is_some(), |c| c.pp.to_string()),
        ("--strategy", args.strategy.is_some(), |c| c.strategy_name()),
        ("--layout", args.layout.is_some(), |c| {
            c.mode.layout().to_string()
        }),
        ("--seq-len", seq_len_given, |c| c.seq_len.to_string()),
        ("--micro-batches", args.micro_batches.is_some(), |c| {
            c.micro_batches.to_string()
        }),
        ("--model-size", args.model_size.is_some(), |c| {
            c.model_size.clone()
        }),
        ("--seed", args.seed.is_some(), |c| c.seed.to_string()),
        ("--mask", args.mask.is_some(), |c| c.mask.clone()),
    ];
    // Strategies that print alike (USP of other degrees) still differ.
    let strategy_differs = given.mode.group_strategy() != saved.mode.group_strategy()
        || given.mode.auto().is_some() != saved.mode.auto().is_some();
    for (flag, was_given, value) in checks {
        let differs = match flag {
            "--strategy" => strategy_differs,
            _ => value(&given) != value(&saved),
        };
        if was_given && differs {
            return Err(TrainError::Config(format!(
                "{flag} {} differs from the resumed run's {} {saved_in}",
                value(&given),
                value(&saved)
            )));
        }
    }
    if args.clip_grad_norm.is_some() && given.clip_grad_norm != saved.clip_grad_norm {
        return Err(TrainError::Config(format!(
            "--clip-grad-norm differs from the resumed run's {:?} {saved_in}",
            saved.clip_grad_norm
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
