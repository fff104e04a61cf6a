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
//! **Same results as the other worlds.** This world is a transport (`comm.rs`); its collectives
//! are the ones every world shares (`comm/collectives.rs`: point-to-point exchanges, sums taken
//! locally in rank order), and the same bytes are counted.
//!
//! **Nothing waits forever, failures name the rank.** Each link has a reader thread that takes
//! every message in as it arrives (so a send never waits on the peer's posting of a receive,
//! and two ranks sending to each other cannot deadlock); waits are bounded by the world's
//! timeout. A rank that fails tells every peer (an abort message with the first failure it
//! knows of, the root cause); a process that dies (SIGKILL) closes its sockets, and its peers'
//! pending and future operations fail at once with [`CommError::PeerFailed`](crate::comm::CommError::PeerFailed) naming it. A rank
//! that finishes says goodbye, so a peer still waiting on it fails naming it instead of timing
//! out.

mod comm;
mod rendezvous;
mod wire;
mod world;

pub use comm::TcpComm;
pub use rendezvous::{Rendezvous, RendezvousError, ENV_VARIABLES};
pub use world::TcpWorld;
