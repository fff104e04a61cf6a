//! NCCL communicator (cargo feature `cuda`): tensor data moves GPU to GPU with NCCL's grouped
//! `ncclSend`/`ncclRecv` (through cudarc 0.19, the crate burn-cuda itself uses); message headers
//! and host payloads travel over a *control* communicator of the same ranks (the MPI world under
//! `mpirun`, or the in-process world when ranks are threads).
//!
//! **Status:** a world of one ran on an H100 (2026-11-26, `burn-dcp/tests/nccl.rs`: a device
//! tensor sent to itself through `ncclSend`/`ncclRecv`, all-reduce, a host all-gather over the
//! control world). Several ranks have not run: NCCL refuses two ranks on one GPU, and the GPU
//! machine lent had one. CI has no GPU.
//!
//! **Why a control communicator.** A receive does not know its message's size, and NCCL needs it
//! before `ncclRecv`. Sending the header over NCCL itself would need a second, dependent NCCL
//! round on every receive, and a rank whose header send waits for its peer's receive while the
//! peer waits for this rank's data deadlocks. Headers over an eager host channel (MPI sends of a
//! few dozen bytes complete at once) have no such cycle: the receiver learns the size, allocates
//! the tensor in burn-cuda's memory, and launches the receive.
//!
//! **Data path.** A sent payload that is a burn-cuda tensor (`CubeTensor<CudaRuntime>`) is made
//! contiguous and sent from its own device memory; a received one is allocated with cubecl's
//! client (so it is an ordinary burn-cuda tensor) and written by NCCL. Posted sends, and the
//! receives of the link being waited on, are launched together in one
//! `ncclGroupStart`/`ncclGroupEnd` on this communicator's own CUDA stream, after cubecl's stream
//! is synchronised (the data is ready, and memory cubecl freed is no longer read by its kernels);
//! the wait polls `cuStreamQuery` and `ncclCommGetAsyncError` against the timeout and aborts the
//! NCCL communicator (`ncclCommAbort`) when it passes. Payloads of other backends and host bytes
//! go over the control communicator.
//!
//! **Same numbers as the other worlds.** This world is a transport (`transport.rs`); its
//! collectives are the ones every world shares (`comm/collectives.rs`: exchanges, sums taken
//! locally in rank order), so a run computes what the in-process and MPI runs compute.

mod comm;
mod state;
mod transport;
mod world;

pub use comm::NcclComm;
pub use world::{CudaTensor, NcclWorld};
