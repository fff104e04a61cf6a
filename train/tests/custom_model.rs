//! A model that is not the GPT, trained through the public engine only: a small causal LM of
//! `burn_dcp::nn` drop-ins (GQA encoder with rotary embeddings, one padded row per sequence).
//! Its per-step losses at cp 2 (ring and Ulysses) and dp 2 × cp 2 equal cp 1's; the same model
//! with burn-nn's own encoder is refused at the first micro-batch.

use burn::backend::flex::FlexDevice;
use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::{Backend, Tensor};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_dcp::comm::{InProcessWorld, WorldConfig};
use burn_dcp::nn::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
use burn_dcp::{Layout, Strategy};
use burn_dcp_train::{
    cross_entropy_sum, CpTrain, InputRows, ModelShape, ShardInput, StepMetrics, StepObserver,
    TpGroup, TrainConfig, TrainData, TrainError, TrainModel, Trainer,
};

type B = CpTrain<Flex>;
const VOCAB: usize = 256;
const D_MODEL: usize = 32;

#[derive(Module, Debug)]
struct TinyLm<B: Backend> {
    embedding: Embedding<B>,
    encoder: TransformerEncoder<B>,
    norm: LayerNorm<B>,
    head: Linear<B>,
}

impl<B: Backend> TinyLm<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 64, 8, 2)
                .with_n_kv_heads(Some(2))
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
            norm: LayerNormConfig::new(D_MODEL).init(device),
            head: LinearConfig::new(D_MODEL, VOCAB).init(device),
        }
    }

    fn shape() -> ModelShape {
        ModelShape {
            vocab_size: VOCAB,
            d_model: D_MODEL,
            n_layers: 2,
            n_heads: 8,
            n_kv_heads: 2,
            d_ff: 64,
            head_dim: None,
            tied_embeddings: false,
        }
    }
}

impl TrainModel<B> for TinyLm<B> {
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

/// The same model on burn-nn's own encoder (attention by matmul + softmax: bypasses the op).
#[derive(Module, Debug)]
struct BurnNnLm<B: Backend> {
    embedding: Embedding<B>,
    encoder: burn::nn::transformer::TransformerEncoder<B>,
    head: Linear<B>,
}

impl TrainModel<B> for BurnNnLm<B> {
    const INPUT_ROWS: InputRows = InputRows::OnePerSequence;

    fn loss_sum(&self, input: ShardInput<B>, _tp: &TpGroup) -> Result<Tensor<B, 1>, TrainError> {
        let [rows, width] = input.tokens.dims();
        let causal =
            burn::nn::attention::generate_autoregressive_mask(rows, width, &input.tokens.device());
        let x = self.embedding.forward(input.tokens);
        let x = self.encoder.forward(
            burn::nn::transformer::TransformerEncoderInput::new(x)
                .mask_pad(input.mask_pad)
                .mask_attn(causal),
        );
        Ok(cross_entropy_sum(self.head.forward(x), input.labels))
    }
}

struct Quiet;
impl StepObserver for Quiet {
    fn on_step(&self, _: &StepMetrics) {}
}

fn config(cp: usize, dp: usize, strategy: Strategy) -> TrainConfig {
    TrainConfig {
        cp,
        dp,
        mode: burn_dcp_train::TrainMode::Static {
            strategy,
            layout: Layout::Zigzag,
        },
        seq_len: 96,
        micro_batches: 2,
        steps: 3,
        corpus: "builtin".into(),
        learning_rate: 1e-2,
        model_shape: Some(TinyLm::<Flex>::shape()),
        ..TrainConfig::default()
    }
}

/// Per-step losses of `config`, every rank starting from the weights in `record`.
fn losses<M, F>(config: &TrainConfig, init: F) -> Result<Vec<f64>, String>
where
    M: TrainModel<B>,
    F: Fn(&FlexDevice) -> M + Sync,
{
    config.validate().map_err(|e| e.to_string())?;
    let data = TrainData::load(config).map_err(|e| e.to_string())?;
    let trainer = Trainer {
        config,
        data: &data,
        resume: None,
        out: None,
        observer: &Quiet,
    };
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let mut results = world.run(|comm| {
        trainer.train_rank::<Flex, M, _>(comm, &Default::default(), |rank| Ok(init(rank.device)))
    });
    let first = results.remove(0)?;
    for other in results {
        other?;
    }
    Ok(first.metrics.iter().map(|m| m.loss).collect())
}

/// The model's initial weights as bytes (burn initialises parameters lazily: recording them
/// draws them once), loaded by every rank.
fn record_of<M: Module<Flex>>(model: M) -> Vec<u8> {
    Recorder::<Flex>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        model.into_record(),
        (),
    )
    .unwrap()
}

fn load<M: Module<B>>(model: M, bytes: &[u8], device: &FlexDevice) -> M {
    let record = Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes.to_vec(),
        device,
    )
    .unwrap();
    model.load_record(record)
}

#[test]
fn a_custom_model_trains_context_parallel_with_cp_1s_losses() {
    let bytes = record_of(TinyLm::<Flex>::new(&Default::default()));
    let init = |device: &FlexDevice| load(TinyLm::<B>::new(device), &bytes, device);
    let want = losses(&config(1, 1, Strategy::Ring), init).unwrap();
    assert!(want.iter().all(|l| l.is_finite() && *l > 0.0), "{want:?}");
    assert!(want[2] < want[0], "the model learns: {want:?}");
    for (cp, dp, strategy) in [
        (2, 1, Strategy::Ring),
        (2, 1, Strategy::Ulysses),
        (2, 2, Strategy::Ring),
    ] {
        let got = losses(&config(cp, dp, strategy), init).unwrap();
        eprintln!("cp {cp} dp {dp} {strategy}: {got:?} (cp 1: {want:?})");
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let rel = ((g - w) / w).abs();
            assert!(
                rel <= 1e-5,
                "cp {cp} dp {dp} {strategy}: step {} loss {g} vs cp 1 {w} (rel {rel:e})",
                step + 1
            );
        }
    }
}

#[test]
fn burn_nns_own_attention_is_refused_at_the_first_micro_batch() {
    let init = |device: &FlexDevice| BurnNnLm::<B> {
        embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
        encoder: burn::nn::transformer::TransformerEncoderConfig::new(D_MODEL, 64, 8, 2)
            .with_dropout(0.0)
            .init(device),
        head: LinearConfig::new(D_MODEL, VOCAB).init(device),
    };
    let error = losses(&config(2, 1, Strategy::Ring), init).unwrap_err();
    for needle in [
        "no attention call was intercepted",
        "MultiHeadAttention",
        "burn_dcp::nn",
    ] {
        assert!(error.contains(needle), "{needle:?} missing from: {error}");
    }
}
