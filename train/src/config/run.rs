//! [`TrainConfig`]: every field of a run, its serde defaults and its limits.

use burn_dcp_models::GptConfig;
use serde::{Deserialize, Serialize};

use crate::mode::TrainMode;
use crate::model::ModelShape;
use crate::optim::{LrScheduleSettings, OptimizerSettings};
use crate::settings::{EmulatedLinks, PpSchedule, Precision, Recompute};

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

/// The most micro-batches one optimizer step may take.
pub const MAX_MICRO_BATCHES: usize = 1 << 20;

/// The most tokens a packed micro-batch may hold (positions are stored as `u32`).
pub const MAX_SEQ_LEN: usize = u32::MAX as usize;
