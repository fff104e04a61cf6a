//! The models' error: which rule a configuration broke, which stage was asked for what it does
//! not hold, or which tensor-parallel collective failed. Its text is the message alone (the
//! values and the rule), so it reads the same wherever it is shown.

use std::fmt;

/// Why a model could not be built or run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelError {
    /// A size or shape rule of the configuration (heads, layers, TP ranks, pipeline stages).
    Config(String),
    /// A pipeline stage asked for what only another stage holds (the embedding, the LM head).
    Stage(String),
    /// A tensor-parallel collective of the model's TP group failed.
    Collective(String),
    /// A Hugging Face checkpoint could not be read or written (the file, the tensor, the shapes).
    Checkpoint(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Config(message)
            | ModelError::Stage(message)
            | ModelError::Collective(message)
            | ModelError::Checkpoint(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ModelError {}

/// For callers whose own errors are text (e.g. `TrainModel::loss_sum`): `?` keeps the message.
impl From<ModelError> for String {
    fn from(error: ModelError) -> Self {
        error.to_string()
    }
}

/// A file operation on a checkpoint that failed: `action` (`read`, `write`, …), the path and why.
pub(crate) fn io(action: &str, path: &std::path::Path, error: impl fmt::Display) -> ModelError {
    ModelError::Checkpoint(format!("{action} {}: {error}", path.display()))
}
