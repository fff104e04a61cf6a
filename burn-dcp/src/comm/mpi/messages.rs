//! MPI messages: the header every message carries, and the handles of posted sends and
//! receives (waited for without blocking in MPI).

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use mpi::ffi;

use super::state::{mpi_lock, Backoff, Posted, Shared};
use crate::comm::common::{check_envelope, frame, host_data, unframe, WireError};
use crate::comm::stall::stall_reason;
use crate::comm::transport::Received;
use crate::comm::{CommError, Payload};

/// The serialised message header: what the receiver checks, and how to rebuild the tensor.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct Header {
    op: String,
    index: u64,
    dtype: DType,
    shape: Vec<usize>,
}

pub(super) fn encode(op: &str, index: u64, data: &TensorData) -> Result<Vec<u8>, WireError> {
    let header = Header {
        op: op.to_string(),
        index,
        dtype: data.dtype,
        shape: data.shape.as_slice().to_vec(),
    };
    frame(&header, data.as_bytes())
}

pub(super) fn decode(message: Vec<u8>) -> Result<(Header, TensorData), WireError> {
    let (header, payload): (Header, _) = unframe(message)?;
    let data = host_data(header.shape.clone(), header.dtype, payload)?;
    Ok((header, data))
}

/// A send in flight: the request, and the buffer MPI reads until it completes.
pub(crate) struct SendHandle {
    pub(super) shared: Arc<Shared>,
    pub(super) request: ffi::MPI_Request,
    pub(super) buffer: Option<Vec<u8>>,
    pub(super) group: String,
    pub(super) rank: usize,
    pub(super) peer: usize,
    pub(super) peer_global: usize,
    pub(super) op: String,
}

// SAFETY: the request is only tested under MPI_LOCK; the buffer is owned.
unsafe impl Send for SendHandle {}

impl SendHandle {
    pub(super) fn wait(mut self) -> Result<(), CommError> {
        let started = Instant::now();
        let mut backoff = Backoff(0);
        let mut waiting = false;
        loop {
            if self.shared.closed.load(Ordering::SeqCst) {
                return Err(self.closed());
            }
            let (code, done) = {
                let _mpi = mpi_lock();
                let mut flag: c_int = 0;
                // SAFETY: a live request of this handle, under MPI_LOCK.
                let code = unsafe {
                    ffi::MPI_Test(&mut self.request, &mut flag, ffi::RSMPI_STATUS_IGNORE)
                };
                (code, flag != 0)
            };
            if code != 0 {
                return Err(self.failed(format!("MPI_Test failed with error code {code}")));
            }
            if done {
                self.buffer = None;
                if waiting {
                    self.shared.set_waiting(None);
                }
                return Ok(());
            }
            if !waiting {
                // Not done at once: blocked on the peer's receive (a rendezvous send).
                let what = format!("its receive of {} (our send)", self.op);
                self.shared.set_waiting(Some((self.peer_global, what)));
                waiting = true;
            }
            self.shared.progress();
            if started.elapsed() >= self.shared.config.timeout {
                return Err(CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global: self.peer_global,
                    op: format!("{} (its receive of our send)", self.op),
                    waited: self.shared.config.timeout,
                });
            }
            backoff.pause();
        }
    }

    fn failed(&self, message: String) -> CommError {
        CommError::Invalid {
            group: self.group.clone(),
            message: format!(
                "rank {} sending {} to rank {}: {message}",
                self.rank, self.op, self.peer
            ),
        }
    }

    fn closed(&self) -> CommError {
        self.failed("the MPI job is shutting down".into())
    }
}

impl Drop for SendHandle {
    fn drop(&mut self) {
        // A send dropped before it completed: MPI may still read the buffer, so leak it.
        if let Some(buffer) = self.buffer.take() {
            std::mem::forget(buffer);
        }
    }
}

/// A posted receive.
pub(crate) struct RecvHandle {
    pub(super) shared: Arc<Shared>,
    pub(super) posted: Arc<Posted>,
    pub(super) group: String,
    pub(super) rank: usize,
    pub(super) peer: usize,
    pub(super) peer_global: usize,
    pub(super) op: String,
    pub(super) index: u64,
}

impl Received for RecvHandle {
    fn wait(self) -> Result<Payload, CommError> {
        let started = Instant::now();
        let mut backoff = Backoff(0);
        let what = format!(
            "{} message #{} of group '{}'",
            self.op, self.index, self.group
        );
        self.shared
            .set_waiting(Some((self.peer_global, what.clone())));
        loop {
            if let Some(message) = self.posted.take() {
                return self.arrived(message, what);
            }
            if self.shared.closed.load(Ordering::SeqCst) {
                self.shared.set_waiting(None);
                return Err(self.protocol("the MPI job is shutting down".into()));
            }
            self.shared.progress();
            if let Some(message) = self.posted.take() {
                return self.arrived(message, what);
            }
            if started.elapsed() >= self.shared.config.timeout {
                self.shared.unpost(&self.posted);
                let timeout = CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global: self.peer_global,
                    op: self.op.clone(),
                    waited: self.shared.config.timeout,
                };
                // Still recorded as waiting while it asks: a peer asking it meanwhile must see
                // that it waits, not take it for the stalled rank.
                let error = self.name_the_stalled(timeout, &what);
                self.shared.set_waiting(None);
                return Err(error);
            }
            backoff.pause();
        }
    }
}

impl RecvHandle {
    fn arrived(
        &self,
        message: Result<Vec<u8>, WireError>,
        what: String,
    ) -> Result<Payload, CommError> {
        self.shared
            .received(format!("{what} from global rank {}", self.peer_global));
        self.open(message)
    }

    /// After a timeout: the rank that made no progress (the end of the chain of waits from the
    /// peer waited for, asked rank by rank: `Shared::stalled`). The timeout itself when that is
    /// the peer (the timeout names it) or this rank; else a failure naming the stalled rank
    /// first, which the program's abort prints for the whole job.
    fn name_the_stalled(&self, timeout: CommError, what: &str) -> CommError {
        let shared = &self.shared;
        let (me, sender) = (shared.rank, self.peer_global);
        let waited = shared.config.timeout;
        let answer = waited.min(Duration::from_secs(2));
        let found = shared.stalled(sender, answer);
        match stall_reason(found, me, sender, what, &timeout, waited) {
            Some((stalled, reason)) if stalled != sender => CommError::PeerFailed {
                group: self.group.clone(),
                rank: self.rank,
                failed_global: stalled,
                reason,
                op: self.op.clone(),
            },
            _ => timeout,
        }
    }

    fn protocol(&self, message: String) -> CommError {
        CommError::Protocol {
            group: self.group.clone(),
            rank: self.rank,
            peer_global: self.peer_global,
            message,
        }
    }

    fn open(&self, message: Result<Vec<u8>, WireError>) -> Result<Payload, CommError> {
        let (header, data) = message
            .and_then(decode)
            .map_err(|e| self.protocol(format!("{} message #{}: {e}", self.op, self.index)))?;
        check_envelope((&self.op, self.index), (&header.op, header.index))
            .map_err(|mismatch| self.protocol(mismatch.to_string()))?;
        Ok(Payload::Host(data))
    }
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        self.shared.unpost(&self.posted);
    }
}
