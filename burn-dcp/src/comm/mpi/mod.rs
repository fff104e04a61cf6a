//! MPI communicator (cargo feature `mpi`): one process per rank, over the system MPI (OpenMPI
//! or MPICH, through the `mpi` crate's raw bindings).
//!
//! Launch with `mpirun -n P program …` (or Slurm's `srun --mpi=pmix`); [`MpiWorld::launched`]
//! tells from the launcher's environment whether this process is one of several ranks.
//!
//! **Same results as the in-process world.** Every operation moves the same messages as
//! [`InProcessComm`](super::in_process) does: this world is a transport (`comm.rs`) under the
//! collectives every world shares (`comm/collectives.rs`: point-to-point exchanges, sums taken
//! locally in rank order). A run under `mpirun` therefore computes bit for bit what the
//! in-process run computes, and counts the same bytes ([`CommStats`](crate::comm::CommStats)).
//!
//! **Nothing waits forever.** Only non-blocking MPI calls are used (`MPI_Isend`, `MPI_Improbe`,
//! `MPI_Test`), polled against the world's timeout. A wait that times out fails with
//! [`CommError::Timeout`](crate::comm::CommError::Timeout) naming the peer — or, when that peer
//! was itself waiting, the rank at the end of the chain of waits, which made no progress
//! (`stall.rs`: ranks answer "what are you waiting for?" whenever they poll) —; the program then
//! aborts the job (`MPI_Abort`, see [`MpiWorld::abort`]), which makes the launcher kill every
//! rank.
//!
//! **Receives are posted, sends may be rendezvous.** A message's size is not known before it
//! arrives, so a posted receive is a registered (source, tag) that the process matches with
//! `MPI_Improbe` + `MPI_Mrecv` *whenever it waits on anything* — a send, a receive or a
//! collective. A rank waiting on its send to a peer therefore still takes in the messages its
//! own posted receives expect, so two ranks that post their receives, then their sends, then
//! wait, never deadlock, whatever the MPI's eager limit.
//!
//! **Matching.** Every message of a (group, sender, receiver, channel) link carries a tag made
//! of its sequence number on the link, and an envelope (operation, index) the receiver checks,
//! as the in-process world does: the n-th receive posted gets the n-th message sent, whatever
//! order receives are waited in.
//!
//! **Threads.** MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it (at
//! least `MPI_THREAD_SERIALIZED` is required); every MPI call of the process is made under one
//! lock, and no call blocks while holding it except `MPI_Comm_split`, made only after every
//! member has been seen to arrive (a control exchange with a deadline), and the stall queries'
//! few-byte `MPI_Send`s (eager in every MPI; their receiver is polling for them).

mod comm;
mod messages;
mod stall;
mod state;
mod world;

pub use comm::MpiComm;
pub use world::{MpiWorld, LAUNCHER_VARIABLES};
