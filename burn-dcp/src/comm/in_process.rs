//! In-process communicator: ranks are threads of one process, messages move through shared
//! mailboxes. Used by tests, examples and single-machine CPU runs.
//!
//! Matching: every (group, sender, receiver, channel) pair has a send counter and a receive
//! counter; the n-th receive posted gets the n-th message sent, whatever order receives are waited
//! in. Point-to-point and collective traffic use separate channels so they never mix.
//!
//! Failure: a rank that returns an error or panics inside [`InProcessWorld::run`] (or calls
//! [`Communicator::abort`], or drops its handle while panicking) is marked failed and all waiters
//! are woken; any operation of a group containing a failed rank then fails naming it.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use crate::comm::{
    sum_tensor_data, Comm, CommError, CommStats, Communicator, OpKind, PendingRecv, PendingSend,
};

/// Settings of an in-process world.
#[derive(Clone, Debug)]
pub struct WorldConfig {
    /// How long any wait may block before failing with [`CommError::Timeout`].
    pub timeout: Duration,
}

impl Default for WorldConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Channel {
    PointToPoint,
    Collective,
    Control,
}

/// (group name, sender global rank, receiver global rank, channel).
type MailboxKey = (String, usize, usize, Channel);

#[derive(Default)]
struct Mailbox {
    sent: u64,
    posted: u64,
    messages: HashMap<u64, TensorData>,
}

#[derive(Default)]
struct WorldState {
    mailboxes: HashMap<MailboxKey, Mailbox>,
    /// Reason of failure of each failed world rank.
    failed: HashMap<usize, String>,
}

struct World {
    config: WorldConfig,
    state: Mutex<WorldState>,
    wake: Condvar,
    stats: Vec<Mutex<CommStats>>,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // A panic while holding the lock cannot leave the mailboxes inconsistent (every critical
        // section is a single insert/remove), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn mark_failed(&self, global_rank: usize, reason: String) {
        self.lock().failed.entry(global_rank).or_insert(reason);
        self.wake.notify_all();
    }
}

/// A world of in-process ranks. Create it, then run one closure per rank with [`Self::run`]
/// (or hand out [`Self::communicators`] to threads of your own).
pub struct InProcessWorld {
    world: Arc<World>,
    size: usize,
}

impl InProcessWorld {
    pub fn new(size: usize, config: WorldConfig) -> Result<Self, CommError> {
        if size == 0 {
            return Err(CommError::Invalid {
                group: "world".into(),
                message: "a world needs at least one rank, got 0".into(),
            });
        }
        let world = World {
            config,
            state: Mutex::new(WorldState::default()),
            wake: Condvar::new(),
            stats: (0..size)
                .map(|_| Mutex::new(CommStats::default()))
                .collect(),
        };
        Ok(Self {
            world: Arc::new(world),
            size,
        })
    }

    /// One communicator per rank over the whole world.
    pub fn communicators(&self) -> Vec<Comm> {
        let members: Arc<[usize]> = (0..self.size).collect();
        (0..self.size)
            .map(|rank| {
                Arc::new(InProcessComm {
                    world: self.world.clone(),
                    name: "world".into(),
                    members: members.clone(),
                    rank,
                    splits: Mutex::new(0),
                }) as Comm
            })
            .collect()
    }

    /// Runs `task(comm)` on one thread per rank and returns each rank's result, in rank order.
    /// A rank that errors or panics is marked failed, so its peers error out instead of hanging.
    pub fn run<T, E, F>(&self, task: F) -> Vec<Result<T, String>>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Comm) -> Result<T, E> + Sync,
    {
        let task = &task;
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .communicators()
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let world = self.world.clone();
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let outcome =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    task(comm)
                                }));
                            let result = match outcome {
                                Ok(Ok(value)) => Ok(value),
                                Ok(Err(error)) => {
                                    Err(format!("rank {rank} returned an error: {error}"))
                                }
                                Err(panic) => {
                                    Err(format!("rank {rank} panicked: {}", panic_message(&panic)))
                                }
                            };
                            if let Err(reason) = &result {
                                world.mark_failed(rank, reason.clone());
                            }
                            result
                        })
                        .expect("spawning a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("rank thread could not be joined".into()))
                })
                .collect()
        })
    }

    /// Bytes sent by each world rank so far.
    pub fn stats(&self) -> Vec<CommStats> {
        self.world
            .stats
            .iter()
            .map(|s| s.lock().map(|s| s.clone()).unwrap_or_default())
            .collect()
    }
}

fn panic_message(panic: &Box<dyn Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}

/// One rank's handle on one group of an [`InProcessWorld`].
pub struct InProcessComm {
    world: Arc<World>,
    name: String,
    /// World ranks of the group members, in group-rank order.
    members: Arc<[usize]>,
    rank: usize,
    splits: Mutex<u64>,
}

impl fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "InProcessComm(group '{}', rank {}/{})",
            self.name,
            self.rank,
            self.members.len()
        )
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let me = self.members[self.rank];
            self.world.mark_failed(me, format!("rank {me} panicked"));
        }
    }
}

impl InProcessComm {
    fn me(&self) -> usize {
        self.members[self.rank]
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<(), CommError> {
        if peer >= self.members.len() {
            return Err(CommError::Invalid {
                group: self.name.clone(),
                message: format!(
                    "{op}: peer rank {peer} does not exist in a group of {} ranks",
                    self.members.len()
                ),
            });
        }
        Ok(())
    }

    fn check_parts(&self, parts: &[TensorData], op: &str) -> Result<(), CommError> {
        if parts.len() != self.members.len() {
            return Err(CommError::Invalid {
                group: self.name.clone(),
                message: format!(
                    "{op} needs one part per rank ({}), got {}",
                    self.members.len(),
                    parts.len()
                ),
            });
        }
        Ok(())
    }

    /// Fails if any member of this group has failed.
    fn check_group(&self, state: &WorldState, op: &str) -> Result<(), CommError> {
        match self
            .members
            .iter()
            .find_map(|m| state.failed.get(m).map(|r| (*m, r)))
        {
            Some((failed_global, reason)) => Err(CommError::PeerFailed {
                group: self.name.clone(),
                rank: self.rank,
                failed_global,
                reason: reason.clone(),
                op: op.to_string(),
            }),
            None => Ok(()),
        }
    }

    fn post(
        &self,
        peer: usize,
        channel: Channel,
        data: TensorData,
        op: Option<OpKind>,
    ) -> Result<(), CommError> {
        let (me, to) = (self.me(), self.members[peer]);
        let bytes = data.bytes.len() as u64;
        {
            let mut state = self.world.lock();
            self.check_group(&state, "send")?;
            let mailbox = state
                .mailboxes
                .entry((self.name.clone(), me, to, channel))
                .or_default();
            let seq = mailbox.sent;
            mailbox.sent += 1;
            mailbox.messages.insert(seq, data);
        }
        self.world.wake.notify_all();
        if let (Some(op), true) = (op, me != to) {
            let mut stats = self.world.stats[me]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *stats.bytes_by_op.entry(op).or_default() += bytes;
            stats.messages += 1;
        }
        Ok(())
    }

    /// Reserves the next message from `peer` on `channel`; returns its sequence number.
    fn reserve(&self, peer: usize, channel: Channel) -> u64 {
        let key = (self.name.clone(), self.members[peer], self.me(), channel);
        let mut state = self.world.lock();
        let mailbox = state.mailboxes.entry(key).or_default();
        mailbox.posted += 1;
        mailbox.posted - 1
    }

    fn wait_for(
        &self,
        peer: usize,
        channel: Channel,
        seq: u64,
        op: &str,
    ) -> Result<TensorData, CommError> {
        wait_message(
            &self.world,
            &self.name,
            &self.members,
            self.rank,
            peer,
            channel,
            seq,
            op,
        )
    }

    fn recv_now(&self, peer: usize, channel: Channel, op: &str) -> Result<TensorData, CommError> {
        let seq = self.reserve(peer, channel);
        self.wait_for(peer, channel, seq, op)
    }

    /// Sends `parts[p]` to every `p` and receives one message from every rank (itself included).
    fn exchange(
        &self,
        parts: Vec<TensorData>,
        channel: Channel,
        op: OpKind,
    ) -> Result<Vec<TensorData>, CommError> {
        for (peer, part) in parts.into_iter().enumerate() {
            self.post(peer, channel, part, Some(op))?;
        }
        (0..self.members.len())
            .map(|peer| self.recv_now(peer, channel, &op.to_string()))
            .collect()
    }
}

/// Blocks until message `seq` from `peer` arrives, a member fails, or the timeout passes.
#[allow(clippy::too_many_arguments)]
fn wait_message(
    world: &World,
    group: &str,
    members: &[usize],
    rank: usize,
    peer: usize,
    channel: Channel,
    seq: u64,
    op: &str,
) -> Result<TensorData, CommError> {
    let key = (group.to_string(), members[peer], members[rank], channel);
    let deadline = Instant::now() + world.config.timeout;
    let mut state = world.lock();
    loop {
        if let Some(data) = state
            .mailboxes
            .get_mut(&key)
            .and_then(|m| m.messages.remove(&seq))
        {
            return Ok(data);
        }
        if let Some((failed_global, reason)) = members
            .iter()
            .find_map(|m| state.failed.get(m).map(|r| (*m, r.clone())))
        {
            return Err(CommError::PeerFailed {
                group: group.to_string(),
                rank,
                failed_global,
                reason,
                op: op.to_string(),
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Timeout {
                group: group.to_string(),
                rank,
                peer,
                peer_global: members[peer],
                op: op.to_string(),
                waited: world.config.timeout,
            });
        }
        state = world
            .wake
            .wait_timeout(state, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn global_rank(&self, rank: usize) -> usize {
        self.members[rank]
    }

    fn isend(&self, peer: usize, data: TensorData) -> Result<PendingSend, CommError> {
        self.check_peer(peer, "isend")?;
        // Eager: the message is in the peer's mailbox when this returns.
        self.post(peer, Channel::PointToPoint, data, Some(OpKind::SendRecv))?;
        Ok(PendingSend::new(|| Ok(())))
    }

    fn irecv(&self, peer: usize) -> Result<PendingRecv, CommError> {
        self.check_peer(peer, "irecv")?;
        let seq = self.reserve(peer, Channel::PointToPoint);
        let (world, name, members, rank) = (
            self.world.clone(),
            self.name.clone(),
            self.members.clone(),
            self.rank,
        );
        Ok(PendingRecv::new(move || {
            wait_message(
                &world,
                &name,
                &members,
                rank,
                peer,
                Channel::PointToPoint,
                seq,
                "recv",
            )
        }))
    }

    fn all_to_all(&self, parts: Vec<TensorData>) -> Result<Vec<TensorData>, CommError> {
        self.check_parts(&parts, "all-to-all")?;
        self.exchange(parts, Channel::Collective, OpKind::AllToAll)
    }

    fn all_gather(&self, data: TensorData) -> Result<Vec<TensorData>, CommError> {
        let parts = vec![data; self.members.len()];
        self.exchange(parts, Channel::Collective, OpKind::AllGather)
    }

    fn reduce_scatter(&self, parts: Vec<TensorData>) -> Result<TensorData, CommError> {
        self.check_parts(&parts, "reduce-scatter")?;
        let received = self.exchange(parts, Channel::Collective, OpKind::ReduceScatter)?;
        sum_tensor_data(received).map_err(|message| CommError::Invalid {
            group: self.name.clone(),
            message: format!("reduce-scatter: {message}"),
        })
    }

    /// Reduce-scatter of flat chunks then all-gather (the ring all-reduce's traffic,
    /// `2·(P−1)/P` of the tensor per rank); the sum is taken in rank order on the chunk's owner.
    fn all_reduce(&self, data: TensorData) -> Result<TensorData, CommError> {
        let invalid = |message: String| CommError::Invalid {
            group: self.name.clone(),
            message: format!("all-reduce: {message}"),
        };
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        let size = self.members.len();
        let flat = flatten(data);
        let chunks = split_flat(&flat, size).map_err(invalid)?;
        let mine = self.exchange(chunks, Channel::Collective, OpKind::AllReduce)?;
        let reduced = sum_tensor_data(mine).map_err(invalid)?;
        let gathered =
            self.exchange(vec![reduced; size], Channel::Collective, OpKind::AllReduce)?;
        concat_flat(gathered, shape.as_slice(), dtype).map_err(invalid)
    }

    fn barrier(&self) -> Result<(), CommError> {
        for peer in 0..self.members.len() {
            self.post(
                peer,
                Channel::Control,
                TensorData::new(Vec::<i64>::new(), [0]),
                None,
            )?;
        }
        for peer in 0..self.members.len() {
            self.recv_now(peer, Channel::Control, "barrier")?;
        }
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm, CommError> {
        let me = TensorData::new(vec![color as i64, key as i64], [2]);
        for peer in 0..self.members.len() {
            self.post(peer, Channel::Control, me.clone(), None)?;
        }
        let mut same_color = Vec::new();
        for peer in 0..self.members.len() {
            let data = self.recv_now(peer, Channel::Control, "split")?;
            let values = data.into_vec::<i64>().map_err(|e| CommError::Invalid {
                group: self.name.clone(),
                message: format!("split: malformed control message {e:?}"),
            })?;
            if values[0] as usize == color {
                same_color.push((values[1] as usize, peer));
            }
        }
        same_color.sort();
        let members: Arc<[usize]> = same_color
            .iter()
            .map(|&(_, peer)| self.members[peer])
            .collect();
        let rank = same_color
            .iter()
            .position(|&(_, peer)| peer == self.rank)
            .unwrap_or(0);
        let index = {
            let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
            *splits += 1;
            *splits
        };
        Ok(Arc::new(InProcessComm {
            world: self.world.clone(),
            name: format!("{}/split{index}:{color}", self.name),
            members,
            rank,
            splits: Mutex::new(0),
        }))
    }

    fn stats(&self) -> CommStats {
        self.world.stats[self.me()]
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    fn abort(&self, reason: &str) {
        self.world
            .mark_failed(self.me(), format!("rank {} aborted: {reason}", self.me()));
    }
}

fn flatten(data: TensorData) -> TensorData {
    let count = data.num_elements();
    TensorData::from_bytes(data.bytes, [count], data.dtype)
}

/// Splits a flat tensor into `parts` contiguous chunks (sizes differ by at most one element).
fn split_flat(flat: &TensorData, parts: usize) -> Result<Vec<TensorData>, String> {
    let count = flat.num_elements();
    let width = flat.dtype.size();
    let bytes = flat.as_bytes();
    Ok((0..parts)
        .map(|p| {
            let (start, end) = (p * count / parts, (p + 1) * count / parts);
            TensorData::from_bytes_vec(
                bytes[start * width..end * width].to_vec(),
                [end - start],
                flat.dtype,
            )
        })
        .collect())
}

fn concat_flat(
    chunks: Vec<TensorData>,
    shape: &[usize],
    dtype: burn::tensor::DType,
) -> Result<TensorData, String> {
    let mut bytes = Vec::new();
    for chunk in &chunks {
        if chunk.dtype != dtype {
            return Err(format!(
                "chunk dtype {:?} differs from {dtype:?}",
                chunk.dtype
            ));
        }
        bytes.extend_from_slice(chunk.as_bytes());
    }
    Ok(TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype))
}
