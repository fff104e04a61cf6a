//! [`TrainFlags`]: every training flag of the examples, each optional, with its help text.

use std::fmt::Debug;

/// The training flags of the examples (`gpt_longctx`'s command line), each optional: what is
/// not given takes [`TrainConfig::default`](crate::TrainConfig::default)'s value (the one home of the defaults), or on resume
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
    /// Virtual pipeline stages per pipeline rank: model chunks assigned round robin over pp × vpp, on Megatron's interleaved 1F1B schedule (the layers must divide by pp × vpp; the schedule's units per step by pp) [default: 1]
    #[cfg_attr(feature = "cli", arg(long))]
    pub vpp: Option<usize>,
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
    /// tiny | small | base (the GPT) | llama-125m | llama-350m | llama-1b (Llama-shaped; see
    /// burn_dcp_models::presets) [default: tiny]
    #[cfg_attr(feature = "cli", arg(long))]
    pub model_size: Option<String>,
    /// A Hugging Face config.json (Llama, Mistral, Qwen2): the architecture, weights drawn as
    /// transformers draws them (in place of --model-size)
    #[cfg_attr(feature = "cli", arg(long, value_name = "CONFIG_JSON"))]
    pub model_config: Option<String>,
    /// A Hugging Face checkpoint directory (config.json, model.safetensors or its shards with
    /// the index; tokenizer.json, used unless --tokenizer-file or --tokenizer is given): the
    /// architecture and the initial weights (in place of --model-size)
    #[cfg_attr(feature = "cli", arg(long, value_name = "DIR"))]
    pub hf_checkpoint: Option<String>,
    /// RoPE's base θ over the architecture's (extending a checkpoint's context)
    #[cfg_attr(feature = "cli", arg(long))]
    pub rope_theta: Option<f64>,
    /// RoPE's scaling over the architecture's: none | linear:FACTOR | llama3:FACTOR,LOW,HIGH,ORIGINAL
    #[cfg_attr(feature = "cli", arg(long))]
    pub rope_scaling: Option<String>,
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
    /// A Hugging Face tokenizer.json: tokenizes the corpus, and its vocabulary sizes the model (in place of --tokenizer)
    #[cfg_attr(feature = "cli", arg(long, value_name = "TOKENIZER_JSON"))]
    pub tokenizer_file: Option<String>,
    /// Pre-tokenized training data in place of --corpus, as Megatron-LM names it: a PREFIX of PREFIX.bin + PREFIX.idx (Megatron's indexed dataset), or a flat token file (nanoGPT's; needs --eod-token); a blend as weight/path pairs: --data-path 0.3 A 0.7 B. A loss mask beside a token file (TOKENS.mask, one byte per token) takes its 0 tokens out of the loss
    #[cfg_attr(feature = "cli", arg(long, num_args = 1.., value_name = "PATH"))]
    pub data_path: Option<Vec<String>>,
    /// The end-of-document id of a flat token file (GPT-2's: 50256); each document ends with it
    #[cfg_attr(feature = "cli", arg(long))]
    pub eod_token: Option<u32>,
    /// The ids of a flat token file: uint16 (nanoGPT) | uint32 [default: uint16]
    #[cfg_attr(feature = "cli", arg(long))]
    pub token_dtype: Option<String>,
    /// What the backward recomputes instead of keeping it: none | attention (burn's BalancedCheckpointing: memory-bound activations and the CP attention's output, which communicates once more) | block (every transformer block from its input) [default: none]
    #[cfg_attr(feature = "cli", arg(long))]
    pub recompute: Option<String>,
    /// The dtype the forward and backward compute in: f32 | bf16 | f16 (parameters, gradients, optimizer moments and checkpoints stay f32; attention accumulates in f32; CP messages travel in this dtype) [default: f32]
    #[cfg_attr(feature = "cli", arg(long))]
    pub precision: Option<String>,
    /// No training: the validation loss of the model (its initial weights, a --hf-checkpoint's,
    /// or --resume's) over the first --eval-tokens tokens of the data in file order, in windows
    /// of --seq-len tokens (what transformers computes with labels=input_ids on each window)
    #[cfg_attr(feature = "cli", arg(long))]
    pub eval_only: bool,
    /// Wait for the device at the end of each phase of a step (forward, backward, gradient
    /// reduction, optimizer), so that forward_ms, backward_ms, grad_sync_ms and optimizer_ms are
    /// device time, not the time to queue the work (slower: the host stops running ahead)
    #[cfg_attr(feature = "cli", arg(long))]
    pub sync_phases: bool,
    /// Timeout of every communication wait, seconds [default: 60]
    #[cfg_attr(feature = "cli", arg(long))]
    pub timeout_secs: Option<u64>,
}
