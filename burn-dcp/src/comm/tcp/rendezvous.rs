//! The rendezvous of a TCP launch: torchrun's variables, the hello every rank says, and the
//! links every pair of ranks opens.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Kind};

/// The environment variables of a TCP launch (torchrun's names).
pub const ENV_VARIABLES: [&str; 5] = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
];

/// Identifies burn-dcp's rendezvous, so a stray connection is told apart from a rank.
pub(super) const MAGIC: &str = "burn-dcp-tcp";
pub(super) const VERSION: u32 = 1;
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

/// Why a TCP launch could not start: a variable breaking its rule, a process breaking the
/// launch's rules, or a network step that failed (each names the variable, rank or address).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RendezvousError {
    #[error("{name} is not set: a TCP launch needs MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (and LOCAL_RANK)")]
    Unset { name: String },
    #[error("{name}={value:?} is not a non-negative integer")]
    NotANumber { name: String, value: String },
    #[error("MASTER_PORT={value:?} is not a port number (1 to 65535)")]
    NotAPort { value: String },
    #[error("WORLD_SIZE=0: a world has at least one rank")]
    EmptyWorld,
    #[error("RANK={rank} is not a rank of a world of WORLD_SIZE={world_size} (ranks are 0..{world_size})")]
    RankOutOfRange { rank: usize, world_size: usize },
    #[error("MASTER_ADDR is empty: it names rank 0's host")]
    EmptyMaster,
    #[error("MASTER_PORT=0: rank 0 listens on a fixed port the others know")]
    ZeroPort,
    /// A process that breaks the launch's rules (rank 0 tells it, and the ranks already
    /// connected, why).
    #[error("{reason}")]
    Refused { reason: String },
    /// Rank 0 stopped the rendezvous (its reason, as it sent it).
    #[error("rank 0 stopped the rendezvous: {reason}")]
    Stopped { reason: String },
    #[error("could not connect to {address} before the timeout ({last})")]
    Unreachable { address: String, last: String },
    #[error("ranks {absent:?} had not connected when the timeout passed")]
    Absent { absent: Vec<usize> },
    #[error("expected a {expected} frame, got {got}")]
    UnexpectedFrame { expected: String, got: String },
    #[error("rank 0 sent a table of {got} ranks, expected {expected}")]
    TableSize { got: usize, expected: usize },
    /// A system call or encoding step that failed: the step, and the OS's or serde's error.
    #[error("{step}: {reason}")]
    Io { step: String, reason: String },
    /// An inner step's error, with what this rank was doing.
    #[error("{context}: {source}")]
    During {
        context: String,
        source: Box<RendezvousError>,
    },
}

impl RendezvousError {
    /// Whether the message contains `text` (what callers did when this error was a `String`).
    pub fn contains(&self, text: &str) -> bool {
        self.to_string().contains(text)
    }

    fn io(step: impl Into<String>, error: impl fmt::Display) -> Self {
        RendezvousError::Io {
            step: step.into(),
            reason: error.to_string(),
        }
    }

    fn during(context: impl Into<String>) -> impl FnOnce(RendezvousError) -> RendezvousError {
        let context = context.into();
        move |source| RendezvousError::During {
            context,
            source: Box::new(source),
        }
    }
}

impl From<RendezvousError> for String {
    /// The message, for code whose errors are text (`?` in a function returning `String`).
    fn from(error: RendezvousError) -> String {
        error.to_string()
    }
}

impl Rendezvous {
    /// The rendezvous the environment describes: `None` when neither `RANK` nor `WORLD_SIZE`
    /// is set (not a TCP launch); an error naming the variable when one is missing or malformed.
    /// `LOCAL_RANK` defaults to 0 (one process per node).
    pub fn from_env() -> Result<Option<Rendezvous>, RendezvousError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Rendezvous::from_env`] over any source of variables.
    pub fn from_vars(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Rendezvous>, RendezvousError> {
        if var("RANK").is_none() && var("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let required = |name: &str| {
            var(name).ok_or_else(|| RendezvousError::Unset {
                name: name.to_string(),
            })
        };
        let number = |name: &str, value: String| {
            value
                .trim()
                .parse::<usize>()
                .map_err(|_| RendezvousError::NotANumber {
                    name: name.to_string(),
                    value: value.clone(),
                })
        };
        let master_addr = required("MASTER_ADDR")?;
        let port = required("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| RendezvousError::NotAPort {
                value: port.clone(),
            })?;
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
    pub fn validate(&self) -> Result<(), RendezvousError> {
        if self.world_size == 0 {
            return Err(RendezvousError::EmptyWorld);
        }
        if self.rank >= self.world_size {
            return Err(RendezvousError::RankOutOfRange {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        if self.master_addr.trim().is_empty() {
            return Err(RendezvousError::EmptyMaster);
        }
        if self.master_port == 0 {
            return Err(RendezvousError::ZeroPort);
        }
        Ok(())
    }

    pub(super) fn master(&self) -> String {
        match self.master_addr.parse::<Ipv6Addr>() {
            Ok(_) => format!("[{}]:{}", self.master_addr, self.master_port),
            Err(_) => format!("{}:{}", self.master_addr, self.master_port),
        }
    }
}

/// What a connecting process says about itself.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
pub(super) struct Hello {
    magic: String,
    version: u32,
    rank: usize,
    world_size: usize,
    /// The port of the process's own listener (for ranks above it); 0 for rank 0.
    port: u16,
}

/// Waits until `deadline` for `connect` to succeed (the peer may not listen yet).
pub(super) fn connect_until(
    address: &str,
    deadline: Instant,
) -> Result<TcpStream, RendezvousError> {
    let mut last = String::from("no address");
    loop {
        let addresses: Vec<SocketAddr> = address
            .to_socket_addrs()
            .map_err(|e| RendezvousError::io(format!("cannot resolve {address}"), e))?
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
            return Err(RendezvousError::Unreachable {
                address: address.to_string(),
                last,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads one frame of kind `expected` before `deadline`.
pub(super) fn read_expected(
    stream: &mut TcpStream,
    expected: Kind,
    deadline: Instant,
) -> Result<Vec<u8>, RendezvousError> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(remaining.max(Duration::from_millis(1))))
        .map_err(|e| RendezvousError::io("setting the read timeout", e))?;
    match read_frame(stream) {
        Ok((kind, body)) if kind == expected => Ok(body),
        Ok((Kind::Refuse, body)) => Err(RendezvousError::Stopped {
            reason: String::from_utf8_lossy(&body).into_owned(),
        }),
        Ok((kind, _)) => Err(RendezvousError::UnexpectedFrame {
            expected: format!("{expected:?}"),
            got: format!("{kind:?}"),
        }),
        Err(e) => Err(RendezvousError::io(
            format!("reading the {expected:?} frame"),
            e,
        )),
    }
}

pub(super) fn send_hello(
    stream: &mut TcpStream,
    rendezvous: &Rendezvous,
    port: u16,
) -> Result<(), RendezvousError> {
    let hello = Hello {
        magic: MAGIC.into(),
        version: VERSION,
        rank: rendezvous.rank,
        world_size: rendezvous.world_size,
        port,
    };
    let body =
        serde_json::to_vec(&hello).map_err(|e| RendezvousError::io("encoding the hello", e))?;
    write_frame(stream, Kind::Hello, &body).map_err(|e| RendezvousError::io("sending the hello", e))
}

/// Reads a connecting process's hello and checks it joins this world as one of `expected`
/// ranks; `Ok(None)` for a connection that is not a burn-dcp rank (ignored).
pub(super) fn accept_hello(
    stream: &mut TcpStream,
    world_size: usize,
    expected: std::ops::Range<usize>,
    taken: &[bool],
    deadline: Instant,
) -> Result<Option<Hello>, RendezvousError> {
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
        Err(RendezvousError::Refused { reason })
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
pub(super) fn accept_ranks(
    listener: &TcpListener,
    world_size: usize,
    expected: std::ops::Range<usize>,
    links: &mut [Option<TcpStream>],
    ports: &mut [u16],
    deadline: Instant,
) -> Result<(), RendezvousError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| RendezvousError::io("listening without blocking", e))?;
    let mut taken = vec![false; world_size];
    let mut missing = expected.len();
    while missing > 0 {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| RendezvousError::io("setting a link to blocking", e))?;
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
                    return Err(RendezvousError::Absent { absent });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(RendezvousError::io("accepting connections", e)),
        }
    }
    Ok(())
}

/// An unspecified address of the family of `like` (IPv4 unless it is IPv6).
pub(super) fn any_address(like: Option<IpAddr>) -> IpAddr {
    match like {
        Some(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// Rank 0: listens at the master port, takes every other rank's hello, sends the table.
pub(super) fn master_links(
    rendezvous: &Rendezvous,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, RendezvousError> {
    let size = rendezvous.world_size;
    let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size == 1 {
        return Ok(links);
    }
    let family = rendezvous.master_addr.parse::<IpAddr>().ok();
    let bind = SocketAddr::new(any_address(family), rendezvous.master_port);
    let listener = TcpListener::bind(bind).map_err(|e| {
        RendezvousError::io(
            format!("rank 0 cannot listen on port {}", rendezvous.master_port),
            format!("{e} (is another job using MASTER_PORT?)"),
        )
    })?;
    let mut ports = vec![0u16; size];
    if let Err(error) = accept_ranks(&listener, size, 1..size, &mut links, &mut ports, deadline) {
        // The ranks already connected learn why the job cannot start.
        let reason = error.to_string();
        for stream in links.iter_mut().flatten() {
            let _ = write_frame(stream, Kind::Refuse, reason.as_bytes());
        }
        return Err(error);
    }
    let mut table = vec![String::new(); size];
    for rank in 1..size {
        let stream = links[rank].as_ref().expect("every rank connected");
        let ip = stream
            .peer_addr()
            .map_err(|e| RendezvousError::io(format!("the address of rank {rank}"), e))?
            .ip();
        table[rank] = SocketAddr::new(ip, ports[rank]).to_string();
    }
    let body = serde_json::to_vec(&table)
        .map_err(|e| RendezvousError::io("encoding the address table", e))?;
    for (rank, link) in links.iter_mut().enumerate().skip(1) {
        let stream = link.as_mut().expect("every rank connected");
        write_frame(stream, Kind::Table, &body).map_err(|e| {
            RendezvousError::io(format!("sending the address table to rank {rank}"), e)
        })?;
    }
    Ok(links)
}

/// Rank `r > 0`: connects to rank 0, gets the table, connects to ranks `1..r` and accepts
/// ranks `r+1..`.
pub(super) fn worker_links(
    rendezvous: &Rendezvous,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, RendezvousError> {
    let (rank, size) = (rendezvous.rank, rendezvous.world_size);
    let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let master = rendezvous.master();
    let mut to_master = connect_until(&master, deadline)
        .map_err(RendezvousError::during(format!("rank {rank}")))?;
    let family = to_master.local_addr().ok().map(|a| a.ip());
    let listener = TcpListener::bind(SocketAddr::new(any_address(family), 0))
        .map_err(|e| RendezvousError::io(format!("rank {rank} cannot listen for its peers"), e))?;
    let port = listener
        .local_addr()
        .map_err(|e| RendezvousError::io(format!("rank {rank}'s listener"), e))?
        .port();
    send_hello(&mut to_master, rendezvous, port)?;
    // Rank 0 answers by its own deadline (the table, or why the start failed), which may lie
    // a little after this rank's: wait for that answer a timeout longer.
    let answer_by = deadline + timeout;
    let table = read_expected(&mut to_master, Kind::Table, answer_by).map_err(
        RendezvousError::during(format!("rank {rank} waiting for rank 0's address table")),
    )?;
    let table: Vec<String> = serde_json::from_slice(&table)
        .map_err(|e| RendezvousError::io(format!("rank {rank}: a malformed address table"), e))?;
    if table.len() != size {
        return Err(RendezvousError::TableSize {
            got: table.len(),
            expected: size,
        });
    }
    links[0] = Some(to_master);
    for (peer, address) in table.iter().enumerate().take(rank).skip(1) {
        let mut stream = connect_until(address, deadline).map_err(RendezvousError::during(
            format!("rank {rank} connecting to rank {peer}"),
        ))?;
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
    .map_err(RendezvousError::during(format!(
        "rank {rank} waiting for its peers"
    )))?;
    Ok(links)
}
