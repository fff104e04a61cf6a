//! Errors of the datasets crate: each names the file (and line) or value and the rule.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("{path}:{line}: {reason}")]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("the default corpus is missing: {0}")]
    MissingCorpus(String),
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, error: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.into(),
            reason: error.to_string(),
        }
    }
}
