//! Naming a stalled rank in an MPI job. Every rank answers stall queries whenever it polls (every
//! wait of the process polls, [`Shared::progress`]) on a communicator of their own, duplicated
//! from the world at start so no data message can match them: what it waits for, and what it
//! last received ([`Status`]). A rank whose wait times out asks the rank it waited for, then the
//! rank that one waits for, and so on; the first that waits for nothing — or does not answer
//! within the answer time: stopped, hung, or busy outside communication — made no progress.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::state::{mpi_lock, receive_arrived, Backoff, Shared};
use crate::comm::stall::{confirmed, follow_waits, Found, Status};

/// A query: "what are you doing?" (its body: the asker's query number, 8 bytes).
const QUERY_TAG: c_int = 1;
/// An answer: the JSON `(query number, Status)`.
const ANSWER_TAG: c_int = 2;

impl Shared {
    /// Under `MPI_LOCK`: answers every query that has arrived with this rank's status.
    pub(super) fn answer_queries(&self) {
        let comm = self.status_comm.0;
        // SAFETY: reading MPI's constant for "any source".
        let any = unsafe { ffi::RSMPI_ANY_SOURCE };
        while let Some(Ok((source, query))) = receive_arrived(comm, any, QUERY_TAG) {
            let Ok(query) = <[u8; 8]>::try_from(query.as_slice()) else {
                continue;
            };
            let mine = self
                .status
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let Ok(answer) = serde_json::to_vec(&(u64::from_le_bytes(query), mine)) else {
                return;
            };
            // SAFETY: a send of a local buffer on the live status communicator, under
            // MPI_LOCK (MPI_Send returns once its buffer may be reused).
            unsafe {
                ffi::MPI_Send(
                    answer.as_ptr() as *const c_void,
                    answer.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    source,
                    ANSWER_TAG,
                    comm,
                );
            }
        }
    }

    /// What global rank `peer` says it is doing, or `None` when it does not answer within
    /// `answer` (answering the queries of others meanwhile).
    fn ask(&self, peer: usize, answer: Duration) -> Option<Status> {
        let comm = self.status_comm.0;
        let query = self.queries.fetch_add(1, Ordering::SeqCst).to_le_bytes();
        {
            let _mpi = mpi_lock();
            // SAFETY: a send of a local buffer on the live status communicator, under MPI_LOCK.
            let code = unsafe {
                ffi::MPI_Send(
                    query.as_ptr() as *const c_void,
                    8,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    QUERY_TAG,
                    comm,
                )
            };
            if code != 0 {
                return None;
            }
        }
        let deadline = Instant::now() + answer;
        let mut backoff = Backoff(0);
        while Instant::now() < deadline {
            if self.closed.load(Ordering::SeqCst) {
                return None;
            }
            {
                let _mpi = mpi_lock();
                self.answer_queries();
                if let Some(status) = self.take_answer(peer, query) {
                    return Some(status);
                }
            }
            backoff.pause();
        }
        None
    }

    /// Under `MPI_LOCK`: the answer of `peer` to `query`, if it has arrived (older answers,
    /// to queries that timed out, are read and dropped).
    fn take_answer(&self, peer: usize, query: [u8; 8]) -> Option<Status> {
        let comm = self.status_comm.0;
        loop {
            let (_, answer) = receive_arrived(comm, peer as c_int, ANSWER_TAG)?.ok()?;
            if let Ok((number, status)) = serde_json::from_slice::<(u64, Status)>(&answer) {
                if number == u64::from_le_bytes(query) {
                    return Some(status);
                }
            }
        }
    }

    /// Who made no progress when this rank timed out waiting for global rank `sender`: the end
    /// of the chain of waits from `sender` (see [`follow_waits`]; a cycle is asked twice,
    /// [`confirmed`]).
    pub(super) fn stalled(&self, sender: usize, answer: Duration) -> Found {
        let look = || follow_waits(self.rank, sender, |rank| self.ask(rank, answer));
        confirmed(look(), look)
    }

    /// Records that this rank waits for `what` from global rank `peer` (`None`: no longer).
    pub(super) fn set_waiting(&self, waiting: Option<(usize, String)>) {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting = waiting;
    }

    /// Records a message received: no longer waiting, and what it last received.
    pub(super) fn received(&self, what: String) {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        status.waiting = None;
        status.last = Some(what);
    }
}
