//! Errors of the attention kernels: every message names the value and the rule it breaks.

/// An invalid attention problem or input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("invalid mask '{mask}': {reason}")]
    InvalidMask { mask: String, reason: String },
    #[error("invalid packing: {0}")]
    InvalidPacking(String),
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error("invalid dtype: {0}")]
    InvalidDType(String),
    /// A setting out of its range (e.g. the softmax scale).
    #[error("invalid value: {0}")]
    InvalidValue(String),
    /// A kernel the device cannot run (e.g. tensor cores it does not have).
    #[error("unsupported on this device: {0}")]
    Unsupported(String),
}
