//! A group of NCCL ranks: posted sends and receives, launched together in NCCL groups on the
//! communicator's own stream and waited for against the timeout.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use burn::tensor::{Shape, TensorData};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::Runtime;
use cudarc::driver::{sys as cuda_sys, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::state::{decode, encode, nccl_error, CudaTensor, Header, RawNccl, Shared};
use crate::comm::common::Accounting;
use crate::comm::transport::Group;
use crate::comm::{Comm, CommError, Payload, PendingRecv, PendingSend};

/// A send posted and not yet completed.
pub(super) struct Outgoing {
    peer: usize,
    /// Keeps the tensor's memory alive until NCCL has read it.
    tensor: CudaTensor,
    bytes: usize,
    done: Arc<Mutex<Option<Result<(), CommError>>>>,
}

/// A receive posted on one link: its header arrives over the control communicator.
pub(super) struct Incoming {
    header: Mutex<Option<PendingRecv>>,
    op: String,
    index: u64,
    slot: Mutex<Option<Result<Payload, CommError>>>,
}

#[derive(Default)]
pub(super) struct Queues {
    sends: Vec<Outgoing>,
    /// Per peer, receives in the order they were posted (NCCL matches them in that order).
    receives: Vec<VecDeque<Arc<Incoming>>>,
    /// Per peer: messages sent and receives posted (the envelope index).
    sent: Vec<u64>,
    posted: Vec<u64>,
}

/// A group of NCCL ranks as seen by one of them.
pub struct NcclComm {
    /// This communicator, for the closures of its pending operations.
    me: Weak<NcclComm>,
    pub(super) shared: Arc<Shared>,
    pub(super) control: Comm,
    pub(super) raw: RawNccl,
    stream: Arc<CudaStream>,
    pub(super) group: Group,
    queues: Mutex<Queues>,
    /// Held while NCCL calls are launched and waited for.
    pub(super) launch: Mutex<()>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("group", &self.group)
            .field("device", &self.shared.device.index)
            .finish()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: this handle owns the communicator; abort after a failure (pending operations
        // may never complete), else destroy (waits for operations in flight).
        unsafe {
            let _ = match self.shared.aborted.load(Ordering::SeqCst) {
                true => nccl::comm_abort(self.raw.0),
                false => nccl::comm_destroy(self.raw.0),
            };
        }
    }
}

impl NcclComm {
    pub(super) fn create(
        shared: Arc<Shared>,
        control: Comm,
        raw: RawNccl,
        name: String,
        label: Arc<str>,
    ) -> Result<Comm, CommError> {
        let size = control.size();
        let members = (0..size).map(|rank| control.global_rank(rank)).collect();
        let group = Group::new(name, label, members, control.rank());
        let stream = shared
            .context
            .new_stream()
            .map_err(|e| CommError::Invalid {
                group: group.name.clone(),
                message: format!("creating the NCCL stream: {e:?}"),
            })?;
        Ok(Arc::new_cyclic(|me| NcclComm {
            me: me.clone(),
            shared,
            control,
            raw,
            stream,
            group,
            queues: Mutex::new(Queues {
                sends: Vec::new(),
                receives: vec![VecDeque::new(); size],
                sent: vec![0; size],
                posted: vec![0; size],
            }),
            launch: Mutex::new(()),
        }))
    }

    pub(super) fn invalid(&self, message: String) -> CommError {
        self.group.invalid(message)
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The payload as a contiguous burn-cuda tensor, when it is one.
    fn cuda_tensor(data: &Payload) -> Option<CudaTensor> {
        let tensor = data.device_any()?.downcast_ref::<CudaTensor>()?.clone();
        let tensor = into_contiguous(tensor);
        // Row-major from the handle's used start (the device pointer includes its offset); the
        // handle may be longer than the data (cubecl rounds allocations), which NCCL never
        // reads: it sends the data's bytes.
        let bytes = tensor.meta.shape().num_elements() * tensor.dtype.size();
        (tensor.is_contiguous() && tensor.handle.size_in_used() as usize >= bytes).then_some(tensor)
    }

    /// Posts a message to `peer`: its header (and host bytes) over the control communicator,
    /// its device data queued for the next launch.
    pub(super) fn queue_send(
        &self,
        peer: usize,
        data: Payload,
        op: &str,
        accounting: Accounting,
    ) -> Result<PendingSend, CommError> {
        let index = {
            let mut queues = self.queues();
            queues.sent[peer] += 1;
            queues.sent[peer] - 1
        };
        let (shape, dtype) = (data.shape(), data.dtype());
        let bytes = data.num_bytes();
        let tensor = Self::cuda_tensor(&data).filter(|_| bytes > 0);
        let header = Header {
            op: op.to_string(),
            index,
            dtype,
            shape,
            on_device: tensor.is_some(),
        };
        let host = match tensor {
            Some(_) => Vec::new(),
            None => self.group.host(data, op)?.into_bytes().to_vec(),
        };
        let message = encode(&header, &host).map_err(|e| self.invalid(format!("{op}: {e}")))?;
        let control = self.control.isend(peer, message.into())?;
        let shared = &self.shared;
        (self.group).count(&shared.stats, &shared.nodes, accounting, peer, bytes);
        let done = Arc::new(Mutex::new(None));
        match tensor {
            Some(tensor) => self.queues().sends.push(Outgoing {
                peer,
                tensor,
                bytes: bytes as usize,
                done: done.clone(),
            }),
            None => *done.lock().unwrap_or_else(|p| p.into_inner()) = Some(Ok(())),
        }
        let comm = self.handle();
        let op = op.to_string();
        Ok(PendingSend::new(move || {
            let finished = |done: &Mutex<Option<Result<(), CommError>>>| {
                done.lock().unwrap_or_else(|p| p.into_inner()).take()
            };
            let result = match finished(&done) {
                Some(result) => result,
                None => {
                    comm.launch_for(&[])?;
                    finished(&done).unwrap_or_else(|| {
                        Err(comm.invalid(format!("{op}: the send to rank {peer} was not launched")))
                    })
                }
            };
            result?;
            control.wait()
        }))
    }

    /// Registers a receive from `peer` (its header's control receive is posted now).
    pub(super) fn post_incoming(&self, peer: usize, op: &str) -> Result<Arc<Incoming>, CommError> {
        let header = self.control.irecv(peer)?;
        let mut queues = self.queues();
        let index = queues.posted[peer];
        queues.posted[peer] += 1;
        let incoming = Arc::new(Incoming {
            header: Mutex::new(Some(header)),
            op: op.to_string(),
            index,
            slot: Mutex::new(None),
        });
        queues.receives[peer].push_back(incoming.clone());
        Ok(incoming)
    }

    /// Waits for posted receives: the ones not yet received are launched together (with every
    /// queued send) in one NCCL group.
    pub(super) fn receive(
        &self,
        targets: &[(usize, Arc<Incoming>)],
    ) -> Result<Vec<Payload>, CommError> {
        let take = |incoming: &Incoming| {
            incoming
                .slot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
        };
        let mut results: Vec<Option<Result<Payload, CommError>>> =
            targets.iter().map(|(_, incoming)| take(incoming)).collect();
        let pending: Vec<(usize, Arc<Incoming>)> = targets
            .iter()
            .zip(&results)
            .filter(|(_, result)| result.is_none())
            .map(|(target, _)| target.clone())
            .collect();
        if !pending.is_empty() {
            self.launch_for(&pending)?;
        }
        targets
            .iter()
            .zip(results.iter_mut())
            .map(|((peer, incoming), result)| {
                result.take().or_else(|| take(incoming)).unwrap_or_else(|| {
                    Err(self.invalid(format!(
                        "{} message #{} from rank {peer} was not received",
                        incoming.op, incoming.index
                    )))
                })
            })
            .collect()
    }

    /// This communicator, kept alive by the pending operations that need it.
    pub(super) fn handle(&self) -> Arc<NcclComm> {
        self.me.upgrade().expect("a communicator in use is alive")
    }

    /// Launches every queued send, and the receives from `peer` up to and including `until`
    /// (their headers are awaited first, in posting order), in one NCCL group, then waits.
    fn launch_for(&self, targets: &[(usize, Arc<Incoming>)]) -> Result<(), CommError> {
        let _launch = self.launch.lock().unwrap_or_else(|p| p.into_inner());
        // Headers of the receives to launch: for each target, its link's receives up to it
        // (NCCL matches a link's receives in posting order). Headers travel eagerly over the
        // control communicator, so waiting for them depends on no NCCL operation.
        let mut receives: Vec<(usize, Arc<Incoming>, Header, CudaTensor)> = Vec::new();
        for (peer, until) in targets {
            let (peer, until) = (*peer, until);
            // Another wait may have launched it meanwhile.
            let queued = self.queues().receives[peer]
                .iter()
                .any(|queued| Arc::ptr_eq(queued, until));
            if !queued {
                continue;
            }
            loop {
                let front = self.queues().receives[peer].pop_front();
                let Some(incoming) = front else { break };
                let last = Arc::ptr_eq(&incoming, until);
                match self.take_header(peer, &incoming) {
                    Err(error) => self.fill(&incoming, Err(error)),
                    Ok((header, host)) if !header.on_device => {
                        let data =
                            TensorData::from_bytes_vec(host, header.shape.clone(), header.dtype);
                        self.fill(&incoming, Ok(Payload::Host(data)));
                    }
                    Ok((header, _)) => {
                        let tensor = self.allocate(&header);
                        receives.push((peer, incoming.clone(), header, tensor));
                    }
                }
                if last {
                    break;
                }
            }
        }
        let sends = std::mem::take(&mut self.queues().sends);
        if sends.is_empty() && receives.is_empty() {
            return Ok(());
        }
        let result = self.run_group(&sends, &receives);
        for send in &sends {
            *send.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(result.clone());
        }
        for (_, incoming, _, tensor) in receives {
            let outcome = result.clone().map(|()| (self.shared.wrap)(tensor));
            self.fill(&incoming, outcome);
        }
        result
    }

    /// Waits for a receive's header (over the control communicator), decodes it and checks its
    /// envelope.
    fn take_header(
        &self,
        peer: usize,
        incoming: &Incoming,
    ) -> Result<(Header, Vec<u8>), CommError> {
        let header = incoming
            .header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| self.invalid("a receive was launched twice".into()))?;
        let message = header
            .wait()?
            .into_host()
            .map_err(|e| self.invalid(e.to_string()))?
            .into_vec::<u8>()
            .map_err(|e| self.invalid(format!("{e:?}")))?;
        let (header, host) =
            decode(message).map_err(|e| self.protocol(peer, incoming, e.to_string()))?;
        if header.op != incoming.op || header.index != incoming.index {
            let message = format!(
                "expected {} message #{}, got {} message #{}",
                incoming.op, incoming.index, header.op, header.index
            );
            return Err(self.protocol(peer, incoming, message));
        }
        Ok((header, host))
    }

    fn fill(&self, incoming: &Incoming, result: Result<Payload, CommError>) {
        *incoming.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
    }

    fn protocol(&self, peer: usize, incoming: &Incoming, message: String) -> CommError {
        CommError::Protocol {
            group: self.group.name.clone(),
            rank: self.group.rank,
            peer_global: self.group.members[peer],
            message: format!("{} message #{}: {message}", incoming.op, incoming.index),
        }
    }

    /// A burn-cuda tensor for a received message, in cubecl's memory.
    fn allocate(&self, header: &Header) -> CudaTensor {
        let client = CudaRuntime::client(&self.shared.device);
        let handle = client.empty(header.bytes());
        CubeTensor::new_contiguous(
            client,
            self.shared.device.clone(),
            Shape::from(header.shape.clone()),
            handle,
            header.dtype,
        )
    }

    /// One NCCL group of `sends` and `receives` on this communicator's stream, waited for.
    fn run_group(
        &self,
        sends: &[Outgoing],
        receives: &[(usize, Arc<Incoming>, Header, CudaTensor)],
    ) -> Result<(), CommError> {
        if self.shared.aborted.load(Ordering::SeqCst) {
            return Err(self.invalid("the NCCL communicator was aborted after a failure".into()));
        }
        let failed = |what: String| self.invalid(what);
        // cubecl's queue first: the data sent is written, and memory cubecl reused for the
        // receive buffers is no longer read by its kernels.
        let client = CudaRuntime::client(&self.shared.device);
        cubecl::future::block_on(client.sync())
            .map_err(|e| failed(format!("synchronising cubecl's stream: {e:?}")))?;
        self.shared
            .context
            .bind_to_thread()
            .map_err(|e| failed(format!("{e:?}")))?;
        let pointer = |tensor: &CudaTensor| {
            client
                .get_resource(tensor.handle.clone())
                .map(|resource| resource.resource().ptr)
                .map_err(|e| failed(format!("the device pointer of a tensor: {e:?}")))
        };
        let stream = self.stream.cu_stream() as nccl_sys::cudaStream_t;
        nccl::group_start().map_err(|e| failed(nccl_error("ncclGroupStart", e)))?;
        let mut launched = Ok(());
        for send in sends {
            let ptr = pointer(&send.tensor)?;
            // SAFETY: `ptr` is the device memory of a live, contiguous tensor of `bytes` bytes.
            let status = unsafe {
                nccl::send(
                    ptr as *const c_void,
                    send.bytes,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    send.peer as c_int,
                    self.raw.0,
                    stream,
                )
            };
            if let Err(e) = status {
                launched = Err(failed(nccl_error(
                    &format!("ncclSend to rank {}", send.peer),
                    e,
                )));
                break;
            }
        }
        for (peer, _, header, tensor) in receives {
            if launched.is_err() {
                break;
            }
            let ptr = pointer(tensor)?;
            // SAFETY: `ptr` is the device memory of a fresh tensor of `header.bytes()` bytes.
            let status = unsafe {
                nccl::recv(
                    ptr as *mut c_void,
                    header.bytes(),
                    nccl_sys::ncclDataType_t::ncclUint8,
                    *peer as c_int,
                    self.raw.0,
                    stream,
                )
            };
            if let Err(e) = status {
                launched = Err(failed(nccl_error(&format!("ncclRecv from rank {peer}"), e)));
            }
        }
        nccl::group_end().map_err(|e| failed(nccl_error("ncclGroupEnd", e)))?;
        launched?;
        let peers: Vec<usize> = sends
            .iter()
            .map(|s| s.peer)
            .chain(receives.iter().map(|r| r.0))
            .collect();
        self.wait_stream(&peers)
    }

    /// Polls the stream and NCCL's asynchronous error until done or the timeout passes.
    fn wait_stream(&self, peers: &[usize]) -> Result<(), CommError> {
        let started = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: a live stream of this communicator's context.
            let status = unsafe { cuda_sys::cuStreamQuery(self.stream.cu_stream()) };
            match status {
                cuda_sys::cudaError_enum::CUDA_SUCCESS => return Ok(()),
                cuda_sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.abort_nccl(format!("the NCCL stream failed: {other:?}"))),
            }
            let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; NCCL writes the result.
            unsafe { nccl_sys::ncclCommGetAsyncError(self.raw.0, &mut async_error) };
            if !matches!(
                async_error,
                nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
            ) {
                return Err(self.abort_nccl(format!("NCCL reported {async_error:?}")));
            }
            if started.elapsed() >= self.shared.config.timeout {
                let peer = peers.first().copied().unwrap_or(self.control.rank());
                self.abort_nccl(String::new());
                return Err(CommError::Timeout {
                    group: self.group.name.clone(),
                    rank: self.group.rank,
                    peer,
                    peer_global: self.control.global_rank(peer),
                    op: format!("NCCL send/recv with ranks {peers:?}"),
                    waited: self.shared.config.timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Aborts the NCCL communicator (its operations will never complete).
    fn abort_nccl(&self, message: String) -> CommError {
        self.shared.aborted.store(true, Ordering::SeqCst);
        self.invalid(message)
    }
}
