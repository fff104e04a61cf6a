//! The architecture a run trains from a Hugging Face `config.json` (`--model-config`,
//! `--hf-checkpoint`, with `--rope-theta` / `--rope-scaling` over it) and its initial weights from
//! a checkpoint.

use std::path::Path;

use burn::prelude::Backend;
use burn_dcp_models::hf::{load_hf, HfConfig};
use burn_dcp_models::{Gpt, GptConfig, RopeScaling};
use serde_json::Value;

use crate::config::TrainConfig;
use crate::error::TrainError;

/// `--rope-scaling`: `none`, `linear:FACTOR` or `llama3:FACTOR,LOW,HIGH,ORIGINAL` (Hugging Face's
/// `factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
pub fn parse_rope_scaling(spec: &str) -> Result<Option<RopeScaling>, TrainError> {
    let bad = |why: &str| {
        TrainError::Config(format!(
            "--rope-scaling {spec}: {why} (none, linear:FACTOR or llama3:FACTOR,LOW,HIGH,ORIGINAL, e.g. llama3:8,1,4,8192)"
        ))
    };
    let (kind, values) = spec.split_once(':').unwrap_or((spec, ""));
    let numbers = || -> Result<Vec<f64>, TrainError> {
        values
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<f64>()
                    .map_err(|_| bad("a value is not a number"))
            })
            .collect()
    };
    let scaling = match kind {
        "none" if values.is_empty() => return Ok(None),
        "linear" => match numbers()?.as_slice() {
            [factor] => RopeScaling::Linear { factor: *factor },
            _ => return Err(bad("linear takes one factor")),
        },
        "llama3" => match numbers()?.as_slice() {
            [factor, low, high, original] if original.fract() == 0.0 && *original >= 1.0 => {
                RopeScaling::Llama3 {
                    factor: *factor,
                    low_freq_factor: *low,
                    high_freq_factor: *high,
                    original_max_position_embeddings: *original as usize,
                }
            }
            _ => {
                return Err(bad(
                    "llama3 takes four values, the last a whole number of positions",
                ))
            }
        },
        _ => return Err(bad("unknown type")),
    };
    scaling.validate()?;
    Ok(Some(scaling))
}

/// The configuration of a `config.json` file (`--model-config`, or a checkpoint's).
pub fn read_hf_config(path: &Path) -> Result<HfConfig, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::Config(format!("{} is not JSON: {e}", path.display())))?;
    HfConfig::from_json(json).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))
}

/// `model` with RoPE's base and scaling as `config` has them (`--rope-theta`, `--rope-scaling`
/// over the checkpoint's).
fn with_overrides(mut model: GptConfig, config: &TrainConfig) -> Result<GptConfig, TrainError> {
    if let Some(theta) = config.rope_theta {
        model.rope_theta = theta;
    }
    if let Some(spec) = &config.rope_scaling {
        model.rope_scaling = parse_rope_scaling(spec)?;
    }
    model
        .validate()
        .map_err(|e| TrainError::Config(e.to_string()))?;
    Ok(model)
}

/// The model a run trains: `config.architecture` (from `--model-config` / `--hf-checkpoint`) or
/// the preset `model_size`, with the RoPE overrides.
pub(crate) fn model_config(config: &TrainConfig) -> Result<GptConfig, TrainError> {
    let tokenizer_vocab = config.tokenizer()?.vocab_size();
    let model = match &config.architecture {
        Some(architecture) => {
            if architecture.vocab_size < tokenizer_vocab && config.data_path.is_empty() {
                return Err(TrainError::Config(format!(
                    "the model embeds {} token ids, fewer than the tokenizer's {tokenizer_vocab}: a token id of the data would fall outside it",
                    architecture.vocab_size
                )));
            }
            architecture.clone()
        }
        None => GptConfig::sized(&config.model_size, tokenizer_vocab)
            .map_err(|e| TrainError::Config(e.to_string()))?,
    };
    with_overrides(model, config)
}

/// The whole model of `config` from its checkpoint `dir` (`--hf-checkpoint`), on `device`: the
/// checkpoint's configuration must still be the run's (with the run's RoPE settings over it).
pub(crate) fn load_initial<B: Backend>(
    config: &TrainConfig,
    dir: &Path,
    device: &B::Device,
) -> Result<Gpt<B>, TrainError> {
    let (model, hf) = load_hf::<B>(dir, device)
        .map_err(|e| TrainError::Checkpoint(format!("--hf-checkpoint {}: {e}", dir.display())))?;
    let wanted = model_config(config)?;
    let found = with_overrides(hf.model, config)?;
    if found != wanted {
        return Err(TrainError::Checkpoint(format!(
            "--hf-checkpoint {}: its config.json no longer describes this run's model ({found:?} here, {wanted:?} when the run started)",
            dir.display()
        )));
    }
    Ok(model.with_rope(wanted.rope()))
}
