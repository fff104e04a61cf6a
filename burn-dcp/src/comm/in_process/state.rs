//! The in-process world's shared state: mailboxes, failures in the order they happened, live
//! handles, planned faults, emulated links; its settings.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use crate::comm::links::LinkClock;
use crate::comm::nodes::NodeMap;
use crate::comm::transport::Channel;
use crate::comm::{panic_message, CommError, CommStats, Fault, FaultKind, Payload};

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
    /// The nodes of a world of `size` ranks ([`NodeMap`]: `ranks_per_node` must divide `size`;
    /// `None`: one node). Every world builds its map here once and classifies bytes by it.
    pub fn nodes(&self, size: usize) -> Result<NodeMap, CommError> {
        match self.ranks_per_node {
            Some(per_node) => {
                NodeMap::with_ranks_per_node(size, per_node).map_err(|e| CommError::Invalid {
                    group: "world".into(),
                    message: e.to_string(),
                })
            }
            None => Ok(NodeMap::single(size)),
        }
    }

    /// The node of world rank `rank`, for a configuration already checked: the worlds classify
    /// bytes with the [`NodeMap`] of [`WorldConfig::nodes`], which checks it.
    pub fn node_of(&self, rank: usize) -> usize {
        self.ranks_per_node.map_or(0, |n| rank / n)
    }
}

/// (group name, sender global rank, receiver global rank, channel).
pub(super) type MailboxKey = (String, usize, usize, Channel);

/// A message with what the receiver checks: the operation and the sender's index on the link.
pub(super) struct Envelope {
    pub(super) op: String,
    pub(super) index: u64,
    pub(super) data: Payload,
    /// When it arrives over an emulated link (`None`: at once).
    pub(super) ready_at: Option<Instant>,
}

#[derive(Default)]
pub(super) struct Mailbox {
    /// Messages put in the mailbox (the transport's sequence numbers).
    pub(super) delivered: u64,
    /// Messages the sender stamped (the envelope indices); equal to `delivered` unless a fault
    /// dropped or duplicated one.
    pub(super) stamped: u64,
    /// Receives posted.
    pub(super) posted: u64,
    pub(super) messages: HashMap<u64, Envelope>,
}

/// Why a rank failed, and when (its place in the order of failures).
pub(super) struct Failure {
    order: u64,
    pub(super) reason: String,
    /// Recorded without the panic message (a replaced panic hook); a later record may refine it.
    provisional: bool,
}

#[derive(Default)]
pub(super) struct WorldState {
    pub(super) mailboxes: HashMap<MailboxKey, Mailbox>,
    pub(super) failures: HashMap<usize, Failure>,
    pub(super) next_failure: u64,
    /// Ranks whose task returned (this run).
    pub(super) finished: HashSet<usize>,
    /// Live handles per (group, global rank); 0: the rank can never send on that group again.
    pub(super) handles: HashMap<(String, usize), usize>,
    /// Faults still to inject, and each rank's communication calls so far.
    pub(super) faults: Vec<Fault>,
    pub(super) calls: Vec<u64>,
    /// A drop or duplicate waiting for the rank's next message to another rank.
    pub(super) message_faults: HashMap<usize, FaultKind>,
    /// Emulated links ([`InProcessWorld::emulate_links`]), if any.
    pub(super) clock: Option<LinkClock>,
    /// The ranks blocked in a receive now: global rank → the global rank it waits for and what.
    pub(super) waiting: HashMap<usize, (usize, String)>,
    /// Each rank's last message received: what it completed before it stopped, if it stops.
    pub(super) progress: HashMap<usize, String>,
}

impl WorldState {
    pub(super) fn first_failure(&self) -> Option<(usize, &Failure)> {
        self.failures
            .iter()
            .min_by_key(|(_, failure)| failure.order)
            .map(|(rank, failure)| (*rank, failure))
    }

    pub(super) fn record_failure(&mut self, rank: usize, reason: String, provisional: bool) {
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
    pub(super) fn peer_failed(&self, group: &str, rank: usize, op: &str) -> Option<CommError> {
        self.first_failure()
            .map(|(failed_global, failure)| CommError::PeerFailed {
                group: group.to_string(),
                rank,
                failed_global,
                reason: failure.reason.clone(),
                op: op.to_string(),
            })
    }

    /// Who made no progress when `me` timed out waiting for `sender`: follow who each blocked
    /// rank waits for from `sender` on, to the first rank that is not blocked in a receive (it
    /// stalled outside communication, or stopped sending); `None` when the waits form a cycle
    /// (the ranks wait for one another: a protocol mismatch, named by the cycle).
    pub(super) fn stalled(&self, me: usize, sender: usize) -> Result<usize, Vec<usize>> {
        let mut chain = vec![me];
        let mut current = sender;
        while let Some((next, _)) = self.waiting.get(&current) {
            if chain.contains(&current) {
                chain.push(current);
                return Err(chain);
            }
            chain.push(current);
            current = *next;
        }
        Ok(current)
    }

    pub(super) fn has_left(&self, group: &str, global_rank: usize) -> bool {
        self.finished.contains(&global_rank)
            || self.handles.get(&(group.to_string(), global_rank)) == Some(&0)
    }
}

pub(super) struct World {
    pub(super) config: WorldConfig,
    pub(super) nodes: NodeMap,
    pub(super) state: Mutex<WorldState>,
    /// One per world rank: a message wakes only its receiver; a failure or a rank leaving wakes
    /// everyone (`wake_all`).
    pub(super) wake: Vec<Condvar>,
    pub(super) stats: Vec<Mutex<CommStats>>,
}

impl World {
    pub(super) fn lock(&self) -> MutexGuard<'_, WorldState> {
        // A panic while holding the lock cannot leave the mailboxes inconsistent (every critical
        // section is a few inserts/removes), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn mark_failed(&self, global_rank: usize, reason: String) {
        self.lock().record_failure(global_rank, reason, false);
        self.wake_all();
    }

    pub(super) fn mark_finished(&self, global_rank: usize) {
        self.lock().finished.insert(global_rank);
        self.wake_all();
    }

    pub(super) fn wake_all(&self) {
        self.wake.iter().for_each(Condvar::notify_all);
    }
}

thread_local! {
    /// The message of the last panic on this thread (set by the panic hook), so that a handle
    /// dropped while unwinding can report it.
    pub(super) static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Set while an injected [`FaultKind::Exit`] unwinds this thread: not a failure.
    pub(super) static EXITING: Cell<bool> = const { Cell::new(false) };
}

/// The unwind payload of an injected [`FaultKind::Exit`].
pub(super) struct InjectedExit;

/// Chains a panic hook that remembers each panic's message per thread (once per process).
pub(super) fn install_panic_hook() {
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
