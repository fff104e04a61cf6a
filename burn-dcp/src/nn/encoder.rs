//! burn-nn 0.21's `TransformerEncoder`, its attention computed by burn's `attention` op.

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::activation::ActivationConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::prelude::{Backend, Bool, Tensor};

use super::mha::{
    input_options, InputOptions, Masks, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
};

/// Configuration of a [`TransformerEncoder`]: burn-nn 0.21's `TransformerEncoderConfig` (same
/// fields, defaults and builders) plus `n_kv_heads` (grouped-query attention).
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate. Default: 0.1 (as burn-nn). Under a CP context the attention's dropout
    /// must be 0 (see [`MultiHeadAttention`]).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm will be applied first instead of after the other modules.
    #[config(default = false)]
    pub norm_first: bool,
    /// Use "quiet softmax" instead of regular softmax.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The type of function used to initialize neural network parameters
    #[config(default = "Initializer::KaimingUniform{gain:1.0/f64::sqrt(3.0), fan_out_only:false}")]
    pub initializer: Initializer,
    /// The activation function used in the position-wise feed-forward network. Default: Gelu
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The epsilon value for layer normalization. Default: 1e-5
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Extension (burn-nn has none): key/value heads of grouped-query attention, dividing
    /// `n_heads`; `None` is `n_heads`.
    pub n_kv_heads: Option<usize>,
}

/// The transformer encoder with burn-nn 0.21's public API and record layout; its attention is
/// [`MultiHeadAttention`] (burn's op, context-parallel under a CP context).
#[derive(Module, Debug)]
pub struct TransformerEncoder<B: Backend> {
    /// The transformer encoder layers.
    pub layers: Vec<TransformerEncoderLayer<B>>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Layer norm will be applied first instead of after the other modules.
    pub norm_first: bool,
    /// Use "quiet softmax" instead of regular softmax.
    pub quiet_softmax: bool,
}

/// [Transformer Encoder](TransformerEncoder) forward pass input argument.
#[derive(Debug)]
pub struct TransformerEncoderInput<B: Backend> {
    tensor: Tensor<B, 3>,
    options: InputOptions<B>,
}

impl<B: Backend> TransformerEncoderInput<B> {
    /// Create a [transformer encoder](TransformerEncoder) input argument.
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        Self {
            tensor,
            options: InputOptions::default(),
        }
    }

    input_options!();
}

impl TransformerEncoderConfig {
    /// Initialize a new [transformer encoder](TransformerEncoder) module.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoder<B> {
        let layers = (0..self.n_layers)
            .map(|_| TransformerEncoderLayer::new(self, device))
            .collect();
        TransformerEncoder {
            layers,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<B: Backend> TransformerEncoder<B> {
    /// Applies the forward pass on the input tensor.
    ///
    /// # Shapes
    ///
    /// - tensor: `[batch_size, seq_length, d_model]`
    /// - output: `[batch_size, seq_length, d_model]`
    pub fn forward(&self, input: TransformerEncoderInput<B>) -> Tensor<B, 3> {
        let mut x = input.tensor;
        for layer in &self.layers {
            x = layer.forward_options(x, input.options.clone());
        }
        x
    }
}

/// Transformer encoder layer module (burn-nn's layout; the attention is the drop-in).
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer<B: Backend> {
    /// Multi-head self-attention sub-layer.
    pub mha: MultiHeadAttention<B>,
    /// Position-wise feed-forward sub-layer.
    pub pwff: PositionWiseFeedForward<B>,
    /// Layer normalization applied around the feed-forward sub-layer.
    pub norm_1: LayerNorm<B>,
    /// Layer normalization applied around the attention sub-layer.
    pub norm_2: LayerNorm<B>,
    /// Dropout module applied to residual connections.
    pub dropout: Dropout,
    /// If `true`, apply layer normalization before sub-layers (pre-norm),
    /// otherwise apply it after (post-norm).
    pub norm_first: bool,
}

impl<B: Backend> TransformerEncoderLayer<B> {
    /// Create a new transformer encoder layer from the given configuration (burn-nn's parameter
    /// draws, in burn-nn's order, when `n_kv_heads` is `None`).
    pub fn new(config: &TransformerEncoderConfig, device: &B::Device) -> Self {
        let mha = MultiHeadAttentionConfig::new(config.d_model, config.n_heads)
            .with_initializer(config.initializer.clone())
            .with_dropout(config.dropout)
            .with_quiet_softmax(config.quiet_softmax)
            .with_n_kv_heads(config.n_kv_heads)
            .init(device);
        let norm_1 = LayerNormConfig::new(config.d_model)
            .with_epsilon(config.layer_norm_eps)
            .init(device);
        let norm_2 = LayerNormConfig::new(config.d_model)
            .with_epsilon(config.layer_norm_eps)
            .init(device);
        let dropout = DropoutConfig::new(config.dropout).init();
        let pwff = PositionWiseFeedForwardConfig::new(config.d_model, config.d_ff)
            .with_initializer(config.initializer.clone())
            .with_dropout(config.dropout)
            .with_activation(config.activation.clone())
            .init(device);
        Self {
            mha,
            pwff,
            norm_1,
            norm_2,
            dropout,
            norm_first: config.norm_first,
        }
    }

    /// Applies the forward pass on the input tensor (`[batch_size, seq_length, d_model]`).
    pub fn forward(
        &self,
        input: Tensor<B, 3>,
        mask_pad: Option<Tensor<B, 2, Bool>>,
        mask_attn: Option<Tensor<B, 3, Bool>>,
    ) -> Tensor<B, 3> {
        let masks = Masks {
            pad: mask_pad,
            attn: mask_attn,
            causal: false,
        };
        let options = InputOptions {
            masks,
            rope_theta: None,
        };
        self.forward_options(input, options)
    }

    fn forward_options(&self, input: Tensor<B, 3>, options: InputOptions<B>) -> Tensor<B, 3> {
        let x = input;
        let residual = if self.norm_first {
            self.norm_2.forward(x.clone())
        } else {
            x.clone()
        };
        let attention_input = MhaInput::self_attn(residual).with_options(options);
        let residual = self.mha.forward(attention_input).context;
        let mut x = x + self.dropout.forward(residual);

        let residual = if self.norm_first {
            self.norm_1.forward(x.clone())
        } else {
            x = self.norm_1.forward(x);
            x.clone()
        };
        let residual = self.pwff.forward(residual);
        let mut x = x + self.dropout.forward(residual);
        if !self.norm_first {
            x = self.norm_2.forward(x)
        }
        x
    }
}
