//! A group of TCP ranks: the [`Transport`] of the TCP world.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::wire::{Failure, Kind, Shared, WireHeader};
use crate::comm::collectives::agree_split;
use crate::comm::common::{check_envelope, frame, host_data};
use crate::comm::stall::stall_reason;
use crate::comm::transport::{Channel, Group, LinkCounters, Received, Traffic, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend};

/// A group of TCP ranks as seen by one of them.
pub struct TcpComm {
    shared: Arc<Shared>,
    group: Group,
    /// Per peer and channel: messages sent, receives posted.
    sent: LinkCounters,
    posted: LinkCounters,
    /// Held from a message's numbering to its write, so that messages of one link leave in
    /// the order of their numbers even when several threads send.
    sending: Mutex<()>,
}

impl fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TcpComm").field(&self.group).finish()
    }
}

/// A posted receive: the arrival it waits for on its (group, channel, sender).
pub(crate) struct RecvHandle {
    shared: Arc<Shared>,
    key: (String, u8, usize),
    arrival: u64,
    rank: usize,
    peer: usize,
    op: String,
}

impl Received for RecvHandle {
    fn wait(self) -> Result<Payload, CommError> {
        let shared = &self.shared;
        let started = Instant::now();
        let peer_global = self.key.2;
        let what = format!(
            "{} message #{} of group '{}'",
            self.op, self.arrival, self.key.0
        );
        let mut state = shared.state();
        state.status.waiting = Some((peer_global, what.clone()));
        loop {
            let inbox = state.inboxes.get_mut(&self.key);
            if let Some(message) = inbox.and_then(|inbox| inbox.messages.remove(&self.arrival)) {
                state.status.waiting = None;
                state.status.last = Some(format!("{what} from global rank {peer_global}"));
                return self.open(message);
            }
            if let Some(failure) = &state.failure {
                return Err(self.peer_failed(failure.clone()));
            }
            if state.left[peer_global] {
                return Err(self.peer_failed(Failure {
                    rank: peer_global,
                    reason: "it finished and left the job before sending this message".into(),
                }));
            }
            let waited = started.elapsed();
            if waited >= shared.config.timeout {
                drop(state);
                let timeout = CommError::Timeout {
                    group: self.key.0.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global,
                    op: self.op.clone(),
                    waited: shared.config.timeout,
                };
                // Still recorded as waiting while it asks: a peer asking it meanwhile must see
                // that it waits, not take it for the stalled rank.
                let error = self.name_the_stalled(timeout, &what);
                shared.state().status.waiting = None;
                return Err(error);
            }
            let remaining = shared.config.timeout - waited;
            state = shared
                .arrived
                .wait_timeout(state, remaining)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl RecvHandle {
    /// After a timeout: the rank that made no progress (asked of every rank, see
    /// `Shared::stalled`), recorded and told to every peer as the first failure, so every
    /// rank's error names it first. Returned: the timeout itself when the peer waited for is
    /// that rank (it names it) or when this rank ends the chain, else the stalled rank's failure.
    fn name_the_stalled(&self, timeout: CommError, what: &str) -> CommError {
        let shared = &self.shared;
        let (me, sender) = (shared.rank, self.key.2);
        let answer = shared.config.timeout.min(std::time::Duration::from_secs(2));
        let found = shared.stalled(sender, answer);
        let waited = shared.config.timeout;
        let Some((rank, reason)) = stall_reason(found, me, sender, what, &timeout, waited) else {
            return timeout;
        };
        let reason = Failure { rank, reason };
        let direct = reason.rank == sender;
        shared.fail(reason.clone());
        if let Ok(body) = serde_json::to_vec(&reason) {
            shared.tell_all(Kind::Abort, &body);
        }
        // The peer it waited for is the stalled rank: the timeout names it already.
        if direct {
            return timeout;
        }
        let known = shared.state().failure.clone().unwrap_or(reason);
        self.peer_failed(known)
    }

    fn peer_failed(&self, failure: Failure) -> CommError {
        CommError::PeerFailed {
            group: self.key.0.clone(),
            rank: self.rank,
            failed_global: failure.rank,
            reason: failure.reason,
            op: self.op.clone(),
        }
    }

    fn open(&self, (header, body): (WireHeader, Vec<u8>)) -> Result<Payload, CommError> {
        let protocol = |message: String| CommError::Protocol {
            group: self.key.0.clone(),
            rank: self.rank,
            peer_global: self.key.2,
            message,
        };
        check_envelope((&self.op, self.arrival), (&header.op, header.index))
            .map_err(|e| protocol(e.to_string()))?;
        let data = host_data(header.shape, header.dtype, body)
            .map_err(|e| protocol(format!("{} message #{}: {e}", self.op, self.arrival)))?;
        Ok(Payload::Host(data))
    }
}

impl TcpComm {
    pub(super) fn create(shared: &Arc<Shared>, group: Group) -> Comm {
        let size = group.size();
        Arc::new(TcpComm {
            shared: shared.clone(),
            group,
            sent: LinkCounters::new(size),
            posted: LinkCounters::new(size),
            sending: Mutex::new(()),
        })
    }

    fn peer_failed(&self, failure: Failure, op: &str) -> CommError {
        CommError::PeerFailed {
            group: self.group.name.clone(),
            rank: self.group.rank,
            failed_global: failure.rank,
            reason: failure.reason,
            op: op.to_string(),
        }
    }
}

impl Transport for TcpComm {
    type Recv = RecvHandle;
    const HOST_BYTES: bool = true;

    fn group(&self) -> &Group {
        &self.group
    }

    /// The first failure known, as this group's error for `op`.
    fn begin(&self, op: &str) -> Result<(), CommError> {
        match &self.shared.state().failure {
            Some(failure) => Err(self.peer_failed(failure.clone(), op)),
            None => Ok(()),
        }
    }

    /// Sends `data` to `peer` now (the peer's reader takes it in whatever it is doing).
    fn post_send(
        &self,
        peer: usize,
        data: Payload,
        traffic: Traffic<'_>,
    ) -> Result<PendingSend, CommError> {
        let Traffic {
            channel,
            op,
            accounting,
        } = traffic;
        self.begin(op)?;
        let group = &self.group;
        // TCP moves host bytes: a device tensor is read back once, here.
        let data = group.host(data, op)?;
        let _sending = self.sending.lock().unwrap_or_else(|p| p.into_inner());
        let index = self.sent.next(peer, channel);
        let header = WireHeader {
            group: group.name.clone(),
            channel: channel.index() as u8,
            op: op.to_string(),
            index,
            dtype: data.dtype,
            shape: data.shape.as_slice().to_vec(),
        };
        let bytes = data.as_bytes().len() as u64;
        let (me, to) = (group.me(), group.members[peer]);
        if me == to {
            self.shared.deliver(me, header, data.into_bytes().to_vec());
        } else {
            let message =
                frame(&header, data.as_bytes()).map_err(|e| group.invalid(format!("{op}: {e}")))?;
            if let Err(failure) = self.shared.send_frame(to, Kind::Message, &message) {
                self.shared.fail(failure.clone());
                return Err(self.peer_failed(failure, op));
            }
        }
        let shared = &self.shared;
        group.count(&shared.stats, &shared.nodes, accounting, peer, bytes);
        Ok(PendingSend::new(|| Ok(())))
    }

    fn post_recv(&self, peer: usize, channel: Channel, op: &str) -> Result<RecvHandle, CommError> {
        self.begin(op)?;
        Ok(RecvHandle {
            shared: self.shared.clone(),
            key: (
                self.group.name.clone(),
                channel.index() as u8,
                self.group.members[peer],
            ),
            arrival: self.posted.next(peer, channel),
            rank: self.group.rank,
            peer,
            op: op.to_string(),
        })
    }

    fn split_group(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        let group = agree_split(self, color, key, label)?;
        Ok(TcpComm::create(&self.shared, group))
    }

    fn counters(&self) -> &Mutex<CommStats> {
        &self.shared.stats
    }

    /// Tells every peer that this rank failed (naming the first failure it knows of, the root
    /// cause); their pending and future operations fail. The process goes on (see
    /// [`TcpWorld::abort`] to end it).
    fn fail(&self, reason: &str) {
        let shared = &self.shared;
        let failure = {
            let mut state = shared.state();
            state
                .failure
                .get_or_insert_with(|| Failure {
                    rank: shared.rank,
                    reason: reason.to_string(),
                })
                .clone()
        };
        shared.arrived.notify_all();
        shared.closing.store(true, Ordering::SeqCst);
        let body = serde_json::to_vec(&failure).unwrap_or_default();
        shared.tell_all(Kind::Abort, &body);
    }
}
