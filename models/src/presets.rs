//! Named model sizes: the GPT's `tiny`, `small`, `base` (GELU MLP, the tokenizer's vocabulary,
//! tied head) and Llama-shaped ones (SwiGLU, RMSNorm ε 1e-5, transformers' normal init with
//! deviation 0.02, their own vocabulary):
//!
//! | name | hidden | layers | heads | kv heads | MLP | vocabulary | head | parameters |
//! |---|---|---|---|---|---|---|---|---|
//! | `llama-125m` | 768 | 12 | 12 | 4 | 2048 | 32 000 | untied | 124.7 M |
//! | `llama-350m` | 1024 | 24 | 16 | 8 | 2816 | 32 000 | untied | 348.7 M |
//! | `llama-1b` | 2048 | 16 | 32 | 8 | 8192 | 128 256 | tied | 1.236 B |
//!
//! `llama-1b` is Llama-3.2-1B's configuration (θ 500 000, its `llama3` RoPE scaling: factor 32,
//! low 1, high 4, 8192 original positions); the two smaller ones take Llama 2's 32 000-token
//! vocabulary and θ 10 000.

use crate::error::ModelError;
use crate::gpt::{GptConfig, Mlp};
use crate::rope::RopeScaling;

/// The names [`preset`] knows.
pub const PRESETS: [&str; 6] = [
    "tiny",
    "small",
    "base",
    "llama-125m",
    "llama-350m",
    "llama-1b",
];

/// The configuration of preset `name`; `tokenizer_vocab` is the tokenizer's vocabulary (the
/// GPT's own, and a lower bound for a Llama preset's).
pub fn preset(name: &str, tokenizer_vocab: usize) -> Result<GptConfig, ModelError> {
    let gpt = |d_model, n_layers, n_heads, n_kv_heads| {
        GptConfig::new(
            tokenizer_vocab,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads,
            4 * d_model,
        )
    };
    let llama = |vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff| {
        GptConfig::new(vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff)
            .with_mlp(Mlp::Swiglu)
            .with_initializer_range(Some(0.02))
            .with_tied_embeddings(false)
    };
    let config = match name {
        "tiny" => gpt(64, 2, 4, 2),
        "small" => gpt(128, 4, 8, 4),
        "base" => gpt(256, 6, 8, 4),
        "llama-125m" => llama(32000, 768, 12, 12, 4, 2048),
        "llama-350m" => llama(32000, 1024, 24, 16, 8, 2816),
        "llama-1b" => llama(128256, 2048, 16, 32, 8, 8192)
            .with_tied_embeddings(true)
            .with_rope_theta(500000.0)
            .with_rope_scaling(Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })),
        other => {
            return Err(ModelError::Config(format!(
                "unknown model size '{other}': expected one of {}",
                PRESETS.join(", ")
            )))
        }
    };
    if config.vocab_size < tokenizer_vocab {
        return Err(ModelError::Config(format!(
            "model size '{name}' embeds {} token ids, fewer than the tokenizer's {tokenizer_vocab}",
            config.vocab_size
        )));
    }
    Ok(config)
}

impl GptConfig {
    /// Named sizes: `tiny`, `small`, `base` (the GPT, the tokenizer's `vocab_size`) and
    /// `llama-125m`, `llama-350m`, `llama-1b` (Llama-shaped, their own vocabulary, which must hold
    /// the tokenizer's); see [`crate::presets`].
    pub fn sized(name: &str, vocab_size: usize) -> Result<Self, ModelError> {
        preset(name, vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counts transformers' `LlamaForCausalLM(config).num_parameters()` gives for the same
    /// configurations (tied heads counted once).
    #[test]
    fn llama_presets_count_as_transformers() {
        let count = |name| preset(name, 256).unwrap().parameter_count();
        assert_eq!(count("llama-125m"), 124_668_672);
        assert_eq!(count("llama-350m"), 348_701_696);
        assert_eq!(count("llama-1b"), 1_235_814_400);
        let error = preset("llama-125m", 50257).unwrap_err().to_string();
        assert!(
            error.contains("32000 token ids, fewer than the tokenizer's 50257"),
            "{error}"
        );
        let error = preset("huge", 256).unwrap_err().to_string();
        assert!(
            error.contains("'huge'") && error.contains("llama-1b"),
            "{error}"
        );
    }
}
