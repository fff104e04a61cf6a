//! One rank's handle on one group: the [`Transport`] of the in-process world.

use std::cell::Cell;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::state::{Envelope, InjectedExit, World, WorldState, EXITING, LAST_PANIC};
use crate::comm::collectives::agree_split;
use crate::comm::common::check_envelope;
use crate::comm::transport::{Channel, Group, Received, Traffic, Transport};
use crate::comm::{Comm, CommError, CommStats, FaultKind, Payload, PendingSend};

/// One rank's handle on one group of an [`InProcessWorld`](super::InProcessWorld).
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
    pub(super) fn open(world: &Arc<World>, group: Group) -> Comm {
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
        data: Payload,
        traffic: Traffic<'_>,
    ) -> Result<PendingSend, CommError> {
        let Traffic {
            channel,
            op,
            accounting,
        } = traffic;
        let group = &self.group;
        let (me, to) = (group.me(), group.members[peer]);
        let bytes = data.num_bytes();
        if me != to {
            // Another rank's thread will read it: this thread's writes first.
            data.finish_writes()
                .map_err(|e| group.invalid(format!("{op}: sending to rank {peer}: {e}")))?;
        }
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
        group.count(&world.stats[me], &world.nodes, accounting, peer, bytes);
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

impl Received for Waiter {
    fn wait(self) -> Result<Payload, CommError> {
        let (me, sender) = (self.members[self.rank], self.members[self.peer]);
        let key = (self.group.clone(), sender, me, self.channel);
        let started = Instant::now();
        let mut state = self.world.lock();
        let what = format!(
            "{} message #{} of group '{}'",
            self.op, self.seq, self.group
        );
        state.waiting.insert(me, (sender, what.clone()));
        loop {
            let arrived = state
                .mailboxes
                .get_mut(&key)
                .and_then(|m| m.messages.remove(&self.seq));
            if arrived.is_some() || state.first_failure().is_some() {
                state.waiting.remove(&me);
            }
            if let Some(envelope) = arrived {
                state
                    .progress
                    .insert(me, format!("{what} from global rank {sender}"));
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
                state.waiting.remove(&me);
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
                state.waiting.remove(&me);
                let error = CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global: sender,
                    op: self.op.clone(),
                    waited: self.world.config.timeout,
                };
                // Name the rank that stopped making progress first, not the first to time out.
                match state.stalled(me, sender) {
                    Ok(stalled) if stalled != me => {
                        let after = match state.progress.get(&stalled) {
                            Some(last) => format!("after it received {last}"),
                            None => "before it received any message".to_string(),
                        };
                        let reason = format!(
                            "global rank {stalled} made no progress for {:?} ({after}; it is not \
                             waiting for any message: stalled outside communication, or stopped \
                             sending); global rank {me} timed out waiting for {what} from global \
                             rank {sender} ({error})",
                            self.world.config.timeout
                        );
                        state.record_failure(stalled, reason, false);
                    }
                    Ok(_) => state.record_failure(me, format!("rank {me}: {error}"), false),
                    Err(cycle) => {
                        let cycle: Vec<String> = cycle.iter().map(|r| r.to_string()).collect();
                        let reason = format!(
                            "global ranks {} wait for one another (each for the next; a protocol \
                             mismatch): rank {me}: {error}",
                            cycle.join(" → ")
                        );
                        state.record_failure(me, reason, false);
                    }
                }
                self.world.wake_all();
                // The peer it waited for is the stalled rank: the timeout names it already.
                if state.first_failure().map(|(rank, _)| rank) == Some(sender) {
                    return Err(error);
                }
                return Err(state
                    .peer_failed(&self.group, self.rank, &self.op)
                    .unwrap_or(error));
            }
            state = self.world.wake[me]
                .wait_timeout(state, self.world.config.timeout - waited)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Waiter {
    /// Checks the envelope of the message that arrived.
    fn open(&self, envelope: Envelope, state: &mut WorldState) -> Result<Payload, CommError> {
        let Err(mismatch) = check_envelope((&self.op, self.seq), (&envelope.op, envelope.index))
        else {
            return Ok(envelope.data);
        };
        let me = self.members[self.rank];
        let error = CommError::Protocol {
            group: self.group.clone(),
            rank: self.rank,
            peer_global: self.members[self.peer],
            message: mismatch.to_string(),
        };
        state.record_failure(me, format!("rank {me}: {error}"), false);
        self.world.wake_all();
        Err(error)
    }
}
