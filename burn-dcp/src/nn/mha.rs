//! burn-nn 0.21's `MultiHeadAttention`, computed by burn's `attention` op.

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::{Dropout, DropoutConfig, Gelu, Linear, LinearConfig};
use burn::prelude::{Backend, Bool, Tensor};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::ops::AttentionModuleOptions;

use super::attention::grouped_attention;
use crate::backend::{current_context, is_context_parallel, CpContext};
use crate::error::HeadError;
use crate::tensors::{bool_values, exact_reshape, repeat_kv_heads};
use burn_dcp_kernels::heads::Heads;

/// Configuration of a [`MultiHeadAttention`]: burn-nn 0.21's `MultiHeadAttentionConfig` (same
/// fields, defaults and builders) plus `n_kv_heads` (grouped-query attention).
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The dropout rate on the attention scores. Default: 0.1 (as burn-nn). Under a CP context
    /// only 0 is allowed: the scores never exist as a tensor there.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The value masked scores get in burn-nn's matmul + softmax path. Default: -1.0e4.
    /// burn's attention op masks with −∞ instead (the same weights unless scores reach ~1e4);
    /// a value above -1.0e4 makes the module use the matmul + softmax path without a CP context.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Use "quiet softmax" instead of regular softmax (not under a CP context).
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The type of function used to initialize neural network parameters.
    #[config(default = "Initializer::KaimingUniform{gain:1.0/f64::sqrt(3.0), fan_out_only:false}")]
    pub initializer: Initializer,
    /// Extension (burn-nn has none): key/value heads of grouped-query attention, dividing
    /// `n_heads`. `None` is `n_heads`. The key and value layers then have
    /// `n_kv_heads · d_model / n_heads` outputs.
    pub n_kv_heads: Option<usize>,
}

/// Multi-head attention with burn-nn 0.21's public API and record layout, computed by burn's
/// `attention` op so that `ContextParallel` runs it across the CP group.
///
/// - Without a CP context it equals burn-nn's module for the same record and input (masks
///   included). Configurations the op cannot express (dropout while training, quiet softmax,
///   a `mask_attn` that is not the causal mask and leaves a query no key, `min_float` above
///   -1.0e4) take burn-nn's matmul + softmax path, which also returns the weights.
/// - Under a CP context ([`crate::backend::set_context`]) on a `ContextParallel<…>` backend the
///   op runs the context's strategy; what it cannot do there panics at the call with the rule:
///   dropout > 0, quiet softmax, a dense `mask_attn` that is not causal (the masks go in the
///   context as `MaskSpec`s), a `mask_pad` that differs from the context's padding, a backend
///   that is not `ContextParallel`.
/// - `MhaOutput::weights` is `None` whenever the op ran (they are `[B, H, S, S]`: they cannot
///   exist at long context).
/// - burn-nn's `forward_cache` (autoregressive decoding) is not provided: load the record into
///   burn-nn's module for cached decoding.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: Backend> {
    /// Linear layer to transform the input features into the query space.
    pub query: Linear<B>,
    /// Linear layer to transform the input features into the key space.
    pub key: Linear<B>,
    /// Linear layer to transform the input features into the value space.
    pub value: Linear<B>,
    /// Linear layer to transform the output features back to the original space.
    pub output: Linear<B>,
    /// Dropout layer.
    pub dropout: Dropout,
    /// Activation function (unused, as in burn-nn; kept for the same module layout).
    pub activation: Gelu,
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// Size of the key and query vectors.
    pub d_k: usize,
    /// Minimum value a float can take.
    pub min_float: f64,
    /// Use "quiet softmax" instead of regular softmax.
    pub quiet_softmax: bool,
}

impl MultiHeadAttentionConfig {
    /// Initialize a new [multihead attention](MultiHeadAttention) module (the same parameter draws
    /// as burn-nn's for the same seed when `n_kv_heads` is `None`).
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        self.check().unwrap_or_else(|message| panic!("{message}"));
        let d_k = self.d_model / self.n_heads;
        let kv_dim = self.n_kv_heads.unwrap_or(self.n_heads) * d_k;
        let linear = |d_output: usize| {
            LinearConfig::new(self.d_model, d_output)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        MultiHeadAttention {
            query: linear(self.d_model),
            key: linear(kv_dim),
            value: linear(kv_dim),
            output: linear(self.d_model),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            n_heads: self.n_heads,
            d_k,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
            d_model: self.d_model,
        }
    }

    fn check(&self) -> Result<(), HeadError> {
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return Err(HeadError::Width {
                d_model: self.d_model,
                heads: self.n_heads,
            });
        }
        if let Some(kv) = self.n_kv_heads {
            // The rule is `Heads`'; the message names burn's config fields.
            Heads::new(self.n_heads, kv).map_err(|_| HeadError::KvHeads {
                kv_heads: kv,
                heads: self.n_heads,
            })?;
        }
        Ok(())
    }
}

/// [Multihead attention](MultiHeadAttention) forward pass input argument (burn-nn's `MhaInput`).
#[derive(Debug, Clone)]
pub struct MhaInput<B: Backend> {
    /// Shape `[batch_size, seq_length_1, d_model]`
    query: Tensor<B, 3>,
    /// Shape `[batch_size, seq_length_2, d_model]`
    key: Tensor<B, 3>,
    /// Shape `[batch_size, seq_length_2, d_model]`
    value: Tensor<B, 3>,
    options: InputOptions<B>,
}

/// What an attention input holds beside its tensors, set by the builders of [`MhaInput`] and
/// [`TransformerEncoderInput`](super::TransformerEncoderInput).
#[derive(Debug, Clone, Default)]
pub(super) struct InputOptions<B: Backend> {
    pub(super) masks: Masks<B>,
    /// The base of the rotary embeddings, if any.
    pub(super) rope_theta: Option<f32>,
}

/// The builders of an input's [`InputOptions`], the same on [`MhaInput`] and
/// [`TransformerEncoderInput`](super::TransformerEncoderInput).
macro_rules! input_options {
    () => {
        /// Register the padding mask `[batch_size, seq_length_2]` (`true` at padding).
        pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
            self.options.masks.pad = Some(mask_pad);
            self
        }

        /// Register the attention mask `[batch_size, seq_length_1, seq_length_2]` (`true` = masked).
        /// burn-nn's `generate_autoregressive_mask` becomes the op's `is_causal`.
        pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
            self.options.masks.attn = Some(mask_attn);
            self
        }

        /// Extension: causal attention without a dense `[B, S, S]` mask (what
        /// `mask_attn(generate_autoregressive_mask(..))` means, at any length).
        pub fn causal(mut self) -> Self {
            self.options.masks.causal = true;
            self
        }

        /// Extension: rotary position embedding (RoFormer) of the queries and keys of every head,
        /// with base `theta` (10000 in most models), each token at its position — its global
        /// position under a CP context. An input option rather than a config field, so that the
        /// module's record keeps burn-nn's layout.
        ///
        /// # Panics
        /// In `forward`, when `theta` is not a positive number or the head dim is odd.
        pub fn rotary(mut self, theta: f32) -> Self {
            self.options.rope_theta = Some(theta);
            self
        }
    };
}
pub(super) use input_options;

impl<B: Backend> MhaInput<B> {
    /// Query, key and value all `tensor` (`[batch_size, seq_length, d_model]`).
    pub fn self_attn(tensor: Tensor<B, 3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// Query `[batch_size, seq_length_1, d_model]`, key and value `[batch_size, seq_length_2, d_model]`.
    pub fn new(query: Tensor<B, 3>, key: Tensor<B, 3>, value: Tensor<B, 3>) -> Self {
        Self {
            query,
            key,
            value,
            options: InputOptions::default(),
        }
    }

    /// The masks, causality and rotary base of another input (a layer's share of a
    /// [`TransformerEncoderInput`](super::TransformerEncoderInput)).
    pub(super) fn with_options(mut self, options: InputOptions<B>) -> Self {
        self.options = options;
        self
    }

    input_options!();
}

/// [Multihead attention](MultiHeadAttention) outputs.
#[derive(Debug, Clone)]
pub struct MhaOutput<B: Backend> {
    /// The attention weights `[batch_size, n_heads, seq_length_1, seq_length_2]`, only where the
    /// module computed them (burn-nn's matmul + softmax path); `None` whenever burn's attention op
    /// ran, always under a CP context.
    pub weights: Option<Tensor<B, 4>>,
    /// The context tensor `[batch_size, seq_length_1, d_model]`.
    pub context: Tensor<B, 3>,
}

impl<B: Backend> MultiHeadAttention<B> {
    /// Key/value heads (from the key layer's outputs).
    pub fn n_kv_heads(&self) -> usize {
        self.key.weight.dims()[1] / self.d_k.max(1)
    }

    /// Applies the forward pass on the input tensors.
    ///
    /// # Shapes
    ///
    /// - query: `[batch_size, seq_length_1, d_model]`
    /// - key: `[batch_size, seq_length_2, d_model]`
    /// - value: `[batch_size, seq_length_2, d_model]`
    /// - output: `[batch_size, seq_length_1, d_model]`
    ///
    /// # Panics
    ///
    /// Under a CP context, on what CP attention cannot compute (see [`MultiHeadAttention`]).
    pub fn forward(&self, input: MhaInput<B>) -> MhaOutput<B> {
        let [batch_size, seq_length_1, _] = input.query.dims();
        let kv_heads = self.n_kv_heads();
        let InputOptions { masks, rope_theta } = input.options;
        let query = self.rotate(
            self.attention_linear(input.query, &self.query, self.n_heads),
            rope_theta,
        );
        let key = self.rotate(
            self.attention_linear(input.key, &self.key, kv_heads),
            rope_theta,
        );
        let value = self.attention_linear(input.value, &self.value, kv_heads);
        let (context, weights) = match current_context() {
            Some(cp) => (self.attend_cp(&cp, query, key, value, masks), None),
            None => self.attend(query, key, value, masks),
        };
        let context = exact_reshape(
            context.swap_dims(1, 2),
            [batch_size, seq_length_1, self.n_heads * self.d_k],
        );
        MhaOutput {
            weights,
            context: self.output.forward(context),
        }
    }

    /// The rotary extension on `[B, heads, S, d_k]`: each token at its position (under a CP
    /// context the global one, else `0..S`).
    fn rotate(&self, x: Tensor<B, 4>, theta: Option<f32>) -> Tensor<B, 4> {
        let Some(theta) = theta else {
            return x;
        };
        assert!(
            theta > 0.0 && theta.is_finite(),
            "MultiHeadAttention: rotary theta {theta} must be a positive number"
        );
        assert!(
            self.d_k.is_multiple_of(2),
            "MultiHeadAttention: rotary embeddings need an even head dim, got {}",
            self.d_k
        );
        let [batch, _, seq, _] = x.dims();
        let positions = super::context_positions(batch, seq)
            .unwrap_or_else(|| (0..batch).flat_map(|_| 0..seq as i64).collect());
        super::rope::rotate_at(x, positions, theta)
    }

    /// `[B, S, d]` → `[B, heads, S, d_k]`.
    fn attention_linear(&self, x: Tensor<B, 3>, linear: &Linear<B>, heads: usize) -> Tensor<B, 4> {
        let [batch_size, seq_length, _] = x.dims();
        exact_reshape(linear.forward(x), [batch_size, seq_length, heads, self.d_k]).swap_dims(1, 2)
    }

    /// Without a CP context: the op where it computes what burn-nn computes, else burn-nn's path.
    fn attend(
        &self,
        query: Tensor<B, 4>,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        masks: Masks<B>,
    ) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
        let [batch, heads, seq_1, _] = query.dims();
        let seq_2 = key.dims()[2];
        let device = query.device();
        if masks.causal && seq_1 != seq_2 {
            panic!("MultiHeadAttention: `.causal()` needs as many queries as keys, got {seq_1} and {seq_2}");
        }
        let dropout = self.dropout.prob > 0.0 && B::ad_enabled(&device);
        let host = masks.host(batch, seq_1, seq_2);
        let op_path = !dropout
            && !self.quiet_softmax
            && self.min_float <= -1.0e4
            && host.every_query_keeps_a_key(batch, seq_1, seq_2);
        if !op_path {
            return self.attend_matmul(query, key, value, masks);
        }
        let is_causal = masks.causal || (masks.attn.is_some() && host.attn_is_causal);
        let dense = match (masks.pad, masks.attn) {
            (pad, Some(attn)) if !host.attn_is_causal => {
                let attn = exact_reshape(attn, [batch, 1, seq_1, seq_2]);
                Some(match pad {
                    Some(pad) => attn.bool_or(exact_reshape(pad, [batch, 1, 1, seq_2])),
                    None => attn,
                })
            }
            (Some(pad), _) => Some(exact_reshape(pad, [batch, 1, 1, seq_2])),
            (None, _) => None,
        };
        let dense = dense.map(|mask| mask.expand([batch, heads, seq_1, seq_2]));
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal,
        };
        (
            grouped_attention(query, key, value, dense, None, options),
            None,
        )
    }

    /// burn-nn's matmul + softmax path (kv heads repeated), with the weights.
    fn attend_matmul(
        &self,
        query: Tensor<B, 4>,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        masks: Masks<B>,
    ) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
        let [batch, _, seq_1, seq_2] = [
            query.dims()[0],
            query.dims()[1],
            query.dims()[2],
            key.dims()[2],
        ];
        let (key, value) = repeat_kv_heads(key, value, self.n_heads)
            .unwrap_or_else(|message| panic!("MultiHeadAttention: {message}"));
        let scores = query
            .matmul(key.transpose())
            .div_scalar((self.d_k as f32).sqrt());
        let mut scores = self.dropout.forward(scores);
        if let Some(pad) = masks.pad {
            scores = scores.mask_fill(exact_reshape(pad, [batch, 1, 1, seq_2]), self.min_float);
        }
        if let Some(attn) = masks.attn {
            scores = scores.mask_fill(
                exact_reshape(attn, [batch, 1, seq_1, seq_2]),
                self.min_float,
            );
        }
        if masks.causal {
            let causal = Tensor::<B, 2, Bool>::tril_mask([seq_1, seq_2], 0, &scores.device());
            scores = scores.mask_fill(exact_reshape(causal, [1, 1, seq_1, seq_2]), self.min_float);
        }
        let weights = if self.quiet_softmax {
            quiet_softmax(scores, 3)
        } else {
            softmax(scores, 3)
        };
        (weights.clone().matmul(value), Some(weights))
    }

    /// Under a CP context: the op on this rank's tokens, or a panic naming what CP cannot do.
    fn attend_cp(
        &self,
        context: &CpContext,
        query: Tensor<B, 4>,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        masks: Masks<B>,
    ) -> Tensor<B, 4> {
        let fail = |message: String| -> ! {
            panic!(
                "burn_dcp::nn::MultiHeadAttention under the CP context of rank {} (CP size {}): {message}",
                context.group.comm.rank(),
                context.group.cp()
            )
        };
        let device = query.device();
        if !is_context_parallel::<B>(&device) {
            fail(format!(
                "the backend {} is not ContextParallel<…>: its attention would see only this rank's tokens; use ContextParallel<Autodiff<B>> (or clear the context)",
                B::name(&device)
            ));
        }
        if self.dropout.prob > 0.0 {
            fail(format!(
                "dropout {} on the attention scores cannot run under context parallelism (the scores never exist as a tensor: attention runs blockwise across ranks). burn-nn's MultiHeadAttentionConfig and TransformerEncoderConfig default to dropout 0.1: build the module with `.with_dropout(0.0)`",
                self.dropout.prob
            ));
        }
        if self.quiet_softmax {
            fail("quiet_softmax cannot run under context parallelism (the CP kernels compute the regular softmax); build the module with `.with_quiet_softmax(false)`".into());
        }
        let [batch, _, seq_1, _] = query.dims();
        let seq_2 = key.dims()[2];
        if seq_1 != seq_2 {
            fail(format!("CP attention is self-attention over this rank's tokens, but the query has {seq_1} tokens and the key {seq_2}"));
        }
        let host = masks.host(batch, seq_1, seq_2);
        if masks.attn.is_some() && !host.attn_is_causal {
            fail("a dense mask_attn that is not the causal mask cannot be sharded across CP ranks: describe the mask per sequence in the CP context's masks (burn_dcp::kernels::MaskSpec: Sliding, Lambda (sink + window), Blockwise, SharedQuestion or KeyRanges) and pass the causal mask (or `.causal()`) for causal-family masks, nothing for MaskSpec::Full".into());
        }
        let is_causal = masks.causal || masks.attn.is_some();
        let rank = context.group.comm.rank();
        let rows = context
            .batch
            .local_rows(rank)
            .unwrap_or_else(|e| fail(e.to_string()));
        if let Some(pad) = host.pad {
            let expected = rows.mask_pad(seq_2).unwrap_or_else(|e| fail(e.to_string()));
            if rows.rows() != batch || pad != expected {
                fail(format!(
                    "mask_pad differs from the CP context's padding of this rank's [{batch}, {seq_2}] rows: padding is described by the context's BatchRows (one sequence per row, real tokens first); cut the local rows with CpBatch::local_rows(rank) and use its mask_pad"
                ));
            }
        }
        let masks_causal = (0..context.batch.placement.seq_lens.len()).all(|seq| {
            let len = context.batch.placement.seq_lens[seq];
            crate::backend::attention::is_causal_mask(context.batch.mask(seq), len)
        });
        let full = (0..context.batch.placement.seq_lens.len())
            .all(|seq| *context.batch.mask(seq) == burn_dcp_kernels::MaskSpec::Full);
        if is_causal && !masks_causal {
            fail("the input is causal (mask_attn or `.causal()`) but the CP context's masks let queries attend later keys".into());
        }
        if !is_causal && !full && masks_causal {
            fail("the CP context's masks are causal-family but the input has no causal mask: pass burn-nn's generate_autoregressive_mask(..) as mask_attn, or call `.causal()` on the input".into());
        }
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal,
        };
        grouped_attention(query, key, value, None, None, options)
    }
}

/// The masks of one call.
#[derive(Debug, Clone, Default)]
pub(super) struct Masks<B: Backend> {
    pub(super) pad: Option<Tensor<B, 2, Bool>>,
    pub(super) attn: Option<Tensor<B, 3, Bool>>,
    pub(super) causal: bool,
}

/// The masks read back to the host (once per call; `[B, S]` and `[B, S1, S2]` booleans).
struct HostMasks {
    pad: Option<Vec<bool>>,
    attn: Option<Vec<bool>>,
    /// `attn` is burn-nn's autoregressive mask (`true` exactly where key > query, square).
    attn_is_causal: bool,
    causal: bool,
}

impl<B: Backend> Masks<B> {
    fn host(&self, batch: usize, seq_1: usize, seq_2: usize) -> HostMasks {
        let pad = self.pad.clone().map(bool_values);
        let attn = self.attn.clone().map(bool_values);
        let attn_is_causal = attn.as_ref().is_some_and(|values| {
            seq_1 == seq_2
                && values.len() == batch * seq_1 * seq_2
                && values
                    .iter()
                    .enumerate()
                    .all(|(i, &masked)| masked == (i % seq_2 > (i / seq_2) % seq_1))
        });
        HostMasks {
            pad,
            attn,
            attn_is_causal,
            causal: self.causal,
        }
    }
}

impl HostMasks {
    /// Whether every query row keeps at least one key (the op gives 0 for a fully masked row;
    /// burn-nn's `min_float` fill gives the mean of the values).
    fn every_query_keeps_a_key(&self, batch: usize, seq_1: usize, seq_2: usize) -> bool {
        if seq_2 == 0 {
            return seq_1 == 0;
        }
        let padded = |b: usize, j: usize| self.pad.as_ref().is_some_and(|p| p[b * seq_2 + j]);
        match &self.attn {
            // Without a dense mask a row keeps a key unless its padding leaves none (causal: key
            // 0 must be real, since query 0 sees only it).
            None if self.causal => (0..batch).all(|b| seq_1 == 0 || !padded(b, 0)),
            None => (0..batch).all(|b| seq_1 == 0 || (0..seq_2).any(|j| !padded(b, j))),
            Some(attn) => (0..batch).all(|b| {
                (0..seq_1).all(|i| {
                    (0..seq_2).any(|j| {
                        let hidden = padded(b, j)
                            || attn[(b * seq_1 + i) * seq_2 + j]
                            || (self.causal && j > i);
                        !hidden
                    })
                })
            }),
        }
    }
}
