//! This process's rank of an MPI job: initialisation, the lock every MPI call is made under,
//! the progress every wait makes on every posted receive, the job's abort.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use mpi::ffi;

use super::comm::MpiComm;
use crate::comm::common::{check_timeout, WireError};
use crate::comm::transport::{Channel, Group};
use crate::comm::{Comm, CommError, CommStats, WorldConfig};
use crate::nodes::NodeMap;

/// Environment variables set by MPI launchers for each rank they start: OpenMPI's `mpirun`,
/// PMIx (`srun --mpi=pmix`, OpenMPI 5), PMI-1/2 (MPICH's hydra, `srun --mpi=pmi2`), MVAPICH.
pub const LAUNCHER_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MV2_COMM_WORLD_SIZE",
];

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
    size: usize,
    pub(super) stats: Mutex<CommStats>,
    /// Receives posted and not yet matched, matched by [`Shared::progress`].
    pub(super) posted: Mutex<Vec<Arc<Posted>>>,
    /// Sequence numbers wrap at this bound (tags are `seq % bound * Channel::COUNT + channel`).
    pub(super) seq_bound: u64,
    /// Set once the job is being aborted or MPI finalised: no further MPI calls.
    pub(super) closed: AtomicBool,
}

impl Shared {
    /// Matches every posted receive whose message has arrived (`MPI_Improbe` + `MPI_Mrecv`).
    pub(super) fn progress(&self) {
        let mut posted = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        if posted.is_empty() || self.closed.load(Ordering::SeqCst) {
            return;
        }
        let _mpi = mpi_lock();
        posted.retain(|p| !p.try_match());
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
        let mut flag: c_int = 0;
        // SAFETY: plain MPI calls on a live communicator, under MPI_LOCK; the status and message
        // are written by MPI.
        unsafe {
            let mut message: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
            let mut status: ffi::MPI_Status = std::mem::zeroed();
            let code = ffi::MPI_Improbe(
                self.source,
                self.tag,
                self.comm.0,
                &mut flag,
                &mut message,
                &mut status,
            );
            let result = if code != 0 {
                Some(Err(WireError::Receive(format!(
                    "MPI_Improbe failed with error code {code}"
                ))))
            } else if flag == 0 {
                None
            } else {
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
                    0 => Ok(buffer),
                    _ => Err(WireError::Receive(format!(
                        "MPI_Mrecv failed with error code {code}"
                    ))),
                })
            };
            match result {
                Some(result) => {
                    *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
                    true
                }
                None => false,
            }
        }
    }

    pub(super) fn take(&self) -> Option<Result<Vec<u8>, WireError>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take()
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

/// This process's rank of an MPI job: initialises MPI, gives the world communicator, and
/// finalises MPI when dropped.
pub struct MpiWorld {
    shared: Arc<Shared>,
    world: Comm,
}

impl fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiWorld")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .finish()
    }
}

impl MpiWorld {
    /// Whether an MPI launcher started this process (one of [`LAUNCHER_VARIABLES`] is set).
    pub fn launched() -> bool {
        LAUNCHER_VARIABLES
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }

    /// Initialises MPI (once per process) and returns this rank's world. `config.timeout`
    /// bounds every wait; `config.ranks_per_node` only classifies the counted bytes by link,
    /// as in the in-process world.
    pub fn init(config: WorldConfig) -> Result<MpiWorld, CommError> {
        let invalid = |message: String| CommError::Invalid {
            group: "world".into(),
            message,
        };
        check_timeout("world", config.timeout)?;
        if SHARED.get().is_some() {
            return Err(invalid(
                "MPI is already initialised in this process (MpiWorld::init may be called once)"
                    .into(),
            ));
        }
        let _mpi = mpi_lock();
        // SAFETY: MPI's initialisation and queries, under `MPI_LOCK`, once per process (checked
        // above); the out-parameters are locals that outlive the calls.
        let (rank, size, seq_bound) = unsafe {
            let mut initialized: c_int = 0;
            ffi::MPI_Initialized(&mut initialized);
            if initialized != 0 {
                return Err(invalid(
                    "MPI was initialised by someone else in this process".into(),
                ));
            }
            let mut provided: c_int = 0;
            let code = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            );
            if code != 0 {
                return Err(invalid(format!(
                    "MPI_Init_thread failed with error code {code}"
                )));
            }
            if provided < ffi::RSMPI_THREAD_SERIALIZED {
                ffi::MPI_Finalize();
                return Err(invalid(format!(
                    "the MPI library gives thread support level {provided}; burn-dcp needs at least MPI_THREAD_SERIALIZED ({})",
                    ffi::RSMPI_THREAD_SERIALIZED
                )));
            }
            // Errors come back as codes (turned into CommErrors) instead of killing the job
            // with MPI's own message.
            ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN);
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
            let mut tag_ub: *mut c_int = std::ptr::null_mut();
            let mut found: c_int = 0;
            ffi::MPI_Comm_get_attr(
                ffi::RSMPI_COMM_WORLD,
                ffi::MPI_TAG_UB as c_int,
                &mut tag_ub as *mut *mut c_int as *mut c_void,
                &mut found,
            );
            // MPI guarantees a tag bound of at least 32767.
            let tag_ub = if found != 0 && !tag_ub.is_null() {
                (*tag_ub).max(32767)
            } else {
                32767
            };
            (
                rank as usize,
                size as usize,
                (tag_ub as u64 + 1) / Channel::COUNT as u64,
            )
        };
        let nodes = match config.nodes(size) {
            Ok(nodes) => nodes,
            Err(error) => {
                // SAFETY: initialised above; nothing else uses MPI yet.
                unsafe { ffi::MPI_Finalize() };
                return Err(error);
            }
        };
        let shared = Arc::new(Shared {
            config,
            nodes,
            rank,
            size,
            stats: Mutex::new(CommStats::default()),
            posted: Mutex::new(Vec::new()),
            seq_bound,
            closed: AtomicBool::new(false),
        });
        let _ = SHARED.set(shared.clone());
        let group = Group::new("world".into(), Arc::from(""), (0..size).collect(), rank);
        // SAFETY: reads a constant the MPI bindings define.
        let world_handle = RawComm(unsafe { ffi::RSMPI_COMM_WORLD });
        let world = MpiComm::create(&shared, world_handle, false, group);
        Ok(MpiWorld { shared, world })
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks (processes) of the job.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// The world communicator.
    pub fn comm(&self) -> Comm {
        self.world.clone()
    }

    /// Prints `message` naming this rank and aborts the whole job (`MPI_Abort`): the launcher
    /// then stops every rank. Never returns.
    pub fn abort(&self, message: &str) -> ! {
        abort_job(self.shared.rank, message)
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        if !self.shared.closed.swap(true, Ordering::SeqCst) {
            let _mpi = mpi_lock();
            // SAFETY: MPI was initialised by `init`; nothing runs MPI calls after `closed`.
            unsafe {
                ffi::MPI_Finalize();
            }
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
