//! The [`Transport`] of the NCCL world.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::comm::{Incoming, NcclComm};
use super::state::{nccl_error, RawNccl};
use crate::comm::transport::{Channel, Group, Received, Traffic, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend};

/// A posted receive, with the communicator that launches it.
pub(crate) struct NcclRecv {
    comm: Arc<NcclComm>,
    peer: usize,
    incoming: Arc<Incoming>,
}

impl Received for NcclRecv {
    fn wait(self) -> Result<Payload, CommError> {
        let received = self.comm.receive(&[(self.peer, self.incoming)])?;
        Ok(received
            .into_iter()
            .next()
            .expect("one receive, one payload"))
    }
}

impl Transport for NcclComm {
    type Recv = NcclRecv;
    const HOST_BYTES: bool = false;

    fn group(&self) -> &Group {
        &self.group
    }

    /// Failures surface from the control communicator and the launch.
    fn begin(&self, _op: &str) -> Result<(), CommError> {
        Ok(())
    }

    fn post_send(
        &self,
        peer: usize,
        data: Payload,
        traffic: Traffic<'_>,
    ) -> Result<PendingSend, CommError> {
        self.queue_send(peer, data, traffic.op, traffic.accounting)
    }

    /// Registers the receive; its header is taken in when it is waited for.
    fn post_recv(&self, peer: usize, _channel: Channel, op: &str) -> Result<NcclRecv, CommError> {
        let incoming = self.post_incoming(peer, op)?;
        Ok(NcclRecv {
            comm: self.handle(),
            peer,
            incoming,
        })
    }

    /// Every receive of one communicator in one group launch with its queued sends: waiting
    /// peer by peer would chain groups into a cycle (rank 1's group waits for rank 2's second
    /// group, which waits for rank 2's first, which waits for rank 1's second).
    fn wait(receives: Vec<NcclRecv>) -> Result<Vec<Payload>, CommError> {
        let Some(comm) = receives.first().map(|r| r.comm.clone()) else {
            return Ok(Vec::new());
        };
        if receives.iter().all(|r| Arc::ptr_eq(&r.comm, &comm)) {
            let targets: Vec<_> = receives.into_iter().map(|r| (r.peer, r.incoming)).collect();
            return comm.receive(&targets);
        }
        receives.into_iter().map(Received::wait).collect()
    }

    /// Barriers and agreements travel on the control communicator.
    fn control(&self) -> Option<&Comm> {
        Some(&self.control)
    }

    fn split_group(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        let (Ok(nccl_color), Ok(nccl_key)) = (c_int::try_from(color), c_int::try_from(key)) else {
            return Err(self.invalid(format!(
                "split: color {color} and key {key} must fit NCCL's non-negative int"
            )));
        };
        // The control split first: every member arrives (with a deadline) before NCCL's
        // blocking ncclCommSplit, and it gives the new ranks (ordered by key, then old rank,
        // as NCCL orders them).
        let control = self.control.split_labeled(color, key, label)?;
        let _launch = self.launch.lock().unwrap_or_else(|p| p.into_inner());
        self.shared
            .context
            .bind_to_thread()
            .map_err(|e| self.invalid(format!("{e:?}")))?;
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: a collective over this communicator that every member enters (above).
        let raw = unsafe {
            // (cudarc's safe wrapper is compiled only for CUDA 12.2–12.5; the binding is not.)
            nccl_sys::ncclCommSplit(
                self.raw.0,
                nccl_color,
                nccl_key,
                raw.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
            .map_err(|e| self.invalid(nccl_error("split: ncclCommSplit", e)))?;
            raw.assume_init()
        };
        // SAFETY: a live communicator.
        let nccl_rank = unsafe { nccl::comm_user_rank(raw) }
            .map_err(|e| self.invalid(nccl_error("split: ncclCommUserRank", e)))?;
        if nccl_rank as usize != control.rank() {
            // SAFETY: the communicator just created, unused.
            unsafe {
                let _ = nccl::comm_abort(raw);
            }
            return Err(self.invalid(format!(
                "split: NCCL placed this rank at {nccl_rank}, the control group at {}",
                control.rank()
            )));
        }
        let name = self.group.split_name(color);
        NcclComm::create(
            self.shared.clone(),
            control,
            RawNccl(raw),
            name,
            Arc::from(label),
        )
    }

    fn counters(&self) -> &Mutex<CommStats> {
        &self.shared.stats
    }

    fn fail(&self, reason: &str) {
        self.shared.aborted.store(true, Ordering::SeqCst);
        self.control.abort(reason)
    }
}
