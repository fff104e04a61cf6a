//! TCP world: one process per rank, started the way `torchrun` starts them — every process gets
//! `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` and `LOCAL_RANK` — for jobs that have no
//! MPI launcher (Kubernetes, a hand-made launch on a few hosts, `scripts/launch_tcp.py` on one
//! machine). It is the NCCL world's bootstrap and control channel when no MPI world exists (the
//! NCCL unique id and message headers travel here; tensor data goes over NCCL), and a complete
//! [`Communicator`](crate::comm::Communicator) of host payloads on its own.
//!
//! **Rendezvous.** Rank 0 listens at `MASTER_ADDR:MASTER_PORT`; every other rank connects to it
//! (retrying until the timeout: processes start in any order), says who it is (rank, world size,
//! the port of its own listener) and receives the table of every rank's address. The connection
//! to rank 0 is that pair's link; each other pair connects the higher rank to the lower one. A
//! process that announces another world size, a rank out of range or a rank already taken fails
//! the rendezvous with an error naming it; a rank missing at the timeout fails it with the list
//! of missing ranks.
//!
//! **Same results as the other worlds.** Collectives are point-to-point exchanges, sums are
//! taken locally in rank order with the same code as the in-process and MPI worlds
//! (`common::all_reduce_by`, `sum_payloads`), and the same bytes are counted.
//!
//! **Nothing waits forever, failures name the rank.** Each link has a reader thread that takes
//! every message in as it arrives (so a send never waits on the peer's posting of a receive,
//! and two ranks sending to each other cannot deadlock); waits are bounded by the world's
//! timeout. A rank that fails tells every peer (an abort message with the first failure it
//! knows of, the root cause); a process that dies (SIGKILL) closes its sockets, and its peers'
//! pending and future operations fail at once with [`CommError::PeerFailed`] naming it. A rank
//! that finishes says goodbye, so a peer still waiting on it fails naming it instead of timing
//! out.

use std::collections::HashMap;
use std::fmt;
use std::io::{BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};

use crate::comm::collectives::agree_split;
use crate::comm::common::{check_nodes, check_timeout, frame, unframe, Accounting};
use crate::comm::transport::{check_envelope, Channel, Group, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend, WorldConfig};

/// The environment variables of a TCP launch (torchrun's names).
pub const ENV_VARIABLES: [&str; 5] = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
];

/// Identifies burn-dcp's rendezvous, so a stray connection is told apart from a rank.
const MAGIC: &str = "burn-dcp-tcp";
const VERSION: u32 = 1;
/// No frame is larger than this (a corrupt length must not allocate the machine's memory).
const MAX_FRAME: u64 = 1 << 40;

/// Frame kinds on the wire: `[u64 length][u8 kind][body]`, the length counting kind and body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
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
        ]
        .into_iter()
        .find(|kind| *kind as u8 == byte)
    }
}

/// Where this process is in a TCP launch: torchrun's variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host of rank 0 (a name or an IP address).
    pub master_addr: String,
    /// Port rank 0 listens on.
    pub master_port: u16,
    pub rank: usize,
    pub world_size: usize,
    /// This process's rank on its node: the GPU it uses.
    pub local_rank: usize,
}

impl Rendezvous {
    /// The rendezvous the environment describes: `None` when neither `RANK` nor `WORLD_SIZE`
    /// is set (not a TCP launch); an error naming the variable when one is missing or malformed.
    /// `LOCAL_RANK` defaults to 0 (one process per node).
    pub fn from_env() -> Result<Option<Rendezvous>, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Rendezvous::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Rendezvous>, String> {
        if var("RANK").is_none() && var("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let required = |name: &str| {
            var(name).ok_or_else(|| {
                format!("{name} is not set: a TCP launch needs MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (and LOCAL_RANK)")
            })
        };
        let number = |name: &str, value: String| {
            value
                .trim()
                .parse::<usize>()
                .map_err(|_| format!("{name}={value:?} is not a non-negative integer"))
        };
        let master_addr = required("MASTER_ADDR")?;
        let port = required("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| format!("MASTER_PORT={port:?} is not a port number (1 to 65535)"))?;
        let rendezvous = Rendezvous {
            master_addr,
            master_port,
            rank: number("RANK", required("RANK")?)?,
            world_size: number("WORLD_SIZE", required("WORLD_SIZE")?)?,
            local_rank: var("LOCAL_RANK")
                .map(|v| number("LOCAL_RANK", v))
                .transpose()?
                .unwrap_or(0),
        };
        rendezvous.validate()?;
        Ok(Some(rendezvous))
    }

    /// The rules: a world of at least one rank, `RANK < WORLD_SIZE`, a master host and a
    /// non-zero port.
    pub fn validate(&self) -> Result<(), String> {
        if self.world_size == 0 {
            return Err("WORLD_SIZE=0: a world has at least one rank".into());
        }
        if self.rank >= self.world_size {
            return Err(format!(
                "RANK={} is not a rank of a world of WORLD_SIZE={} (ranks are 0..{})",
                self.rank, self.world_size, self.world_size
            ));
        }
        if self.master_addr.trim().is_empty() {
            return Err("MASTER_ADDR is empty: it names rank 0's host".into());
        }
        if self.master_port == 0 {
            return Err("MASTER_PORT=0: rank 0 listens on a fixed port the others know".into());
        }
        Ok(())
    }

    fn master(&self) -> String {
        match self.master_addr.parse::<Ipv6Addr>() {
            Ok(_) => format!("[{}]:{}", self.master_addr, self.master_port),
            Err(_) => format!("{}:{}", self.master_addr, self.master_port),
        }
    }
}

/// What a connecting process says about itself.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct Hello {
    magic: String,
    version: u32,
    rank: usize,
    world_size: usize,
    /// The port of the process's own listener (for ranks above it); 0 for rank 0.
    port: u16,
}

/// A rank's failure as told to its peers.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Failure {
    rank: usize,
    reason: String,
}

/// The header of a data message.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct WireHeader {
    group: String,
    channel: u8,
    op: String,
    index: u64,
    dtype: DType,
    shape: Vec<usize>,
}

fn write_frame(stream: &mut TcpStream, kind: Kind, body: &[u8]) -> std::io::Result<()> {
    let mut prefix = [0u8; 9];
    prefix[..8].copy_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    prefix[8] = kind as u8;
    stream.write_all(&prefix)?;
    stream.write_all(body)?;
    stream.flush()
}

fn read_frame(reader: &mut impl Read) -> std::io::Result<(Kind, Vec<u8>)> {
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
struct Inbox {
    arrived: u64,
    messages: HashMap<u64, (WireHeader, Vec<u8>)>,
}

#[derive(Default)]
struct State {
    inboxes: HashMap<(String, u8, usize), Inbox>,
    /// The first failure this rank learned of (its own or a peer's).
    failure: Option<Failure>,
    /// Peers that said goodbye.
    left: Vec<bool>,
    /// Peers whose link this rank has read to its end (or given up on).
    ended: Vec<bool>,
}

/// What every communicator of the process shares: this process is one rank.
struct Shared {
    config: WorldConfig,
    rank: usize,
    size: usize,
    /// The write half of the link to each global rank (`None` for this rank).
    links: Vec<Option<Mutex<TcpStream>>>,
    state: Mutex<State>,
    arrived: Condvar,
    stats: Mutex<CommStats>,
    /// Set when this rank says goodbye or aborts: links closing after that are expected.
    closing: AtomicBool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `failure` unless an earlier one is known, and wakes every waiter.
    fn fail(&self, failure: Failure) {
        let mut state = self.state();
        if state.failure.is_none() {
            state.failure = Some(failure);
        }
        drop(state);
        self.arrived.notify_all();
    }

    fn deliver(&self, from: usize, header: WireHeader, body: Vec<u8>) {
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
    fn read_link(&self, peer: usize, stream: TcpStream) {
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
    fn send_frame(&self, to: usize, kind: Kind, body: &[u8]) -> Result<(), Failure> {
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
    fn close_links(&self, linger: Duration) {
        for link in self.links.iter().flatten() {
            let stream = link.lock().unwrap_or_else(|p| p.into_inner());
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
        let deadline = Instant::now() + linger;
        let mut state = self.state();
        while (0..self.size).any(|peer| peer != self.rank && !state.ended[peer]) {
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
    }

    /// Tells every peer `kind` (best effort: a peer that is gone is skipped).
    fn tell_all(&self, kind: Kind, body: &[u8]) {
        for to in (0..self.size).filter(|&to| to != self.rank) {
            let _ = self.send_frame(to, kind, body);
        }
    }
}

/// This process's rank of a TCP launch: rendezvous, links to every other rank, the world
/// communicator. Dropping it says goodbye to the peers and closes the links.
pub struct TcpWorld {
    shared: Arc<Shared>,
    local_rank: usize,
    world: Comm,
}

impl fmt::Debug for TcpWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpWorld")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("local_rank", &self.local_rank)
            .finish()
    }
}

impl TcpWorld {
    /// Whether this process was started for a TCP launch (`RANK` or `WORLD_SIZE` is set).
    pub fn launched() -> bool {
        std::env::var_os("RANK").is_some() || std::env::var_os("WORLD_SIZE").is_some()
    }

    /// Meets the other ranks of `rendezvous` and connects to each of them. `config.timeout`
    /// bounds the rendezvous and every later wait; `config.ranks_per_node` only classifies the
    /// counted bytes, as in the in-process world.
    pub fn connect(rendezvous: &Rendezvous, config: WorldConfig) -> Result<TcpWorld, CommError> {
        let invalid = |message: String| CommError::Invalid {
            group: "world".into(),
            message: format!("TCP rendezvous at {}: {message}", rendezvous.master()),
        };
        rendezvous.validate().map_err(&invalid)?;
        check_timeout("world", config.timeout)?;
        check_nodes(rendezvous.world_size, &config)?;
        let deadline = Instant::now() + config.timeout;
        let links = match rendezvous.rank {
            0 => master_links(rendezvous, deadline),
            _ => worker_links(rendezvous, deadline, config.timeout),
        }
        .map_err(&invalid)?;
        let (rank, size) = (rendezvous.rank, rendezvous.world_size);
        let mut writers = Vec::with_capacity(size);
        let mut readers = Vec::new();
        for (peer, link) in links.into_iter().enumerate() {
            let Some(stream) = link else {
                writers.push(None);
                continue;
            };
            let prepared = stream
                .set_nodelay(true)
                .and_then(|()| stream.set_read_timeout(None))
                .and_then(|()| stream.set_write_timeout(Some(config.timeout)))
                .and_then(|()| stream.try_clone());
            let reader = prepared.map_err(|e| invalid(format!("the link to rank {peer}: {e}")))?;
            readers.push((peer, reader));
            writers.push(Some(Mutex::new(stream)));
        }
        let shared = Arc::new(Shared {
            config,
            rank,
            size,
            links: writers,
            state: Mutex::new(State {
                left: vec![false; size],
                ended: vec![false; size],
                ..State::default()
            }),
            arrived: Condvar::new(),
            stats: Mutex::new(CommStats::default()),
            closing: AtomicBool::new(false),
        });
        for (peer, reader) in readers {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("burn-dcp-tcp-{rank}<-{peer}"))
                .spawn(move || shared.read_link(peer, reader))
                .map_err(|e| invalid(format!("starting the reader of rank {peer}: {e}")))?;
        }
        let group = Group::new("world".into(), Arc::from(""), (0..size).collect(), rank);
        let world = TcpComm::create(&shared, group);
        Ok(TcpWorld {
            shared,
            local_rank: rendezvous.local_rank,
            world,
        })
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks (processes) of the job.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// This process's rank on its node (`LOCAL_RANK`): the GPU it uses.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The world communicator.
    pub fn comm(&self) -> Comm {
        self.world.clone()
    }

    /// Prints `message` naming this rank, tells every peer (their operations fail naming the
    /// first failure this rank knows of) and exits the process with status 1.
    pub fn abort(&self, message: &str) -> ! {
        log::error!("rank {} aborts the job: {message}", self.shared.rank);
        self.world.abort(message);
        // A moment for the abort message to be read before the sockets close.
        let linger = self.shared.config.timeout.min(Duration::from_secs(2));
        self.shared.close_links(linger);
        std::process::exit(1)
    }
}

impl Drop for TcpWorld {
    /// Says goodbye to every peer and waits (up to the timeout) for theirs: ranks that finish
    /// together leave together, and no message in flight is lost to a closing socket.
    fn drop(&mut self) {
        if !self.shared.closing.swap(true, Ordering::SeqCst) {
            self.shared.tell_all(Kind::Bye, &[]);
        }
        self.shared.close_links(self.shared.config.timeout);
    }
}

/// Waits until `deadline` for `connect` to succeed (the peer may not listen yet).
fn connect_until(address: &str, deadline: Instant) -> Result<TcpStream, String> {
    let mut last = String::from("no address");
    loop {
        let addresses: Vec<SocketAddr> = address
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {address}: {e}"))?
            .collect();
        for socket in &addresses {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = remaining
                .min(Duration::from_secs(5))
                .max(Duration::from_millis(1));
            match TcpStream::connect_timeout(socket, attempt) {
                Ok(stream) => return Ok(stream),
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "could not connect to {address} before the timeout ({last})"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads one frame of kind `expected` before `deadline`.
fn read_expected(
    stream: &mut TcpStream,
    expected: Kind,
    deadline: Instant,
) -> Result<Vec<u8>, String> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(remaining.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    match read_frame(stream) {
        Ok((kind, body)) if kind == expected => Ok(body),
        Ok((Kind::Refuse, body)) => Err(format!(
            "rank 0 stopped the rendezvous: {}",
            String::from_utf8_lossy(&body)
        )),
        Ok((kind, _)) => Err(format!("expected a {expected:?} frame, got {kind:?}")),
        Err(e) => Err(format!("reading the {expected:?} frame: {e}")),
    }
}

fn send_hello(stream: &mut TcpStream, rendezvous: &Rendezvous, port: u16) -> Result<(), String> {
    let hello = Hello {
        magic: MAGIC.into(),
        version: VERSION,
        rank: rendezvous.rank,
        world_size: rendezvous.world_size,
        port,
    };
    let body = serde_json::to_vec(&hello).map_err(|e| e.to_string())?;
    write_frame(stream, Kind::Hello, &body).map_err(|e| format!("sending the hello: {e}"))
}

/// Reads a connecting process's hello and checks it joins this world as one of `expected`
/// ranks; `Ok(None)` for a connection that is not a burn-dcp rank (ignored).
fn accept_hello(
    stream: &mut TcpStream,
    world_size: usize,
    expected: std::ops::Range<usize>,
    taken: &[bool],
    deadline: Instant,
) -> Result<Option<Hello>, String> {
    // A stranger (a port scanner, another program) is dropped; only a rank that says it is
    // one, and breaks the rules, fails the rendezvous.
    // A rank sends its hello as soon as it is connected.
    let hello_by = deadline.min(Instant::now() + Duration::from_secs(10));
    let Ok(body) = read_expected(stream, Kind::Hello, hello_by) else {
        return Ok(None);
    };
    let Ok(hello) = serde_json::from_slice::<Hello>(&body) else {
        return Ok(None);
    };
    if hello.magic != MAGIC {
        return Ok(None);
    }
    let refuse = |stream: &mut TcpStream, reason: String| {
        let _ = write_frame(stream, Kind::Refuse, reason.as_bytes());
        Err(reason)
    };
    if hello.version != VERSION {
        let reason = format!(
            "rank {} speaks protocol version {}, this one {VERSION} (mixed burn-dcp builds)",
            hello.rank, hello.version
        );
        return refuse(stream, reason);
    }
    if hello.world_size != world_size {
        let reason = format!(
            "rank {} was started with WORLD_SIZE={}, rank 0 with WORLD_SIZE={world_size}",
            hello.rank, hello.world_size
        );
        return refuse(stream, reason);
    }
    if !expected.contains(&hello.rank) {
        let reason = format!(
            "a process announced RANK={}, expected one of {expected:?} here",
            hello.rank
        );
        return refuse(stream, reason);
    }
    if taken[hello.rank] {
        let reason = format!("two processes were started with RANK={}", hello.rank);
        return refuse(stream, reason);
    }
    Ok(Some(hello))
}

/// Accepts the ranks `expected` on `listener` until `deadline`; `links[r]` gets rank `r`'s
/// stream, `ports[r]` its listener's port.
fn accept_ranks(
    listener: &TcpListener,
    world_size: usize,
    expected: std::ops::Range<usize>,
    links: &mut [Option<TcpStream>],
    ports: &mut [u16],
    deadline: Instant,
) -> Result<(), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut taken = vec![false; world_size];
    let mut missing = expected.len();
    while missing > 0 {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                let hello =
                    accept_hello(&mut stream, world_size, expected.clone(), &taken, deadline)?;
                if let Some(hello) = hello {
                    taken[hello.rank] = true;
                    ports[hello.rank] = hello.port;
                    links[hello.rank] = Some(stream);
                    missing -= 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let absent: Vec<usize> = expected.clone().filter(|&r| !taken[r]).collect();
                    return Err(format!(
                        "ranks {absent:?} had not connected when the timeout passed"
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(format!("accepting connections: {e}")),
        }
    }
    Ok(())
}

/// An unspecified address of the family of `like` (IPv4 unless it is IPv6).
fn any_address(like: Option<IpAddr>) -> IpAddr {
    match like {
        Some(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// Rank 0: listens at the master port, takes every other rank's hello, sends the table.
fn master_links(
    rendezvous: &Rendezvous,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, String> {
    let size = rendezvous.world_size;
    let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size == 1 {
        return Ok(links);
    }
    let family = rendezvous.master_addr.parse::<IpAddr>().ok();
    let bind = SocketAddr::new(any_address(family), rendezvous.master_port);
    let listener = TcpListener::bind(bind).map_err(|e| {
        format!(
            "rank 0 cannot listen on port {}: {e} (is another job using MASTER_PORT?)",
            rendezvous.master_port
        )
    })?;
    let mut ports = vec![0u16; size];
    if let Err(reason) = accept_ranks(&listener, size, 1..size, &mut links, &mut ports, deadline) {
        // The ranks already connected learn why the job cannot start.
        for stream in links.iter_mut().flatten() {
            let _ = write_frame(stream, Kind::Refuse, reason.as_bytes());
        }
        return Err(reason);
    }
    let mut table = vec![String::new(); size];
    for rank in 1..size {
        let stream = links[rank].as_ref().expect("every rank connected");
        let ip = stream.peer_addr().map_err(|e| e.to_string())?.ip();
        table[rank] = SocketAddr::new(ip, ports[rank]).to_string();
    }
    let body = serde_json::to_vec(&table).map_err(|e| e.to_string())?;
    for (rank, link) in links.iter_mut().enumerate().skip(1) {
        let stream = link.as_mut().expect("every rank connected");
        write_frame(stream, Kind::Table, &body)
            .map_err(|e| format!("sending the address table to rank {rank}: {e}"))?;
    }
    Ok(links)
}

/// Rank `r > 0`: connects to rank 0, gets the table, connects to ranks `1..r` and accepts
/// ranks `r+1..`.
fn worker_links(
    rendezvous: &Rendezvous,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, String> {
    let (rank, size) = (rendezvous.rank, rendezvous.world_size);
    let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let master = rendezvous.master();
    let mut to_master =
        connect_until(&master, deadline).map_err(|e| format!("rank {rank}: {e}"))?;
    let family = to_master.local_addr().ok().map(|a| a.ip());
    let listener = TcpListener::bind(SocketAddr::new(any_address(family), 0))
        .map_err(|e| format!("rank {rank} cannot listen for its peers: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    send_hello(&mut to_master, rendezvous, port)?;
    // Rank 0 answers by its own deadline (the table, or why the start failed), which may lie
    // a little after this rank's: wait for that answer a timeout longer.
    let answer_by = deadline + timeout;
    let table = read_expected(&mut to_master, Kind::Table, answer_by)
        .map_err(|e| format!("rank {rank} waiting for rank 0's address table: {e}"))?;
    let table: Vec<String> = serde_json::from_slice(&table)
        .map_err(|e| format!("rank {rank}: a malformed address table: {e}"))?;
    if table.len() != size {
        return Err(format!(
            "rank 0 sent a table of {} ranks, expected {size}",
            table.len()
        ));
    }
    links[0] = Some(to_master);
    for (peer, address) in table.iter().enumerate().take(rank).skip(1) {
        let mut stream = connect_until(address, deadline)
            .map_err(|e| format!("rank {rank} connecting to rank {peer}: {e}"))?;
        send_hello(&mut stream, rendezvous, port)?;
        links[peer] = Some(stream);
    }
    let mut ports = vec![0u16; size];
    accept_ranks(
        &listener,
        size,
        rank + 1..size,
        &mut links,
        &mut ports,
        deadline,
    )
    .map_err(|e| format!("rank {rank} waiting for its peers: {e}"))?;
    Ok(links)
}

/// A group of TCP ranks as seen by one of them.
pub struct TcpComm {
    shared: Arc<Shared>,
    group: Group,
    /// Per peer and channel: messages sent, receives posted.
    sent: Mutex<Vec<[u64; Channel::COUNT]>>,
    posted: Mutex<Vec<[u64; Channel::COUNT]>>,
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

impl RecvHandle {
    fn wait(self) -> Result<Payload, CommError> {
        let shared = &self.shared;
        let started = Instant::now();
        let peer_global = self.key.2;
        let mut state = shared.state();
        loop {
            let inbox = state.inboxes.get_mut(&self.key);
            if let Some(message) = inbox.and_then(|inbox| inbox.messages.remove(&self.arrival)) {
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
                return Err(CommError::Timeout {
                    group: self.key.0.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global,
                    op: self.op.clone(),
                    waited: shared.config.timeout,
                });
            }
            let remaining = shared.config.timeout - waited;
            state = shared
                .arrived
                .wait_timeout(state, remaining)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
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
        check_envelope((&self.op, self.arrival), (&header.op, header.index)).map_err(protocol)?;
        let expected = header.shape.iter().product::<usize>() * header.dtype.size();
        if body.len() != expected {
            return Err(protocol(format!(
                "{} message #{}: a {:?} {:?} message with {} bytes instead of {expected}",
                self.op,
                self.arrival,
                header.shape,
                header.dtype,
                body.len()
            )));
        }
        let data = TensorData::from_bytes_vec(body, header.shape, header.dtype);
        Ok(Payload::Host(data))
    }
}

impl TcpComm {
    fn create(shared: &Arc<Shared>, group: Group) -> Comm {
        let size = group.size();
        Arc::new(TcpComm {
            shared: shared.clone(),
            group,
            sent: Mutex::new(vec![[0; Channel::COUNT]; size]),
            posted: Mutex::new(vec![[0; Channel::COUNT]; size]),
            sending: Mutex::new(()),
        })
    }

    fn next(counters: &Mutex<Vec<[u64; Channel::COUNT]>>, peer: usize, channel: Channel) -> u64 {
        let mut counters = counters.lock().unwrap_or_else(|p| p.into_inner());
        counters[peer][channel.index()] += 1;
        counters[peer][channel.index()] - 1
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
        channel: Channel,
        data: Payload,
        op: &str,
        accounting: Accounting,
    ) -> Result<PendingSend, CommError> {
        self.begin(op)?;
        let group = &self.group;
        // TCP moves host bytes: a device tensor is read back once, here.
        let data = data
            .into_host()
            .map_err(|e| group.invalid(format!("{op}: {e}")))?;
        let _sending = self.sending.lock().unwrap_or_else(|p| p.into_inner());
        let index = Self::next(&self.sent, peer, channel);
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
        group.count(&shared.stats, &shared.config, accounting, peer, bytes);
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
            arrival: Self::next(&self.posted, peer, channel),
            rank: self.group.rank,
            peer,
            op: op.to_string(),
        })
    }

    fn wait(receives: Vec<RecvHandle>) -> Result<Vec<Payload>, CommError> {
        receives.into_iter().map(RecvHandle::wait).collect()
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
