//! The `Communicator` trait (one rank's view of a group) and its shared handle, `Comm`.

use std::fmt;
use std::sync::Arc;

use burn::tensor::TensorData;

use super::{CommError, CommStats, Payload, PendingRecv, PendingSend};

/// A shared handle to one rank's view of a group.
pub type Comm = Arc<dyn Communicator>;

/// A process group as seen by one of its ranks.
///
/// Collectives must be called by every member in the same order. Ranks are group-local
/// (`0..size()`); [`Communicator::global_rank`] maps them to the world for messages.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks of the group.
    fn size(&self) -> usize;
    /// The group's name (for error messages).
    fn name(&self) -> &str;
    /// World rank of group rank `rank`.
    fn global_rank(&self, rank: usize) -> usize;

    /// Starts sending `data` to `peer`; messages between two ranks arrive in send order.
    fn isend(&self, peer: usize, data: Payload) -> Result<PendingSend, CommError>;
    /// Posts a receive of the next message from `peer` (receives match sends in posting order).
    fn irecv(&self, peer: usize) -> Result<PendingRecv, CommError>;

    /// `parts[p]` goes to rank `p`; returns what every rank sent here, indexed by sender.
    fn all_to_all(&self, parts: Vec<Payload>) -> Result<Vec<Payload>, CommError>;
    /// Every rank's `data`, indexed by rank.
    fn all_gather(&self, data: Payload) -> Result<Vec<Payload>, CommError>;
    /// `parts[p]` goes to rank `p`; returns the elementwise sum (in rank order) of what was sent here.
    fn reduce_scatter(&self, parts: Vec<Payload>) -> Result<Payload, CommError>;
    /// Elementwise sum over ranks; every rank gets the identical result.
    fn all_reduce(&self, data: Payload) -> Result<Payload, CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
    /// Every rank's small control payload, indexed by rank (configuration agreement before data
    /// moves). `what` names the exchange in errors. The in-process world counts these bytes as
    /// control bytes only; the default (for communicators written elsewhere) is an `all_gather`.
    fn all_gather_control(&self, what: &str, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let count = payload.len();
        let received = self.all_gather(TensorData::new(payload, [count]).into())?;
        control_payloads(self.name(), what, received)
    }
    /// Splits the group: ranks with the same `color` form a new group, ordered by `(key, rank)`.
    /// The new group keeps this group's label.
    fn split(&self, color: usize, key: usize) -> Result<Comm, CommError>;
    /// [`Communicator::split`], labelling the new group (and the groups split from it) for
    /// [`CommStats::bytes_by_label`] — the mesh labels its axis groups `tp`, `cp`, `dp`, `pp`.
    /// The default ignores the label.
    fn split_labeled(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        let _ = label;
        self.split(color, key)
    }

    /// Bytes sent so far by this rank (all its groups).
    fn stats(&self) -> CommStats;
    /// Marks this rank as failed: its peers' pending and future operations fail naming it.
    fn abort(&self, reason: &str);
}

/// The bytes of control messages received as `u8` tensors (see
/// [`Communicator::all_gather_control`]).
pub(crate) fn control_payloads(
    group: &str,
    what: &str,
    received: Vec<Payload>,
) -> Result<Vec<Vec<u8>>, CommError> {
    received
        .into_iter()
        .map(|data| {
            let invalid = |message: String| CommError::Invalid {
                group: group.to_string(),
                message: format!("{what}: malformed control message {message}"),
            };
            data.into_host()
                .map_err(|e| invalid(e.to_string()))?
                .into_vec::<u8>()
                .map_err(|e| invalid(format!("{e:?}")))
        })
        .collect()
}
