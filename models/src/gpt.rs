//! A GPT for long-context training, written as an ordinary burn model generic over `B: Backend`.
//!
//! Token embedding → `n_layers` pre-norm blocks (RMSNorm → multi-head attention with RoPE on the
//! tokens' *global* positions → residual; RMSNorm → GELU MLP → residual) → RMSNorm → LM head (tied
//! to the embedding or untied). Attention calls burn's `attention` op with `is_causal = true`, no
//! mask tensor and the real kv heads (`burn_dcp::nn::grouped_attention`). There is no context-parallel code here: under `ContextParallel<Autodiff<B>>`
//! with a CP context, the same call runs the CP strategy on this rank's tokens.
//!
//! Inputs are one packed micro-batch (or this rank's shard of it): `tokens [T]`, `positions [T]`
//! (each token's position within its own sequence, which is what makes RoPE correct when a shard
//! holds non-contiguous tokens), `labels [T]` with `-1` where there is no next token.

use crate::error::ModelError;
use crate::rope::{Rope, RopeScaling, RopeSettings};
pub use crate::tensors::reshape;
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::prelude::{Backend, Config, Int, Tensor, TensorData};
use burn::tensor::activation::{gelu, log_softmax, silu};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::FloatDType;
use burn_dcp::heads::Heads;
use burn_dcp::nn::grouped_attention;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The feed-forward network of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// `down(gelu(up(x)))`: the GPT's.
    Gelu,
    /// `down(silu(gate(x)) · up(x))`: the Llama family's (Hugging Face's `LlamaMLP`, `hidden_act`
    /// `silu`).
    Swiglu,
}

/// Model hyper-parameters: the GPT of this crate and the Llama family (Llama, Mistral, Qwen2) of
/// Hugging Face transformers, which differ only in the fields below.
#[derive(Config, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); must divide `n_heads`.
    pub n_kv_heads: usize,
    pub d_ff: usize,
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// Share the LM head with the token embedding.
    #[config(default = true)]
    pub tied_embeddings: bool,
    /// The MLP (GELU for the GPT, SwiGLU for the Llama family).
    #[config(default = "Mlp::Gelu")]
    pub mlp: Mlp,
    /// RMSNorm's ε (`rms_norm_eps`).
    #[config(default = 1e-5)]
    pub rms_norm_eps: f64,
    /// The width of one head when it is not `d_model / n_heads` (Hugging Face's `head_dim`).
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Biases on the q, k and v projections (`attention_bias`; Qwen2 has them).
    #[config(default = false)]
    pub attention_bias: bool,
    /// RoPE's rescaling for a longer context (`rope_scaling`).
    #[config(default = "None")]
    pub rope_scaling: Option<RopeScaling>,
    /// Weights drawn as transformers draws them, normal with this standard deviation
    /// (`initializer_range`); `None`: the GPT's own (uniform, `1/√d_in` for projections, 0.02 for
    /// the embedding).
    #[config(default = "None")]
    pub initializer_range: Option<f64>,
}

impl GptConfig {
    /// The query and kv heads ([`Heads`]' rules: kv heads divide the query heads).
    pub fn heads(&self) -> Result<Heads, ModelError> {
        Heads::new(self.n_heads, self.n_kv_heads).map_err(|e| ModelError::Config(e.to_string()))
    }

    /// Checks the shape rules, naming the values.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("d_ff", self.d_ff),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, value)| *value == 0) {
            return Err(ModelError::Config(format!(
                "{name} must be positive, not 0"
            )));
        }
        match self.head_dim {
            Some(0) => {
                return Err(ModelError::Config(
                    "head_dim must be positive, not 0".into(),
                ))
            }
            None if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) => {
                return Err(ModelError::Config(format!(
                    "d_model {} must be a multiple of n_heads {} (or head_dim given)",
                    self.d_model, self.n_heads
                )))
            }
            _ => {}
        }
        self.heads()?;
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "the head dim {} must be even for RoPE",
                self.head_dim()
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelError::Config(format!(
                "rms_norm_eps {} must be a positive number",
                self.rms_norm_eps
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(ModelError::Config(format!(
                "rope_theta {} must be a positive number",
                self.rope_theta
            )));
        }
        if let Some(scaling) = &self.rope_scaling {
            scaling.validate()?;
        }
        match self.initializer_range {
            Some(std) if !(std.is_finite() && std > 0.0) => Err(ModelError::Config(format!(
                "initializer_range {std} must be a positive number"
            ))),
            _ => Ok(()),
        }
    }

    /// The width of one head: `head_dim`, or `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// RoPE's base and rescaling.
    pub fn rope(&self) -> RopeSettings {
        RopeSettings {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
        }
    }

    /// The parameters of the whole model (what transformers' `num_parameters()` counts for the
    /// same configuration: the tied head once).
    pub fn parameter_count(&self) -> usize {
        let (d, ff) = (self.d_model, self.d_ff);
        let q = self.n_heads * self.head_dim();
        let kv = self.n_kv_heads * self.head_dim();
        let bias = match self.attention_bias {
            true => q + 2 * kv,
            false => 0,
        };
        let mlp = match self.mlp {
            Mlp::Gelu => 2 * d * ff,
            Mlp::Swiglu => 3 * d * ff,
        };
        let block = 2 * d + d * (2 * q + 2 * kv) + bias + mlp;
        let head = match self.tied_embeddings {
            true => 0,
            false => self.vocab_size * d,
        };
        self.vocab_size * d + self.n_layers * block + d + head
    }

    /// Builds the model with weights drawn from a generator seeded with `seed` (not from the
    /// backend's global RNG), so every rank thread builds identical weights independently.
    pub fn init<B: Backend>(&self, seed: u64, device: &B::Device) -> Result<Gpt<B>, ModelError> {
        self.validate()?;
        let mut init = Init {
            rng: SmallRng::seed_from_u64(seed),
            device: device.clone(),
            std: self.initializer_range,
        };
        let d = self.d_model;
        let q_dim = self.n_heads * self.head_dim();
        let kv_dim = self.n_kv_heads * self.head_dim();
        let bias = self.attention_bias;
        let norm = || {
            RmsNormConfig::new(d)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let blocks = (0..self.n_layers)
            .map(|_| Block {
                attn_norm: norm(),
                q: init.linear(d, q_dim, bias),
                k: init.linear(d, kv_dim, bias),
                v: init.linear(d, kv_dim, bias),
                o: init.linear(q_dim, d, false),
                mlp_norm: norm(),
                gate: (self.mlp == Mlp::Swiglu).then(|| init.linear(d, self.d_ff, false)),
                up: init.linear(d, self.d_ff, false),
                down: init.linear(self.d_ff, d, false),
            })
            .collect();
        let mut embedding = EmbeddingConfig::new(self.vocab_size, d).init(device);
        embedding.weight = init.param([self.vocab_size, d], 0.02);
        let head = (!self.tied_embeddings).then(|| init.linear(d, self.vocab_size, false));
        Ok(Gpt {
            embedding,
            blocks,
            norm: norm(),
            head,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim(),
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
        })
    }
}

impl GptConfig {
    /// The model with every weight zero (norm gains one): the shape to load a record into,
    /// built without drawing a weight.
    pub fn skeleton<B: Backend>(&self, device: &B::Device) -> Result<Gpt<B>, ModelError> {
        self.validate()?;
        let d = self.d_model;
        let q_dim = self.n_heads * self.head_dim();
        let kv_dim = self.n_kv_heads * self.head_dim();
        let linear = |d_in: usize, d_out: usize, bias: bool| Linear {
            weight: Param::from_tensor(Tensor::zeros([d_in, d_out], device)),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
        };
        let norm = || {
            RmsNormConfig::new(d)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let bias = self.attention_bias;
        let blocks = (0..self.n_layers)
            .map(|_| Block {
                attn_norm: norm(),
                q: linear(d, q_dim, bias),
                k: linear(d, kv_dim, bias),
                v: linear(d, kv_dim, bias),
                o: linear(q_dim, d, false),
                mlp_norm: norm(),
                gate: (self.mlp == Mlp::Swiglu).then(|| linear(d, self.d_ff, false)),
                up: linear(d, self.d_ff, false),
                down: linear(self.d_ff, d, false),
            })
            .collect();
        Ok(Gpt {
            embedding: Embedding {
                weight: Param::from_tensor(Tensor::zeros([self.vocab_size, d], device)),
            },
            blocks,
            norm: norm(),
            head: (!self.tied_embeddings).then(|| linear(d, self.vocab_size, false)),
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim(),
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
        })
    }
}

struct Init<B: Backend> {
    rng: SmallRng,
    device: B::Device,
    /// transformers' normal init with this deviation, for every matrix; `None`: the GPT's.
    std: Option<f64>,
}

impl<B: Backend> Init<B> {
    /// Normal with deviation `initializer_range` when given (transformers' `_init_weights`),
    /// else uniform in `[-std·√3, std·√3]` (variance `std²`).
    fn param(&mut self, dims: [usize; 2], std: f64) -> Param<Tensor<B, 2>> {
        let count = dims[0] * dims[1];
        let values: Vec<f32> = match self.std {
            Some(std) => normal_values(self.rng.random(), count, std),
            None => {
                let bound = (std * 3f64.sqrt()) as f32;
                (0..count)
                    .map(|_| self.rng.random_range(-bound..bound))
                    .collect()
            }
        };
        Param::from_tensor(Tensor::from_data(
            TensorData::new(values, dims),
            &self.device,
        ))
    }

    /// A projection `[d_in, d_out]` (burn's layout: `x · W`), with a zero bias if `bias`.
    fn linear(&mut self, d_in: usize, d_out: usize, bias: bool) -> Linear<B> {
        let mut linear = LinearConfig::new(d_in, d_out)
            .with_bias(bias)
            .init(&self.device);
        linear.weight = self.param([d_in, d_out], (1.0 / d_in as f64).sqrt());
        linear.bias = bias.then(|| Param::from_tensor(Tensor::zeros([d_out], &self.device)));
        linear
    }
}

/// `count` draws of a normal with deviation `std`, from generators seeded by `seed` and the
/// index of each chunk of [`NORMAL_CHUNK`] values (Box–Muller, both outputs of each pair): the
/// same values whatever the number of threads, drawn on all of them (a 1 B-parameter model's
/// weights in seconds).
fn normal_values(seed: u64, count: usize, std: f64) -> Vec<f32> {
    let mut values = vec![0f32; count];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunks: Vec<(usize, &mut [f32])> = values.chunks_mut(NORMAL_CHUNK).enumerate().collect();
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let mut chunks = chunks.into_iter();
    std::thread::scope(|scope| loop {
        let batch: Vec<_> = chunks.by_ref().take(per_thread).collect();
        if batch.is_empty() {
            break;
        }
        scope.spawn(move || {
            for (index, chunk) in batch {
                let mut rng = SmallRng::seed_from_u64(
                    seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                for pair in chunk.chunks_mut(2) {
                    let u: f64 = 1.0 - rng.random::<f64>();
                    let angle = 2.0 * std::f64::consts::PI * rng.random::<f64>();
                    let radius = std * (-2.0 * u.ln()).sqrt();
                    pair[0] = (radius * angle.cos()) as f32;
                    if let Some(second) = pair.get_mut(1) {
                        *second = (radius * angle.sin()) as f32;
                    }
                }
            }
        });
    });
    values
}

/// Values per independently seeded chunk of [`normal_values`].
const NORMAL_CHUNK: usize = 1 << 16;

/// Sum of the cross-entropy of `[n, vocab]` logits against `[n]` labels over the labels `≥ 0`
/// (labels `< 0` are ignored), as a `[1]` tensor; the softmax and the loss in f32, whatever the
/// model computes in. Divide by the step's *global* label count (all CP and DP ranks) for the
/// mean loss: gradients summed over ranks are then the mean's gradients.
pub fn cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let count = labels.dims()[0];
    let log_probs = log_softmax(logits.cast(FloatDType::F32), 1);
    let valid = labels.clone().greater_equal_elem(0);
    let targets = reshape(labels.clamp_min(0), [count, 1]);
    let picked = reshape(log_probs.gather(1, targets), [count]);
    let zeros = picked.zeros_like();
    zeros.mask_where(valid, picked).sum().neg()
}

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub(crate) attn_norm: RmsNorm<B>,
    pub(crate) q: Linear<B>,
    pub(crate) k: Linear<B>,
    pub(crate) v: Linear<B>,
    pub(crate) o: Linear<B>,
    pub(crate) mlp_norm: RmsNorm<B>,
    /// SwiGLU's gate projection (`None`: a GELU MLP).
    pub(crate) gate: Option<Linear<B>>,
    pub(crate) up: Linear<B>,
    pub(crate) down: Linear<B>,
}

/// The GPT (or a Llama-family model: see [`GptConfig`]).
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    pub(crate) embedding: Embedding<B>,
    pub(crate) blocks: Vec<Block<B>>,
    pub(crate) norm: RmsNorm<B>,
    pub(crate) head: Option<Linear<B>>,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rope_theta: f64,
    pub(crate) rope_scaling: Option<RopeScaling>,
}

impl<B: Backend> Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Tensor<B, 3> {
        let head_dim = self.q.weight.dims()[1] / n_heads;
        let h = self.attn_norm.forward(x.clone());
        let merged = self_attention(
            [&self.q, &self.k, &self.v],
            h,
            rope,
            n_heads,
            n_kv_heads,
            head_dim,
        );
        let x = x + self.o.forward(merged);
        let h = self.mlp_norm.forward(x.clone());
        x.clone() + mlp(self.gate.as_ref(), &self.up, &self.down, h)
    }
}

/// The feed-forward network on the normalised input `h`: `down(silu(gate(h)) · up(h))` with a
/// gate (SwiGLU), else `down(gelu(up(h)))`. Shared by the plain block and its TP shard.
pub(crate) fn mlp<B: Backend>(
    gate: Option<&Linear<B>>,
    up: &Linear<B>,
    down: &Linear<B>,
    h: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let hidden = match gate {
        Some(gate) => silu(gate.forward(h.clone())) * up.forward(h),
        None => gelu(up.forward(h)),
    };
    down.forward(hidden)
}

/// The attention of a block on its normalised input `h [1, T, d]`: Q/K/V projections of
/// `heads` / `kv_heads` heads (RoPE on Q and K), causal attention with the real kv heads
/// ([`grouped_attention`]: on `ContextParallel` the strategies move `kv_heads` heads, not
/// `heads` copies), heads merged back to `[1, T, heads·Dh]` (before the output projection).
/// Shared by the plain block and its TP shard, which passes its own heads.
pub(crate) fn self_attention<B: Backend>(
    [q, k, v]: [&Linear<B>; 3],
    h: Tensor<B, 3>,
    rope: &Rope<B>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Tensor<B, 3> {
    let tokens = h.dims()[1];
    // [1, T, heads·Dh] → [1, heads, T, Dh]
    let split =
        |t: Tensor<B, 3>, heads: usize| reshape(t, [1, tokens, heads, head_dim]).swap_dims(1, 2);
    let q = rope.apply(split(q.forward(h.clone()), heads));
    let k = rope.apply(split(k.forward(h.clone()), kv_heads));
    let v = split(v.forward(h), kv_heads);
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    let attended = grouped_attention(q, k, v, None, None, options);
    reshape(attended.swap_dims(1, 2), [1, tokens, heads * head_dim])
}

impl<B: Backend> Gpt<B> {
    /// The model with RoPE's base and scaling replaced (`--rope-theta`, `--rope-scaling` over a
    /// checkpoint's).
    pub fn with_rope(mut self, settings: RopeSettings) -> Self {
        self.rope_theta = settings.theta;
        self.rope_scaling = settings.scaling;
        self
    }

    /// Logits `[T, vocab]` of `tokens [T]` at `positions [T]`.
    pub fn forward(&self, tokens: Tensor<B, 1, Int>, positions: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        let count = tokens.dims()[0];
        let settings = RopeSettings {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
        };
        let rope = Rope::new(&positions, self.head_dim, &settings);
        let mut x = self.embedding.forward(reshape(tokens, [1, count]));
        for block in &self.blocks {
            x = block.forward(x, &rope, self.n_heads, self.n_kv_heads);
        }
        let x = reshape(self.norm.forward(x), [count, self.d_model()]);
        match &self.head {
            Some(head) => head.forward(x),
            None => x.matmul(self.embedding.weight.val().transpose()),
        }
    }

    /// Sum of the next-token cross-entropy over tokens whose label is `≥ 0` (labels `< 0` are
    /// ignored), as a `[1]` tensor. Divide by the *global* label count of the step (all CP and DP
    /// ranks) to get the mean loss; gradients summed over ranks are then the mean's gradients.
    pub fn loss_sum(
        &self,
        tokens: Tensor<B, 1, Int>,
        positions: Tensor<B, 1, Int>,
        labels: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        cross_entropy_sum(self.forward(tokens, positions), labels)
    }

    fn d_model(&self) -> usize {
        self.embedding.weight.dims()[1]
    }
}
