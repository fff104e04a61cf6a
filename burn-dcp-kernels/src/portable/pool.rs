//! The portable kernels' threads: one persistent pool per process (rayon), and one budget.
//!
//! A kernel call splits its work items over `threads()` workers. By default the ranks of this
//! process share its cores: `cores / ranks` where `ranks` counts the CP ranks this process runs
//! as threads right now ([`RankThreads`]; 1 when none registered, e.g. one rank per process under
//! MPI/TCP). `BURN_DCP_CPU_THREADS` overrides it. Workers run on a pool built once (as many
//! threads as cores), not on threads spawned per call; with one worker the call runs on the
//! caller's thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::definition::KernelError;

/// The environment variable that sets the portable kernels' threads per call (default: this
/// process's cores shared among its ranks).
pub const THREADS_VAR: &str = "BURN_DCP_CPU_THREADS";

/// CP ranks this process runs as threads now (see [`RankThreads`]).
static RANK_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Registers `ranks` ranks running as threads of this process while it lives, so that the
/// kernels' default thread count shares the cores among them. The in-process world holds one
/// while its ranks run; several worlds at once add up.
#[must_use = "the ranks count only while the guard lives"]
pub struct RankThreads {
    ranks: usize,
}

impl RankThreads {
    pub fn enter(ranks: usize) -> Self {
        RANK_THREADS.fetch_add(ranks, Ordering::SeqCst);
        Self { ranks }
    }

    /// Ranks registered now, in all guards of the process.
    pub fn current() -> usize {
        RANK_THREADS.load(Ordering::SeqCst)
    }
}

impl Drop for RankThreads {
    fn drop(&mut self) {
        RANK_THREADS.fetch_sub(self.ranks, Ordering::SeqCst);
    }
}

/// The cores of this machine (as the OS reports them to this process).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads per kernel call: `BURN_DCP_CPU_THREADS` when set (a positive integer, else an error
/// naming the value), else the cores shared among the ranks running as threads
/// (`max(1, cores / ranks)`).
pub fn threads() -> Result<usize, KernelError> {
    match std::env::var(THREADS_VAR) {
        Ok(value) => match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(KernelError::InvalidValue(format!(
                "{THREADS_VAR}={value:?}: the portable kernels' thread count must be a positive \
                 integer"
            ))),
        },
        Err(_) => Ok((cores() / RankThreads::current().max(1)).max(1)),
    }
}

/// The process's pool: as many threads as cores, built on first use.
fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores())
            .thread_name(|i| format!("burn-dcp-kernels-{i}"))
            .build()
            .expect("the kernels' thread pool could not start")
    })
}

/// Runs `task(i)` for `i in 0..count` on `threads` workers of the pool (worker `w` takes items
/// `w, w + threads, …`, so the split does not depend on timing), results in item order.
pub(super) fn parallel_map<T: Send>(
    threads: usize,
    count: usize,
    task: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let workers = threads.min(count).max(1);
    if workers == 1 {
        return (0..count).map(task).collect();
    }
    let task = &task;
    // Workers charge what they allocate to the rank they work for (`crate::memory`).
    let tag = crate::memory::tag();
    let mut slots: Vec<Vec<(usize, T)>> = (0..workers).map(|_| Vec::new()).collect();
    pool().scope(|scope| {
        for (w, slot) in slots.iter_mut().enumerate() {
            scope.spawn(move |_| {
                let _tag = crate::memory::TagGuard::set(tag);
                *slot = (w..count).step_by(workers).map(|i| (i, task(i))).collect();
            });
        }
    });
    let mut results: Vec<(usize, T)> = slots.into_iter().flatten().collect();
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}
