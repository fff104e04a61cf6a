//! A Hugging Face `config.json` of `LlamaForCausalLM`, `MistralForCausalLM` or
//! `Qwen2ForCausalLM` as a [`GptConfig`], and back.
//!
//! Read: the keys of transformers 4.x (`rope_theta`, `rope_scaling` with `rope_type` or the older
//! `type`) and 5.x (`rope_parameters`); defaults as transformers' configuration classes have them
//! (`num_key_value_heads` = heads, `rms_norm_eps` 1e-6, `rope_theta` 10 000, untied head).
//! Refused, naming the key and value: another `model_type`, a `hidden_act` other than `silu`, a
//! `rope_scaling` other than `linear` / `llama3`, Llama's `attention_bias` or `mlp_bias` (a bias on
//! the output or MLP projections, which no model of this crate has).
//!
//! Written: every architecture key, in both spellings of RoPE's, over the keys of the
//! configuration read (token ids, `max_position_embeddings`, …), which are kept.

use serde_json::{json, Map, Value};

use crate::error::ModelError;
use crate::gpt::{GptConfig, Mlp};
use crate::rope::RopeScaling;

/// The Hugging Face architecture a configuration is (its `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArchitecture {
    Llama,
    /// Llama with a sliding-window mask (`sliding_window`).
    Mistral,
    /// Llama with biases on q, k and v.
    Qwen2,
}

impl HfArchitecture {
    fn parse(model_type: &str) -> Result<Self, ModelError> {
        match model_type {
            "llama" => Ok(Self::Llama),
            "mistral" => Ok(Self::Mistral),
            "qwen2" => Ok(Self::Qwen2),
            other => Err(ModelError::Config(format!(
                "config.json: model_type '{other}' is not supported: expected llama, mistral or qwen2"
            ))),
        }
    }

    /// `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
        }
    }

    /// The class transformers builds (`architectures`).
    pub fn class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// A checkpoint's configuration: the model, and what the trainer needs beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    pub model: GptConfig,
    pub architecture: HfArchitecture,
    /// Mistral's (and Qwen2's with `use_sliding_window`) window: each query sees itself and the
    /// `window − 1` keys before it.
    pub sliding_window: Option<usize>,
    /// The configuration as read (its other keys are written back on export).
    pub json: Value,
}

fn get<'a>(json: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    json.get(key).filter(|v| !v.is_null())
}

fn count(json: &Map<String, Value>, key: &str) -> Result<Option<usize>, ModelError> {
    match get(json, key) {
        None => Ok(None),
        Some(value) => value.as_u64().map(|v| Some(v as usize)).ok_or_else(|| {
            ModelError::Config(format!(
                "config.json: {key} {value} must be a non-negative integer"
            ))
        }),
    }
}

fn required(json: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    count(json, key)?.ok_or_else(|| ModelError::Config(format!("config.json: {key} is missing")))
}

fn number(json: &Map<String, Value>, key: &str, default: f64) -> Result<f64, ModelError> {
    match get(json, key) {
        None => Ok(default),
        Some(value) => value.as_f64().ok_or_else(|| {
            ModelError::Config(format!("config.json: {key} {value} must be a number"))
        }),
    }
}

fn flag(json: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ModelError> {
    match get(json, key) {
        None => Ok(default),
        Some(value) => value.as_bool().ok_or_else(|| {
            ModelError::Config(format!("config.json: {key} {value} must be true or false"))
        }),
    }
}

/// RoPE's base and scaling: 5.x's `rope_parameters`, else 4.x's `rope_theta` and `rope_scaling`.
fn rope(json: &Map<String, Value>) -> Result<(f64, Option<RopeScaling>), ModelError> {
    let (theta, scaling) = match get(json, "rope_parameters").and_then(Value::as_object) {
        Some(parameters) => (
            number(
                parameters,
                "rope_theta",
                number(json, "rope_theta", 10000.0)?,
            )?,
            Some(parameters),
        ),
        None => (
            number(json, "rope_theta", 10000.0)?,
            get(json, "rope_scaling").and_then(Value::as_object),
        ),
    };
    let Some(scaling) = scaling else {
        return Ok((theta, None));
    };
    let kind = get(scaling, "rope_type")
        .or_else(|| get(scaling, "type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || number(scaling, "factor", f64::NAN);
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: number(scaling, "low_freq_factor", f64::NAN)?,
            high_freq_factor: number(scaling, "high_freq_factor", f64::NAN)?,
            original_max_position_embeddings: required(
                scaling,
                "original_max_position_embeddings",
            )?,
        }),
        other => {
            return Err(ModelError::Config(format!(
                "config.json: rope_scaling type '{other}' is not supported: expected none, linear or llama3"
            )))
        }
    };
    if let Some(scaling) = &scaling {
        scaling.validate()?;
    }
    Ok((theta, scaling))
}

impl HfConfig {
    /// The configuration of a `config.json`'s contents.
    pub fn from_json(json: Value) -> Result<Self, ModelError> {
        let Some(map) = json.as_object() else {
            return Err(ModelError::Config(
                "config.json must hold a JSON object".into(),
            ));
        };
        let model_type = get(map, "model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Config("config.json: model_type is missing".into()))?;
        let architecture = HfArchitecture::parse(model_type)?;
        let act = get(map, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::Config(format!(
                "config.json: hidden_act '{act}' is not supported: the Llama family's MLP is silu (SwiGLU)"
            )));
        }
        for key in ["attention_bias", "mlp_bias"] {
            if architecture == HfArchitecture::Llama && flag(map, key, false)? {
                return Err(ModelError::Config(format!(
                    "config.json: {key} true is not supported (biases on the output or MLP projections)"
                )));
            }
        }
        let heads = required(map, "num_attention_heads")?;
        let hidden = required(map, "hidden_size")?;
        let head_dim = count(map, "head_dim")?.filter(|&d| heads == 0 || d * heads != hidden);
        let (rope_theta, rope_scaling) = rope(map)?;
        let sliding_window = match architecture {
            HfArchitecture::Llama => None,
            HfArchitecture::Mistral => count(map, "sliding_window")?,
            HfArchitecture::Qwen2 => match flag(map, "use_sliding_window", false)? {
                true => count(map, "sliding_window")?,
                false => None,
            },
        };
        let model = GptConfig::new(
            required(map, "vocab_size")?,
            hidden,
            required(map, "num_hidden_layers")?,
            heads,
            count(map, "num_key_value_heads")?.unwrap_or(heads),
            required(map, "intermediate_size")?,
        )
        .with_mlp(Mlp::Swiglu)
        .with_rms_norm_eps(number(map, "rms_norm_eps", 1e-6)?)
        .with_head_dim(head_dim)
        .with_attention_bias(architecture == HfArchitecture::Qwen2)
        .with_rope_theta(rope_theta)
        .with_rope_scaling(rope_scaling)
        .with_tied_embeddings(flag(map, "tie_word_embeddings", false)?)
        .with_initializer_range(Some(number(map, "initializer_range", 0.02)?));
        model.validate().map_err(|e| {
            ModelError::Config(format!("config.json describes no valid model: {e}"))
        })?;
        Ok(Self {
            model,
            architecture,
            sliding_window,
            json,
        })
    }

    /// The configuration of a model of this crate with no checkpoint behind it: Llama, or Qwen2
    /// with q/k/v biases, or Mistral with a sliding window. A GELU model has no Hugging Face
    /// architecture and is refused.
    pub fn for_model(
        model: &GptConfig,
        sliding_window: Option<usize>,
        max_position_embeddings: usize,
    ) -> Result<Self, ModelError> {
        if model.mlp != Mlp::Swiglu {
            return Err(ModelError::Config(
                "a GELU GPT has no Hugging Face architecture: export a Llama-shaped model (--model-size llama-125m|llama-350m|llama-1b, --model-config, --hf-checkpoint)".into(),
            ));
        }
        let architecture = match (model.attention_bias, sliding_window) {
            (true, _) => HfArchitecture::Qwen2,
            (false, Some(_)) => HfArchitecture::Mistral,
            (false, None) => HfArchitecture::Llama,
        };
        Ok(Self {
            model: model.clone(),
            architecture,
            sliding_window,
            json: json!({
                "max_position_embeddings": max_position_embeddings,
                "bos_token_id": null,
                "eos_token_id": null,
            }),
        })
    }

    /// `config.json`'s contents for `dtype` (`bfloat16` or `float32`): the kept keys with
    /// `model`'s architecture written over them.
    pub fn to_json(&self, dtype: &str) -> Value {
        let m = &self.model;
        let mut json = self.json.as_object().cloned().unwrap_or_default();
        let (rope_scaling, mut rope_parameters) = match &m.rope_scaling {
            None => (Value::Null, json!({"rope_type": "default"})),
            Some(scaling) => {
                let value = serde_json::to_value(scaling).unwrap_or(Value::Null);
                (value.clone(), value)
            }
        };
        rope_parameters["rope_theta"] = json!(m.rope_theta);
        let architecture = self.architecture;
        let values = json!({
            "architectures": [architecture.class()],
            "model_type": architecture.model_type(),
            "vocab_size": m.vocab_size,
            "hidden_size": m.d_model,
            "intermediate_size": m.d_ff,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim(),
            "hidden_act": "silu",
            "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": m.tied_embeddings,
            "initializer_range": m.initializer_range.unwrap_or(0.02),
            "torch_dtype": dtype,
            "dtype": dtype,
        });
        for (key, value) in values.as_object().into_iter().flatten() {
            json.insert(key.clone(), value.clone());
        }
        match architecture {
            HfArchitecture::Llama => {
                json.insert("attention_bias".into(), json!(false));
                json.insert("mlp_bias".into(), json!(false));
            }
            HfArchitecture::Mistral => {
                json.insert("sliding_window".into(), json!(self.sliding_window));
            }
            HfArchitecture::Qwen2 => {
                json.insert(
                    "use_sliding_window".into(),
                    json!(self.sliding_window.is_some()),
                );
                json.insert("sliding_window".into(), json!(self.sliding_window));
            }
        }
        Value::Object(json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> Value {
        json!({
            "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": true, "bos_token_id": 128000, "head_dim": 64
        })
    }

    #[test]
    fn llama_3_2_1b_reads_as_the_preset_and_writes_back() {
        let config = HfConfig::from_json(llama()).unwrap();
        let preset = crate::preset("llama-1b", 256).unwrap();
        assert_eq!(config.model, preset);
        let written = config.to_json("bfloat16");
        assert_eq!(written["bos_token_id"], 128000);
        assert_eq!(written["architectures"][0], "LlamaForCausalLM");
        assert_eq!(written["rope_parameters"]["rope_type"], "llama3");
        assert_eq!(written["rope_parameters"]["rope_theta"], 500000.0);
        assert_eq!(HfConfig::from_json(written).unwrap().model, preset);
    }

    #[test]
    fn refusals_name_the_key_and_value() {
        let refused = |edit: &dyn Fn(&mut Value), wanted: &str| {
            let mut json = llama();
            edit(&mut json);
            let error = HfConfig::from_json(json).unwrap_err().to_string();
            assert!(error.contains(wanted), "{error} lacks {wanted}");
        };
        refused(&|j| j["model_type"] = json!("gemma"), "model_type 'gemma'");
        refused(
            &|j| j["rope_scaling"]["rope_type"] = json!("yarn"),
            "'yarn'",
        );
        refused(&|j| j["hidden_act"] = json!("gelu"), "hidden_act 'gelu'");
        refused(
            &|j| j["attention_bias"] = json!(true),
            "attention_bias true",
        );
        refused(&|j| j["num_key_value_heads"] = json!(5), "kv heads");
        refused(
            &|j| {
                j.as_object_mut().unwrap().remove("hidden_size");
            },
            "hidden_size is missing",
        );
    }

    #[test]
    fn mistral_window_and_qwen2_biases() {
        let mut mistral = llama();
        mistral["model_type"] = json!("mistral");
        mistral["sliding_window"] = json!(4096);
        let config = HfConfig::from_json(mistral).unwrap();
        assert_eq!(config.sliding_window, Some(4096));
        let mut qwen = llama();
        qwen["model_type"] = json!("qwen2");
        qwen["sliding_window"] = json!(4096);
        let config = HfConfig::from_json(qwen).unwrap();
        assert!(config.model.attention_bias);
        assert_eq!(config.sliding_window, None, "use_sliding_window is false");
        let gelu = GptConfig::new(256, 64, 2, 4, 2, 256);
        let error = HfConfig::for_model(&gelu, None, 2048)
            .unwrap_err()
            .to_string();
        assert!(error.contains("GELU"), "{error}");
    }
}
