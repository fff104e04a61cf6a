//! What travels on a TCP link (frames of a kind: messages, aborts, goodbyes, the rendezvous'
//! hellos) and what the process's communicators share: the write half of every link, the
//! inboxes its reader threads fill, the first failure known.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::DType;

use crate::comm::common::unframe;
use crate::comm::nodes::NodeMap;
use crate::comm::stall::{confirmed, follow_waits, Found, Status};
use crate::comm::{CommStats, WorldConfig};

/// No frame is larger than this (a corrupt length must not allocate the machine's memory).
pub(super) const MAX_FRAME: u64 = 1 << 40;

/// Frame kinds on the wire: `[u64 length][u8 kind][body]`, the length counting kind and body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// A message: a [`frame`] of its [`WireHeader`] and data bytes.
    Message = 1,
    /// The sender fails: a JSON [`Failure`] (the first failure it knows of).
    Abort = 2,
    /// The sender is done and closes its links.
    Bye = 3,
    /// Rendezvous: a JSON [`Hello`].
    Hello = 4,
    /// Rendezvous: rank 0's JSON table of every rank's address.
    Table = 5,
    /// Rendezvous: rank 0 refuses the connecting process; the body says why.
    Refuse = 6,
    /// A rank timed out: what is the receiver waiting for? (empty body; answered by the
    /// receiver's reader thread, so a rank stalled outside communication answers too)
    Query = 7,
    /// The answer to a [`Kind::Query`]: a JSON [`Status`].
    Status = 8,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Kind> {
        [
            Kind::Message,
            Kind::Abort,
            Kind::Bye,
            Kind::Hello,
            Kind::Table,
            Kind::Refuse,
            Kind::Query,
            Kind::Status,
        ]
        .into_iter()
        .find(|kind| *kind as u8 == byte)
    }
}

/// A rank's failure as told to its peers.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
pub(super) struct Failure {
    pub(super) rank: usize,
    pub(super) reason: String,
}

/// The header of a data message.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
pub(super) struct WireHeader {
    pub(super) group: String,
    pub(super) channel: u8,
    pub(super) op: String,
    pub(super) index: u64,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
}

pub(super) fn write_frame(stream: &mut TcpStream, kind: Kind, body: &[u8]) -> std::io::Result<()> {
    let mut prefix = [0u8; 9];
    prefix[..8].copy_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    prefix[8] = kind as u8;
    stream.write_all(&prefix)?;
    stream.write_all(body)?;
    stream.flush()
}

pub(super) fn read_frame(reader: &mut impl Read) -> std::io::Result<(Kind, Vec<u8>)> {
    let mut prefix = [0u8; 9];
    reader.read_exact(&mut prefix)?;
    let len = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    let malformed = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    if len == 0 || len > MAX_FRAME {
        return Err(malformed(format!("a frame of {len} bytes")));
    }
    let kind = Kind::from_byte(prefix[8])
        .ok_or_else(|| malformed(format!("a frame of unknown kind {}", prefix[8])))?;
    let mut body = vec![0u8; (len - 1) as usize];
    reader.read_exact(&mut body)?;
    Ok((kind, body))
}

/// Messages of one (group, channel, sender), by arrival order.
#[derive(Default)]
pub(super) struct Inbox {
    arrived: u64,
    pub(super) messages: HashMap<u64, (WireHeader, Vec<u8>)>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) inboxes: HashMap<(String, u8, usize), Inbox>,
    /// The first failure this rank learned of (its own or a peer's).
    pub(super) failure: Option<Failure>,
    /// Peers that said goodbye.
    pub(super) left: Vec<bool>,
    /// Peers whose link this rank has read to its end (or given up on).
    pub(super) ended: Vec<bool>,
    /// This rank's own status (what it waits for, what it last received), told on a query.
    pub(super) status: Status,
    /// The peers' answers to this rank's last query.
    pub(super) statuses: HashMap<usize, Status>,
}

/// What every communicator of the process shares: this process is one rank.
pub(super) struct Shared {
    pub(super) config: WorldConfig,
    pub(super) nodes: NodeMap,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// The write half of the link to each global rank (`None` for this rank).
    pub(super) links: Vec<Option<Mutex<TcpStream>>>,
    pub(super) state: Mutex<State>,
    pub(super) arrived: Condvar,
    pub(super) stats: Mutex<CommStats>,
    /// Set when this rank says goodbye or aborts: links closing after that are expected.
    pub(super) closing: AtomicBool,
}

impl Shared {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `failure` unless an earlier one is known, and wakes every waiter.
    pub(super) fn fail(&self, failure: Failure) {
        let mut state = self.state();
        if state.failure.is_none() {
            state.failure = Some(failure);
        }
        drop(state);
        self.arrived.notify_all();
    }

    pub(super) fn deliver(&self, from: usize, header: WireHeader, body: Vec<u8>) {
        let mut state = self.state();
        let inbox = state
            .inboxes
            .entry((header.group.clone(), header.channel, from))
            .or_default();
        inbox.messages.insert(inbox.arrived, (header, body));
        inbox.arrived += 1;
        drop(state);
        self.arrived.notify_all();
    }

    /// Takes in every frame from global rank `peer` until its link closes.
    pub(super) fn read_link(&self, peer: usize, stream: TcpStream) {
        self.read_frames(peer, stream);
        self.state().ended[peer] = true;
        self.arrived.notify_all();
    }

    fn read_frames(&self, peer: usize, stream: TcpStream) {
        let mut reader = BufReader::with_capacity(1 << 16, stream);
        loop {
            let frame = read_frame(&mut reader);
            let closing = self.closing.load(Ordering::SeqCst);
            match frame {
                Ok((Kind::Message, message)) => match unframe::<WireHeader>(message) {
                    Ok((header, body)) => self.deliver(peer, header, body),
                    Err(e) => {
                        return self.fail(Failure {
                            rank: peer,
                            reason: format!("it sent a malformed message ({e})"),
                        })
                    }
                },
                Ok((Kind::Abort, body)) => {
                    let failure = serde_json::from_slice(&body).unwrap_or(Failure {
                        rank: peer,
                        reason: String::from_utf8_lossy(&body).into_owned(),
                    });
                    self.fail(failure);
                }
                Ok((Kind::Bye, _)) => {
                    self.state().left[peer] = true;
                    self.arrived.notify_all();
                }
                Ok((Kind::Query, _)) => {
                    let status = self.state().status.clone();
                    let body = serde_json::to_vec(&status).unwrap_or_default();
                    let _ = self.send_frame(peer, Kind::Status, &body);
                }
                Ok((Kind::Status, body)) => {
                    let status = serde_json::from_slice(&body).unwrap_or_default();
                    self.state().statuses.insert(peer, status);
                    self.arrived.notify_all();
                }
                Ok((kind, _)) => {
                    return self.fail(Failure {
                        rank: peer,
                        reason: format!("it sent a {kind:?} frame after the rendezvous"),
                    })
                }
                Err(error) => {
                    let said_bye = self.state().left[peer];
                    if !said_bye && !closing {
                        self.fail(Failure {
                            rank: peer,
                            reason: format!(
                                "its connection was lost without a goodbye (the process exited or was killed): {error}"
                            ),
                        });
                    }
                    return;
                }
            }
        }
    }

    /// Sends one frame to global rank `to`; a failed write is that rank's failure.
    pub(super) fn send_frame(&self, to: usize, kind: Kind, body: &[u8]) -> Result<(), Failure> {
        let link = self.links[to].as_ref().expect("a link to every other rank");
        let mut stream = link.lock().unwrap_or_else(|p| p.into_inner());
        write_frame(&mut stream, kind, body).map_err(|error| Failure {
            rank: to,
            reason: format!("sending to it failed: {error}"),
        })
    }

    /// Half-closes every link and waits (at most `linger`) until every peer has closed its
    /// side too: all they sent has then been read, so closing the sockets sends no reset that
    /// could destroy data still on its way to them.
    pub(super) fn close_links(&self, linger: Duration) {
        for link in self.links.iter().flatten() {
            let stream = link.lock().unwrap_or_else(|p| p.into_inner());
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
        drop(self.wait_until(Instant::now() + linger, |state| {
            (0..self.size).all(|peer| peer == self.rank || state.ended[peer])
        }));
    }

    /// The state once `done` holds of it, or at `deadline`, whichever comes first.
    fn wait_until(
        &self,
        deadline: Instant,
        done: impl Fn(&State) -> bool,
    ) -> MutexGuard<'_, State> {
        let mut state = self.state();
        while !done(&state) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        state
    }

    /// Who made no progress when this rank timed out waiting for `sender`: asks every peer what
    /// it waits for (its reader thread answers, whatever its main thread does), waits at most
    /// `answer` for the answers, then follows the waits from `sender` to the first rank that
    /// waits for nothing, or does not answer (a stopped process). `Err` with the chain when
    /// the waits form a cycle twice ([`confirmed`]).
    pub(super) fn stalled(&self, sender: usize, answer: Duration) -> Found {
        let look = || {
            self.state().statuses.clear();
            self.tell_all(Kind::Query, &[]);
            let state = self.wait_until(Instant::now() + answer, |state| {
                state.statuses.len() + 1 >= self.size
            });
            follow_waits(self.rank, sender, |rank| state.statuses.get(&rank).cloned())
        };
        confirmed(look(), look)
    }

    /// Tells every peer `kind` (best effort: a peer that is gone is skipped).
    pub(super) fn tell_all(&self, kind: Kind, body: &[u8]) {
        for to in (0..self.size).filter(|&to| to != self.rank) {
            let _ = self.send_frame(to, kind, body);
        }
    }
}
