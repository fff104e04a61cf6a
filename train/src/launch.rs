//! Where the ranks of an example run: threads of this process ([`InProcessWorld`]); one rank per
//! process when an MPI launcher started the process (`mpirun -n P …`, `srun --mpi=pmix …`) and
//! the binary has the cargo feature `mpi` (`burn_dcp::comm::MpiWorld`); or one rank
//! per process over TCP when the process was started the way `torchrun` starts them
//! (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; [`TcpWorld`]).
//!
//! The examples run the same per-rank task either way; with several processes only rank 0
//! prints and writes files, and a rank that fails ends the job with a message naming it (MPI:
//! `MPI_Abort`; TCP: it tells every peer, whose operations then fail naming it, and exits).

use std::io::Write;
use std::path::PathBuf;

use burn_dcp::comm::{Comm, InProcessWorld, Rendezvous, TcpWorld, WorldConfig};

use crate::error::TrainError;

/// Launcher variables giving this process's rank, in the order they are trusted.
const RANK_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "RANK",
];
/// Launcher variables giving this process's rank on its node (its GPU).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
const LOCAL_RANK_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMIX_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "LOCAL_RANK",
];
/// Launcher variables giving the number of processes.
const SIZE_VARIABLES: [&str; 4] = [
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "SLURM_NTASKS",
];

/// This process's rank as its launcher announces it (0 when no launcher started it). Known
/// before MPI is initialised, so that only rank 0 prints errors found before the world exists.
pub fn launcher_rank() -> usize {
    RANK_VARIABLES
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// Ends a program whose `run` failed. Every rank of a job (MPI or TCP processes) finds the same
/// configuration error: rank 0 alone prints `error: MESSAGE` (a rank's own failure during
/// training is printed by that rank as it aborts the job); every rank exits with status 2.
pub fn exit_on_error<E: std::fmt::Display>(result: Result<(), E>) {
    if let Err(message) = result {
        if launcher_rank() == 0 {
            eprintln!("error: {message}");
        }
        std::process::exit(2);
    }
}

/// The number of processes the launcher started (1 when none did).
#[cfg_attr(feature = "mpi", allow(dead_code))]
fn launcher_size() -> usize {
    SIZE_VARIABLES
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(1)
}

/// Whether this process is one of several an MPI launcher started: a variable only MPI
/// launchers set ([`burn_dcp::comm::MPI_LAUNCHER_VARIABLES`]: mpirun, `srun --mpi=pmix|pmi2`,
/// hydra). Slurm's own `SLURM_NTASKS` is not one: it is set in every step of an allocation, also
/// around a threads run or a TCP launch (torchrun's variables), which must not be taken for MPI.
pub fn launched_by_mpi() -> bool {
    #[cfg(feature = "mpi")]
    {
        burn_dcp::comm::MpiWorld::launched()
    }
    #[cfg(not(feature = "mpi"))]
    {
        burn_dcp::comm::MPI_LAUNCHER_VARIABLES
            .iter()
            .any(|v| std::env::var_os(v).is_some())
            && launcher_size() > 1
    }
}

/// The ranks of a run.
pub enum Ranks {
    /// Every rank is a thread of this process.
    InProcess(InProcessWorld),
    /// This process is one rank of an MPI job.
    #[cfg(feature = "mpi")]
    Mpi(burn_dcp::comm::MpiWorld),
    /// This process is one rank of a TCP launch (torchrun's variables).
    Tcp(TcpWorld),
}

impl Ranks {
    /// `size` ranks: threads, or this process's rank of the MPI job that started it, which must
    /// have exactly `size` processes. The MPI check is the same on every rank, so a wrong `-n`
    /// fails everywhere with the same message.
    pub fn new(size: usize, config: WorldConfig) -> Result<Ranks, TrainError> {
        let launch = |message: String| TrainError::Launch(message);
        if launched_by_mpi() {
            #[cfg(not(feature = "mpi"))]
            return Err(launch(format!(
                "started by an MPI launcher as one of {} processes, but this binary was built without MPI: rebuild with `--features mpi`",
                launcher_size()
            )));
            #[cfg(feature = "mpi")]
            {
                let processes = launcher_size();
                if processes != size {
                    return Err(launch(format!(
                        "the MPI job has {processes} processes but the configuration needs {size} ranks (one process per rank: mpirun -n {size})"
                    )));
                }
                let world =
                    burn_dcp::comm::MpiWorld::init(config).map_err(|e| launch(e.to_string()))?;
                if world.size() != size {
                    return Err(launch(format!(
                        "MPI's world has {} ranks but the configuration needs {size}",
                        world.size()
                    )));
                }
                return Ok(Ranks::Mpi(world));
            }
        }
        if let Some(rendezvous) = Rendezvous::from_env().map_err(|e| launch(e.to_string()))? {
            if rendezvous.world_size != size {
                return Err(launch(format!(
                    "WORLD_SIZE={} but the configuration needs {size} ranks (one process per rank)",
                    rendezvous.world_size
                )));
            }
            return TcpWorld::connect(&rendezvous, config)
                .map(Ranks::Tcp)
                .map_err(|e| {
                    // Each rank meets its own rendezvous failure: every rank prints it (the
                    // examples print rank 0's errors only, as those of the configuration are
                    // the same on every rank).
                    let message = format!("rank {} of the TCP launch: {e}", rendezvous.rank);
                    if rendezvous.rank != 0 {
                        log::error!("{message}");
                    }
                    launch(message)
                });
        }
        InProcessWorld::new(size, config)
            .map(Ranks::InProcess)
            .map_err(|e| launch(e.to_string()))
    }

    /// This process's rank on its node (the GPU it uses) when it is one rank of several
    /// processes; `None` for threads (they share the default device).
    pub fn local_rank(&self) -> Option<usize> {
        match self {
            Ranks::InProcess(_) => None,
            #[cfg(feature = "mpi")]
            Ranks::Mpi(_) => Some(
                LOCAL_RANK_VARIABLES
                    .iter()
                    .find_map(|v| std::env::var(v).ok()?.parse().ok())
                    .unwrap_or(0),
            ),
            Ranks::Tcp(world) => Some(world.local_rank()),
        }
    }

    /// Whether this process reports (prints, writes files): always in-process, rank 0 of
    /// several processes.
    pub fn is_leader(&self) -> bool {
        match self {
            Ranks::InProcess(_) => true,
            #[cfg(feature = "mpi")]
            Ranks::Mpi(world) => world.rank() == 0,
            Ranks::Tcp(world) => world.rank() == 0,
        }
    }

    /// Whether this process is one rank of several processes (MPI or TCP).
    pub fn is_distributed(&self) -> bool {
        !matches!(self, Ranks::InProcess(_))
    }

    /// With several processes, ends the job after a failure of this process outside a rank's
    /// task (loading its data, writing its files): prints `message` naming this rank and stops
    /// every rank (MPI: `MPI_Abort`; TCP: its peers fail naming it); never returns. With threads
    /// it does nothing (the caller reports the error).
    pub fn abort(&self, message: &str) {
        match self {
            Ranks::InProcess(_) => {}
            #[cfg(feature = "mpi")]
            Ranks::Mpi(world) => world.abort(message),
            Ranks::Tcp(world) => world.abort(message),
        }
    }

    /// How the ranks run, for the start line.
    pub fn describe(&self) -> String {
        match self {
            Ranks::InProcess(_) => "threads".into(),
            #[cfg(feature = "mpi")]
            Ranks::Mpi(world) => format!("{} MPI processes", world.size()),
            Ranks::Tcp(world) => format!("{} TCP processes", world.size()),
        }
    }

    /// Runs `task` on every rank this process holds and returns rank 0's result (`None` on the
    /// other processes of a job). A failure is an error naming the rank that failed first
    /// (in-process); with processes the failing rank prints its error and ends the job (MPI:
    /// `MPI_Abort`; TCP: its peers fail naming it, and every process exits non-zero).
    pub fn run<T: Send, E: std::fmt::Display>(
        &self,
        task: impl Fn(Comm) -> Result<T, E> + Sync,
    ) -> Result<Option<T>, TrainError> {
        match self {
            Ranks::InProcess(world) => {
                let results = world.run(task);
                if let Some(summary) = world.failure_summary(&results) {
                    return Err(TrainError::RankFailed(summary));
                }
                Ok(results.into_iter().next().and_then(Result::ok))
            }
            #[cfg(feature = "mpi")]
            Ranks::Mpi(world) => match unwound(world.rank(), || task(world.comm())) {
                Ok(value) => Ok((world.rank() == 0).then_some(value)),
                Err(error) => world.abort(&error),
            },
            Ranks::Tcp(world) => match unwound(world.rank(), || task(world.comm())) {
                Ok(value) => Ok((world.rank() == 0).then_some(value)),
                Err(error) => world.abort(&error),
            },
        }
    }
}

/// Runs rank `rank`'s task; a panic (a burn op cannot return an error, so a failed
/// context-parallel attention panics) becomes an error naming the rank, so the job ends
/// through the world's abort like any other failure.
fn unwound<T, E: std::fmt::Display>(
    rank: usize,
    task: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    let task = || task().map_err(|e| e.to_string());
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)).unwrap_or_else(|panic| {
        Err(format!(
            "rank {rank} panicked: {}",
            burn_dcp::comm::panic_message(panic.as_ref())
        ))
    })
}

/// The `log` facade's logger for programs without one of their own (the examples and tools call
/// it first): `env_logger` on stderr, its level and filters from `RUST_LOG` (default `warn`:
/// errors such as a rank aborting a job, and warnings), each line prefixed with the rank that
/// wrote it — `[rank 2] ERROR burn_dcp::…: …` — from the thread's name for in-process ranks
/// (`rank-N`) or the launcher's variables for one process per rank (MPI, Slurm, TCP). A program
/// that installed another logger keeps it.
pub fn init_logging() {
    let process_rank = PROCESS_RANK_VARIABLES
        .iter()
        .find_map(|name| std::env::var(name).ok());
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format(move |out, record| {
            let thread = std::thread::current();
            let rank = thread
                .name()
                .and_then(|name| name.strip_prefix("rank-"))
                .or(process_rank.as_deref());
            let prefix = rank.map(|r| format!("[rank {r}] ")).unwrap_or_default();
            writeln!(
                out,
                "{prefix}{} {}: {}",
                record.level(),
                record.target(),
                record.args()
            )
        })
        .try_init();
}

/// Where a launcher puts this process's rank: OpenMPI, PMIx (`srun --mpi=pmix`), PMI
/// (`srun --mpi=pmi2`, MPICH's hydra), Slurm, torchrun (the TCP world).
const PROCESS_RANK_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "RANK",
];

/// `--trace FILE`: the run's tracer and where it goes (one track per rank).
pub struct Tracing {
    path: PathBuf,
    tracer: std::sync::Arc<burn_dcp::diagnostics::trace::Tracer>,
}

impl Tracing {
    /// A tracer whose trace goes to `path`.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            tracer: burn_dcp::diagnostics::trace::Tracer::new(),
        }
    }

    /// Records the calling rank thread's steps on the track of `rank`.
    pub fn enter(&self, rank: usize) -> burn_dcp::diagnostics::trace::RankTrace {
        burn_dcp::diagnostics::trace::RankTrace::enter(&self.tracer, rank)
    }

    /// The file of `rank` when ranks are processes: FILE with `.rank<r>` before its extension.
    fn rank_path(&self, rank: usize) -> PathBuf {
        let stem = self.path.file_stem().unwrap_or_default().to_string_lossy();
        let name = match self.path.extension() {
            Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
            None => format!("{stem}.rank{rank}"),
        };
        self.path.with_file_name(name)
    }

    /// Ranks that are processes write their own file when they finish.
    pub fn write_rank(&self, ranks_are_processes: bool, rank: usize) -> Result<(), TrainError> {
        if !ranks_are_processes {
            return Ok(());
        }
        let path = self.rank_path(rank);
        self.tracer
            .write(&path)
            .map_err(|e| TrainError::Config(format!("--trace {}: {e}", path.display())))
    }

    /// Ranks that are threads share one file, written once they all finished.
    pub fn write_threads(&self, ranks: &Ranks) -> Result<(), TrainError> {
        if ranks.is_distributed() {
            return Ok(());
        }
        self.tracer
            .write(&self.path)
            .map_err(|e| TrainError::Config(format!("--trace {}: {e}", self.path.display())))
    }
}
