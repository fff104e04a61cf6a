//! Errors of context-parallel attention.

use burn_dcp_kernels::KernelError;

use crate::comm::CommError;

/// Why a context-parallel attention call (or its configuration) was refused or failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CpError {
    /// The configuration breaks a rule; the message names the values and the rule.
    #[error("invalid context-parallel configuration: {0}")]
    Config(String),
    /// Inputs do not match the configuration (shapes, dtypes, token counts).
    #[error("invalid input: {0}")]
    Input(String),
    /// The ranks of a group disagree on a call's configuration (names the ranks and fields).
    #[error("mismatched ranks: {0}")]
    Mismatch(String),
    /// A multi-rank run failed: names the rank that failed first and its reason.
    #[error("context-parallel run failed: {0}")]
    RunFailed(String),
    /// A CP context saw no attention call at CP size > 1: the model computed attention without
    /// burn's op (see [`CpContextGuard::finish`](crate::backend::CpContextGuard::finish)).
    #[error("attention bypassed context parallelism: {0}")]
    Bypassed(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// A head rule broken by a configuration ([`crate::heads`]): a [`CpError::Config`] naming it.
impl From<crate::heads::HeadSplitError> for CpError {
    fn from(error: crate::heads::HeadSplitError) -> Self {
        CpError::Config(error.to_string())
    }
}
