//! Communicators (process groups): the only way ranks exchange data.
//!
//! Payloads are [`TensorData`] (bytes + shape + dtype), so one communicator serves every backend
//! and dtype. Every blocking wait has a timeout and fails with an error naming the peer; when a
//! rank fails, every member of its groups gets [`CommError::PeerFailed`] naming it, on pending and
//! future operations alike.

pub mod in_process;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{DType, TensorData};

pub use in_process::{InProcessWorld, WorldConfig};

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
}

/// Operation kinds, for byte accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CommStats {
    pub bytes_by_op: BTreeMap<OpKind, u64>,
    pub messages: u64,
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
pub struct PendingRecv(Box<dyn FnOnce() -> Result<TensorData, CommError> + Send>);

impl PendingRecv {
    pub fn new(wait: impl FnOnce() -> Result<TensorData, CommError> + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) -> Result<TensorData, CommError> {
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
    fn isend(&self, peer: usize, data: TensorData) -> Result<PendingSend, CommError>;
    /// Posts a receive of the next message from `peer` (receives match sends in posting order).
    fn irecv(&self, peer: usize) -> Result<PendingRecv, CommError>;

    /// `parts[p]` goes to rank `p`; returns what every rank sent here, indexed by sender.
    fn all_to_all(&self, parts: Vec<TensorData>) -> Result<Vec<TensorData>, CommError>;
    /// Every rank's `data`, indexed by rank.
    fn all_gather(&self, data: TensorData) -> Result<Vec<TensorData>, CommError>;
    /// `parts[p]` goes to rank `p`; returns the elementwise sum (in rank order) of what was sent here.
    fn reduce_scatter(&self, parts: Vec<TensorData>) -> Result<TensorData, CommError>;
    /// Elementwise sum over ranks; every rank gets the identical result.
    fn all_reduce(&self, data: TensorData) -> Result<TensorData, CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
    /// Splits the group: ranks with the same `color` form a new group, ordered by `(key, rank)`.
    fn split(&self, color: usize, key: usize) -> Result<Comm, CommError>;

    /// Bytes sent so far by this rank (all its groups).
    fn stats(&self) -> CommStats;
    /// Marks this rank as failed: its peers' pending and future operations fail naming it.
    fn abort(&self, reason: &str);
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
