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

/// A head rule broken by a configuration ([`burn_dcp_kernels::heads`]): a [`CpError::Config`] naming it.
impl From<burn_dcp_kernels::heads::HeadSplitError> for CpError {
    fn from(error: burn_dcp_kernels::heads::HeadSplitError) -> Self {
        CpError::Config(error.to_string())
    }
}

/// Why a head configuration of the drop-ins ([`crate::nn`]) cannot run: each names the counts
/// and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// The model width does not split into the heads.
    #[error("MultiHeadAttentionConfig: d_model {d_model} must be a multiple of n_heads {heads}")]
    Width { d_model: usize, heads: usize },
    /// Key/value heads that do not divide the query heads (grouped-query attention).
    #[error("MultiHeadAttentionConfig: n_kv_heads {kv_heads} must divide n_heads {heads}")]
    KvHeads { kv_heads: usize, heads: usize },
    /// Key and value tensors whose heads differ or do not divide the query heads.
    #[error("grouped-query attention needs key and value with the same number of heads, dividing the {heads} query heads; got key {key} and value {value}")]
    KeyValue {
        heads: usize,
        key: usize,
        value: usize,
    },
}

impl HeadError {
    /// Whether the message contains `text` (what callers did when this error was a `String`).
    pub fn contains(&self, text: &str) -> bool {
        self.to_string().contains(text)
    }
}
