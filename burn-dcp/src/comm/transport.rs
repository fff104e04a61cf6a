//! What a world provides: one rank's sends and receives within a group ([`Transport`]). The
//! collectives are written once over it (`collectives.rs`), so every world sends the same
//! messages in the same order and counts the same bytes.

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::tensor::TensorData;

use crate::comm::common::Accounting;
use crate::comm::nodes::NodeMap;
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend};

/// The ordered stream between two ranks of a group that a message travels on: point-to-point,
/// collective and control traffic never mix, so a collective cannot take a message a ring step
/// sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Channel {
    PointToPoint = 0,
    Collective = 1,
    Control = 2,
}

impl Channel {
    /// How many channels there are.
    pub(crate) const COUNT: usize = 3;

    /// The channel's number (`0..COUNT`), as it travels in headers and tags.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Per peer and channel, how many messages so far: a message's index on its link (sends), or
/// the arrival a receive waits for (receives).
pub(crate) struct LinkCounters(Mutex<Vec<[u64; Channel::COUNT]>>);

impl LinkCounters {
    /// Counters for a group of `size` ranks, all at zero.
    pub(crate) fn new(size: usize) -> Self {
        Self(Mutex::new(vec![[0; Channel::COUNT]; size]))
    }

    /// The next number on the link to (or from) `peer` on `channel`.
    pub(crate) fn next(&self, peer: usize, channel: Channel) -> u64 {
        let mut counters = self.0.lock().unwrap_or_else(|p| p.into_inner());
        counters[peer][channel.index()] += 1;
        counters[peer][channel.index()] - 1
    }
}

/// A posted receive, waited for on its own (NCCL's receives of one exchange are waited for
/// together, [`Transport::wait`]).
pub(crate) trait Received: Send + 'static {
    /// Blocks (up to the world's timeout) for the message.
    fn wait(self) -> Result<Payload, CommError>;
}

/// Which traffic a message belongs to: its channel, the operation (checked by the receiver)
/// and how its bytes are counted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Traffic<'a> {
    pub(crate) channel: Channel,
    pub(crate) op: &'a str,
    pub(crate) accounting: Accounting,
}

/// A group as one of its members sees it: its name (for errors), its label (for
/// [`CommStats::bytes_by_label`]), the world rank of each member and this member's place.
pub(crate) struct Group {
    pub(crate) name: String,
    pub(crate) label: Arc<str>,
    /// World rank of each group rank.
    pub(crate) members: Arc<[usize]>,
    pub(crate) rank: usize,
    /// Splits made so far (names the sub-groups `name/split<n>:<color>`).
    splits: Mutex<u64>,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("members", &self.members)
            .finish()
    }
}

impl Group {
    pub(crate) fn new(name: String, label: Arc<str>, members: Arc<[usize]>, rank: usize) -> Self {
        Self {
            name,
            label,
            members,
            rank,
            splits: Mutex::new(0),
        }
    }

    /// Number of ranks of the group.
    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// This member's world rank.
    pub(crate) fn me(&self) -> usize {
        self.members[self.rank]
    }

    /// An error of this group: a bad argument or a failed local call.
    pub(crate) fn invalid(&self, message: String) -> CommError {
        CommError::Invalid {
            group: self.name.clone(),
            message,
        }
    }

    /// The payload's host bytes (a device tensor read back) for operation `op`.
    pub(crate) fn host(&self, data: Payload, op: &str) -> Result<TensorData, CommError> {
        data.into_host()
            .map_err(|e| self.invalid(format!("{op}: {e}")))
    }

    /// The name of this group's next sub-group of `color`: `name/split<n>:<color>`, `n`
    /// counting its splits from 1.
    pub(crate) fn split_name(&self, color: usize) -> String {
        let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
        *splits += 1;
        format!("{}/split{}:{color}", self.name, *splits)
    }

    /// Counts `bytes` this member sends to group rank `peer` in `stats` (nothing when it is
    /// this member); the link class comes from the world's `nodes`.
    pub(crate) fn count(
        &self,
        stats: &Mutex<CommStats>,
        nodes: &NodeMap,
        accounting: Accounting,
        peer: usize,
        bytes: u64,
    ) {
        let (me, to) = (self.me(), self.members[peer]);
        if me == to {
            return;
        }
        let mut stats = stats.lock().unwrap_or_else(|p| p.into_inner());
        accounting.count(&mut stats, &self.label, bytes, nodes.same_node(me, to));
    }
}

/// One rank's sends and receives within a group: what each world implements (threads'
/// mailboxes, TCP links, MPI, NCCL). Every type that implements it is a
/// [`Communicator`](crate::comm::Communicator), its collectives written once over these
/// calls (`collectives.rs`).
///
/// Messages from one rank to another on one [`Channel`] arrive in send order, and the n-th
/// receive posted takes the n-th message, whatever order receives are waited in.
pub(crate) trait Transport: Send + Sync + fmt::Debug + 'static {
    /// A posted receive, waited for with [`Transport::wait`].
    type Recv: Received;

    /// Whether messages leave as host bytes: an all-gather then reads a device tensor back once
    /// rather than once per peer.
    const HOST_BYTES: bool;

    /// The group this transport serves.
    fn group(&self) -> &Group;

    /// The start of every operation of the communicator, named `op`: fails at once when a
    /// failure is already known (the in-process world also counts calls and injects faults
    /// here).
    fn begin(&self, op: &str) -> Result<(), CommError>;

    /// Starts sending `data` to group rank `peer` (never this rank) as `traffic`.
    fn post_send(
        &self,
        peer: usize,
        data: Payload,
        traffic: Traffic<'_>,
    ) -> Result<PendingSend, CommError>;

    /// Posts a receive of the next message from group rank `peer` on `channel`.
    fn post_recv(&self, peer: usize, channel: Channel, op: &str) -> Result<Self::Recv, CommError>;

    /// Waits for posted receives (of one group), returning their data in their order: each in
    /// turn (NCCL launches them in one group call).
    fn wait(receives: Vec<Self::Recv>) -> Result<Vec<Payload>, CommError> {
        receives.into_iter().map(Received::wait).collect()
    }

    /// Another communicator that carries this one's control traffic (barriers, agreements),
    /// when it has one (NCCL's bootstrap world).
    fn control(&self) -> Option<&Comm> {
        None
    }

    /// The sub-group of the members that chose `color`, ordered by `(key, rank)`, labelled
    /// `label` (most worlds: [`agree_split`](crate::comm::collectives::agree_split), then their
    /// own split call).
    fn split_group(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError>;

    /// The bytes this rank has sent (all its groups).
    fn counters(&self) -> &Mutex<CommStats>;

    /// Marks this rank as failed: its peers' pending and future operations fail naming it.
    fn fail(&self, reason: &str);
}
