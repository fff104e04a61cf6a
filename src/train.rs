//! Long-context GPT training with context parallelism on in-process ranks: the engine of the
//! `gpt_longctx` example, shared with the tests.
//!
//! World: `dp × cp` ranks (threads). Rank `r` is CP rank `r mod cp` of DP replica `⌊r/cp⌋`. Each
//! optimizer step processes `micro_batches` packed micro-batches of `seq_len` tokens (the global
//! batch); replica `d` takes micro-batches `d, d+dp, …` and shards each over its CP group by the
//! layout. Per micro-batch, every rank sets its CP context and runs the unchanged GPT on
//! `ContextParallel<Autodiff<B>>`; the loss is the *sum* of its tokens' cross-entropy divided by
//! the step's global label count, so gradients summed over all DP×CP ranks (the all-reduce) are
//! exactly the gradients of the global mean loss, whatever cp and dp are.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::prelude::{Int, Tensor, TensorData, ToElement};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::backend::{set_context, ContextParallel, CpContext};
use burn_dcp::comm::{Comm, CommError};
use burn_dcp::kernels::{FlashOps, MaskSpec};
use burn_dcp::shard::PackedMicroBatch;
use burn_dcp::{CpBatch, CpError, CpGroup, Layout, Strategy};
use burn_dcp_datasets::corpus::{open_documents, Document};
use burn_dcp_datasets::tokenizer::{cache_dir, default_tokenized, files_identity, tokenize_cached};
use burn_dcp_datasets::{pack_corpus, MaskPolicy, PackingConfig, TokenizedCorpus, Tokenizer};
use burn_dcp_models::{Gpt, GptConfig};
use serde::{Deserialize, Serialize};

/// The training backend over an inner backend `B` (burn Flex on the CPU, or a cubecl backend with
/// the kernels): the decorator over autodiff over `B`.
pub type CpTrain<B> = ContextParallel<burn::backend::Autodiff<B>>;

/// The default training backend: [`CpTrain`] over burn Flex (CPU).
pub type TrainBackend = CpTrain<burn::backend::Flex>;

/// Everything that defines a run (written to `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub cp: usize,
    pub dp: usize,
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
    /// `default` (Vim help files, Debian vim-runtime), `builtin` (this repository's text), or a
    /// directory of text files / a `.jsonl` file.
    pub corpus: String,
    /// `gpt2` (r50k BPE) or `bytes`.
    pub tokenizer: String,
    pub timeout_secs: u64,
}

impl TrainConfig {
    /// Checks the rules, naming the values.
    pub fn validate(&self) -> Result<(), String> {
        if self.cp == 0 || self.dp == 0 {
            return Err(format!(
                "cp ({}) and dp ({}) must be at least 1",
                self.cp, self.dp
            ));
        }
        if self.micro_batches == 0 || !self.micro_batches.is_multiple_of(self.dp) {
            return Err(format!(
                "the global batch of {} micro-batches must be a positive multiple of dp {}",
                self.micro_batches, self.dp
            ));
        }
        if self.seq_len < 2 {
            return Err(format!(
                "seq_len {} must be at least 2 tokens",
                self.seq_len
            ));
        }
        self.strategy
            .validate_mesh(self.cp)
            .map_err(|e| e.to_string())?;
        let model = self.model_config()?;
        self.strategy
            .validate_heads(model.n_heads, model.n_heads, self.cp)
            .map_err(|e| e.to_string())?;
        self.mask_policy()?;
        Ok(())
    }

    pub fn model_config(&self) -> Result<GptConfig, String> {
        GptConfig::sized(&self.model_size, self.tokenizer()?.vocab_size())
    }

    pub fn mask_policy(&self) -> Result<MaskPolicy, String> {
        MaskPolicy::parse(&self.mask).map_err(|e| e.to_string())
    }

    pub fn tokenizer(&self) -> Result<Tokenizer, String> {
        Tokenizer::from_name(&self.tokenizer).map_err(|e| e.to_string())
    }

    pub fn world_size(&self) -> usize {
        self.cp * self.dp
    }
}

/// The `builtin` corpus: this repository's own design notes and sources (small; for tests).
pub fn builtin_documents() -> Vec<Document> {
    [
        ("README.md", include_str!("../README.md")),
        ("ring.rs", include_str!("../burn-dcp/src/strategy/ring.rs")),
        (
            "ulysses.rs",
            include_str!("../burn-dcp/src/strategy/ulysses.rs"),
        ),
        (
            "in_process.rs",
            include_str!("../burn-dcp/src/comm/in_process.rs"),
        ),
        (
            "portable.rs",
            include_str!("../burn-dcp-kernels/src/portable.rs"),
        ),
        (
            "mask.rs",
            include_str!("../burn-dcp-kernels/src/definition/mask.rs"),
        ),
        ("gpt.rs", include_str!("../models/src/gpt.rs")),
    ]
    .iter()
    .map(|(name, text)| Document {
        name: name.to_string(),
        text: text.to_string(),
    })
    .collect()
}

/// A packed micro-batch and the mask of each of its sequences.
#[derive(Clone, Debug)]
pub struct TrainBatch {
    pub packed: PackedMicroBatch,
    pub masks: Vec<MaskSpec>,
}

/// The training data: the corpus tokenized and packed once into micro-batches of at most
/// `seq_len` tokens (long documents split; see `burn_dcp_datasets::packing`). Step `s` uses
/// micro-batches `(s−1)·n .. s·n` (cyclically), `n` = micro-batches per step, so any cp/dp split
/// and a resumed run see the same data.
pub struct TrainData {
    batches: Vec<TrainBatch>,
}

impl TrainData {
    pub fn load(config: &TrainConfig) -> Result<Self, String> {
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
        .map_err(|e| e.to_string())?;
        let packing = PackingConfig {
            max_tokens_per_rank: config.seq_len,
            ranks: 1,
            max_seq_len: None,
            seed: config.seed,
        };
        let packing =
            pack_corpus(&corpus, &packing, &config.mask_policy()?).map_err(|e| e.to_string())?;
        let batches: Vec<TrainBatch> = packing
            .micro_batches
            .into_iter()
            .map(|b| TrainBatch {
                packed: PackedMicroBatch {
                    tokens: b.tokens.iter().map(|&t| i64::from(t)).collect(),
                    labels: b.labels.clone(),
                    positions: b.positions.iter().map(|&p| p as i64).collect(),
                    seq_lens: b.seq_lens(),
                },
                masks: b.masks,
            })
            .collect();
        if batches.is_empty() {
            return Err(format!("corpus '{}' holds no tokens", config.corpus));
        }
        Ok(Self { batches })
    }

    /// The micro-batches of optimizer step `step` (1-based).
    pub fn step_batches(&self, step: usize, count: usize) -> Vec<&TrainBatch> {
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

/// One optimizer step's measurements (a line of `metrics.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean cross-entropy over every labelled token of the global batch.
    pub loss: f64,
    /// Tokens processed in the step (all replicas).
    pub tokens: usize,
    /// Bytes sent by all ranks during the step (attention and gradient all-reduce).
    pub bytes_communicated: u64,
    pub step_ms: f64,
}

/// A rank's groups: the whole world (gradient all-reduce) and its CP group.
pub struct RankGroups {
    pub world: Comm,
    pub cp: CpGroup,
    pub dp_rank: usize,
}

impl RankGroups {
    pub fn new(world: Comm, config: &TrainConfig) -> Result<Self, CpError> {
        let rank = world.rank();
        let dp_rank = rank / config.cp;
        let cp_comm = world.split(dp_rank, rank % config.cp)?;
        Ok(Self {
            cp: CpGroup::new(cp_comm, config.strategy)?,
            world,
            dp_rank,
        })
    }
}

fn int_tensor<B: burn::prelude::Backend>(values: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// Forward and backward of this rank's share of one micro-batch; returns its loss sum (unscaled)
/// and its gradients of `loss_sum / global_labels`.
fn micro_batch_gradients<B: FlashOps>(
    model: &Gpt<CpTrain<B>>,
    groups: &RankGroups,
    batch: &TrainBatch,
    config: &TrainConfig,
    global_labels: usize,
    device: &B::Device,
) -> Result<(f64, GradientsParams), CpError> {
    let sharding = batch.packed.sharding(config.cp, config.layout)?;
    let shard = batch.packed.shard(&sharding, groups.cp.comm.rank());
    let _context = set_context(CpContext {
        group: groups.cp.clone(),
        batch: CpBatch::new(sharding, batch.masks.clone()),
    });
    let loss_sum = model.loss_sum(
        int_tensor(&shard.tokens, device),
        int_tensor(&shard.positions, device),
        int_tensor(&shard.labels, device),
    );
    let value = loss_sum.clone().into_scalar().to_f64();
    let grads = (loss_sum / global_labels as f64).backward();
    Ok((value, GradientsParams::from_grads(grads, model)))
}

/// Sums every parameter's gradient over the world (zeros where a rank has none), in the model's
/// parameter order, which is the same on every rank.
struct AllReduceGradients<'a, B: AutodiffBackend> {
    grads: GradientsParams,
    comm: &'a Comm,
    error: Option<CommError>,
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
        match self.comm.all_reduce(grad.into_data()) {
            Ok(summed) => self.grads.register(
                param.id,
                Tensor::<B::InnerBackend, D>::from_data(summed, &device),
            ),
            Err(error) => self.error = Some(error),
        }
    }
}

/// Gradients of the global mean loss of step `step` (all-reduced over DP×CP), and the loss.
pub fn step_gradients<B: FlashOps>(
    model: &Gpt<CpTrain<B>>,
    groups: &RankGroups,
    config: &TrainConfig,
    data: &TrainData,
    step: usize,
    device: &B::Device,
) -> Result<(f64, GradientsParams, usize), CpError> {
    let batches = data.step_batches(step, config.micro_batches);
    let global_labels: usize = batches.iter().map(|b| b.packed.label_count()).sum();
    let mut accumulator = GradientsAccumulator::<Gpt<CpTrain<B>>>::new();
    let mut loss_sum = 0.0;
    for batch in batches
        .iter()
        .copied()
        .skip(groups.dp_rank)
        .step_by(config.dp)
    {
        let (value, grads) =
            micro_batch_gradients(model, groups, batch, config, global_labels, device)?;
        loss_sum += value;
        accumulator.accumulate(model, grads);
    }
    let mut reducer = AllReduceGradients {
        grads: accumulator.grads(),
        comm: &groups.world,
        error: None,
        phantom: std::marker::PhantomData,
    };
    model.visit(&mut reducer);
    if let Some(error) = reducer.error {
        return Err(error.into());
    }
    let total = groups
        .world
        .all_reduce(TensorData::new(vec![loss_sum], [1]))?;
    let total: f64 = total
        .to_vec::<f64>()
        .map_err(|e| CpError::Input(format!("{e:?}")))?[0];
    let tokens = batches.iter().map(|b| b.packed.tokens.len()).sum();
    Ok((total / global_labels as f64, reducer.grads, tokens))
}

/// Where a run keeps its checkpoint.
pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// Saved training state besides the weights: the last completed step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    pub step: usize,
}

type Recorder_ = NamedMpkFileRecorder<FullPrecisionSettings>;

/// The result of one rank's training.
pub struct RankOutcome {
    pub metrics: Vec<StepMetrics>,
}

/// Hooks of rank 0: called after each step with its metrics (progress, metrics.jsonl).
pub trait StepObserver: Sync {
    fn on_step(&self, metrics: &StepMetrics);
    /// Bytes sent so far by all ranks (read between two barriers).
    fn total_bytes(&self) -> u64;
}

/// Trains on one rank from `start_step` (after loading `resume` if given); rank 0 saves the
/// checkpoint to `out` at the end.
pub fn train_rank<B: FlashOps>(
    world: Comm,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: Option<&Path>,
    observer: &dyn StepObserver,
    device: &B::Device,
) -> Result<RankOutcome, String> {
    let groups = RankGroups::new(world, config).map_err(|e| e.to_string())?;
    let model_config = config.model_config()?;
    let mut model: Gpt<CpTrain<B>> = model_config.init(config.seed, device)?;
    let mut optimizer = AdamWConfig::new().init::<CpTrain<B>, Gpt<CpTrain<B>>>();
    let recorder = Recorder_::new();
    let mut first_step = 1;
    if let Some(dir) = resume {
        let checkpoint = checkpoint_dir(dir);
        model = model
            .load_file(checkpoint.join("model"), &recorder, device)
            .map_err(|e| {
                format!(
                    "cannot load the model checkpoint from {}: {e}",
                    checkpoint.display()
                )
            })?;
        let record = recorder
            .load(checkpoint.join("optimizer"), device)
            .map_err(|e| {
                format!(
                    "cannot load the optimizer checkpoint from {}: {e}",
                    checkpoint.display()
                )
            })?;
        optimizer = optimizer.load_record(record);
        let state: TrainState = read_json(&checkpoint.join("state.json"))?;
        first_step = state.step + 1;
    }
    let mut metrics = Vec::new();
    for step in first_step..=config.steps {
        let started = Instant::now();
        groups.world.barrier().map_err(|e| e.to_string())?;
        let bytes_before = (groups.world.rank() == 0).then(|| observer.total_bytes());
        groups.world.barrier().map_err(|e| e.to_string())?;
        let (loss, grads, tokens) = step_gradients(&model, &groups, config, data, step, device)
            .map_err(|e| e.to_string())?;
        model = optimizer.step(config.learning_rate, model, grads);
        groups.world.barrier().map_err(|e| e.to_string())?;
        if let Some(before) = bytes_before {
            let step_metrics = StepMetrics {
                step,
                loss,
                tokens,
                bytes_communicated: observer.total_bytes() - before,
                step_ms: started.elapsed().as_secs_f64() * 1e3,
            };
            observer.on_step(&step_metrics);
            metrics.push(step_metrics);
        }
        groups.world.barrier().map_err(|e| e.to_string())?;
    }
    if let (Some(out), 0) = (out, groups.world.rank()) {
        save_checkpoint(out, &model, &optimizer, config.steps, &recorder)?;
    }
    Ok(RankOutcome { metrics })
}

fn save_checkpoint<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    out: &Path,
    model: &Gpt<B>,
    optimizer: &O,
    step: usize,
    recorder: &Recorder_,
) -> Result<(), String> {
    let dir = checkpoint_dir(out);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    model
        .clone()
        .save_file(dir.join("model"), recorder)
        .map_err(|e| format!("cannot save the model to {}: {e}", dir.display()))?;
    recorder
        .record(optimizer.to_record(), dir.join("optimizer"))
        .map_err(|e| format!("cannot save the optimizer to {}: {e}", dir.display()))?;
    write_json(&dir.join("state.json"), &TrainState { step })
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not valid: {e}", path.display()))
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
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
