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
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::prelude::{Backend, Config, Int, Shape, Tensor, TensorData};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{BasicOps, FloatDType};
use burn_dcp::heads::Heads;
use burn_dcp::nn::grouped_attention;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Model hyper-parameters.
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
}

impl GptConfig {
    /// Named sizes: `tiny`, `small`, `base`.
    pub fn sized(name: &str, vocab_size: usize) -> Result<Self, ModelError> {
        let (d_model, n_layers, n_heads, n_kv_heads) = match name {
            "tiny" => (64, 2, 4, 2),
            "small" => (128, 4, 8, 4),
            "base" => (256, 6, 8, 4),
            other => {
                return Err(ModelError::Config(format!(
                    "unknown model size '{other}': expected tiny, small or base"
                )))
            }
        };
        Ok(Self::new(
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads,
            4 * d_model,
        ))
    }

    /// The query and kv heads ([`Heads`]' rules: kv heads divide the query heads).
    pub fn heads(&self) -> Result<Heads, ModelError> {
        Heads::new(self.n_heads, self.n_kv_heads).map_err(|e| ModelError::Config(e.to_string()))
    }

    /// Checks the shape rules, naming the values.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ModelError::Config(format!(
                "d_model {} must be a multiple of n_heads {}",
                self.d_model, self.n_heads
            )));
        }
        self.heads()?;
        if !(self.d_model / self.n_heads).is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "the head dim {} must be even for RoPE",
                self.d_model / self.n_heads
            )));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Builds the model with weights drawn from a generator seeded with `seed` (not from the
    /// backend's global RNG), so every rank thread builds identical weights independently.
    pub fn init<B: Backend>(&self, seed: u64, device: &B::Device) -> Result<Gpt<B>, ModelError> {
        self.validate()?;
        let mut init = Init {
            rng: SmallRng::seed_from_u64(seed),
            device: device.clone(),
        };
        let kv_dim = self.n_kv_heads * self.head_dim();
        let blocks = (0..self.n_layers)
            .map(|_| Block {
                attn_norm: RmsNormConfig::new(self.d_model).init(device),
                q: init.linear(self.d_model, self.d_model),
                k: init.linear(self.d_model, kv_dim),
                v: init.linear(self.d_model, kv_dim),
                o: init.linear(self.d_model, self.d_model),
                mlp_norm: RmsNormConfig::new(self.d_model).init(device),
                up: init.linear(self.d_model, self.d_ff),
                down: init.linear(self.d_ff, self.d_model),
            })
            .collect();
        let mut embedding = EmbeddingConfig::new(self.vocab_size, self.d_model).init(device);
        embedding.weight = init.param([self.vocab_size, self.d_model], 0.02);
        let head = (!self.tied_embeddings).then(|| init.linear(self.d_model, self.vocab_size));
        Ok(Gpt {
            embedding,
            blocks,
            norm: RmsNormConfig::new(self.d_model).init(device),
            head,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            rope_theta: self.rope_theta,
        })
    }
}

struct Init<B: Backend> {
    rng: SmallRng,
    device: B::Device,
}

impl<B: Backend> Init<B> {
    /// Uniform in `[-std·√3, std·√3]` (variance `std²`).
    fn param(&mut self, dims: [usize; 2], std: f64) -> Param<Tensor<B, 2>> {
        let bound = (std * 3f64.sqrt()) as f32;
        let values: Vec<f32> = (0..dims[0] * dims[1])
            .map(|_| self.rng.random_range(-bound..bound))
            .collect();
        Param::from_tensor(Tensor::from_data(
            TensorData::new(values, dims),
            &self.device,
        ))
    }

    fn linear(&mut self, d_in: usize, d_out: usize) -> Linear<B> {
        let mut linear = LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .init(&self.device);
        linear.weight = self.param([d_in, d_out], (1.0 / d_in as f64).sqrt());
        linear
    }
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
    pub(crate) up: Linear<B>,
    pub(crate) down: Linear<B>,
}

/// The GPT.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    pub(crate) embedding: Embedding<B>,
    pub(crate) blocks: Vec<Block<B>>,
    pub(crate) norm: RmsNorm<B>,
    pub(crate) head: Option<Linear<B>>,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) rope_theta: f64,
}

/// `tensor.reshape(dims)` that also works when a dim of `dims` is 0 (a CP rank holding no token):
/// burn 0.21's `Tensor::reshape` reads a 0 in the target as "keep the source's dim at this index"
/// (ONNX style), so `[0, 8] → [1, 1, 0, 8]` panics and `[1, 0, 8] → [0, 8]` picks the wrong dims.
/// The backend op takes the shape as given (and autodiff records it as usual).
pub fn reshape<B: Backend, const D1: usize, const D2: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D1, K>,
    dims: [usize; D2],
) -> Tensor<B, D2, K> {
    let elements: usize = dims.iter().product();
    assert_eq!(
        tensor.shape().num_elements(),
        elements,
        "reshape of a {:?} tensor to {dims:?}",
        tensor.dims()
    );
    Tensor::from_primitive(K::reshape(tensor.into_primitive(), Shape::from(dims)))
}

/// RoPE rotation tables for given positions: `cos`, `sin` of shape `[1, 1, T, head_dim/2]`.
pub(crate) struct Rope<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> Rope<B> {
    pub(crate) fn new(positions: &Tensor<B, 1, Int>, head_dim: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let device = positions.device();
        let inverse_frequencies: Vec<f32> = (0..half)
            .map(|i| theta.powf(-(2.0 * i as f64) / head_dim as f64) as f32)
            .collect();
        let frequencies =
            Tensor::<B, 1>::from_data(TensorData::new(inverse_frequencies, [half]), &device);
        let tokens = positions.dims()[0];
        // angle[t, i] = position[t] · θ^(−2i/D)
        let angles =
            reshape(positions.clone().float(), [tokens, 1]) * frequencies.reshape([1, half]);
        Self {
            cos: reshape(angles.clone().cos(), [1, 1, tokens, half]),
            sin: reshape(angles.sin(), [1, 1, tokens, half]),
        }
    }

    /// Rotates `x [1, heads, T, head_dim]` (half-split convention). The tables are computed in
    /// f32 and rounded to `x`'s dtype (bf16 training rotates bf16 queries and keys).
    pub(crate) fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [_, _, _, dim] = x.dims();
        let half = dim / 2;
        let dtype = x.dtype();
        let (cos, sin) = (self.cos.clone().cast(dtype), self.sin.clone().cast(dtype));
        // Nothing to rotate on a rank without tokens (and burn-flex 0.21 narrows an empty bf16
        // tensor into an empty f32 one).
        if x.shape().num_elements() == 0 {
            return x;
        }
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.narrow(3, half, half);
        let rotated_1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let rotated_2 = x1 * sin + x2 * cos;
        Tensor::cat(vec![rotated_1, rotated_2], 3)
    }
}

impl<B: Backend> Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Tensor<B, 3> {
        let head_dim = x.dims()[2] / n_heads;
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
        x.clone() + self.down.forward(gelu(self.up.forward(h)))
    }
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
    /// Logits `[T, vocab]` of `tokens [T]` at `positions [T]`.
    pub fn forward(&self, tokens: Tensor<B, 1, Int>, positions: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        let count = tokens.dims()[0];
        let rope = Rope::new(&positions, self.head_dim(), self.rope_theta);
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
        let count = tokens.dims()[0];
        // The softmax and the loss in f32, whatever the model computes in.
        let logits = self.forward(tokens, positions).cast(FloatDType::F32);
        let log_probs = log_softmax(logits, 1);
        let valid = labels.clone().greater_equal_elem(0);
        let targets = reshape(labels.clamp_min(0), [count, 1]);
        let picked = reshape(log_probs.gather(1, targets), [count]);
        let zeros = picked.zeros_like();
        zeros.mask_where(valid, picked).sum().neg()
    }

    fn d_model(&self) -> usize {
        self.embedding.weight.dims()[1]
    }

    fn head_dim(&self) -> usize {
        self.d_model() / self.n_heads
    }
}
