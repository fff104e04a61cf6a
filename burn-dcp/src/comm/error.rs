//! The communicators' error: every variant names the group, the ranks and the rule or event.

use std::time::Duration;

use burn::tensor::DType;

/// Errors of communication. Each names the group, the ranks involved and the rule or event.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    #[error("group '{group}': rank {rank} waited {waited:?} for {op} from peer rank {peer} (global rank {peer_global}) and timed out")]
    Timeout {
        group: String,
        rank: usize,
        peer: usize,
        peer_global: usize,
        op: String,
        waited: Duration,
    },
    #[error("group '{group}': global rank {failed_global} failed ({reason}); rank {rank} cannot complete {op}")]
    PeerFailed {
        group: String,
        rank: usize,
        failed_global: usize,
        reason: String,
        op: String,
    },
    #[error("group '{group}': {message}")]
    Invalid { group: String, message: String },
    /// A message that is not the one the receiver expects: another operation, or out of order
    /// (a message was lost or duplicated), or a block of the wrong shape.
    #[error("group '{group}': rank {rank} received an unexpected message from global rank {peer_global}: {message}")]
    Protocol {
        group: String,
        rank: usize,
        peer_global: usize,
        message: String,
    },
    /// A fault injected by a test ([`Fault`](super::Fault)).
    #[error("group '{group}': injected fault: global rank {global_rank} failed at its communication call #{call} ({op})")]
    Injected {
        group: String,
        global_rank: usize,
        call: u64,
        op: String,
    },
}

impl CommError {
    /// Whether this error only reports another rank's failure (the root cause is elsewhere).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, CommError::PeerFailed { .. })
    }
}

/// Why a payload could not be read, converted or combined.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PayloadError {
    /// The platform has no synchronous read of device memory (the browser's wgpu).
    #[error("this platform cannot read a device tensor synchronously")]
    NoSyncRead,
    /// The backend failed to read a device tensor back (its error, rendered).
    #[error("reading a device tensor back failed: {0}")]
    ReadBack(String),
    /// The backend failed to finish the copy of a received tensor (its error, rendered).
    #[error("waiting for a received tensor's copy failed: {0}")]
    Copy(String),
    /// Host bytes that are not of the dtype asked for (burn's error, rendered).
    #[error("{0}")]
    Data(String),
    /// A payload of another number of dimensions than the tensor asked for.
    #[error("a {dims:?} payload is not a tensor of {expected} dimensions")]
    Dims { dims: Vec<usize>, expected: usize },
    /// A sum of no parts.
    #[error("nothing to sum")]
    NothingToSum,
    /// Parts of a sum with different shapes or dtypes.
    #[error("cannot sum a {shape:?} {dtype:?} tensor with a {expected_shape:?} {expected_dtype:?} tensor")]
    Mismatch {
        shape: Vec<usize>,
        dtype: DType,
        expected_shape: Vec<usize>,
        expected_dtype: DType,
    },
    /// All-reduce chunks of another dtype than the tensor.
    #[error("chunk dtype {dtype:?} differs from {expected:?}")]
    ChunkDtype { dtype: DType, expected: DType },
    /// All-reduce chunks that do not add up to the tensor.
    #[error("the gathered chunks hold {bytes} bytes but a {shape:?} {dtype:?} tensor needs {expected}: the ranks passed tensors of different sizes")]
    ChunkSizes {
        bytes: usize,
        shape: Vec<usize>,
        dtype: DType,
        expected: usize,
    },
}

impl PayloadError {
    /// Whether the message contains `text` (what callers did when this error was a `String`).
    pub fn contains(&self, text: &str) -> bool {
        self.to_string().contains(text)
    }
}

impl From<PayloadError> for String {
    /// The message, for code whose errors are text (`?` in a closure returning `String`).
    fn from(error: PayloadError) -> String {
        error.to_string()
    }
}
