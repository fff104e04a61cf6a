//! In-process communicator: ranks are threads of one process, messages move through shared
//! mailboxes. Used by tests, examples and single-machine CPU runs.
//!
//! Matching: every (group, sender, receiver, channel) pair has a delivery counter and a receive
//! counter; the n-th receive posted gets the n-th message delivered, whatever order receives are
//! waited in. Point-to-point, collective and control traffic use separate channels so they never
//! mix. Every message carries an envelope — the operation and the sender's index of the message
//! on that link — which the receiver checks: a message of another operation (ranks running
//! different protocols), or an index out of order (a lost or duplicated message), is a
//! [`CommError::Protocol`] error, never wrong data.
//!
//! Failure (fail-fast, like an aborted NCCL or MPI job): the world records failures in the order
//! they happen. A rank fails when it returns an error or panics inside [`InProcessWorld::run`],
//! calls [`Communicator::abort`](crate::comm::Communicator::abort), drops a handle while panicking, times out, or receives an
//! unexpected message. From then on every operation of every rank fails with
//! [`CommError::PeerFailed`] naming the rank that failed **first** and its reason (for a panic,
//! the panic message). A rank that leaves (its task returns, or its last handle on a group is
//! dropped) without sending a message a peer waits for is recorded as failed at that moment, so
//! the peer fails at once instead of at the timeout.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use crate::comm::collectives::agree_split;
use crate::comm::common::{check_nodes, check_timeout, Accounting};
use crate::comm::links::{LinkClock, LinkEmulation};
use crate::comm::transport::{check_envelope, Channel, Group, Transport};
use crate::comm::{
    panic_message, Comm, CommError, CommStats, Fault, FaultKind, Payload, PendingSend,
};

/// The most ranks an in-process world may have (one thread each).
pub const MAX_IN_PROCESS_RANKS: usize = 1024;
/// The longest timeout a world accepts (a week): longer waits are a mistake, not a setting.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Settings of an in-process world.
#[derive(Clone, Debug)]
pub struct WorldConfig {
    /// How long any wait may block before failing with [`CommError::Timeout`].
    pub timeout: Duration,
    /// Virtual nodes: world rank `r` is on node `r / ranks_per_node` (`None`: one node). Data
    /// bytes are counted per link class ([`CommStats::bytes_by_link`]): a message between two
    /// ranks of one node is intra-node, any other inter-node. Collectives are counted as the
    /// direct messages this world sends (each rank's part straight to each peer).
    pub ranks_per_node: Option<usize>,
}

impl Default for WorldConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            ranks_per_node: None,
        }
    }
}

impl WorldConfig {
    /// The node of world rank `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        self.ranks_per_node.map_or(0, |n| rank / n)
    }
}

/// (group name, sender global rank, receiver global rank, channel).
type MailboxKey = (String, usize, usize, Channel);

/// A message with what the receiver checks: the operation and the sender's index on the link.
struct Envelope {
    op: String,
    index: u64,
    data: Payload,
    /// When it arrives over an emulated link (`None`: at once).
    ready_at: Option<Instant>,
}

#[derive(Default)]
struct Mailbox {
    /// Messages put in the mailbox (the transport's sequence numbers).
    delivered: u64,
    /// Messages the sender stamped (the envelope indices); equal to `delivered` unless a fault
    /// dropped or duplicated one.
    stamped: u64,
    /// Receives posted.
    posted: u64,
    messages: HashMap<u64, Envelope>,
}

/// Why a rank failed, and when (its place in the order of failures).
struct Failure {
    order: u64,
    reason: String,
    /// Recorded without the panic message (a replaced panic hook); a later record may refine it.
    provisional: bool,
}

#[derive(Default)]
struct WorldState {
    mailboxes: HashMap<MailboxKey, Mailbox>,
    failures: HashMap<usize, Failure>,
    next_failure: u64,
    /// Ranks whose task returned (this run).
    finished: HashSet<usize>,
    /// Live handles per (group, global rank); 0: the rank can never send on that group again.
    handles: HashMap<(String, usize), usize>,
    /// Faults still to inject, and each rank's communication calls so far.
    faults: Vec<Fault>,
    calls: Vec<u64>,
    /// A drop or duplicate waiting for the rank's next message to another rank.
    message_faults: HashMap<usize, FaultKind>,
    /// Emulated links ([`InProcessWorld::emulate_links`]), if any.
    clock: Option<LinkClock>,
}

impl WorldState {
    fn first_failure(&self) -> Option<(usize, &Failure)> {
        self.failures
            .iter()
            .min_by_key(|(_, failure)| failure.order)
            .map(|(rank, failure)| (*rank, failure))
    }

    fn record_failure(&mut self, rank: usize, reason: String, provisional: bool) {
        match self.failures.get_mut(&rank) {
            Some(failure) if failure.provisional && !provisional => {
                failure.reason = reason;
                failure.provisional = false;
            }
            Some(_) => {}
            None => {
                let order = self.next_failure;
                self.next_failure += 1;
                self.failures.insert(
                    rank,
                    Failure {
                        order,
                        reason,
                        provisional,
                    },
                );
            }
        }
    }

    /// [`CommError::PeerFailed`] naming the first failure, if any rank has failed.
    fn peer_failed(&self, group: &str, rank: usize, op: &str) -> Option<CommError> {
        self.first_failure()
            .map(|(failed_global, failure)| CommError::PeerFailed {
                group: group.to_string(),
                rank,
                failed_global,
                reason: failure.reason.clone(),
                op: op.to_string(),
            })
    }

    fn has_left(&self, group: &str, global_rank: usize) -> bool {
        self.finished.contains(&global_rank)
            || self.handles.get(&(group.to_string(), global_rank)) == Some(&0)
    }
}

struct World {
    config: WorldConfig,
    state: Mutex<WorldState>,
    /// One per world rank: a message wakes only its receiver; a failure or a rank leaving wakes
    /// everyone (`wake_all`).
    wake: Vec<Condvar>,
    stats: Vec<Mutex<CommStats>>,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // A panic while holding the lock cannot leave the mailboxes inconsistent (every critical
        // section is a few inserts/removes), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn mark_failed(&self, global_rank: usize, reason: String) {
        self.lock().record_failure(global_rank, reason, false);
        self.wake_all();
    }

    fn mark_finished(&self, global_rank: usize) {
        self.lock().finished.insert(global_rank);
        self.wake_all();
    }

    fn wake_all(&self) {
        self.wake.iter().for_each(Condvar::notify_all);
    }
}

thread_local! {
    /// The message of the last panic on this thread (set by the panic hook), so that a handle
    /// dropped while unwinding can report it.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Set while an injected [`FaultKind::Exit`] unwinds this thread: not a failure.
    static EXITING: Cell<bool> = const { Cell::new(false) };
}

/// The unwind payload of an injected [`FaultKind::Exit`].
struct InjectedExit;

/// Chains a panic hook that remembers each panic's message per thread (once per process).
fn install_panic_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let location = info
                .location()
                .map(|l| format!(" (at {}:{})", l.file(), l.line()))
                .unwrap_or_default();
            let message = format!("{}{location}", panic_message(info.payload()));
            let _ = LAST_PANIC.try_with(|last| *last.borrow_mut() = Some(message));
            previous(info);
        }));
    });
}

/// A world of in-process ranks. Create it, then run one closure per rank with [`Self::run`]
/// (or hand out [`Self::communicators`] to threads of your own).
pub struct InProcessWorld {
    world: Arc<World>,
    size: usize,
}

impl InProcessWorld {
    /// A world of `size` ranks (1 to [`MAX_IN_PROCESS_RANKS`]) whose waits time out after
    /// `config.timeout` (more than zero, at most [`MAX_TIMEOUT`]).
    pub fn new(size: usize, config: WorldConfig) -> Result<Self, CommError> {
        let invalid = |message: String| {
            Err(CommError::Invalid {
                group: "world".into(),
                message,
            })
        };
        if size == 0 || size > MAX_IN_PROCESS_RANKS {
            return invalid(format!(
                "an in-process world has 1 to {MAX_IN_PROCESS_RANKS} ranks (one thread each), got {size}"
            ));
        }
        check_timeout("world", config.timeout)?;
        check_nodes(size, &config)?;
        install_panic_hook();
        let state = WorldState {
            calls: vec![0; size],
            ..WorldState::default()
        };
        let world = World {
            config,
            state: Mutex::new(state),
            wake: (0..size).map(|_| Condvar::new()).collect(),
            stats: (0..size)
                .map(|_| Mutex::new(CommStats::default()))
                .collect(),
        };
        Ok(Self {
            world: Arc::new(world),
            size,
        })
    }

    /// Emulates links from now on (see [`super::links`]): every message between two ranks is
    /// received no earlier than it would arrive over its link (intra-node or inter-node, by the
    /// world's `ranks_per_node`). Bytes and results are unchanged.
    pub fn emulate_links(&self, links: LinkEmulation) -> Result<(), CommError> {
        links.validate()?;
        let nodes = match self.world.config.ranks_per_node {
            Some(per_node) => crate::nodes::NodeMap::with_ranks_per_node(self.size, per_node)
                .map_err(|e| CommError::Invalid {
                    group: "world".into(),
                    message: e.to_string(),
                })?,
            None => crate::nodes::NodeMap::single(self.size),
        };
        self.world.lock().clock = Some(LinkClock::new(links, nodes));
        Ok(())
    }

    /// One communicator per rank over the whole world.
    pub fn communicators(&self) -> Vec<Comm> {
        let members: Arc<[usize]> = (0..self.size).collect();
        (0..self.size)
            .map(|rank| {
                let group = Group::new("world".into(), Arc::from(""), members.clone(), rank);
                InProcessComm::open(&self.world, group)
            })
            .collect()
    }

    /// Runs `task(comm)` on one thread per rank and returns each rank's result, in rank order.
    /// While they run, the portable kernels' default threads per call are this process's cores
    /// shared among its ranks ([`burn_dcp_kernels::portable::RankThreads`]).
    /// A rank that errors or panics is marked failed, so its peers error out instead of hanging;
    /// a rank that returns is marked finished, so peers waiting on it fail at once.
    pub fn run<T, E, F>(&self, task: F) -> Vec<Result<T, String>>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Comm) -> Result<T, E> + Sync,
    {
        self.world.lock().finished.clear();
        let task = &task;
        // The portable kernels share this process's cores among the ranks while they run.
        let _cores = burn_dcp_kernels::portable::RankThreads::enter(self.size);
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
                            // What the rank allocates is its own (`burn_dcp_kernels::memory`).
                            let _tag = burn_dcp_kernels::memory::TagGuard::set(Some(rank));
                            run_rank(&world, rank, comm, task)
                        })
                        .map_err(|error| {
                            let reason = format!("rank {rank} could not be started: {error}");
                            self.world.mark_failed(rank, reason.clone());
                            reason
                        })
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| {
                    handle?
                        .join()
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

    /// Adds faults to inject (tests of failure behaviour; see [`Fault`]).
    pub fn inject_faults(&self, faults: impl IntoIterator<Item = Fault>) {
        self.world.lock().faults.extend(faults);
    }

    /// Communication calls each world rank has made so far (the clock of [`Fault::at_call`]).
    pub fn calls(&self) -> Vec<u64> {
        self.world.lock().calls.clone()
    }

    /// The rank that failed first and its reason, if any rank failed.
    pub fn first_failure(&self) -> Option<(usize, String)> {
        let state = self.world.lock();
        state
            .first_failure()
            .map(|(rank, failure)| (rank, failure.reason.clone()))
    }

    /// One message for a run whose ranks returned `results`: the rank that failed first with its
    /// reason, then the ranks that failed after it. `None` when every rank succeeded.
    pub fn failure_summary<T>(&self, results: &[Result<T, String>]) -> Option<String> {
        let failed: Vec<usize> = (0..results.len())
            .filter(|&r| results[r].is_err())
            .collect();
        if failed.is_empty() {
            return None;
        }
        let Some((first, reason)) = self.first_failure() else {
            let rank = failed[0];
            return results[rank].as_ref().err().cloned();
        };
        let others: Vec<String> = failed
            .iter()
            .filter(|&&r| r != first)
            .map(|r| r.to_string())
            .collect();
        let mut summary = format!("global rank {first} failed first: {reason}");
        if !others.is_empty() {
            summary.push_str(&format!(
                " (then rank(s) {} failed because of it)",
                others.join(", ")
            ));
        }
        Some(summary)
    }
}

/// One rank's thread body: runs the task and records how it ended.
fn run_rank<T, E: fmt::Display>(
    world: &World,
    rank: usize,
    comm: Comm,
    task: &(impl Fn(Comm) -> Result<T, E> + Sync),
) -> Result<T, String> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(comm)));
    EXITING.with(|exiting| exiting.set(false));
    match outcome {
        Ok(Ok(value)) => {
            world.mark_finished(rank);
            Ok(value)
        }
        Ok(Err(error)) => {
            let reason = format!("rank {rank} returned an error: {error}");
            world.mark_failed(rank, reason.clone());
            Err(reason)
        }
        Err(payload) if payload.is::<InjectedExit>() => {
            world.mark_finished(rank);
            Err(format!("rank {rank} left the world early (injected fault)"))
        }
        Err(payload) => {
            let reason = format!("rank {rank} panicked: {}", panic_message(&*payload));
            world.mark_failed(rank, reason.clone());
            Err(reason)
        }
    }
}

/// One rank's handle on one group of an [`InProcessWorld`].
pub struct InProcessComm {
    world: Arc<World>,
    group: Group,
}

impl fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "InProcessComm(group '{}', rank {}/{})",
            self.group.name,
            self.group.rank,
            self.group.size()
        )
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        let me = self.group.me();
        let mut state = self.world.lock();
        if std::thread::panicking() && !EXITING.with(Cell::get) {
            let message = LAST_PANIC
                .try_with(|last| last.borrow().clone())
                .ok()
                .flatten();
            let provisional = message.is_none();
            let message = message.unwrap_or_else(|| "no panic message captured".into());
            state.record_failure(me, format!("rank {me} panicked: {message}"), provisional);
        }
        if let Some(count) = state.handles.get_mut(&(self.group.name.clone(), me)) {
            *count = count.saturating_sub(1);
        }
        drop(state);
        self.world.wake_all();
    }
}

impl InProcessComm {
    fn open(world: &Arc<World>, group: Group) -> Comm {
        *world
            .lock()
            .handles
            .entry((group.name.clone(), group.me()))
            .or_default() += 1;
        Arc::new(InProcessComm {
            world: world.clone(),
            group,
        })
    }
}

impl Transport for InProcessComm {
    type Recv = Waiter;
    const HOST_BYTES: bool = false;

    fn group(&self) -> &Group {
        &self.group
    }

    /// Fails fast if any rank has failed, counts the call and injects a fault planned for it.
    fn begin(&self, op: &str) -> Result<(), CommError> {
        let me = self.group.me();
        let (fault, call) = {
            let mut state = self.world.lock();
            if let Some(error) = state.peer_failed(&self.group.name, self.group.rank, op) {
                return Err(error);
            }
            let call = state.calls[me];
            state.calls[me] += 1;
            let planned = state
                .faults
                .iter()
                .position(|f| f.rank == me && f.at_call == call);
            let fault = planned.map(|i| state.faults.remove(i).kind);
            match fault {
                Some(kind @ (FaultKind::DropMessage | FaultKind::DuplicateMessage)) => {
                    state.message_faults.insert(me, kind);
                    (None, call)
                }
                other => (other, call),
            }
        };
        match fault {
            None => Ok(()),
            Some(FaultKind::Panic) => {
                panic!("injected fault: global rank {me} panics at its communication call #{call} ({op})")
            }
            Some(FaultKind::Error) => {
                let error = CommError::Injected {
                    group: self.group.name.clone(),
                    global_rank: me,
                    call,
                    op: op.to_string(),
                };
                self.world.mark_failed(me, error.to_string());
                Err(error)
            }
            Some(FaultKind::Delay(duration)) => {
                std::thread::sleep(duration);
                Ok(())
            }
            Some(FaultKind::Exit) => {
                EXITING.with(|exiting| exiting.set(true));
                std::panic::resume_unwind(Box::new(InjectedExit))
            }
            Some(FaultKind::DropMessage | FaultKind::DuplicateMessage) => Ok(()),
        }
    }

    /// Puts the message in `peer`'s mailbox: sends are eager, done when this returns.
    fn post_send(
        &self,
        peer: usize,
        channel: Channel,
        data: Payload,
        op: &str,
        accounting: Accounting,
    ) -> Result<PendingSend, CommError> {
        let group = &self.group;
        let (me, to) = (group.me(), group.members[peer]);
        let bytes = data.num_bytes();
        {
            let mut state = self.world.lock();
            if let Some(error) = state.peer_failed(&group.name, group.rank, op) {
                return Err(error);
            }
            let fault = if me != to {
                state.message_faults.remove(&me)
            } else {
                None
            };
            let ready_at = state
                .clock
                .as_mut()
                .map(|clock| clock.arrival(me, to, bytes));
            let mailbox = state
                .mailboxes
                .entry((group.name.clone(), me, to, channel))
                .or_default();
            let index = mailbox.stamped;
            mailbox.stamped += 1;
            let envelope = |data| Envelope {
                op: op.to_string(),
                index,
                data,
                ready_at,
            };
            if fault == Some(FaultKind::DuplicateMessage) {
                mailbox
                    .messages
                    .insert(mailbox.delivered, envelope(data.clone()));
                mailbox.delivered += 1;
            }
            if fault != Some(FaultKind::DropMessage) {
                mailbox.messages.insert(mailbox.delivered, envelope(data));
                mailbox.delivered += 1;
            }
        }
        self.world.wake[to].notify_all();
        let world = &self.world;
        group.count(&world.stats[me], &world.config, accounting, peer, bytes);
        Ok(PendingSend::new(|| Ok(())))
    }

    /// Reserves the next message from `peer` on `channel`.
    fn post_recv(&self, peer: usize, channel: Channel, op: &str) -> Result<Waiter, CommError> {
        let group = &self.group;
        let key = (group.name.clone(), group.members[peer], group.me(), channel);
        let seq = {
            let mut state = self.world.lock();
            let mailbox = state.mailboxes.entry(key).or_default();
            mailbox.posted += 1;
            mailbox.posted - 1
        };
        Ok(Waiter {
            world: self.world.clone(),
            group: group.name.clone(),
            members: group.members.clone(),
            rank: group.rank,
            peer,
            channel,
            seq,
            op: op.to_string(),
        })
    }

    fn wait(receives: Vec<Waiter>) -> Result<Vec<Payload>, CommError> {
        receives.into_iter().map(Waiter::wait).collect()
    }

    fn split_group(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        let group = agree_split(self, color, key, label)?;
        Ok(InProcessComm::open(&self.world, group))
    }

    fn counters(&self) -> &Mutex<CommStats> {
        &self.world.stats[self.group.me()]
    }

    fn fail(&self, reason: &str) {
        let me = self.group.me();
        self.world
            .mark_failed(me, format!("rank {me} aborted: {reason}"));
    }
}

/// One posted receive: blocks until its message arrives, any rank fails, the sender leaves, or
/// the timeout passes.
pub(crate) struct Waiter {
    world: Arc<World>,
    group: String,
    members: Arc<[usize]>,
    rank: usize,
    peer: usize,
    channel: Channel,
    seq: u64,
    op: String,
}

impl Waiter {
    fn wait(self) -> Result<Payload, CommError> {
        let (me, sender) = (self.members[self.rank], self.members[self.peer]);
        let key = (self.group.clone(), sender, me, self.channel);
        let started = Instant::now();
        let mut state = self.world.lock();
        loop {
            let arrived = state
                .mailboxes
                .get_mut(&key)
                .and_then(|m| m.messages.remove(&self.seq));
            if let Some(envelope) = arrived {
                let ready_at = envelope.ready_at;
                let data = self.open(envelope, &mut state)?;
                drop(state);
                // Over an emulated link: not before it would have arrived.
                if let Some(wait) =
                    ready_at.and_then(|at| at.checked_duration_since(Instant::now()))
                {
                    std::thread::sleep(wait);
                }
                if sender == me {
                    return Ok(data);
                }
                // Another rank's thread produced it: copy it into this thread's memory.
                return data.adopt().map_err(|message| CommError::Protocol {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer_global: sender,
                    message: format!("{} message #{}: {message}", self.op, self.seq),
                });
            }
            if let Some(error) = state.peer_failed(&self.group, self.rank, &self.op) {
                return Err(error);
            }
            if state.has_left(&self.group, sender) {
                let reason = format!(
                    "global rank {sender} left group '{}' (its task returned or its handle was dropped) without sending {} message #{} that global rank {me} waits for",
                    self.group, self.op, self.seq
                );
                state.record_failure(sender, reason, false);
                self.world.wake_all();
                return Err(state
                    .peer_failed(&self.group, self.rank, &self.op)
                    .expect("a failure was just recorded"));
            }
            let waited = started.elapsed();
            if waited >= self.world.config.timeout {
                let error = CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global: sender,
                    op: self.op.clone(),
                    waited: self.world.config.timeout,
                };
                state.record_failure(me, format!("rank {me}: {error}"), false);
                self.world.wake_all();
                return Err(error);
            }
            state = self.world.wake[me]
                .wait_timeout(state, self.world.config.timeout - waited)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Checks the envelope of the message that arrived.
    fn open(&self, envelope: Envelope, state: &mut WorldState) -> Result<Payload, CommError> {
        let Err(message) = check_envelope((&self.op, self.seq), (&envelope.op, envelope.index))
        else {
            return Ok(envelope.data);
        };
        let me = self.members[self.rank];
        let error = CommError::Protocol {
            group: self.group.clone(),
            rank: self.rank,
            peer_global: self.members[self.peer],
            message,
        };
        state.record_failure(me, format!("rank {me}: {error}"), false);
        self.world.wake_all();
        Err(error)
    }
}
