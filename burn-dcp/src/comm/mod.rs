//! Communicators (process groups): the only way ranks exchange data.
//!
//! Messages are [`Payload`]s: a backend's tensor on its device, or host [`TensorData`](burn::tensor::TensorData) (bytes +
//! shape + dtype), so one communicator serves every backend and dtype, and a communicator that
//! can pass device tensors as they are (the in-process world) never copies them to the host. Every blocking wait has a timeout and fails with an error naming the peer; when a
//! rank fails, every rank's pending and future operations fail with [`CommError::PeerFailed`]
//! naming the rank that failed *first* (the root cause) and its reason. Every message carries an
//! envelope (operation, index), so a receiver notices a lost, duplicated or mismatched message
//! ([`CommError::Protocol`]) instead of computing with the wrong data.

mod collectives;
mod common;
mod communicator;
mod error;
mod faults;
mod helpers;
pub mod in_process;
pub mod links;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod nodes;
pub mod payload;
mod pending;
mod stall;
mod stats;
pub mod tcp;
mod transport;

pub(crate) use communicator::control_payloads;
pub use communicator::{Comm, Communicator};
pub use error::{CommError, PayloadError};
pub use faults::{Fault, FaultKind};
pub use helpers::{panic_message, sum_tensor_data};
pub use in_process::{
    InProcessWorld, RankFailure, RankFailureKind, WorldConfig, MAX_IN_PROCESS_RANKS, MAX_TIMEOUT,
};
pub use links::LinkEmulation;

/// Environment variables set by MPI launchers for each rank they start (known to every build,
/// so that one without `mpi` can tell it was started by one): OpenMPI's `mpirun`,
/// PMIx (`srun --mpi=pmix`, OpenMPI 5), PMI-1/2 (MPICH's hydra, `srun --mpi=pmi2`), MVAPICH.
pub const MPI_LAUNCHER_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MV2_COMM_WORLD_SIZE",
];

#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiWorld};
#[cfg(feature = "cuda")]
pub use nccl::{NcclComm, NcclWorld};
pub use payload::{DeviceTensor, Payload};
pub use pending::{PendingRecv, PendingSend};
pub use stats::{CommStats, LinkBytes, OpKind};
pub use tcp::{Rendezvous, RendezvousError, TcpComm, TcpWorld};
