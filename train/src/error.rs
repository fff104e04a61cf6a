//! Why training could not start, go on or save: one typed error for the whole engine.
//!
//! Every message names the value and the rule (or the file, the rank, the step), and reads the
//! same through `Display` as it did when the engine returned strings: `gpt_longctx` prints it
//! after `error: `. Errors of context parallelism itself ([`CpError`]: configuration, planning,
//! communication, kernels) pass through unchanged.

use std::path::PathBuf;

use burn_dcp::comm::CommError;
use burn_dcp::CpError;

/// Why training could not start, go on or save.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag or configuration value breaks a rule (the message names the value and the rule).
    #[error("{0}")]
    Config(String),
    /// The corpus cannot be read, tokenized or packed into micro-batches.
    #[error("{0}")]
    Data(String),
    /// The model cannot be built, sharded or recorded.
    #[error("{0}")]
    Model(String),
    /// A checkpoint is missing, cannot be loaded, or does not fit the configuration.
    #[error("{0}")]
    Checkpoint(String),
    /// A file or a message does not hold what it should (names it).
    #[error("{0}")]
    Malformed(String),
    /// A rank failed while training; the message names the rank that failed first.
    #[error("training failed: {0}")]
    RankFailed(String),
    /// The ranks could not be started (MPI or TCP launch, rendezvous, NCCL).
    #[error("{0}")]
    Launch(String),
    /// The thread planning steps ahead stopped before it sent the plan of `step`.
    #[error("step {step}: the planning thread stopped")]
    PlannerStopped { step: usize },
    /// A file system operation failed (`cannot {action} {path}: {source}`).
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Context parallelism failed: its configuration, planning, a collective or a kernel (a
    /// failed rank is named).
    #[error(transparent)]
    Cp(#[from] CpError),
    /// A collective of the training loop failed (names the group and the peer).
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl TrainError {
    /// `cannot {action} {path}: {source}`.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// A model's error (its rule or its failed collective) as the run's: its message.
impl From<burn_dcp_models::ModelError> for TrainError {
    fn from(error: burn_dcp_models::ModelError) -> Self {
        TrainError::Model(error.to_string())
    }
}

/// The message, for callers that report errors as text (the launcher, the examples).
impl From<TrainError> for String {
    fn from(error: TrainError) -> Self {
        error.to_string()
    }
}

/// A model's forward failing, as the step's error.
pub(crate) fn forward_failed(error: TrainError) -> CpError {
    CpError::RunFailed(format!("model forward: {error}"))
}
