//! The run's configuration ([`TrainConfig`]: written to `config.json`), its defaults (one home:
//! [`TrainConfig::default`]) and its rules ([`TrainConfig::validate`]).

use burn_dcp::heads::Heads;
use burn_dcp::mesh::MeshShape;
use burn_dcp::CpError;
use burn_dcp_datasets::{DataError, LengthMix, LengthSampler, MaskPolicy, Tokenizer};
use burn_dcp_models::GptConfig;
use serde::{Deserialize, Serialize};

mod rules;

use crate::error::TrainError;
pub use crate::mode::{GroupStrategy, TrainMode};
use crate::model::ModelShape;
pub use crate::optim::{LrScheduleSettings, OptimizerSettings};
pub use crate::settings::{
    AutoSettings, CpSizes, DcpSettings, DynamicSettings, EmulatedLinks, PpSchedule, Precision,
    Recompute,
};

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
    /// Virtual pipeline stages per pipeline rank (`--vpp`): each rank holds `vpp` model chunks,
    /// layers assigned round robin over `pp × vpp` chunks, on the interleaved 1F1B schedule
    /// (Megatron-LM's); 1: one contiguous block of layers per rank.
    #[serde(default = "default_one")]
    pub vpp: usize,
    /// How the CP ranks attend: the strategy and layout, DCP, dynamic CP or auto, each with its
    /// settings (in `config.json` the flat fields `strategy`, `layout`, `dynamic`, `dcp`, `auto`).
    #[serde(flatten)]
    pub mode: TrainMode,
    /// Tokens per packed micro-batch (one DP replica's CP group processes one at a time).
    pub seq_len: usize,
    /// Micro-batches per optimizer step over all DP replicas (the global batch).
    pub micro_batches: usize,
    pub steps: usize,
    pub model_size: String,
    pub seed: u64,
    /// The peak learning rate (`--lr`; the schedule's).
    pub learning_rate: f64,
    /// The optimizer and its hyper-parameters (`--optimizer` …; default burn's AdamW).
    #[serde(default)]
    pub optimizer: OptimizerSettings,
    /// The learning rate over the steps (`--lr-schedule`, `--warmup-steps`, `--min-lr`;
    /// default constant).
    #[serde(default)]
    pub lr_schedule: LrScheduleSettings,
    /// `--clip-grad-norm`: gradients scaled so that their global norm (over every parameter of
    /// the model, each counted once across TP, PP and the DP × CP pool) is at most this;
    /// `None`: not clipped (the norm is reported either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// `--eval-every N`: the validation loss (over the held-out documents of `eval_tokens`)
    /// after every N-th step and the last; `None`: no documents held out, no validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<usize>,
    /// `--eval-tokens T`: at least this many tokens of whole documents held out of training.
    #[serde(default = "default_eval_tokens")]
    pub eval_tokens: usize,
    /// `--checkpoint-every N`: a checkpoint after every N-th step too (with an output
    /// directory; the last step's is always written); `None`: only the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<usize>,
    /// `--keep-checkpoints K`: the newest K checkpoints are kept (`checkpoint/`, then
    /// `checkpoint-<step>/`), older ones removed.
    #[serde(default = "default_one")]
    pub keep_checkpoints: usize,
    /// `--checkpoint-chunk-bytes B`: the largest message a checkpoint sends (a shard gathered
    /// to rank 0 travels as chunks of at most B bytes), at most [`MAX_CHUNK_BYTES`] (MPI counts
    /// a message's bytes in an `int`).
    #[serde(default = "default_chunk_bytes")]
    pub checkpoint_chunk_bytes: usize,
    /// `--checkpoint-timeout-secs S`: how long the other ranks wait, in all, for rank 0 to write a
    /// checkpoint (each of its "still writing" messages arrives within the communication
    /// timeout, `timeout_secs`).
    #[serde(default = "default_checkpoint_timeout")]
    pub checkpoint_timeout_secs: u64,
    /// Mask policy: `causal`, `lambda`, `blockwise`, `shared-question` (DCP defaults), `mixed`
    /// (one of those per sequence), `full`, or a spec such as `lambda:64,4096`.
    pub mask: String,
    /// `default` (Vim help files, Debian vim-runtime), `builtin` (burn-dcp-train's README and sources), or a
    /// directory of text files / a `.jsonl` file.
    pub corpus: String,
    /// `gpt2` (r50k BPE) or `bytes`.
    pub tokenizer: String,
    /// `--tokenizer-file`: a Hugging Face `tokenizer.json` (in place of `tokenizer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_file: Option<String>,
    /// `--data-path`: pre-tokenized data in place of `corpus`: a Megatron `.bin/.idx` prefix or
    /// a flat token file, or weight/path pairs of a blend (`burn_dcp_datasets::stream`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_path: Vec<String>,
    /// `--eod-token`: the end-of-document id of a flat token file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eod_token: Option<u32>,
    /// `--token-dtype`: `uint16` or `uint32`, the ids of a flat token file.
    #[serde(default = "default_token_dtype")]
    pub token_dtype: String,
    /// `--lengths-from longalign-like|ldc-like`: the corpus's tokens recut into documents of
    /// lengths drawn from that dataset's sampler fitted to `seq_len`
    /// (`burn_dcp_datasets::sampler::recut`); `None`: the corpus's own documents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lengths_from: Option<String>,
    pub timeout_secs: u64,
    /// Steps planned ahead on a background thread (`--plan-ahead`).
    #[serde(default = "default_plan_ahead")]
    pub plan_ahead: usize,
    /// Topology preset the ranks model (`--topology`): DCP plans for it, and every strategy's
    /// bytes are counted per link class.
    #[serde(default = "default_topology")]
    pub topology: String,
    /// Virtual nodes the world's ranks are spread over (`--nodes`; consecutive ranks share one).
    #[serde(default = "default_nodes")]
    pub nodes: usize,
    /// `--emulate-links`: the in-process world delays every message as over the topology's
    /// links, slowed to this machine's compute (`crate::links`); `None`: messages arrive at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emulate_links: Option<EmulatedLinks>,
    /// The shape of a model other than the GPT of `model_size` (planning and checks read it);
    /// `None`: the GPT's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_shape: Option<ModelShape>,
    /// The architecture of `--model-config` / `--hf-checkpoint` (a Hugging Face `config.json`),
    /// in place of the preset `model_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<GptConfig>,
    /// `--hf-checkpoint`: the directory the initial weights are read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_checkpoint: Option<String>,
    /// `--rope-theta`: RoPE's base over the architecture's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `--rope-scaling`: `none`, `linear:F` or `llama3:F,LOW,HIGH,ORIGINAL` over the
    /// architecture's (`crate::hf::parse_rope_scaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<String>,
    /// `--eval-only`: no training, the validation loss of the model over the first
    /// `eval_tokens` tokens of the data in file order (`TrainData::eval_windows`).
    #[serde(default)]
    pub eval_only: bool,
    /// `--sync-phases`: the device is waited for at the end of each phase of a step, so the
    /// phases' times in the metrics are device time.
    #[serde(default)]
    pub sync_phases: bool,
    /// What the backward recomputes (`--recompute`): memory for compute, same results.
    #[serde(default)]
    pub recompute: Recompute,
    /// The dtype the forward and backward compute in (`--precision`; the master weights stay
    /// f32, see [`Precision`]).
    #[serde(default)]
    pub precision: Precision,
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
            vpp: 1,
            mode: TrainMode::default(),
            seq_len: 4096,
            micro_batches: 2,
            steps: 30,
            model_size: "tiny".into(),
            seed: 0,
            learning_rate: 3e-3,
            optimizer: OptimizerSettings::default(),
            lr_schedule: LrScheduleSettings::default(),
            clip_grad_norm: None,
            eval_every: None,
            eval_tokens: default_eval_tokens(),
            checkpoint_every: None,
            keep_checkpoints: 1,
            checkpoint_chunk_bytes: default_chunk_bytes(),
            checkpoint_timeout_secs: default_checkpoint_timeout(),
            mask: "causal".into(),
            corpus: "default".into(),
            tokenizer: "bytes".into(),
            tokenizer_file: None,
            data_path: Vec::new(),
            eod_token: None,
            token_dtype: default_token_dtype(),
            lengths_from: None,
            timeout_secs: 60,
            plan_ahead: DEFAULT_PLAN_AHEAD,
            topology: default_topology(),
            nodes: default_nodes(),
            emulate_links: None,
            model_shape: None,
            recompute: Recompute::None,
            precision: Precision::F32,
            sync_phases: false,
            eval_only: false,
            architecture: None,
            hf_checkpoint: None,
            rope_theta: None,
            rope_scaling: None,
        }
    }
}

pub(crate) fn default_token_dtype() -> String {
    "uint16".into()
}

pub(crate) fn default_topology() -> String {
    "a100-p4d".into()
}

pub(crate) fn default_nodes() -> usize {
    1
}

pub(crate) fn default_eval_tokens() -> usize {
    4096
}

/// The largest checkpoint message: MPI's `int` count of bytes.
pub const MAX_CHUNK_BYTES: usize = i32::MAX as usize;

/// Checkpoint messages of 256 MiB by default.
pub(crate) fn default_chunk_bytes() -> usize {
    256 << 20
}

/// An hour for a checkpoint by default.
pub(crate) fn default_checkpoint_timeout() -> u64 {
    3600
}

pub(crate) fn default_one() -> usize {
    1
}

pub(crate) fn default_plan_ahead() -> usize {
    DEFAULT_PLAN_AHEAD
}

/// Steps planned ahead by default.
pub const DEFAULT_PLAN_AHEAD: usize = 2;

/// The most steps that may be planned ahead.
pub const MAX_PLAN_AHEAD: usize = 64;

impl TrainConfig {
    /// The strategy as `--strategy` names it ([`TrainMode::name`]).
    pub fn strategy_name(&self) -> String {
        self.mode.name()
    }

    /// The model trained: the architecture of `--model-config` / `--hf-checkpoint`, or the
    /// preset `model_size` (the GPT's with the tokenizer's vocabulary), with `--rope-theta` and
    /// `--rope-scaling` over it.
    pub fn model_config(&self) -> Result<GptConfig, TrainError> {
        crate::hf::model_config(self)
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

    /// `--lengths-from`'s sampler, fitted to `seq_len` (`None` without the flag).
    pub fn length_sampler(&self) -> Result<Option<LengthSampler>, TrainError> {
        let Some(name) = &self.lengths_from else {
            return Ok(None);
        };
        let mix: LengthMix = name
            .parse()
            .map_err(|e: DataError| TrainError::Config(format!("--lengths-from: {e}")))?;
        LengthSampler::fitted(mix, self.seq_len)
            .map(Some)
            .map_err(|e| TrainError::Config(e.to_string()))
    }

    /// `tokenizer_file`'s tokenizer, else `tokenizer`'s.
    pub fn tokenizer(&self) -> Result<Tokenizer, TrainError> {
        match &self.tokenizer_file {
            Some(path) => Tokenizer::from_file(std::path::Path::new(path)),
            None => Tokenizer::from_name(&self.tokenizer),
        }
        .map_err(|e| TrainError::Config(e.to_string()))
    }

    /// The ids the model embeds: `model_shape`'s vocabulary, else the trained model's.
    pub fn vocab_size(&self) -> Result<usize, TrainError> {
        match &self.model_shape {
            Some(shape) => Ok(shape.vocab_size),
            None => Ok(self.model_config()?.vocab_size),
        }
    }

    /// What the training data are called in messages: `--data-path`'s words or the corpus.
    pub fn data_name(&self) -> String {
        match self.data_path.is_empty() {
            true => format!("corpus {}", self.corpus),
            false => format!("--data-path {}", self.data_path.join(" ")),
        }
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
    pub fn rank_heads(&self, model: &ModelShape) -> Result<Heads, TrainError> {
        let heads = model.heads().map_err(TrainError::Config)?;
        self.mesh_shape()
            .heads_per_tp_rank(heads)
            .map_err(|e| TrainError::Config(e.naming_parts(&format!("--tp {}", self.tp))))
    }

    /// World ranks per virtual node (`--nodes` must divide the world).
    pub fn ranks_per_node(&self) -> Result<usize, CpError> {
        let world = self.world_size();
        match burn_dcp::comm::nodes::NodeMap::new(world, self.nodes) {
            Ok(map) => Ok(map.ranks_per_node()),
            // The rule is NodeMap's; the message names the flag and what the world is.
            Err(_) => Err(CpError::Config(format!(
                "--nodes {} must divide the {world} ranks (tp × cp × dp × pp)",
                self.nodes
            ))),
        }
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

    /// The topology of the CP group of pool ranks `ranks` (a dynamic CP group or a replica) as
    /// they sit on the run's nodes: the nodes it touches, holding equal shares of it.
    pub fn ranks_topology(
        &self,
        ranks: &std::ops::Range<usize>,
    ) -> Result<burn_dcp::planner::topology::Topology, CpError> {
        let per_node = (self.ranks_per_node()? / self.tp).max(1);
        let size = ranks.len();
        let first = ranks.start / per_node;
        let last = ranks.end.saturating_sub(1) / per_node;
        let nodes = last - first + 1;
        if !size.is_multiple_of(nodes) {
            return Err(CpError::Config(format!(
                "a CP group of {size} ranks ({ranks:?}) spreads unevenly over {nodes} nodes of {per_node}"
            )));
        }
        burn_dcp::planner::topology::Topology::for_ranks(&self.topology, nodes, size)
            .map_err(|e| CpError::Config(format!("--topology {}: {e}", self.topology)))
    }
}

/// The GPT of a shape (the TP rules of `burn_dcp_models` are stated on it).
pub(crate) fn gpt_of_shape(shape: &ModelShape) -> GptConfig {
    GptConfig::new(
        shape.vocab_size,
        shape.d_model,
        shape.n_layers,
        shape.n_heads,
        shape.n_kv_heads,
        shape.d_ff,
    )
    .with_tied_embeddings(shape.tied_embeddings)
    .with_head_dim(shape.head_dim)
}

/// The most micro-batches one optimizer step may take.
pub const MAX_MICRO_BATCHES: usize = 1 << 20;

/// The most tokens a packed micro-batch may hold (positions are stored as `u32`).
pub const MAX_SEQ_LEN: usize = u32::MAX as usize;
