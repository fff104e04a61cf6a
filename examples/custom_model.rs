//! A user's own burn model, trained context-parallel through `burn-dcp-train`'s public engine.
//!
//! The model is built only from burn modules and the drop-ins of `burn_dcp::nn`: token embedding
//! → an encoder stack (pre-norm, causal, rotary embeddings, 8 query heads and 2 kv heads by
//! default) → layer norm → LM head. It takes one right-padded row per sequence (`[B, W]` with
//! burn-nn's `mask_pad`), as burn models usually do. Everything context-parallel — planning,
//! sharding, the CP context, loss scaling, the gradient all-reduce — is the engine's.
//!
//! ```sh
//! cargo run --release --example custom_model                      # cp 4, ring (zigzag)
//! cargo run --release --example custom_model -- --cp 2 --dp 2 --strategy ulysses --out runs/c
//! cargo run --release --example custom_model -- --burn-nn         # refused: burn-nn's attention
//! ```
//!
//! `--out DIR` writes `metrics.jsonl` (`step`, `loss`, `tokens`, `bytes_communicated`, …). The
//! same seed gives the same data and weights at any `--cp`/`--dp`, so per-step losses equal
//! cp 1's. Processes instead of threads: as `gpt_longctx` (mpirun or scripts/launch_tcp.py).

use std::path::PathBuf;
use std::time::Duration;

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::{Backend, Tensor};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_dcp::comm::WorldConfig;
use burn_dcp::nn::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
use burn_dcp::StrategyKind;
use burn_dcp_suite::train::launch::Ranks;
use burn_dcp_suite::train::metrics::truncate_metrics;
use burn_dcp_suite::train::{
    check_resume, cross_entropy_sum, CpTrain, InputRows, ModelShape, Precision, Progress,
    ShardInput, TpGroup, TrainConfig, TrainData, TrainError, TrainMode, TrainModel, Trainer,
};
use clap::Parser;

/// Train a small causal LM of burn_dcp::nn modules with context parallelism.
#[derive(Parser, Debug)]
struct Args {
    /// Context-parallel ranks per replica
    #[arg(long, default_value_t = 4)]
    cp: usize,
    /// Data-parallel replicas
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// ring | ring-zigzag | ring-contiguous | ring-stripe | ulysses | all-gather | usp (with --ulysses-degree)
    #[arg(long, default_value = "ring")]
    strategy: String,
    /// Ulysses degree of USP
    #[arg(long)]
    ulysses_degree: Option<usize>,
    /// Optimizer steps
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Tokens per packed micro-batch (whole documents up to this length, longer ones split)
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// Micro-batches per step (a multiple of dp)
    #[arg(long, default_value_t = 2)]
    micro_batches: usize,
    /// Query heads
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (grouped-query attention)
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Model width
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Encoder layers
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Training text: default | builtin | a directory | a .jsonl file
    #[arg(long, default_value = "default")]
    corpus: String,
    /// Pre-tokenized byte tokens in place of --corpus: a Megatron PREFIX (.bin/.idx), a flat
    /// token file (with --eod-token), or a blend of weight/path pairs (as gpt_longctx's)
    #[arg(long, num_args = 1..)]
    data_path: Vec<String>,
    /// The end-of-document id of a flat token file
    #[arg(long)]
    eod_token: Option<u32>,
    /// The ids of a flat token file: uint16 | uint32
    #[arg(long, default_value = "uint16")]
    token_dtype: String,
    /// Seed of the weights and the data
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The dtype the forward and backward compute in: f32 | bf16 | f16 (the weights, their
    /// gradients and AdamW's moments stay f32)
    #[arg(long, default_value = "f32")]
    precision: String,
    /// The same model on burn-nn's own TransformerEncoder (its attention bypasses burn's op:
    /// refused at the first micro-batch)
    #[arg(long)]
    burn_nn: bool,
    /// Write metrics.jsonl and the checkpoint (after the last step) here
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run saved in DIR from its checkpoint (the flags must give the same model;
    /// --steps is the new total; metrics are appended)
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Also save a checkpoint after every N-th step
    #[arg(long)]
    checkpoint_every: Option<usize>,
    /// Print the per-step losses as JSON on stdout
    #[arg(long)]
    json: bool,
}

const VOCAB: usize = 256; // byte tokens

type B = CpTrain<Flex>;

/// Memory per rank where ranks are threads (`peak_memory_mb` in metrics.jsonl): every allocation
/// charged to the rank that makes it.
#[global_allocator]
static ALLOCATOR: burn_dcp::kernels::memory::TrackingAllocator =
    burn_dcp::kernels::memory::TrackingAllocator;

/// The user's model: embedding → drop-in encoder (causal, RoPE, GQA) → norm → LM head.
#[derive(Module, Debug)]
struct CausalLm<B: Backend> {
    embedding: Embedding<B>,
    encoder: TransformerEncoder<B>,
    norm: LayerNorm<B>,
    head: Linear<B>,
}

impl<B: Backend> CausalLm<B> {
    fn new(args: &Args, device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, args.d_model).init(device),
            encoder: TransformerEncoderConfig::new(
                args.d_model,
                4 * args.d_model,
                args.heads,
                args.layers,
            )
            .with_n_kv_heads(Some(args.kv_heads))
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(device),
            norm: LayerNormConfig::new(args.d_model).init(device),
            head: LinearConfig::new(args.d_model, VOCAB).init(device),
        }
    }
}

/// The same model with burn-nn's encoder (no GQA, no rotary embeddings in burn-nn).
#[derive(Module, Debug)]
struct BurnNnLm<B: Backend> {
    embedding: Embedding<B>,
    encoder: burn::nn::transformer::TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> BurnNnLm<B> {
    fn new(args: &Args, device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, args.d_model).init(device),
            encoder: burn::nn::transformer::TransformerEncoderConfig::new(
                args.d_model,
                4 * args.d_model,
                args.heads,
                args.layers,
            )
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(device),
            head: LinearConfig::new(args.d_model, VOCAB).init(device),
        }
    }
}

impl TrainModel<B> for CausalLm<B> {
    const INPUT_ROWS: InputRows = InputRows::OnePerSequence;

    fn loss_sum(&self, input: ShardInput<B>, _tp: &TpGroup) -> Result<Tensor<B, 1>, TrainError> {
        let x = self.embedding.forward(input.tokens);
        let x = self.encoder.forward(
            TransformerEncoderInput::new(x)
                .mask_pad(input.mask_pad)
                .causal()
                .rotary(10_000.0),
        );
        Ok(cross_entropy_sum(
            self.head.forward(self.norm.forward(x)),
            input.labels,
        ))
    }
}

impl TrainModel<B> for BurnNnLm<B> {
    const INPUT_ROWS: InputRows = InputRows::OnePerSequence;

    fn loss_sum(&self, input: ShardInput<B>, _tp: &TpGroup) -> Result<Tensor<B, 1>, TrainError> {
        let [rows, width] = input.tokens.dims();
        let device = input.tokens.device();
        let causal = burn::nn::attention::generate_autoregressive_mask(rows, width, &device);
        let x = self.embedding.forward(input.tokens);
        let x = self.encoder.forward(
            burn::nn::transformer::TransformerEncoderInput::new(x)
                .mask_pad(input.mask_pad)
                .mask_attn(causal),
        );
        Ok(cross_entropy_sum(self.head.forward(x), input.labels))
    }
}

fn config(args: &Args) -> Result<TrainConfig, TrainError> {
    // `ring` is ring-zigzag; a ring's name carries its layout, the others run zigzag.
    let kind = match args.strategy.as_str() {
        "ring" => StrategyKind::RING_ZIGZAG,
        name => name.parse()?,
    };
    let layout = kind.layout().unwrap_or(burn_dcp::Layout::Zigzag);
    let strategy = kind.strategy(args.ulysses_degree, args.cp)?;
    let config = TrainConfig {
        cp: args.cp,
        dp: args.dp,
        mode: TrainMode::Static { strategy, layout },
        seq_len: args.seq_len,
        micro_batches: args.micro_batches,
        steps: args.steps,
        seed: args.seed,
        corpus: args.corpus.clone(),
        data_path: args.data_path.clone(),
        eod_token: args.eod_token,
        token_dtype: args.token_dtype.clone(),
        checkpoint_every: args.checkpoint_every,
        precision: Precision::parse(&args.precision)?,
        model_shape: Some(ModelShape {
            vocab_size: VOCAB,
            d_model: args.d_model,
            n_layers: args.layers,
            n_heads: args.heads,
            n_kv_heads: args.kv_heads,
            d_ff: 4 * args.d_model,
            head_dim: None,
            tied_embeddings: false,
        }),
        ..TrainConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Every rank starts from the same weights: drawn once from the seed (in every process alike)
/// and loaded by each rank.
fn initial_record<M: Module<Flex>>(model: M) -> Vec<u8> {
    Recorder::<Flex>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        model.into_record(),
        (),
    )
    .expect("the model records")
}

fn loaded<M: Module<B>>(model: M, bytes: &[u8]) -> Result<M, TrainError> {
    let record = Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes.to_vec(),
        &Default::default(),
    )
    .map_err(|e| TrainError::Model(format!("cannot load the initial weights: {e}")))?;
    Ok(model.load_record(record))
}

fn train<M: TrainModel<B>>(
    args: &Args,
    config: &TrainConfig,
    bytes: &[u8],
    model: impl Fn() -> M + Sync,
) -> Result<(), TrainError> {
    let ranks = Ranks::new(
        config.world_size(),
        WorldConfig {
            timeout: Duration::from_secs(config.timeout_secs),
            ranks_per_node: None,
        },
    )?;
    let leader = ranks.is_leader();
    // A resumed run writes where it was saved, unless --out names another directory.
    let out = args.out.clone().or_else(|| args.resume.clone());
    if let Some(dir) = &args.resume {
        let saved_step = check_resume(dir, config)?;
        if leader && out.as_deref() == Some(dir.as_path()) {
            truncate_metrics(&dir.join("metrics.jsonl"), saved_step)?;
        }
    }
    if let (true, Some(out)) = (leader, &out) {
        std::fs::create_dir_all(out).map_err(|e| TrainError::io("create", out, e))?;
    }
    let data = TrainData::load(config)?;
    let progress = Progress::new(
        format!("custom_model {}", config.mesh_shape()),
        config.steps,
        out.as_deref().filter(|_| leader),
        args.resume.is_some() && out == args.resume,
    )?;
    let trainer = Trainer {
        config,
        data: &data,
        resume: args.resume.as_deref(),
        out: out.as_deref(),
        observer: &progress,
    };
    let result = ranks.run(|comm| {
        trainer.train_rank::<Flex, M, _>(comm, &Default::default(), |_| loaded(model(), bytes))
    });
    if leader {
        progress.finish()?;
    }
    let outcome = result?;
    if let (Some(outcome), true) = (outcome, args.json) {
        let losses: Vec<f64> = outcome.metrics.iter().map(|m| m.loss).collect();
        println!("{}", serde_json::json!({ "losses": losses }));
    }
    Ok(())
}

fn run(args: &Args) -> Result<(), TrainError> {
    let config = config(args)?;
    let device = Default::default();
    Flex::seed(&device, args.seed);
    if args.burn_nn {
        let bytes = initial_record(BurnNnLm::<Flex>::new(args, &device));
        train(args, &config, &bytes, || BurnNnLm::<B>::new(args, &device))
    } else {
        let bytes = initial_record(CausalLm::<Flex>::new(args, &device));
        train(args, &config, &bytes, || CausalLm::<B>::new(args, &device))
    }
}

fn main() {
    burn_dcp_suite::launch::init_logging();
    let args = Args::parse();
    if let Err(error) = run(&args) {
        eprintln!("custom_model: {error}");
        std::process::exit(1);
    }
}
