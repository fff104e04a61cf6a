//! A world of in-process ranks, and running one task per rank on threads.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};

use super::comm::InProcessComm;
use super::failure::RankFailure;
use super::state::{
    install_panic_hook, InjectedExit, World, WorldConfig, WorldState, EXITING, MAX_IN_PROCESS_RANKS,
};
use crate::comm::common::check_timeout;
use crate::comm::links::{LinkClock, LinkEmulation};
use crate::comm::transport::Group;
use crate::comm::{panic_message, Comm, CommError, CommStats, Fault};

/// A world of in-process ranks. Create it, then run one closure per rank with [`Self::run`]
/// (or hand out [`Self::communicators`] to threads of your own).
pub struct InProcessWorld {
    world: Arc<World>,
    size: usize,
}

impl InProcessWorld {
    /// A world of `size` ranks (1 to [`MAX_IN_PROCESS_RANKS`]) whose waits time out after
    /// `config.timeout` (more than zero, at most [`MAX_TIMEOUT`](super::MAX_TIMEOUT)).
    pub fn new(size: usize, config: WorldConfig) -> Result<Self, CommError> {
        let invalid = |message: String| {
            Err(CommError::Invalid {
                group: "world".into(),
                message,
            })
        };
        if size == 0 || size > MAX_IN_PROCESS_RANKS {
            return invalid(format!(
                "an in-process world has 1 to {MAX_IN_PROCESS_RANKS} ranks (one thread each), got {size}"
            ));
        }
        check_timeout("world", config.timeout)?;
        let nodes = config.nodes(size)?;
        install_panic_hook();
        let state = WorldState {
            calls: vec![0; size],
            ..WorldState::default()
        };
        let world = World {
            config,
            nodes,
            state: Mutex::new(state),
            wake: (0..size).map(|_| Condvar::new()).collect(),
            stats: (0..size)
                .map(|_| Mutex::new(CommStats::default()))
                .collect(),
        };
        Ok(Self {
            world: Arc::new(world),
            size,
        })
    }

    /// Emulates links from now on (see [`links`](crate::comm::links)): every message between two ranks is
    /// received no earlier than it would arrive over its link (intra-node or inter-node, by the
    /// world's `ranks_per_node`). Bytes and results are unchanged.
    pub fn emulate_links(&self, links: LinkEmulation) -> Result<(), CommError> {
        links.validate()?;
        self.world.lock().clock = Some(LinkClock::new(links, self.world.nodes));
        Ok(())
    }

    /// One communicator per rank over the whole world.
    pub fn communicators(&self) -> Vec<Comm> {
        let members: Arc<[usize]> = (0..self.size).collect();
        (0..self.size)
            .map(|rank| {
                let group = Group::new("world".into(), Arc::from(""), members.clone(), rank);
                InProcessComm::open(&self.world, group)
            })
            .collect()
    }

    /// Runs `task(comm)` on one thread per rank and returns each rank's result, in rank order.
    /// While they run, the portable kernels' default threads per call are this process's cores
    /// shared among its ranks ([`burn_dcp_kernels::portable::RankThreads`]).
    /// A rank that errors or panics is marked failed, so its peers error out instead of hanging;
    /// a rank that returns is marked finished, so peers waiting on it fail at once. A failed
    /// rank's result is a [`RankFailure`] naming it ("rank 1 returned an error: …").
    pub fn run<T, E, F>(&self, task: F) -> Vec<Result<T, RankFailure>>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Comm) -> Result<T, E> + Sync,
    {
        self.world.lock().finished.clear();
        let task = &task;
        // The portable kernels share this process's cores among the ranks while they run.
        let _cores = burn_dcp_kernels::portable::RankThreads::enter(self.size);
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .communicators()
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let world = self.world.clone();
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            // What the rank allocates is its own (`burn_dcp_kernels::memory`).
                            let _tag = burn_dcp_kernels::memory::TagGuard::set(Some(rank));
                            run_rank(&world, rank, comm, task)
                        })
                        .map_err(|error| {
                            let what = format!("could not be started: {error}");
                            failed(&self.world, RankFailure::thread(rank, what))
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, handle)| {
                    handle?.join().unwrap_or_else(|_| {
                        let what = "thread could not be joined".to_string();
                        Err(RankFailure::thread(rank, what))
                    })
                })
                .collect()
        })
    }

    /// Bytes sent by each world rank so far.
    pub fn stats(&self) -> Vec<CommStats> {
        self.world
            .stats
            .iter()
            .map(|s| s.lock().map(|s| s.clone()).unwrap_or_default())
            .collect()
    }

    /// Adds faults to inject (tests of failure behaviour; see [`Fault`]).
    pub fn inject_faults(&self, faults: impl IntoIterator<Item = Fault>) {
        self.world.lock().faults.extend(faults);
    }

    /// Communication calls each world rank has made so far (the clock of [`Fault::at_call`]).
    pub fn calls(&self) -> Vec<u64> {
        self.world.lock().calls.clone()
    }

    /// The rank that failed first and its reason, if any rank failed.
    pub fn first_failure(&self) -> Option<(usize, String)> {
        let state = self.world.lock();
        state
            .first_failure()
            .map(|(rank, failure)| (rank, failure.reason.clone()))
    }

    /// One message for a run whose ranks returned `results`: the rank that failed first with its
    /// reason, then the ranks that failed after it. `None` when every rank succeeded.
    pub fn failure_summary<T, E: fmt::Display>(&self, results: &[Result<T, E>]) -> Option<String> {
        let failed: Vec<usize> = (0..results.len())
            .filter(|&r| results[r].is_err())
            .collect();
        if failed.is_empty() {
            return None;
        }
        let Some((first, reason)) = self.first_failure() else {
            let rank = failed[0];
            return results[rank].as_ref().err().map(|e| e.to_string());
        };
        let others: Vec<String> = failed
            .iter()
            .filter(|&&r| r != first)
            .map(|r| r.to_string())
            .collect();
        let mut summary = format!("global rank {first} failed first: {reason}");
        if !others.is_empty() {
            summary.push_str(&format!(
                " (then rank(s) {} failed because of it)",
                others.join(", ")
            ));
        }
        Some(summary)
    }
}

/// One rank's thread body: runs the task and records how it ended.
pub(super) fn run_rank<T, E: fmt::Display>(
    world: &World,
    rank: usize,
    comm: Comm,
    task: &(impl Fn(Comm) -> Result<T, E> + Sync),
) -> Result<T, RankFailure> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(comm)));
    EXITING.with(|exiting| exiting.set(false));
    match outcome {
        Ok(Ok(value)) => {
            world.mark_finished(rank);
            Ok(value)
        }
        Ok(Err(error)) => Err(failed(world, RankFailure::error(rank, error))),
        Err(payload) if payload.is::<InjectedExit>() => {
            world.mark_finished(rank);
            Err(RankFailure::exit(rank))
        }
        Err(payload) => {
            let failure = RankFailure::panic(rank, panic_message(&*payload));
            Err(failed(world, failure))
        }
    }
}

/// Records `failure` as its rank's in the world (what its peers' errors will name) and returns it.
fn failed(world: &World, failure: RankFailure) -> RankFailure {
    world.mark_failed(failure.rank(), failure.to_string());
    failure
}
