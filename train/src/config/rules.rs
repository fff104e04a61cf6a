//! The rules of a [`TrainConfig`] ([`TrainConfig::validate`]): each names the values it
//! refuses.

use burn_dcp::comm::{MAX_IN_PROCESS_RANKS, MAX_TIMEOUT};
use burn_dcp::heads::{HeadParts, Heads};
use burn_dcp::kernels::MaskSpec;
use burn_dcp::mesh::PipelineError;
use burn_dcp::{Strategy, StrategyKind};
use burn_dcp_datasets::MaskPolicy;

use super::*;
use crate::error::TrainError;

impl TrainConfig {
    /// Checks the rules, naming the values. In order: the mesh, the schedule, the model and
    /// the strategy on it, the limits, dynamic CP, the topology, DCP, the mask.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.mesh_shape()
            .validate(MAX_IN_PROCESS_RANKS)
            .map_err(|e| TrainError::Config(format!("{e} (in-process ranks are threads)")))?;
        self.validate_schedule()?;
        self.validate_parallelism()?;
        self.validate_limits()?;
        if let TrainMode::Dynamic { settings, inner } = &self.mode {
            self.validate_dynamic(settings, inner)?;
        }
        self.group_topology()?;
        self.validate_dcp()?;
        self.validate_data()?;
        self.validate_mask()
    }

    /// `--data-path` and what goes with it (the files themselves are read when the data load).
    fn validate_data(&self) -> Result<(), TrainError> {
        use burn_dcp_datasets::{indexed::TokenType, DataPath};
        TokenType::parse_flat(&self.token_dtype).map_err(|e| TrainError::Config(e.to_string()))?;
        if self.data_path.is_empty() {
            if let Some(eod) = self.eod_token {
                return Err(TrainError::Config(format!(
                    "--eod-token {eod} ends the documents of a flat token file: it needs --data-path"
                )));
            }
            return Ok(());
        }
        DataPath::parse(&self.data_path).map_err(|e| TrainError::Config(e.to_string()))?;
        if let Some(recut) = &self.lengths_from {
            return Err(TrainError::Config(format!(
                "--lengths-from {recut} recuts a text corpus; --data-path reads its documents as                  written"
            )));
        }
        if self.corpus != "default" {
            return Err(TrainError::Config(format!(
                "--corpus {} and --data-path {}: give one source of training data",
                self.corpus,
                self.data_path.join(" ")
            )));
        }
        Ok(())
    }

    /// Learning rate, timeout, steps, sequence length and the global batch.
    fn validate_schedule(&self) -> Result<(), TrainError> {
        if !self.learning_rate.is_finite() || self.learning_rate <= 0.0 || self.learning_rate > 1.0
        {
            return Err(TrainError::Config(format!(
                "learning rate {} must be a finite number in (0, 1]",
                self.learning_rate
            )));
        }
        self.optimizer.validate()?;
        self.lr_schedule.validate(self.learning_rate, self.steps)?;
        if let Some(max) = self.clip_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return Err(TrainError::Config(format!(
                "--clip-grad-norm {max} must be a positive number"
            )));
        }
        if self.eval_every == Some(0) || self.eval_tokens == 0 {
            return Err(TrainError::Config(format!(
                "--eval-every {:?} and --eval-tokens {} must be at least 1",
                self.eval_every, self.eval_tokens
            )));
        }
        if self.checkpoint_every == Some(0) || self.keep_checkpoints == 0 {
            return Err(TrainError::Config(format!(
                "--checkpoint-every {:?} and --keep-checkpoints {} must be at least 1",
                self.checkpoint_every, self.keep_checkpoints
            )));
        }
        if !(1..=MAX_CHUNK_BYTES).contains(&self.checkpoint_chunk_bytes) {
            return Err(TrainError::Config(format!(
                "--checkpoint-chunk-bytes {} must be between 1 and {MAX_CHUNK_BYTES} (MPI's \
                 largest message)",
                self.checkpoint_chunk_bytes
            )));
        }
        for (name, secs) in [
            ("timeout", self.timeout_secs),
            ("--checkpoint-timeout-secs", self.checkpoint_timeout_secs),
        ] {
            if secs == 0 || secs > MAX_TIMEOUT.as_secs() {
                return Err(TrainError::Config(format!(
                    "{name} {secs} s must be between 1 and {} s (a week)",
                    MAX_TIMEOUT.as_secs()
                )));
            }
        }
        if self.steps == 0 || self.steps.checked_mul(self.micro_batches).is_none() {
            return Err(TrainError::Config(format!(
                "steps {} must be at least 1, and steps × micro-batches ({}) must not overflow",
                self.steps, self.micro_batches
            )));
        }
        if self.seq_len > MAX_SEQ_LEN {
            return Err(TrainError::Config(format!(
                "seq_len {} exceeds the limit of {MAX_SEQ_LEN} tokens per micro-batch (token positions are 32-bit)",
                self.seq_len
            )));
        }
        if self.micro_batches == 0 || !self.micro_batches.is_multiple_of(self.dp) {
            return Err(TrainError::Config(format!(
                "the global batch of {} micro-batches must be a positive multiple of dp {}",
                self.micro_batches, self.dp
            )));
        }
        if self.seq_len < 2 {
            return Err(TrainError::Config(format!(
                "seq_len {} must be at least 2 tokens",
                self.seq_len
            )));
        }
        Ok(())
    }

    /// The model's shape under TP and PP, then the strategy on the heads of one TP rank:
    /// auto's candidates, or the static strategy on the CP group.
    fn validate_parallelism(&self) -> Result<(), TrainError> {
        let model = self.model_shape()?;
        let heads = self.rank_heads(&model)?;
        burn_dcp_models::tensor_parallel::validate_tp(&gpt_of_shape(&model), self.tp)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        self.mesh_shape()
            .validate_pipeline(model.n_layers, self.micro_batches)
            .map_err(|e| {
                let message = e.naming_stages(&format!("--pp {}", self.pp));
                TrainError::Config(match e {
                    PipelineError::Layers { .. } => message,
                    PipelineError::MicroBatches { .. } => {
                        format!("{message}: give --micro-batches ≥ pp × dp")
                    }
                })
            })?;
        self.validate_vpp(model.n_layers)?;
        match &self.mode {
            TrainMode::Static { strategy, .. } => {
                static_strategy(*strategy)?;
                strategy.validate_mesh(self.cp)?;
                strategy
                    .validate_heads(heads.heads(), heads.kv_heads(), self.cp)
                    .map_err(|e| {
                        TrainError::Config(format!("{e} (the heads of one TP rank of {})", self.tp))
                    })?;
            }
            TrainMode::Auto { settings, .. } => self.validate_auto(settings, heads)?,
            // DCP runs on any heads; dynamic CP's groups are checked with its settings.
            TrainMode::Dcp(_) | TrainMode::Dynamic { .. } => {}
        }
        Ok(())
    }

    /// `--vpp`: chunks of whole layers, on the interleaved 1F1B schedule of a real pipeline,
    /// over units that come in whole rounds of `pp` (Megatron-LM's rule; a plan whose step has
    /// another count of units is refused at that step).
    fn validate_vpp(&self, layers: usize) -> Result<(), TrainError> {
        if self.vpp == 1 {
            return Ok(());
        }
        let chunks = self.pp.saturating_mul(self.vpp);
        let rule = if self.vpp == 0 {
            "must be at least 1".to_string()
        } else if self.pp < 2 {
            "interleaves the chunks of a pipeline: it needs --pp 2 or more".to_string()
        } else if self.pp_schedule == PpSchedule::Gpipe {
            "runs the interleaved 1F1B schedule: --pp-schedule gpipe has no virtual stages".into()
        } else if !layers.is_multiple_of(chunks) {
            format!(
                "splits the {layers} layers into --pp {} × --vpp {} = {chunks} chunks: they must divide",
                self.pp, self.vpp
            )
        } else if !(self.micro_batches / self.dp).is_multiple_of(self.pp) {
            format!(
                "interleaves rounds of --pp {} micro-batches: the {} micro-batches of each of the \
                 --dp {} replicas must be a multiple of it (Megatron-LM's rule)",
                self.pp,
                self.micro_batches / self.dp,
                self.dp
            )
        } else {
            return Ok(());
        };
        Err(TrainError::Config(format!("--vpp {} {rule}", self.vpp)))
    }

    /// Auto's candidates (with the `heads` of one TP rank), and no other strategy setting.
    fn validate_auto(&self, auto: &AutoSettings, heads: Heads) -> Result<(), TrainError> {
        if auto.candidates.is_empty() {
            return Err(TrainError::Config(
                "strategy auto needs at least one candidate (--auto-candidates)".into(),
            ));
        }
        if let Some(other) = auto.candidates.iter().find(|c| !c.is_candidate()) {
            return Err(TrainError::Config(format!(
                "strategy auto cannot run {other}: its candidates are {}",
                candidate_names()
            )));
        }
        // Every candidate but Ulysses runs on any group; Ulysses needs the heads to split.
        if auto.candidates.iter().all(|c| *c == StrategyKind::Ulysses) {
            if let Err(e) = heads.split_queries(HeadParts::Ulysses(self.cp)) {
                return Err(TrainError::Config(format!(
                    "--auto-candidates ulysses alone cannot run on cp {}: {e} (the query heads of a TP rank)",
                    self.cp
                )));
            }
        }
        Ok(())
    }

    /// Plan-ahead depth and micro-batches per step.
    fn validate_limits(&self) -> Result<(), TrainError> {
        if self.plan_ahead == 0 || self.plan_ahead > MAX_PLAN_AHEAD {
            return Err(TrainError::Config(format!(
                "--plan-ahead {} must be between 1 and {MAX_PLAN_AHEAD} steps",
                self.plan_ahead
            )));
        }
        if self.micro_batches > MAX_MICRO_BATCHES {
            return Err(TrainError::Config(format!(
                "{} micro-batches per step exceed the limit of {MAX_MICRO_BATCHES}",
                self.micro_batches
            )));
        }
        self.length_sampler()?;
        Ok(())
    }

    /// DCP's block and stages (where the mode plans blocks).
    fn validate_dcp(&self) -> Result<(), TrainError> {
        if let Some(dcp) = self.mode.dcp() {
            if dcp.block == 0 || dcp.block > self.seq_len.max(1) {
                return Err(TrainError::Config(format!(
                    "--block {} must be between 1 and --seq-len {}",
                    dcp.block, self.seq_len
                )));
            }
            burn_dcp::planner::dcp::DcpConfig {
                stages: dcp.stages,
                ..Default::default()
            }
            .validate()
            .map_err(|e| TrainError::Config(format!("--stages {}: {e}", dcp.stages)))?;
        }
        Ok(())
    }

    /// The mask must keep a token from seeing its own label.
    fn validate_mask(&self) -> Result<(), TrainError> {
        if let MaskPolicy::Same(MaskSpec::Full) = self.mask_policy()? {
            return Err(TrainError::Config(
                "mask full lets every token attend the tokens after it, including its own label: a GPT trained as a language model needs a causal-family mask (causal, sliding:W, lambda, blockwise, shared-question or mixed)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Dynamic CP: the settings, the inner strategy on every group size, and the longest packed
    /// sequence (`seq_len` tokens) fitting the pool.
    fn validate_dynamic(
        &self,
        settings: &DynamicSettings,
        inner: &GroupStrategy,
    ) -> Result<(), TrainError> {
        let model = self.model_shape()?;
        let pool = self.pool_size();
        let heads = self.rank_heads(&model)?;
        if let GroupStrategy::Static { strategy, .. } = inner {
            static_strategy(*strategy)?;
        }
        settings.validate(
            pool,
            self.mode.group_strategy(),
            heads.heads(),
            heads.kv_heads(),
        )?;
        burn_dcp::planner::dynamic::min_cp_size_for(
            self.seq_len,
            &settings.scheduler(pool),
            self.mode.layout(),
        )
        .map(|_| ())
        .map_err(|e| {
            TrainError::Config(format!(
                "--seq-len {} makes packed sequences of up to that length: {e}",
                self.seq_len
            ))
        })
    }
}

/// A static strategy (of a static mode or dynamic CP's groups) is never DCP: DCP plans blocks
/// with its own settings ([`TrainMode::Dcp`], [`GroupStrategy::Dcp`]).
fn static_strategy(strategy: Strategy) -> Result<(), TrainError> {
    if strategy == Strategy::Dcp {
        return Err(TrainError::Config(
            "a static strategy cannot be dcp: DCP plans blocks with its settings (TrainMode::Dcp, GroupStrategy::Dcp; --block, --stages)".into(),
        ));
    }
    Ok(())
}

/// Auto's candidates' names, comma-separated.
fn candidate_names() -> String {
    StrategyKind::names(&StrategyKind::ALL)
}
