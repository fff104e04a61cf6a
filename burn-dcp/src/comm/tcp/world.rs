//! This process's rank of a TCP launch.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::comm::TcpComm;
use super::rendezvous::{master_links, worker_links, Rendezvous};
use super::wire::{Kind, Shared, State};
use crate::comm::common::check_timeout;
use crate::comm::transport::Group;
use crate::comm::{Comm, CommError, CommStats, WorldConfig};

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
        rendezvous.validate().map_err(|e| invalid(e.to_string()))?;
        check_timeout("world", config.timeout)?;
        let nodes = config.nodes(rendezvous.world_size)?;
        let deadline = Instant::now() + config.timeout;
        let links = match rendezvous.rank {
            0 => master_links(rendezvous, deadline),
            _ => worker_links(rendezvous, deadline, config.timeout),
        }
        .map_err(|e| invalid(e.to_string()))?;
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
            nodes,
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
