//! From flags to a [`TrainConfig`]: the defaults for what is not given, each flag checked and
//! named in its error.

use std::path::Path;

use burn_dcp::StrategyKind;

use super::args::TrainFlags;
use super::mode::mode_from_args;
use crate::config::{PpSchedule, Precision, Recompute, TrainConfig, TrainMode, MAX_SEQ_LEN};
use crate::error::TrainError;
use crate::optim::{LrScheduleKind, LrScheduleSettings, OptimizerKind, OptimizerSettings};
use crate::settings::EmulatedLinks;

impl TrainFlags {
    /// The configuration of a new run.
    pub fn config(&self) -> Result<TrainConfig, TrainError> {
        config_from_args(self)
    }
}

pub(super) fn config_from_args(args: &TrainFlags) -> Result<TrainConfig, TrainError> {
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
        vpp: args.vpp.unwrap_or(defaults.vpp),
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
        tokenizer_file: args.tokenizer_file.clone(),
        data_path: args.data_path.clone().unwrap_or_default(),
        eod_token: args.eod_token,
        token_dtype: args
            .token_dtype
            .clone()
            .unwrap_or(defaults.token_dtype.clone()),
        lengths_from: args.lengths_from.clone().or(defaults.lengths_from.clone()),
        timeout_secs: args.timeout_secs.unwrap_or(defaults.timeout_secs),
        sync_phases: args.sync_phases,
        eval_only: args.eval_only,
        architecture: None,
        hf_checkpoint: None,
        rope_theta: args.rope_theta,
        rope_scaling: args.rope_scaling.clone(),
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
        hf_architecture(args, &mut config)?;
        Ok(config)
    })
}

/// `--model-config` or `--hf-checkpoint`: the architecture of a Hugging Face `config.json` (and
/// from a checkpoint its tokenizer, and Mistral's sliding window as the mask), unless a flag says
/// otherwise.
fn hf_architecture(args: &TrainFlags, config: &mut TrainConfig) -> Result<(), TrainError> {
    let file = match (&args.model_config, &args.hf_checkpoint, &args.model_size) {
        (None, None, _) => return Ok(()),
        (Some(_), Some(_), _) => {
            return Err(TrainError::Config(
                "give --model-config (an architecture, random weights) or --hf-checkpoint (an architecture and its weights), not both".into(),
            ))
        }
        (_, _, Some(size)) => {
            return Err(TrainError::Config(format!(
                "--model-size {size} names a preset, --model-config and --hf-checkpoint an architecture of their own: give one"
            )))
        }
        (Some(file), None, None) => Path::new(file).to_path_buf(),
        (None, Some(dir), None) => Path::new(dir).join("config.json"),
    };
    let hf = crate::hf::load::read_hf_config(&file)?;
    if let Some(dir) = &args.hf_checkpoint {
        // Every tensor there with its shape, no file truncated: checked before anything is
        // written or allocated.
        burn_dcp_models::hf::check_hf(Path::new(dir), &hf.model)
            .map_err(|e| TrainError::Checkpoint(format!("--hf-checkpoint: {e}")))?;
        let tokenizer = Path::new(dir).join("tokenizer.json");
        if args.tokenizer_file.is_none() && args.tokenizer.is_none() && tokenizer.exists() {
            config.tokenizer_file = Some(tokenizer.display().to_string());
        }
        config.hf_checkpoint = Some(dir.clone());
    }
    if let (Some(window), None) = (hf.sliding_window, &args.mask) {
        config.mask = format!("sliding:{window}");
    }
    config.model_size = hf.architecture.class().to_string();
    config.architecture = Some(hf.model);
    Ok(())
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
