//! This process's rank of an MPI job: initialisation, the lock every MPI call is made under,
//! the progress every wait makes on every posted receive, the job's abort.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mpi::ffi;

use super::comm::MpiComm;
use super::state::{abort_job, mpi_lock, RawComm, Shared, SHARED};
use crate::comm::common::check_timeout;
use crate::comm::transport::{Channel, Group};
use crate::comm::{Comm, CommError, CommStats, WorldConfig};

pub use crate::comm::MPI_LAUNCHER_VARIABLES as LAUNCHER_VARIABLES;

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
        let (rank, size, seq_bound, status_comm) = unsafe {
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
            // The stall queries' own communicator (MPI_Comm_dup keeps the error handler).
            let mut status_comm: ffi::MPI_Comm = std::mem::zeroed();
            let code = ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut status_comm);
            if code != 0 {
                ffi::MPI_Finalize();
                return Err(invalid(format!(
                    "MPI_Comm_dup failed with error code {code}"
                )));
            }
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
                RawComm(status_comm),
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
            status_comm,
            status: Mutex::new(Default::default()),
            queries: AtomicU64::new(0),
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
