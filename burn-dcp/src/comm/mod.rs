//! Communicators (process groups): the only way ranks exchange data.
//!
//! Messages are [`Payload`]s: a backend's tensor on its device, or host [`TensorData`] (bytes +
//! shape + dtype), so one communicator serves every backend and dtype, and a communicator that
//! can pass device tensors as they are (the in-process world) never copies them to the host. Every blocking wait has a timeout and fails with an error naming the peer; when a
//! rank fails, every rank's pending and future operations fail with [`CommError::PeerFailed`]
//! naming the rank that failed *first* (the root cause) and its reason. Every message carries an
//! envelope (operation, index), so a receiver notices a lost, duplicated or mismatched message
//! ([`CommError::Protocol`]) instead of computing with the wrong data.

mod common;
pub mod in_process;
pub mod links;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod payload;
pub mod tcp;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{DType, TensorData};

pub use in_process::{InProcessWorld, WorldConfig, MAX_IN_PROCESS_RANKS, MAX_TIMEOUT};
pub use links::LinkEmulation;
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiWorld};
#[cfg(feature = "cuda")]
pub use nccl::{NcclComm, NcclWorld};
pub use payload::{DeviceTensor, Payload};
pub use tcp::{Rendezvous, TcpComm, TcpWorld};

/// A shared handle to one rank's view of a group.
pub type Comm = Arc<dyn Communicator>;

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

/// A fault to inject into an in-process world (tests of failure behaviour): when global rank
/// `rank` makes its communication call number `at_call` (0-based, counting every operation of
/// every group of that rank), `kind` happens.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub rank: usize,
    pub at_call: u64,
    pub kind: FaultKind,
}

/// What an injected [`Fault`] does.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// The rank panics inside the call.
    Panic,
    /// The call returns [`CommError::Injected`].
    Error,
    /// The call sleeps this long first (past the timeout, peers waiting on the rank time out).
    Delay(Duration),
    /// The rank leaves the world at once, as if its task returned without finishing the
    /// protocol (its peers must notice at once, not at the timeout).
    Exit,
    /// The next message this rank sends to another rank (from this call on) is never delivered.
    DropMessage,
    /// The next message this rank sends to another rank (from this call on) is delivered twice.
    DuplicateMessage,
}

/// Operation kinds, for byte accounting.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    SendRecv,
    AllToAll,
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            OpKind::SendRecv => "send/recv",
            OpKind::AllToAll => "all-to-all",
            OpKind::AllGather => "all-gather",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::AllReduce => "all-reduce",
        };
        f.write_str(name)
    }
}

/// Bytes this rank sent to *other* ranks (sends to itself are free), per operation kind, summed
/// over every group the rank belongs to. Control messages of `split`/`barrier` are not counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CommStats {
    pub bytes_by_op: BTreeMap<OpKind, u64>,
    pub messages: u64,
    /// Bytes of control messages (configuration agreement), kept apart from the data bytes.
    pub control_bytes: u64,
    /// The data bytes by link class (see `WorldConfig::ranks_per_node`).
    pub bytes_by_link: LinkBytes,
    /// The data bytes by the label of the group that sent them (see
    /// [`Communicator::split_labeled`]; unlabeled groups count under `""`).
    pub bytes_by_label: BTreeMap<String, u64>,
}

/// Bytes by link class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkBytes {
    pub intra_node: u64,
    pub inter_node: u64,
}

impl CommStats {
    pub fn total_bytes(&self) -> u64 {
        self.bytes_by_op.values().sum()
    }

    pub fn bytes(&self, op: OpKind) -> u64 {
        self.bytes_by_op.get(&op).copied().unwrap_or(0)
    }
}

/// A receive in flight: [`PendingRecv::wait`] blocks (up to the timeout) for the data.
pub struct PendingRecv(Box<dyn FnOnce() -> Result<Payload, CommError> + Send>);

impl PendingRecv {
    pub fn new(wait: impl FnOnce() -> Result<Payload, CommError> + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) -> Result<Payload, CommError> {
        (self.0)()
    }
}

/// A send in flight: [`PendingSend::wait`] returns once the buffer may be reused.
pub struct PendingSend(Box<dyn FnOnce() -> Result<(), CommError> + Send>);

impl PendingSend {
    pub fn new(wait: impl FnOnce() -> Result<(), CommError> + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) -> Result<(), CommError> {
        (self.0)()
    }
}

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
                .map_err(invalid)?
                .into_vec::<u8>()
                .map_err(|e| invalid(format!("{e:?}")))
        })
        .collect()
}

/// The message of a panic payload (`&str` or `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}

/// Elementwise sum of tensors of one shape and dtype, in the given order (deterministic).
pub fn sum_tensor_data(parts: Vec<TensorData>) -> Result<TensorData, String> {
    let mut iter = parts.into_iter();
    let first = iter.next().ok_or("nothing to sum")?;
    let (shape, dtype) = (first.shape.clone(), first.dtype);
    if dtype == DType::F64 {
        let mut acc = first.into_vec::<f64>().map_err(|e| format!("{e:?}"))?;
        for part in iter {
            check_same(&shape, dtype, &part)?;
            let values = part.into_vec::<f64>().map_err(|e| format!("{e:?}"))?;
            acc.iter_mut().zip(values).for_each(|(a, b)| *a += b);
        }
        return Ok(TensorData::new(acc, shape));
    }
    let mut acc = first
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    for part in iter {
        check_same(&shape, dtype, &part)?;
        let values = part
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?;
        acc.iter_mut().zip(values).for_each(|(a, b)| *a += b);
    }
    Ok(TensorData::new(acc, shape).convert_dtype(dtype))
}

fn check_same(shape: &burn::tensor::Shape, dtype: DType, part: &TensorData) -> Result<(), String> {
    if &part.shape != shape || part.dtype != dtype {
        return Err(format!(
            "cannot sum a {:?} {:?} tensor with a {:?} {:?} tensor",
            part.shape.as_slice(),
            part.dtype,
            shape.as_slice(),
            dtype
        ));
    }
    Ok(())
}
