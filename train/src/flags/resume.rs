//! On resume: the saved configuration, and every flag given checked against it.

use std::fmt::Debug;
use std::path::Path;

use burn_dcp::StrategyKind;

use super::build::config_from_args;
use super::TrainFlags;
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::files::read_json;

impl TrainFlags {
    /// The configuration of the run saved in `dir` (its `config.json`), `--steps` the new total;
    /// every other flag given must agree with it (an error names the flag and both values).
    pub fn resume(&self, dir: &Path) -> Result<TrainConfig, TrainError> {
        resumed_config(self, dir)
    }
}

/// On resume: the saved config, with `--steps` as the new total; any other flag must agree.
fn resumed_config(args: &TrainFlags, dir: &Path) -> Result<TrainConfig, TrainError> {
    let saved: TrainConfig = read_json(&dir.join("config.json"))?;
    let mut config = saved.clone();
    if let Some(steps) = args.steps {
        config.steps = steps;
    }
    // Waiting for the device at each phase changes when work runs, not what it computes.
    config.sync_phases = args.sync_phases;
    // Evaluating a saved run trains nothing.
    config.eval_only = args.eval_only;
    // Planning ahead changes when plans are made, not what they are.
    if let Some(plan_ahead) = args.plan_ahead {
        config.plan_ahead = plan_ahead;
    }
    let given = config_from_args(args)?;
    // Emulated links change when messages arrive, not what they hold: this run's flags decide.
    config.emulate_links = given.emulate_links;
    // Settings a given flag takes from this run, the saved value otherwise.
    macro_rules! this_run_decides {
        ($($field:ident),*) => {$(
            if args.$field.is_some() {
                config.$field = given.$field;
            }
        )*};
    }
    // When checkpoints are written, how many are kept, in what messages and how long their
    // waits may take changes no result; the pipeline schedule the order of the passes, not
    // their results.
    this_run_decides!(
        checkpoint_every,
        keep_checkpoints,
        checkpoint_chunk_bytes,
        checkpoint_timeout_secs,
        pp_schedule
    );
    // What the backward recomputes changes memory and time, not results; the master weights
    // and the optimizer's moments are f32 whatever the precision: a resumed run may compute in
    // another one.
    this_run_decides!(recompute, precision);
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
    let checks: [(&str, bool, Value); 22] = [
        ("--corpus", args.corpus.is_some(), |c| c.corpus.clone()),
        ("--data-path", args.data_path.is_some(), |c| {
            c.data_path.join(" ")
        }),
        ("--eod-token", args.eod_token.is_some(), |c| {
            c.eod_token.map_or("none".into(), |id| id.to_string())
        }),
        ("--token-dtype", args.token_dtype.is_some(), |c| {
            c.token_dtype.clone()
        }),
        ("--tokenizer-file", args.tokenizer_file.is_some(), |c| {
            c.tokenizer_file.clone().unwrap_or("none".into())
        }),
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
        ("--vpp", args.vpp.is_some(), |c| c.vpp.to_string()),
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
        (
            "--model-config / --hf-checkpoint",
            args.model_config.is_some() || args.hf_checkpoint.is_some(),
            |c| format!("{:?}", c.architecture),
        ),
        ("--rope-theta", args.rope_theta.is_some(), |c| {
            format!("{:?}", c.rope_theta)
        }),
        ("--rope-scaling", args.rope_scaling.is_some(), |c| {
            format!("{:?}", c.rope_scaling)
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

/// `Some` of both shown (`{:?}`) when `given` and `saved` differ.
fn differ<T: PartialEq + Debug>(given: &T, saved: &T) -> Option<(String, String)> {
    (given != saved).then(|| (format!("{given:?}"), format!("{saved:?}")))
}
