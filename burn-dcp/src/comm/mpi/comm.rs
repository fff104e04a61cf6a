//! A group of MPI processes: the [`Transport`] of the MPI world.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use mpi::ffi;

use super::messages::{encode, RecvHandle, SendHandle};
use super::state::{abort_job, mpi_lock, Posted, RawComm, Shared};
use crate::comm::collectives::agree_split;
use crate::comm::transport::{Channel, Group, LinkCounters, Traffic, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend};

/// A group of MPI processes as seen by one of them.
pub struct MpiComm {
    shared: Arc<Shared>,
    comm: RawComm,
    /// Whether this handle owns `comm` (split groups are freed on drop; the world is not).
    owned: bool,
    group: Group,
    /// Per peer and channel: messages sent, receives posted.
    sent: LinkCounters,
    received: LinkCounters,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MpiComm").field(&self.group).finish()
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.owned && !self.shared.closed.load(Ordering::SeqCst) {
            let _mpi = mpi_lock();
            // SAFETY: this handle owns the split communicator; OpenMPI frees it once pending
            // operations complete.
            unsafe {
                ffi::MPI_Comm_free(&mut self.comm.0);
            }
        }
    }
}
impl MpiComm {
    pub(super) fn create(shared: &Arc<Shared>, comm: RawComm, owned: bool, group: Group) -> Comm {
        let size = group.size();
        Arc::new(MpiComm {
            shared: shared.clone(),
            comm,
            owned,
            group,
            sent: LinkCounters::new(size),
            received: LinkCounters::new(size),
        })
    }

    fn tag(&self, seq: u64, channel: Channel) -> c_int {
        ((seq % self.shared.seq_bound) * Channel::COUNT as u64 + channel.index() as u64) as c_int
    }
}

impl Transport for MpiComm {
    type Recv = RecvHandle;
    const HOST_BYTES: bool = true;

    fn group(&self) -> &Group {
        &self.group
    }

    fn begin(&self, op: &str) -> Result<(), CommError> {
        match self.shared.closed.load(Ordering::SeqCst) {
            true => Err(self
                .group
                .invalid(format!("{op}: the MPI job is shutting down"))),
            false => Ok(()),
        }
    }

    fn post_send(
        &self,
        peer: usize,
        data: Payload,
        traffic: Traffic<'_>,
    ) -> Result<PendingSend, CommError> {
        let Traffic {
            channel,
            op,
            accounting,
        } = traffic;
        self.begin(op)?;
        let group = &self.group;
        // MPI moves host bytes: a device tensor is read back once, here.
        let data = group.host(data, op)?;
        let index = self.sent.next(peer, channel);
        let buffer = encode(op, index, &data).map_err(|e| group.invalid(format!("{op}: {e}")))?;
        let count = c_int::try_from(buffer.len()).map_err(|_| {
            group.invalid(format!(
                "{op}: a message of {} bytes exceeds MPI's limit of {} bytes per message",
                buffer.len(),
                c_int::MAX
            ))
        })?;
        // SAFETY: reads a constant the MPI bindings define.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        let code = {
            let _mpi = mpi_lock();
            // SAFETY: the buffer lives in the handle until the request completes (or leaks).
            unsafe {
                ffi::MPI_Isend(
                    buffer.as_ptr() as *const c_void,
                    count,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    self.tag(index, channel),
                    self.comm.0,
                    &mut request,
                )
            }
        };
        if code != 0 {
            return Err(group.invalid(format!(
                "{op}: MPI_Isend to rank {peer} failed with error code {code}"
            )));
        }
        let bytes = data.as_bytes().len() as u64;
        group.count(
            &self.shared.stats,
            &self.shared.nodes,
            accounting,
            peer,
            bytes,
        );
        let send = SendHandle {
            shared: self.shared.clone(),
            request,
            buffer: Some(buffer),
            group: group.name.clone(),
            rank: group.rank,
            peer,
            peer_global: group.members[peer],
            op: op.to_string(),
        };
        Ok(PendingSend::new(move || send.wait()))
    }

    fn post_recv(&self, peer: usize, channel: Channel, op: &str) -> Result<RecvHandle, CommError> {
        self.begin(op)?;
        let index = self.received.next(peer, channel);
        let posted = Arc::new(Posted {
            comm: self.comm,
            source: peer as c_int,
            tag: self.tag(index, channel),
            slot: Mutex::new(None),
        });
        self.shared
            .posted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(posted.clone());
        Ok(RecvHandle {
            shared: self.shared.clone(),
            posted,
            group: self.group.name.clone(),
            rank: self.group.rank,
            peer,
            peer_global: self.group.members[peer],
            op: op.to_string(),
            index,
        })
    }

    fn split_group(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        let (Ok(mpi_color), Ok(mpi_key)) = (c_int::try_from(color), c_int::try_from(key)) else {
            return Err(self.group.invalid(format!(
                "split: color {color} and key {key} must fit MPI's non-negative int"
            )));
        };
        // Everyone arrives (with a deadline) before the blocking MPI_Comm_split.
        let group = agree_split(self, color, key, label)?;
        self.begin("split")?;
        // SAFETY: reads a constant the MPI bindings define.
        let mut comm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        let code = {
            let _mpi = mpi_lock();
            // SAFETY: a collective every member has entered (the agreement above).
            unsafe {
                let code = ffi::MPI_Comm_split(self.comm.0, mpi_color, mpi_key, &mut comm);
                if code == 0 {
                    ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
                }
                code
            }
        };
        if code != 0 {
            return Err(self.group.invalid(format!(
                "split: MPI_Comm_split failed with error code {code}"
            )));
        }
        Ok(MpiComm::create(&self.shared, RawComm(comm), true, group))
    }

    fn counters(&self) -> &Mutex<CommStats> {
        &self.shared.stats
    }

    /// Aborts the whole job (`MPI_Abort`) after printing the reason: every rank stops.
    fn fail(&self, reason: &str) {
        abort_job(self.shared.rank, reason)
    }
}
