//! The rules of query and key/value heads the drop-ins check.

/// Why a head configuration cannot run: each names the counts and the rule.
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
