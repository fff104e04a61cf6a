//! The communicators' error: every variant names the group, the ranks and the rule or event.

use std::time::Duration;

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
    /// A fault injected by a test ([`Fault`]).
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
