//! What every MPI communicator of the process shares: the one lock every MPI call is made under,
//! the process's world state ([`Shared`]), posted receives and their matching, and aborting the
//! job.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use mpi::ffi;

use crate::comm::common::WireError;
use crate::comm::nodes::NodeMap;
use crate::comm::stall::Status;
use crate::comm::{CommStats, WorldConfig};

/// Every MPI call of the process is made under this lock (see the module docs).
pub(super) static MPI_LOCK: Mutex<()> = Mutex::new(());
/// The process's world, once initialised (MPI can be initialised once per process).
pub(super) static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();

pub(super) fn mpi_lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A raw MPI communicator handle (a pointer under OpenMPI), used only under [`MPI_LOCK`].
#[derive(Clone, Copy)]
pub(super) struct RawComm(pub(super) ffi::MPI_Comm);
// SAFETY: the handle is only passed to MPI calls made under `MPI_LOCK`, with the library
// initialised for at least `MPI_THREAD_SERIALIZED`.
unsafe impl Send for RawComm {}
// SAFETY: as `Send`: shared references only hand the handle to calls under `MPI_LOCK`.
unsafe impl Sync for RawComm {}

/// What every communicator of the process shares: this process is one rank.
pub(super) struct Shared {
    pub(super) config: WorldConfig,
    pub(super) nodes: NodeMap,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) stats: Mutex<CommStats>,
    /// Receives posted and not yet matched, matched by [`Shared::progress`].
    pub(super) posted: Mutex<Vec<Arc<Posted>>>,
    /// Sequence numbers wrap at this bound (tags are `seq % bound * Channel::COUNT + channel`).
    pub(super) seq_bound: u64,
    /// Set once the job is being aborted or MPI finalised: no further MPI calls.
    pub(super) closed: AtomicBool,
    /// The world duplicated for stall queries and their answers (`stall.rs`).
    pub(super) status_comm: RawComm,
    /// What this rank waits for and last received, as it answers a stall query.
    pub(super) status: Mutex<Status>,
    /// This rank's stall queries so far (each answer names its query).
    pub(super) queries: AtomicU64,
}

impl Shared {
    /// Matches every posted receive whose message has arrived (`MPI_Improbe` + `MPI_Mrecv`)
    /// and answers the stall queries that have (see `stall.rs`).
    pub(super) fn progress(&self) {
        let mut posted = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        let _mpi = mpi_lock();
        posted.retain(|p| !p.try_match());
        self.answer_queries();
    }

    pub(super) fn unpost(&self, which: &Arc<Posted>) {
        let mut posted = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        posted.retain(|p| !Arc::ptr_eq(p, which));
    }
}

/// A receive posted on (communicator, source, tag); `slot` holds the message once matched.
pub(super) struct Posted {
    pub(super) comm: RawComm,
    pub(super) source: c_int,
    pub(super) tag: c_int,
    pub(super) slot: Mutex<Option<Result<Vec<u8>, WireError>>>,
}

impl Posted {
    /// Under `MPI_LOCK`: takes the message in if it has arrived; whether it did.
    fn try_match(&self) -> bool {
        match receive_arrived(self.comm.0, self.source, self.tag) {
            Some(result) => {
                let message = result.map(|(_, bytes)| bytes);
                *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
                true
            }
            None => false,
        }
    }

    pub(super) fn take(&self) -> Option<Result<Vec<u8>, WireError>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Under `MPI_LOCK`: the next message from `source` (or `RSMPI_ANY_SOURCE`) with `tag` on
/// `comm` if one has arrived, with its sender: a matched probe and the receive of what it
/// matched, so no other probe can take the message in between. `None` when none has arrived.
pub(super) fn receive_arrived(
    comm: ffi::MPI_Comm,
    source: c_int,
    tag: c_int,
) -> Option<Result<(c_int, Vec<u8>), WireError>> {
    let mut flag: c_int = 0;
    // SAFETY: plain MPI calls on a live communicator, under MPI_LOCK; the status and message are
    // written by MPI, and the receive buffer has the probed size.
    unsafe {
        let mut message: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
        let mut status: ffi::MPI_Status = std::mem::zeroed();
        let code = ffi::MPI_Improbe(source, tag, comm, &mut flag, &mut message, &mut status);
        if code != 0 {
            return Some(Err(WireError::Receive(format!(
                "MPI_Improbe failed with error code {code}"
            ))));
        }
        if flag == 0 {
            return None;
        }
        let mut count: c_int = 0;
        ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count);
        let mut buffer = vec![0u8; count.max(0) as usize];
        let code = ffi::MPI_Mrecv(
            buffer.as_mut_ptr() as *mut c_void,
            count,
            ffi::RSMPI_UINT8_T,
            &mut message,
            ffi::RSMPI_STATUS_IGNORE,
        );
        Some(match code {
            0 => Ok((status.MPI_SOURCE, buffer)),
            _ => Err(WireError::Receive(format!(
                "MPI_Mrecv failed with error code {code}"
            ))),
        })
    }
}

/// Polls with a short spin, then sleeps growing to 1 ms (ranks may outnumber cores).
pub(super) struct Backoff(pub(super) u32);

impl Backoff {
    pub(super) fn pause(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let micros = (self.0 as u64 - 63).min(50) * 20;
            std::thread::sleep(Duration::from_micros(micros));
        }
    }
}

/// Prints `message` for world rank `rank` and aborts the job; never returns.
pub(super) fn abort_job(rank: usize, message: &str) -> ! {
    log::error!("rank {rank} aborts the MPI job: {message}");
    if let Some(shared) = SHARED.get() {
        shared.closed.store(true, Ordering::SeqCst);
    }
    // The lock is not taken: another thread may hold it in a poll, and the job ends anyway.
    // SAFETY: MPI_Abort on the world communicator of an initialised MPI.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
    }
    std::process::exit(1)
}
