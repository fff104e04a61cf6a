//! Long-context GPT training with context parallelism on in-process ranks: the engine of the
//! `gpt_longctx` example, shared with the tests.
//!
//! World: `tp × cp × dp × pp` ranks (threads; `burn_dcp::mesh`). Each optimizer step processes
//! `micro_batches` packed micro-batches of `seq_len` tokens (the global batch). Every (TP rank,
//! stage) position plans the same step over its DP × CP pool; TP shards the model inside each
//! rank's work (`TpGpt`), PP runs the plan's sub-steps through the stages ([`pipeline`]). One path
//! for every strategy:
//!
//! ```text
//! TrainData ──step_batches──▶ the step's MicroBatches ──plan_step──▶ StepPlan (plan.rs)
//!   (datasets' packing)        (same data for any cp/dp)   static: replica d runs micro-batches
//!                                                           d, d+dp, … on ranks d·cp..(d+1)·cp;
//!                                                           dynamic: the scheduler's groups;
//!                                                           dcp: block plans; auto: per
//!                                                           micro-batch the fastest estimate
//! StepPlan ──per planned batch this rank is in──▶ gather its sequences (one MicroBatch)
//!          ──RankShard::of(placement, rank)──▶ tokens, global positions, labels
//!          ──set_context(group, placement, masks)──▶ GPT on ContextParallel<Autodiff<B>>
//!          ──ModuleOps::attention──▶ the group's strategy (burn-dcp) ──▶ kernels
//! ```
//!
//! The loss of a planned batch is the *sum* of its tokens' cross-entropy divided by the step's
//! global label count, so gradients summed over all ranks (the all-reduce) are exactly the
//! gradients of the global mean loss, whatever the plan.

pub mod dynamic;
pub mod error;
pub mod groups;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod plan;
pub mod tensor_parallel;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::prelude::{Int, Tensor, TensorData};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::backend::ContextParallel;
use burn_dcp::comm::{
    panic_message, Comm, CommError, CommStats, LinkBytes, Payload, MAX_IN_PROCESS_RANKS,
    MAX_TIMEOUT,
};
use burn_dcp::kernels::{FlashOps, MaskSpec, MicroBatch};
use burn_dcp::mesh::MeshShape;
use burn_dcp::planner::auto::AutoCandidate;
use burn_dcp::{CpError, Layout, Strategy};
use burn_dcp_datasets::corpus::{open_documents, Document};
use burn_dcp_datasets::tokenizer::{cache_dir, default_tokenized, files_identity, tokenize_cached};
use burn_dcp_datasets::{pack_corpus, MaskPolicy, PackingConfig, TokenizedCorpus, Tokenizer};
use burn_dcp_models::{GptConfig, TpGpt};
use serde::{Deserialize, Serialize};

pub use dynamic::{sequence_work, CpSizes, DynamicSettings};
pub use error::TrainError;
pub use groups::RankGroups;
pub use metrics::{Progress, StepMetrics, StepObserver};
pub use model::{InputRows, ModelShape, PipelineStage, ShardInput, TrainModel};
pub use pipeline::PpSchedule;
use pipeline::{stage_passes, Pass, StageRun};
pub use plan::{
    plan_step, AutoRecord, PlannedBatch, RankWork, ScheduleStats, StepPlan, StepSequences,
};
pub use tensor_parallel::TpGroup;

/// The training backend over an inner backend `B` (burn Flex on the CPU, or a cubecl backend with
/// the kernels): the decorator over autodiff over `B`.
pub type CpTrain<B> = ContextParallel<burn::backend::Autodiff<B>>;

/// The model one rank trains: its TP shard of the GPT (the whole GPT at tp 1).
pub type TrainGpt<B> = TpGpt<CpTrain<B>>;

/// The default training backend: [`CpTrain`] over burn Flex (CPU).
pub type TrainBackend = CpTrain<burn::backend::Flex>;

/// Everything that defines a run (written to `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub cp: usize,
    pub dp: usize,
    /// Tensor-parallel ranks (`--tp`; innermost axis of the mesh, see `burn_dcp::mesh`).
    #[serde(default = "default_one")]
    pub tp: usize,
    /// Pipeline stages (`--pp`; outermost axis of the mesh).
    #[serde(default = "default_one")]
    pub pp: usize,
    /// The pipeline's schedule (`--pp-schedule`).
    #[serde(default)]
    pub pp_schedule: PpSchedule,
    pub strategy: Strategy,
    pub layout: Layout,
    /// Tokens per packed micro-batch (one DP replica's CP group processes one at a time).
    pub seq_len: usize,
    /// Micro-batches per optimizer step over all DP replicas (the global batch).
    pub micro_batches: usize,
    pub steps: usize,
    pub model_size: String,
    pub seed: u64,
    pub learning_rate: f64,
    /// Mask policy: `causal`, `lambda`, `blockwise`, `shared-question` (DCP defaults), `mixed`
    /// (one of those per sequence), `full`, or a spec such as `lambda:64,4096`.
    pub mask: String,
    /// `default` (Vim help files, Debian vim-runtime), `builtin` (burn-dcp-train's README and sources), or a
    /// directory of text files / a `.jsonl` file.
    pub corpus: String,
    /// `gpt2` (r50k BPE) or `bytes`.
    pub tokenizer: String,
    pub timeout_secs: u64,
    /// `--strategy dynamic`: the `dp × cp` ranks form one pool and every sequence gets a CP group
    /// per step (then `strategy` and `layout` are the strategy inside each group).
    #[serde(default)]
    pub dynamic: Option<DynamicSettings>,
    /// Steps planned ahead on a background thread (`--plan-ahead`).
    #[serde(default = "default_plan_ahead")]
    pub plan_ahead: usize,
    /// `--strategy dcp`: the block size and stages of each micro-batch's DCP plan.
    #[serde(default)]
    pub dcp: Option<DcpSettings>,
    /// Topology preset the ranks model (`--topology`): DCP plans for it, and every strategy's
    /// bytes are counted per link class.
    #[serde(default = "default_topology")]
    pub topology: String,
    /// Virtual nodes the world's ranks are spread over (`--nodes`; consecutive ranks share one).
    #[serde(default = "default_nodes")]
    pub nodes: usize,
    /// `--strategy auto`: every micro-batch runs the strategy with the lowest estimated attention
    /// time on the topology (`burn_dcp::planner::auto`): ring-zigzag, ulysses, usp, all-gather,
    /// dynamic (groups inside the replica) or dcp (planned with `dcp`'s settings). `strategy` and
    /// `layout` then hold ring and zigzag, the static candidates' layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto: Option<AutoSettings>,
    /// The shape of a model other than the GPT of `model_size` (planning and checks read it);
    /// `None`: the GPT's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_shape: Option<ModelShape>,
}

impl Default for TrainConfig {
    /// The one home of the defaults (what `gpt_longctx` runs without flags): cp 4 ring-zigzag,
    /// micro-batches of ≤ 4096 tokens of the default corpus in byte tokens, 2 per step, 30 steps
    /// of AdamW at 3e-3, causal masks, the tiny GPT.
    fn default() -> Self {
        Self {
            cp: 4,
            dp: 1,
            tp: 1,
            pp: 1,
            pp_schedule: PpSchedule::default(),
            strategy: Strategy::Ring,
            layout: Layout::Zigzag,
            seq_len: 4096,
            micro_batches: 2,
            steps: 30,
            model_size: "tiny".into(),
            seed: 0,
            learning_rate: 3e-3,
            mask: "causal".into(),
            corpus: "default".into(),
            tokenizer: "bytes".into(),
            timeout_secs: 60,
            dynamic: None,
            plan_ahead: DEFAULT_PLAN_AHEAD,
            dcp: None,
            topology: default_topology(),
            nodes: default_nodes(),
            auto: None,
            model_shape: None,
        }
    }
}

/// Settings of `--strategy auto`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AutoSettings {
    /// The strategies it may choose (`--auto-candidates`; default all).
    pub candidates: Vec<AutoCandidate>,
}

/// Settings of `--strategy dcp`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DcpSettings {
    /// Tokens per block (`--block`).
    pub block: usize,
    /// Communication stages of each plan (`--stages`).
    pub stages: usize,
}

fn default_topology() -> String {
    "a100-p4d".into()
}

fn default_nodes() -> usize {
    1
}

fn default_one() -> usize {
    1
}

fn default_plan_ahead() -> usize {
    DEFAULT_PLAN_AHEAD
}

/// Steps planned ahead by default.
pub const DEFAULT_PLAN_AHEAD: usize = 2;

/// The most steps that may be planned ahead.
pub const MAX_PLAN_AHEAD: usize = 64;

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
        if let Some(settings) = &self.dynamic {
            self.validate_dynamic(settings)?;
        }
        self.group_topology()?;
        self.validate_dcp()?;
        self.validate_mask()
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
        if self.timeout_secs == 0 || self.timeout_secs > MAX_TIMEOUT.as_secs() {
            return Err(TrainError::Config(format!(
                "timeout {} s must be between 1 and {} s (a week)",
                self.timeout_secs,
                MAX_TIMEOUT.as_secs()
            )));
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
        burn_dcp_models::tensor_parallel::validate_tp(&gpt_of_shape(&model), self.tp)
            .map_err(TrainError::Config)?;
        self.mesh_shape()
            .validate_pipeline(model.n_layers, self.micro_batches)?;
        let (heads, kv_heads) = self.rank_heads(&model);
        if let Some(auto) = &self.auto {
            self.validate_auto(auto, heads)?;
        }
        if self.dynamic.is_none() {
            self.strategy.validate_mesh(self.cp)?;
            self.strategy
                .validate_heads(heads, kv_heads, self.cp)
                .map_err(|e| {
                    TrainError::Config(format!("{e} (the heads of one TP rank of {})", self.tp))
                })?;
        }
        Ok(())
    }

    /// Auto's candidates (with `heads` query heads per TP rank), and no other strategy setting.
    fn validate_auto(&self, auto: &AutoSettings, heads: usize) -> Result<(), TrainError> {
        if auto.candidates.is_empty() {
            return Err(TrainError::Config(
                "strategy auto needs at least one candidate (--auto-candidates)".into(),
            ));
        }
        // Every candidate but Ulysses runs on any group; Ulysses needs the heads to split.
        if auto.candidates.iter().all(|c| *c == AutoCandidate::Ulysses)
            && !heads.is_multiple_of(self.cp)
        {
            return Err(TrainError::Config(format!(
                "--auto-candidates ulysses alone cannot run on cp {}: Ulysses needs the query heads of a TP rank ({heads}) to be a multiple of the CP size",
                self.cp
            )));
        }
        if self.dynamic.is_some()
            || self.strategy != Strategy::Ring
            || self.layout != Layout::Zigzag
        {
            return Err(TrainError::Config(format!(
                "strategy auto chooses per micro-batch among ring-zigzag, ulysses, usp, all-gather, dynamic and dcp: it cannot be combined with dynamic settings {:?}, strategy {} or layout {}",
                self.dynamic, self.strategy, self.layout
            )));
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
        Ok(())
    }

    /// DCP settings exactly with strategies dcp and auto; their block and stages.
    fn validate_dcp(&self) -> Result<(), TrainError> {
        if (self.strategy == Strategy::Dcp || self.auto.is_some()) != self.dcp.is_some() {
            return Err(TrainError::Config(format!(
                "strategy {} with DCP settings {:?}: strategies dcp and auto need them, the others none",
                self.strategy_name(),
                self.dcp
            )));
        }
        if let Some(dcp) = &self.dcp {
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
    fn validate_dynamic(&self, settings: &DynamicSettings) -> Result<(), TrainError> {
        let model = self.model_shape()?;
        let pool = self.pool_size();
        let (heads, kv_heads) = self.rank_heads(&model);
        settings.validate(pool, self.strategy, heads, kv_heads)?;
        burn_dcp::planner::dynamic::min_cp_size_for(
            self.seq_len,
            &settings.scheduler(pool),
            self.layout,
        )
        .map(|_| ())
        .map_err(|e| {
            TrainError::Config(format!(
                "--seq-len {} makes packed sequences of up to that length: {e}",
                self.seq_len
            ))
        })
    }

    /// The strategy as `--strategy` names it: `auto`, `dynamic`, `ring-zigzag` (ring with its
    /// layout), `ulysses`, `usp`, `all-gather` or `dcp`.
    pub fn strategy_name(&self) -> String {
        if self.auto.is_some() {
            "auto".into()
        } else if self.dynamic.is_some() {
            "dynamic".into()
        } else {
            static_strategy_name(self.strategy, self.layout)
        }
    }

    /// The GPT of `model_size` (with the tokenizer's vocabulary).
    pub fn model_config(&self) -> Result<GptConfig, TrainError> {
        GptConfig::sized(&self.model_size, self.tokenizer()?.vocab_size())
            .map_err(TrainError::Config)
    }

    /// The shape of the model trained: `model_shape`, or the GPT's of `model_size`.
    pub fn model_shape(&self) -> Result<ModelShape, TrainError> {
        match &self.model_shape {
            Some(shape) => {
                shape.validate().map_err(TrainError::Config)?;
                Ok(shape.clone())
            }
            None => Ok(ModelShape::from(&self.model_config()?)),
        }
    }

    /// What a checkpoint records of the model (and a resume compares): the GPT's configuration,
    /// or the custom model's shape, as JSON.
    pub fn model_identity(&self) -> Result<serde_json::Value, TrainError> {
        let value = match &self.model_shape {
            Some(shape) => serde_json::to_value(shape),
            None => serde_json::to_value(self.model_config()?),
        };
        value.map_err(|e| TrainError::Malformed(format!("the model's configuration: {e}")))
    }

    pub fn mask_policy(&self) -> Result<MaskPolicy, TrainError> {
        MaskPolicy::parse(&self.mask).map_err(|e| TrainError::Config(e.to_string()))
    }

    pub fn tokenizer(&self) -> Result<Tokenizer, TrainError> {
        Tokenizer::from_name(&self.tokenizer).map_err(|e| TrainError::Config(e.to_string()))
    }

    /// tp × cp × dp × pp ranks.
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// The DP × CP ranks of one (TP, PP) position: the pool plans (and dynamic CP) schedule over.
    pub fn pool_size(&self) -> usize {
        self.cp * self.dp
    }

    /// The mesh of the world (`burn_dcp::mesh`).
    pub fn mesh_shape(&self) -> MeshShape {
        MeshShape {
            tp: self.tp,
            cp: self.cp,
            dp: self.dp,
            pp: self.pp,
        }
    }

    /// The query and kv heads one TP rank holds (kv heads replicated when tp > kv heads): what
    /// its CP attention runs on.
    pub fn rank_heads(&self, model: &ModelShape) -> (usize, usize) {
        self.mesh_shape()
            .heads_per_tp_rank(model.n_heads, model.n_kv_heads)
    }

    /// World ranks per virtual node (`--nodes` must divide the world).
    pub fn ranks_per_node(&self) -> Result<usize, CpError> {
        let world = self.world_size();
        if self.nodes == 0 || !world.is_multiple_of(self.nodes) {
            return Err(CpError::Config(format!(
                "--nodes {} must divide the {world} ranks (tp × cp × dp × pp)",
                self.nodes
            )));
        }
        Ok(world / self.nodes)
    }

    /// The topology of one static CP group (ranks `d·cp .. (d+1)·cp`) as its ranks sit on the
    /// world's nodes: a group must fill whole nodes or sit inside one.
    pub fn group_topology(&self) -> Result<burn_dcp::planner::topology::Topology, CpError> {
        let world_per_node = self.ranks_per_node()?;
        // TP is the innermost axis: a node holds whole TP groups, and world_per_node / tp ranks
        // of each CP group.
        if !world_per_node.is_multiple_of(self.tp) {
            return Err(CpError::Config(format!(
                "a node of {world_per_node} ranks (--nodes {}) must hold whole TP groups of {}",
                self.nodes, self.tp
            )));
        }
        let per_node = world_per_node / self.tp;
        let nodes = if self.cp.is_multiple_of(per_node) {
            self.cp / per_node
        } else if per_node.is_multiple_of(self.cp) {
            1
        } else {
            return Err(CpError::Config(format!(
                "a CP group of {} ranks neither fills whole nodes of {per_node} ranks nor fits in one (--nodes {})",
                self.cp, self.nodes
            )));
        };
        burn_dcp::planner::topology::Topology::for_ranks(&self.topology, nodes, self.cp)
            .map_err(|e| CpError::Config(format!("--topology {}: {e}", self.topology)))
    }
}

/// The GPT of a shape (the TP rules of `burn_dcp_models` are stated on it).
fn gpt_of_shape(shape: &ModelShape) -> GptConfig {
    GptConfig::new(
        shape.vocab_size,
        shape.d_model,
        shape.n_layers,
        shape.n_heads,
        shape.n_kv_heads,
        shape.d_ff,
    )
    .with_tied_embeddings(shape.tied_embeddings)
}

/// A static strategy's name in `strategy_counts`: ring with its layout (`ring-zigzag`), the
/// others by name (`usp` without its degrees).
pub fn static_strategy_name(strategy: Strategy, layout: Layout) -> String {
    match strategy {
        Strategy::Ring => format!("ring-{layout}"),
        Strategy::Usp { .. } => "usp".into(),
        other => other.to_string(),
    }
}

/// The most micro-batches one optimizer step may take.
pub const MAX_MICRO_BATCHES: usize = 1 << 20;

/// The most tokens a packed micro-batch may hold (positions are stored as `u32`).
pub const MAX_SEQ_LEN: usize = u32::MAX as usize;

/// The `builtin` corpus: this crate's own README and sources (small, always at hand; for tests and
/// examples that must not depend on installed files).
pub fn builtin_documents() -> Vec<Document> {
    [
        ("README.md", include_str!("../README.md")),
        ("lib.rs", include_str!("lib.rs")),
        ("plan.rs", include_str!("plan.rs")),
        ("pipeline.rs", include_str!("pipeline.rs")),
        ("groups.rs", include_str!("groups.rs")),
        ("model.rs", include_str!("model.rs")),
        ("launch.rs", include_str!("launch.rs")),
    ]
    .iter()
    .map(|(name, text)| Document {
        name: name.to_string(),
        text: text.to_string(),
    })
    .collect()
}

/// The training data: the corpus tokenized and packed once into micro-batches of at most
/// `seq_len` tokens (long documents split; see `burn_dcp_datasets::packing`). Step `s` uses
/// micro-batches `(s−1)·n .. s·n` (cyclically), `n` = micro-batches per step, so any cp/dp split
/// and a resumed run see the same data.
pub struct TrainData {
    batches: Vec<MicroBatch>,
}

impl TrainData {
    pub fn load(config: &TrainConfig) -> Result<Self, TrainError> {
        let tokenizer = config.tokenizer()?;
        let corpus = match config.corpus.as_str() {
            "builtin" => {
                TokenizedCorpus::tokenize(builtin_documents().into_iter().map(Ok), tokenizer)
            }
            "default" => default_tokenized(tokenizer),
            path => {
                let identity = format!("{path}:{}", files_identity(&[path.into()]));
                tokenize_cached(&identity, || open_documents(path), tokenizer, &cache_dir())
            }
        }
        .map_err(|e| TrainError::Data(e.to_string()))?;
        let packing = PackingConfig {
            max_tokens_per_rank: config.seq_len,
            ranks: 1,
            max_seq_len: None,
            seed: config.seed,
        };
        let packing = pack_corpus(&corpus, &packing, &config.mask_policy()?)
            .map_err(|e| TrainError::Data(e.to_string()))?;
        let batches = packing.micro_batches;
        if batches.is_empty() {
            return Err(TrainError::Data(format!(
                "corpus '{}' holds no tokens",
                config.corpus
            )));
        }
        if batches.iter().all(|b| b.label_count() == 0) {
            return Err(TrainError::Data(format!(
                "corpus '{}' holds no token with a next token to predict (every document is a single token)",
                config.corpus
            )));
        }
        Ok(Self { batches })
    }

    /// The micro-batches of optimizer step `step` (1-based).
    pub fn step_batches(&self, step: usize, count: usize) -> Vec<&MicroBatch> {
        (0..count)
            .map(|i| &self.batches[((step - 1) * count + i) % self.batches.len()])
            .collect()
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}

fn int_tensor<B: burn::prelude::Backend>(values: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// Sums every parameter's gradient over the pool (zeros where a rank has none), in the model's
/// parameter order, which is the same on every rank of the pool; some parameters are then also
/// summed over another group (`extra`).
struct AllReduceGradients<'a, B: AutodiffBackend> {
    grads: GradientsParams,
    comm: &'a Comm,
    /// Parameters whose gradient is also summed over a group: the replicated kv projections over
    /// their TP replicas (tp > kv heads), the tied embedding over the first and last stage.
    extra: Vec<(Vec<ParamId>, &'a Comm)>,
    error: Option<CommError>,
    /// Parameters (in visiting order) whose local gradient on this rank is not finite.
    non_finite: Vec<usize>,
    visited: usize,
    phantom: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for AllReduceGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_some() {
            return;
        }
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| param.val().inner().zeros_like());
        let device = grad.device();
        // One flag read back; the gradient itself stays on its device.
        if !all_finite(&grad) {
            self.non_finite.push(self.visited);
        }
        self.visited += 1;
        let summed = self.extra.iter().fold(
            self.comm.all_reduce(Payload::device(grad)),
            |summed, (ids, comm)| {
                summed.and_then(|summed| match ids.contains(&param.id) {
                    true => comm.all_reduce(summed),
                    false => Ok(summed),
                })
            },
        );
        let summed = summed.and_then(|summed| {
            summed
                .into_tensor::<B::InnerBackend, D>(&device)
                .map_err(|message| CommError::Invalid {
                    group: self.comm.name().to_string(),
                    message: format!("gradient all-reduce: {message}"),
                })
        });
        match summed {
            Ok(summed) => self.grads.register(param.id, summed),
            Err(error) => self.error = Some(error),
        }
    }
}

/// Gradients of the global mean loss of step `step` (all-reduced over DP×CP), the loss and the
/// step's token count. The step is planned here, synchronously; training plans ahead on a
/// background thread and calls [`step_gradients_planned`].
pub fn step_gradients<B: FlashOps, M: TrainModel<CpTrain<B>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    data: &TrainData,
    step: usize,
    device: &B::Device,
) -> Result<(f64, GradientsParams, usize), CpError> {
    let plan = plan_step(config, data, step)?;
    let result = step_gradients_planned(model, groups, config, data, &plan, device)?;
    Ok((result.loss, result.grads, result.tokens))
}

/// One rank's step: the mean loss, the all-reduced gradients, the tokens, and what ran where.
pub struct StepResult {
    pub loss: f64,
    pub grads: GradientsParams,
    pub tokens: usize,
    pub stats: ScheduleStats,
}

/// Runs step `plan.step` by its plan: this rank's shard of every planned batch it is in, in the
/// batch's group, through the pipeline's stages on the pipeline schedule ([`pipeline`]; at pp 1
/// one forward and backward after the other); then the all-reduces of the gradients and the loss.
pub fn step_gradients_planned<B: FlashOps, M: TrainModel<CpTrain<B>>>(
    model: &M,
    groups: &RankGroups,
    config: &TrainConfig,
    data: &TrainData,
    plan: &StepPlan,
    device: &B::Device,
) -> Result<StepResult, CpError> {
    let step = plan.step;
    let batches = data.step_batches(step, config.micro_batches);
    let global_labels: usize = batches.iter().map(|b| b.label_count()).sum();
    if global_labels == 0 {
        return Err(CpError::Input(format!(
            "step {step}: its {} micro-batches hold no labelled token, so the mean loss is undefined; use more micro-batches per step or longer documents",
            batches.len()
        )));
    }
    let tokens = batches.iter().map(|b| b.tokens.len()).sum();
    let sequences = StepSequences::new(batches);
    groups.ensure(plan)?;
    if config.pp > 1 {
        check_stages_agree(&groups.mesh.pp, plan)?;
    }
    // The schedule's units are the plan's sub-steps: this rank's batch in each, if any.
    let me = groups.world.rank();
    let mut units: Vec<Option<&PlannedBatch>> = vec![None; plan.sub_step_ranges().len()];
    for planned in plan.batches_of(me) {
        units[planned.sub_step] = Some(planned);
    }
    let mut run = StageRun::new(model, groups, &sequences, global_labels, device);
    let passes = stage_passes(
        config.pp_schedule,
        groups.mesh.pp.rank(),
        config.pp,
        units.len(),
    );
    for pass in passes {
        match pass {
            Pass::Forward(unit) => {
                if let Some(planned) = units[unit] {
                    run.forward(unit, planned)?;
                }
            }
            Pass::Backward(unit) => {
                if units[unit].is_some() {
                    run.backward(unit)?;
                }
            }
        }
    }
    let (accumulator, loss_sum) = run.finish()?;
    let (loss, grads) = reduce_step(model, groups, step, accumulator, loss_sum, global_labels)?;
    Ok(StepResult {
        loss,
        grads,
        tokens,
        stats: plan.stats(groups.world.size()),
    })
}

/// All-reduces the accumulated gradients and the loss over the world; stops on non-finite values.
fn reduce_step<B: FlashOps, M: TrainModel<CpTrain<B>>>(
    model: &M,
    groups: &RankGroups,
    step: usize,
    mut accumulator: GradientsAccumulator<M>,
    loss_sum: f64,
    global_labels: usize,
) -> Result<(f64, GradientsParams), CpError> {
    let mut extra = Vec::new();
    if let Some(kv) = &groups.kv_replicas {
        extra.push((model.kv_param_ids(), kv));
    }
    if let (Some(id), Some(embedding)) = (model.tied_embedding_id(), &groups.embedding) {
        extra.push((vec![id], embedding));
    }
    let mut reducer = AllReduceGradients {
        grads: accumulator.grads(),
        comm: &groups.world,
        extra,
        error: None,
        non_finite: Vec::new(),
        visited: 0,
        phantom: std::marker::PhantomData,
    };
    model.visit(&mut reducer);
    if let Some(error) = reducer.error {
        return Err(error.into());
    }
    // Over the whole world: a non-finite gradient on one TP position stops every rank, named.
    check_finite(&groups.mesh.world, step, loss_sum, &reducer.non_finite)?;
    let mut total = groups
        .world
        .all_reduce(TensorData::new(vec![loss_sum], [1]).into())?;
    if groups.mesh.pp.size() > 1 {
        // Only the last stage computes losses: every stage gets their sum.
        total = groups.mesh.pp.all_reduce(total)?;
    }
    let total: f64 = total
        .into_host()
        .map_err(CpError::Input)?
        .to_vec::<f64>()
        .map_err(|e| CpError::Input(format!("{e:?}")))?[0];
    Ok((total / global_labels as f64, reducer.grads))
}

/// Stops the step with an error, rather than a hang or a wrong gradient, when the pipeline's stages
/// hold different plans for it (they compute them independently from the same configuration and
/// data, so this means the ranks were started inconsistently): every stage of a micro-batch must
/// run it on the same CP group, placement and strategy.
fn check_stages_agree(pp: &Comm, plan: &StepPlan) -> Result<(), CpError> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for batch in &plan.batches {
        (batch.sub_step, &batch.ranks, &batch.sequences).hash(&mut hasher);
        batch.strategy.hash(&mut hasher);
        batch.placement.hash(&mut hasher);
    }
    let fingerprint = format!("{:016x}", hasher.finish());
    let stages = pp.all_gather_control("pipeline plan check", fingerprint.clone().into_bytes())?;
    if let Some((stage, other)) = stages
        .iter()
        .enumerate()
        .find(|(_, f)| f.as_slice() != fingerprint.as_bytes())
    {
        return Err(CpError::Config(format!(
            "step {}: pipeline stage {} planned the step differently from stage {stage} (plan fingerprints {fingerprint} and {}): every stage of a micro-batch must run it on the same CP group",
            plan.step,
            pp.rank(),
            String::from_utf8_lossy(other)
        )));
    }
    Ok(())
}

fn all_finite<B: burn::prelude::Backend, const D: usize>(tensor: &Tensor<B, D>) -> bool {
    use burn::tensor::ElementConversion;
    tensor
        .clone()
        .is_finite()
        .all()
        .into_scalar()
        .elem::<bool>()
}

/// Stops the step on every rank when any rank's loss or gradients are not finite (NaN or ±∞),
/// naming the step and the ranks where they appeared (before the all-reduce spreads them).
fn check_finite(
    world: &Comm,
    step: usize,
    loss_sum: f64,
    non_finite_params: &[usize],
) -> Result<(), CpError> {
    let mut local = Vec::new();
    if !loss_sum.is_finite() {
        local.push(format!("loss sum {loss_sum}"));
    }
    if let Some(first) = non_finite_params.first() {
        local.push(format!(
            "gradients of {} parameter(s) (the first is parameter #{first} in the model's order)",
            non_finite_params.len()
        ));
    }
    let reports = world.all_gather_control("non-finite check", local.join(" and ").into_bytes())?;
    let bad: Vec<String> = reports
        .iter()
        .enumerate()
        .filter(|(_, report)| !report.is_empty())
        .map(|(rank, report)| format!("rank {rank}: {}", String::from_utf8_lossy(report)))
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    Err(CpError::Input(format!(
        "step {step}: non-finite values, training stopped ({})",
        bad.join("; ")
    )))
}

/// Where a run keeps its checkpoint.
pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// Saved training state besides the weights: the last completed step, and what the checkpoint
/// holds (absent in checkpoints written before these fields existed).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    pub step: usize,
    #[serde(default)]
    pub config: Option<TrainConfig>,
    /// The model's configuration ([`TrainConfig::model_identity`]).
    #[serde(default)]
    pub model: Option<serde_json::Value>,
}

/// The checkpoint to load from the run directory `dir`: `checkpoint/`, or `checkpoint.old/` when
/// a save was cut between its two renames (see `save_checkpoint`).
pub fn saved_checkpoint(dir: &Path) -> Result<PathBuf, TrainError> {
    let current = checkpoint_dir(dir);
    if current.join("state.json").is_file() {
        return Ok(current);
    }
    let previous = dir.join("checkpoint.old");
    if previous.join("state.json").is_file() {
        return Ok(previous);
    }
    Err(TrainError::Checkpoint(format!(
        "{} holds no checkpoint (no {})",
        dir.display(),
        current.join("state.json").display()
    )))
}

/// Checks that the run saved in `dir` can continue under `config` and returns its saved step: the
/// checkpoint never moves backwards (`config.steps` ≥ the saved step), and the saved model has
/// the shape `config` describes (config.json may have been edited).
pub fn check_resume(dir: &Path, config: &TrainConfig) -> Result<usize, TrainError> {
    let checkpoint = saved_checkpoint(dir)?;
    let state: TrainState = read_json(&checkpoint.join("state.json"))?;
    if config.steps < state.step {
        return Err(TrainError::Config(format!(
            "--steps {} is below the step {} of the checkpoint in {}: a checkpoint never moves backwards (use --steps {} or more, or --out to start a new run)",
            config.steps,
            state.step,
            checkpoint.display(),
            state.step
        )));
    }
    if let Some(saved) = &state.model {
        let wanted = config.model_identity()?;
        let differences = model_differences(saved, &wanted);
        if !differences.is_empty() {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint in {} holds a different model than the configuration asks for ({}): {}",
                checkpoint.display(),
                dir.join("config.json").display(),
                differences.join(", ")
            )));
        }
    }
    Ok(state.step)
}

/// `field: checkpoint X, configuration Y` for every field where the two models differ (compared
/// through their JSON form, so every field of the configuration counts).
fn model_differences(saved: &serde_json::Value, wanted: &serde_json::Value) -> Vec<String> {
    let fields = |config: &serde_json::Value| match config {
        serde_json::Value::Object(fields) => fields.clone(),
        _ => serde_json::Map::new(),
    };
    let (saved, wanted) = (fields(saved), fields(wanted));
    wanted
        .iter()
        .filter(|(name, value)| saved.get(*name) != Some(value))
        .map(|(name, value)| {
            let old = saved
                .get(name)
                .map_or("(missing)".into(), |v| v.to_string());
            format!("{name}: checkpoint {old}, configuration {value}")
        })
        .collect()
}

type Recorder_ = NamedMpkFileRecorder<FullPrecisionSettings>;
/// Records to bytes exactly what `Recorder_` writes to a file (named MessagePack).
type BytesRecorder_ = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// The result of one rank's training.
pub struct RankOutcome {
    pub metrics: Vec<StepMetrics>,
}

/// The bytes one rank sent during one step: every rank measures its own
/// ([`Communicator::stats`](burn_dcp::comm::Communicator::stats)) and rank 0 sums them, so the
/// totals are the same whether ranks are threads of one process or processes of an MPI job.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct StepBytes {
    total: u64,
    links: LinkBytes,
    labels: BTreeMap<String, u64>,
}

impl StepBytes {
    fn between(before: &CommStats, after: &CommStats) -> Self {
        let labels = after
            .bytes_by_label
            .iter()
            .map(|(label, bytes)| {
                let earlier = before.bytes_by_label.get(label).copied().unwrap_or(0);
                (label.clone(), bytes - earlier)
            })
            .collect();
        StepBytes {
            total: after.total_bytes() - before.total_bytes(),
            links: LinkBytes {
                intra_node: after.bytes_by_link.intra_node - before.bytes_by_link.intra_node,
                inter_node: after.bytes_by_link.inter_node - before.bytes_by_link.inter_node,
            },
            labels,
        }
    }

    /// Every rank's bytes of the step, summed (on every rank) through a control all-gather.
    fn summed(self, world: &Comm) -> Result<StepBytes, TrainError> {
        let payload = serde_json::to_vec(&self)
            .map_err(|e| TrainError::Malformed(format!("a per-rank byte count: {e}")))?;
        let all = world.all_gather_control("step bytes", payload)?;
        let mut sum = StepBytes::default();
        for bytes in all {
            let rank: StepBytes = serde_json::from_slice(&bytes).map_err(|e| {
                TrainError::Malformed(format!("a malformed per-rank byte count: {e}"))
            })?;
            sum.total += rank.total;
            sum.links.intra_node += rank.links.intra_node;
            sum.links.inter_node += rank.links.inter_node;
            for (label, bytes) in rank.labels {
                *sum.labels.entry(label).or_default() += bytes;
            }
        }
        Ok(sum)
    }
}

/// The mesh's axes, as `bytes_by_axis` names them.
pub const AXES: [&str; 4] = ["tp", "cp", "dp", "pp"];

/// TP rank `tp_rank`'s shard of pipeline stage `pp_rank` of the model at initialisation: every
/// rank cuts its shard from the same full initialisation (seed `config.seed`), so any mesh starts
/// from tp 1, pp 1's weights.
pub fn init_model<B: FlashOps>(
    config: &TrainConfig,
    tp_rank: usize,
    pp_rank: usize,
    device: &B::Device,
) -> Result<TrainGpt<B>, TrainError> {
    let model_config = config.model_config()?;
    let full = model_config
        .init::<CpTrain<B>>(config.seed, device)
        .map_err(TrainError::Model)?;
    TpGpt::stage(&full, &model_config, tp_rank, config.tp, pp_rank, config.pp)
        .map_err(TrainError::Model)
}

/// What a rank's model is built from: the run's configuration, the rank's TP rank and pipeline
/// stage, its device.
pub struct ModelInit<'a, B: FlashOps> {
    pub config: &'a TrainConfig,
    pub tp_rank: usize,
    pub pp_rank: usize,
    pub device: &'a B::Device,
}

/// A training run as every rank sees it: the configuration, the data, where to resume from and
/// save to, and rank 0's observer of the steps.
pub struct Trainer<'a> {
    pub config: &'a TrainConfig,
    pub data: &'a TrainData,
    /// A run directory to continue (its checkpoint).
    pub resume: Option<&'a Path>,
    /// Where the checkpoint is saved at the end (all ranks take part).
    pub out: Option<&'a Path>,
    pub observer: &'a dyn StepObserver,
}

impl Trainer<'_> {
    /// Trains model `M` on this rank (`world`: the rank's communicator of the whole run) from
    /// the first step not yet trained; `init` builds the rank's model (every rank of a TP
    /// position must build the same weights: seed it, or load one record).
    pub fn train_rank<B, M, F>(
        &self,
        world: Comm,
        device: &B::Device,
        init: F,
    ) -> Result<RankOutcome, TrainError>
    where
        B: FlashOps,
        M: TrainModel<CpTrain<B>>,
        F: FnOnce(&ModelInit<B>) -> Result<M, TrainError>,
    {
        let config = self.config;
        let groups = RankGroups::new(world, config)?;
        let (tp_rank, pp_rank) = (groups.tp.comm.rank(), groups.mesh.pp.rank());
        let mut model = init(&ModelInit {
            config,
            tp_rank,
            pp_rank,
            device,
        })?;
        check_model_support(&model, config)?;
        let files = CheckpointFiles::of(config, tp_rank, pp_rank);
        let mut optimizer = AdamWConfig::new().init::<CpTrain<B>, M>();
        let mut first_step = 1;
        if let Some(dir) = self.resume {
            let checkpoint = saved_checkpoint(dir)?;
            model = load_model(model, &checkpoint, &files.model, device)?;
            let record = Recorder_::new()
                .load(checkpoint.join(&files.optimizer), device)
                .map_err(|e| {
                    TrainError::Checkpoint(format!(
                        "cannot load the optimizer checkpoint from {}: {e}",
                        checkpoint.display()
                    ))
                })?;
            optimizer = optimizer.load_record(record);
            let state: TrainState = read_json(&checkpoint.join("state.json"))?;
            first_step = state.step + 1;
        }
        let run = StepLoop {
            groups: &groups,
            config,
            data: self.data,
            observer: self.observer,
            device,
        };
        let (model, metrics) = std::thread::scope(|scope| {
            let plans = plan_ahead(scope, config, self.data, first_step);
            run.steps(model, &mut optimizer, first_step, &plans)
        })?;
        if let Some(out) = self.out {
            let state = TrainState {
                step: config.steps,
                config: Some(config.clone()),
                model: Some(config.model_identity()?),
            };
            let saved = Checkpoint {
                out,
                model: &model,
                optimizer: &optimizer,
                state: &state,
                files: &files,
            };
            save_checkpoint(&groups, &saved)
                .inspect_err(|e| groups.mesh.world.abort(&e.to_string()))?;
        }
        Ok(RankOutcome { metrics })
    }
}

/// The mesh asks only what the model supports: TP needs [`TrainModel::tensor_parallel`], PP
/// [`TrainModel::stages`].
fn check_model_support<B: AutodiffBackend, M: TrainModel<B>>(
    model: &M,
    config: &TrainConfig,
) -> Result<(), TrainError> {
    if config.tp > 1 && !model.tensor_parallel() {
        return Err(TrainError::Config(format!(
            "tp {} needs a model that shards itself over a TP group (TrainModel::tensor_parallel); this one does not",
            config.tp
        )));
    }
    if config.pp > 1 && model.stages().is_none() {
        return Err(TrainError::Config(format!(
            "pp {} needs a model split into pipeline stages (TrainModel::stages); this one is not",
            config.pp
        )));
    }
    if config.pp > 1 && M::INPUT_ROWS != InputRows::Packed {
        return Err(TrainError::Config(format!(
            "pp {} sends packed rows between stages: the model must take InputRows::Packed",
            config.pp
        )));
    }
    Ok(())
}

/// Trains the GPT of `config.model_size` on one rank ([`Trainer::train_rank`] with
/// [`init_model`]).
pub fn train_rank<B: FlashOps>(
    world: Comm,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: Option<&Path>,
    observer: &dyn StepObserver,
    device: &B::Device,
) -> Result<RankOutcome, TrainError> {
    let trainer = Trainer {
        config,
        data,
        resume,
        out,
        observer,
    };
    trainer.train_rank::<B, TrainGpt<B>, _>(world, device, |rank| {
        init_model::<B>(rank.config, rank.tp_rank, rank.pp_rank, rank.device)
    })
}

/// `model` with the weights of `file` in the checkpoint directory `checkpoint`.
fn load_model<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: M,
    checkpoint: &Path,
    file: &str,
    device: &B::Device,
) -> Result<M, TrainError> {
    // burn's record loader panics on a record of another shape (a checkpoint older than the
    // shape check of `check_resume`): turn that into an error.
    let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.load_file(checkpoint.join(file), &Recorder_::new(), device)
    }))
    .map_err(|panic| {
        TrainError::Checkpoint(format!(
            "the model checkpoint in {} does not fit the configured model: {}",
            checkpoint.display(),
            panic_message(&*panic)
        ))
    })?;
    loaded.map_err(|e| {
        TrainError::Checkpoint(format!(
            "cannot load the model checkpoint from {}: {e}",
            checkpoint.display()
        ))
    })
}

/// A receiver of the plans of consecutive steps, computed ahead on a background thread.
type PlanReceiver = std::sync::mpsc::Receiver<Result<StepPlan, CpError>>;

/// Plans steps `first..=steps` on a thread of `scope`, at most `plan_ahead` steps ahead of the one
/// training (a bounded channel). The thread stops when the receiver is dropped.
fn plan_ahead<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    config: &'env TrainConfig,
    data: &'env TrainData,
    first: usize,
) -> PlanReceiver {
    let (sender, receiver) = std::sync::mpsc::sync_channel(config.plan_ahead);
    scope.spawn(move || {
        for step in first..=config.steps {
            if sender.send(plan_step(config, data, step)).is_err() {
                break;
            }
        }
    });
    receiver
}

/// What every step of a rank's training needs.
struct StepLoop<'a, B: FlashOps> {
    groups: &'a RankGroups,
    config: &'a TrainConfig,
    data: &'a TrainData,
    observer: &'a dyn StepObserver,
    device: &'a B::Device,
}

impl<B: FlashOps> StepLoop<'_, B> {
    /// Trains steps `first..=steps` and returns the trained model; rank 0 also returns (and
    /// reports) the steps' metrics.
    fn steps<M: TrainModel<CpTrain<B>>, O: Optimizer<M, CpTrain<B>>>(
        &self,
        mut model: M,
        optimizer: &mut O,
        first: usize,
        plans: &PlanReceiver,
    ) -> Result<(M, Vec<StepMetrics>), TrainError> {
        let world = &self.groups.mesh.world;
        let mut metrics = Vec::new();
        for step in first..=self.config.steps {
            let started = Instant::now();
            world.barrier()?;
            let stats_before = world.stats();
            let waited = Instant::now();
            let plan = plans
                .recv()
                .map_err(|_| TrainError::PlannerStopped { step })??;
            let plan_wait_ms = waited.elapsed().as_secs_f64() * 1e3;
            let result = step_gradients_planned(
                &model,
                self.groups,
                self.config,
                self.data,
                &plan,
                self.device,
            )?;
            model = optimizer.step(self.config.learning_rate, model, result.grads);
            let bytes = StepBytes::between(&stats_before, &world.stats()).summed(world)?;
            if world.rank() == 0 {
                let bytes_by_axis = AXES
                    .iter()
                    .map(|axis| {
                        let sent = bytes.labels.get(*axis).copied().unwrap_or(0);
                        (axis.to_string(), sent)
                    })
                    .collect();
                let step_metrics = StepMetrics {
                    step,
                    loss: result.loss,
                    tokens: result.tokens,
                    bytes_communicated: bytes.total,
                    bytes_by_link: bytes.links,
                    step_ms: started.elapsed().as_secs_f64() * 1e3,
                    cp_group_sizes: result
                        .stats
                        .cp_group_sizes
                        .iter()
                        .map(|(size, count)| (size.to_string(), *count))
                        .collect(),
                    rank_workload_imbalance: result.stats.rank_workload_imbalance,
                    plan_ms: Some(plan.plan_ms),
                    plan_wait_ms: Some(plan_wait_ms),
                    bytes_by_axis,
                    strategy_counts: result.stats.strategy_counts.clone(),
                    auto_choices: plan.auto_choices.clone(),
                };
                self.observer.on_step(&step_metrics);
                metrics.push(step_metrics);
            }
            world.barrier()?;
        }
        Ok((model, metrics))
    }
}

/// The file names of one (TP rank, pipeline stage)'s shard in a checkpoint: `model` and
/// `optimizer`, with `-tp{r}` when tp > 1 and `-pp{s}` when pp > 1 (`model-tp1-pp0`).
struct CheckpointFiles {
    model: String,
    optimizer: String,
}

impl CheckpointFiles {
    fn of(config: &TrainConfig, tp_rank: usize, pp_rank: usize) -> Self {
        let mut suffix = String::new();
        if config.tp > 1 {
            suffix += &format!("-tp{tp_rank}");
        }
        if config.pp > 1 {
            suffix += &format!("-pp{pp_rank}");
        }
        Self {
            model: format!("model{suffix}"),
            optimizer: format!("optimizer{suffix}"),
        }
    }
}

/// What a checkpoint holds from one rank.
struct Checkpoint<'a, M, O> {
    out: &'a Path,
    model: &'a M,
    optimizer: &'a O,
    state: &'a TrainState,
    files: &'a CheckpointFiles,
}

/// Saves the checkpoint atomically, sharded over TP and PP. The first rank of every (TP, PP)
/// position's pool records its shard (model and optimizer) to bytes and sends them to world rank
/// 0, which alone touches the file system (under MPI the ranks may be on other nodes): it writes
/// every shard to `checkpoint.tmp/`, then `state.json`, renames the old `checkpoint/` to
/// `checkpoint.old/`, `checkpoint.tmp/` to `checkpoint/`, and removes the old one. A run killed
/// at any point leaves a complete checkpoint (the old or the new) behind.
fn save_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>, O: Optimizer<M, B>>(
    groups: &RankGroups,
    saved: &Checkpoint<M, O>,
) -> Result<(), TrainError> {
    let world = &groups.mesh.world;
    // The shard this rank owns, as (file name, bytes) pairs.
    let owner = groups.world.rank() == 0;
    let mut shard = Vec::new();
    if owner {
        let bytes = BytesRecorder_::default();
        let model = Recorder::<B>::record(&bytes, saved.model.clone().into_record(), ())
            .map_err(|e| TrainError::Model(format!("cannot record the model: {e}")))?;
        let optimizer = Recorder::<B>::record(&bytes, saved.optimizer.to_record(), ())
            .map_err(|e| TrainError::Model(format!("cannot record the optimizer: {e}")))?;
        shard.push((format!("{}.mpk", saved.files.model), model));
        shard.push((format!("{}.mpk", saved.files.optimizer), optimizer));
    }
    let owners = world.all_gather_control("checkpoint owners", vec![owner as u8])?;
    let leader = world.rank() == 0;
    // Owners send (name, bytes) pairs to rank 0: the name as one message, the bytes as another.
    let mut sends = Vec::new();
    if owner && !leader {
        for (name, bytes) in shard.drain(..) {
            let name = name.into_bytes();
            let (name_len, len) = (name.len(), bytes.len());
            sends.push(world.isend(0, TensorData::new(name, [name_len]).into())?);
            sends.push(world.isend(0, TensorData::new(bytes, [len]).into())?);
        }
    }
    if leader {
        let mut receives = Vec::new();
        for (rank, flag) in owners.iter().enumerate() {
            if rank != 0 && flag.first() == Some(&1) {
                for _ in 0..2 {
                    receives.push((world.irecv(rank)?, world.irecv(rank)?));
                }
            }
        }
        for (name, bytes) in receives {
            let name = name
                .wait()?
                .into_host()
                .map_err(TrainError::Malformed)?
                .into_vec::<u8>();
            let bytes = bytes
                .wait()?
                .into_host()
                .map_err(TrainError::Malformed)?
                .into_vec::<u8>();
            match (name.map(String::from_utf8), bytes) {
                (Ok(Ok(name)), Ok(bytes)) => shard.push((name, bytes)),
                _ => {
                    return Err(TrainError::Malformed(
                        "a malformed checkpoint shard message".into(),
                    ))
                }
            }
        }
        write_checkpoint(saved.out, &shard, saved.state)?;
    }
    for send in sends {
        send.wait()?;
    }
    Ok(world.barrier()?)
}

/// Rank 0's part of [`save_checkpoint`]: the files, then the atomic swap of directories.
fn write_checkpoint(
    out: &Path,
    files: &[(String, Vec<u8>)],
    state: &TrainState,
) -> Result<(), TrainError> {
    let (dir, tmp, old) = (
        checkpoint_dir(out),
        out.join("checkpoint.tmp"),
        out.join("checkpoint.old"),
    );
    let io = |what: &'static str, path: &Path, e: std::io::Error| TrainError::io(what, path, e);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io("remove", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io("create", &tmp, e))?;
    for (name, bytes) in files {
        let path = tmp.join(name);
        std::fs::write(&path, bytes).map_err(|e| io("write", &path, e))?;
    }
    write_json(&tmp.join("state.json"), state)?;
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| io("remove", &old, e))?;
        }
        std::fs::rename(&dir, &old).map_err(|e| io("move aside", &dir, e))?;
    }
    std::fs::rename(&tmp, &dir).map_err(|e| io("move into place", &tmp, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| io("remove", &old, e))?;
    }
    Ok(())
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| TrainError::Malformed(format!("{} is not valid: {e}", path.display())))
}

/// Writes `value` as JSON atomically (a temporary file renamed over `path`).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), TrainError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| TrainError::Malformed(format!("{}: {e}", path.display())))?;
    write_atomically(path, text.as_bytes())
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader (or a run killed while writing) sees the old or the new content, never a mix.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| TrainError::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::io("write", path, e))
}

/// Every parameter's gradient in `grads`, in the model's parameter order (for checks).
pub fn gradient_values<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = self
                .0
                .get::<B::InnerBackend, D>(param.id)
                .expect("every parameter has a gradient");
            self.1.push(
                grad.into_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("f32 data"),
            );
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}
