//! Models for burn-dcp: ordinary burn models with no context-parallel code in them. CP comes only
//! from the backend type (`ContextParallel<Autodiff<B>>`) and the per-rank CP context.

pub mod error;
pub mod gather;
pub mod gpt;
pub mod hf;
pub mod presets;
pub mod rope;
pub mod tensor_parallel;
mod tensors;

pub use error::ModelError;
pub use gpt::{cross_entropy_sum, Gpt, GptConfig, Mlp};
pub use presets::{preset, PRESETS};
pub use rope::RopeScaling;
pub use tensor_parallel::{TensorParallel, TpGpt};
