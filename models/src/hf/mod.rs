//! Hugging Face checkpoints of the Llama family in and out: `config.json` ↔ [`GptConfig`]
//! ([`config`]) and the weights, `model.safetensors` or shards with their index, ↔ [`Gpt`]
//! ([`weights`]), with transformers' tensor names, so that
//! `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads what this writes and this loads
//! what transformers' `save_pretrained` writes, with no conversion script.
//!
//! [`Gpt`]: crate::Gpt
//! [`GptConfig`]: crate::GptConfig

pub mod check;
pub mod config;
pub mod weights;

pub use check::{check_hf, expected_tensors};
pub use config::{HfArchitecture, HfConfig};
pub use weights::{load_hf, save_hf, ExportDtype};
