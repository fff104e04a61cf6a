//! NCCL communicator (cargo feature `cuda`): tensor data moves GPU to GPU with NCCL's grouped
//! `ncclSend`/`ncclRecv` (through cudarc 0.19, the crate burn-cuda itself uses); message headers
//! and host payloads travel over a *control* communicator of the same ranks (the MPI world under
//! `mpirun`, or the in-process world when ranks are threads).
//!
//! **Status: compiled in CI, never run.** This task has no GPU; nothing in this file has executed
//! on a device. The README says so too.
//!
//! **Why a control communicator.** A receive does not know its message's size, and NCCL needs it
//! before `ncclRecv`. Sending the header over NCCL itself would need a second, dependent NCCL
//! round on every receive, and a rank whose header send waits for its peer's receive while the
//! peer waits for this rank's data deadlocks. Headers over an eager host channel (MPI sends of a
//! few dozen bytes complete at once) have no such cycle: the receiver learns the size, allocates
//! the tensor in burn-cuda's memory, and launches the receive.
//!
//! **Data path.** A sent payload that is a burn-cuda tensor (`CubeTensor<CudaRuntime>`) is made
//! contiguous and sent from its own device memory; a received one is allocated with cubecl's
//! client (so it is an ordinary burn-cuda tensor) and written by NCCL. Posted sends, and the
//! receives of the link being waited on, are launched together in one
//! `ncclGroupStart`/`ncclGroupEnd` on this communicator's own CUDA stream, after cubecl's stream
//! is synchronised (the data is ready, and memory cubecl freed is no longer read by its kernels);
//! the wait polls `cuStreamQuery` and `ncclCommGetAsyncError` against the timeout and aborts the
//! NCCL communicator (`ncclCommAbort`) when it passes. Payloads of other backends and host bytes
//! go over the control communicator.
//!
//! **Same numbers as the other worlds.** Collectives are exchanges and sums are taken locally in
//! rank order with the same code (`common::all_reduce_by`, `sum_payloads`), so a run computes
//! what the in-process and MPI runs compute.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use burn::prelude::Backend;
use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use cudarc::driver::{sys as cuda_sys, CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use crate::comm::common::{check_timeout, frame, unframe, Accounting};
use crate::comm::transport::{Channel, Group, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingRecv, PendingSend, WorldConfig};

/// A burn-cuda float tensor.
pub type CudaTensor = CubeTensor<CudaRuntime>;

/// Turns a received tensor into a payload of the user's backend.
type Wrap = Arc<dyn Fn(CudaTensor) -> Payload + Send + Sync>;

/// A raw NCCL communicator handle.
struct RawNccl(nccl_sys::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread as long as calls on one communicator
// are not concurrent; every call on it is made under `NcclComm::launch`'s lock.
unsafe impl Send for RawNccl {}
unsafe impl Sync for RawNccl {}

/// The message header, sent over the control communicator.
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct Header {
    op: String,
    index: u64,
    dtype: DType,
    shape: Vec<usize>,
    /// Whether the data follows over NCCL (else it is appended to the header, host bytes).
    on_device: bool,
}

impl Header {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// One control message: the header, then the host bytes (none for data that follows over NCCL).
fn encode(header: &Header, host: &[u8]) -> Result<TensorData, String> {
    let message = frame(header, host)?;
    let len = message.len();
    Ok(TensorData::new(message, [len]))
}

fn decode(message: Vec<u8>) -> Result<(Header, Vec<u8>), String> {
    let (header, host): (Header, _) = unframe(message)?;
    let expected = if header.on_device { 0 } else { header.bytes() };
    if host.len() != expected {
        return Err(format!(
            "a {:?} {:?} message carries {} host bytes instead of {expected}",
            header.shape,
            header.dtype,
            host.len()
        ));
    }
    Ok((header, host))
}

fn nccl_error(what: &str, error: nccl::NcclError) -> String {
    format!("{what} failed: {:?}", error.0)
}

/// Runs `f`, which loads a CUDA library on first use: cudarc panics when the library is
/// missing, which becomes an error naming it.
fn loading<T>(library: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        format!(
            "{library} could not be loaded (NCCL needs an NVIDIA GPU with its driver and NCCL installed): {}",
            crate::comm::panic_message(panic.as_ref())
        )
    })
}

/// What the communicators of one process (or thread) share.
struct Shared {
    context: Arc<CudaContext>,
    device: CudaDevice,
    config: WorldConfig,
    wrap: Wrap,
    stats: Mutex<CommStats>,
    /// Set once an NCCL communicator was aborted: nothing more is launched.
    aborted: AtomicBool,
}

/// Builds NCCL communicators.
pub struct NcclWorld;

impl NcclWorld {
    /// The NCCL communicator of the ranks of `control` (one process or thread per rank, each
    /// with its own GPU `device`); received tensors become float tensors of `B` (burn-cuda's
    /// `CubeBackend<CudaRuntime, …>`). Rank 0 creates the NCCL unique id and sends it over
    /// `control`; every wait is bounded by `config.timeout`.
    pub fn init<B>(
        control: Comm,
        device: CudaDevice,
        config: WorldConfig,
    ) -> Result<Comm, CommError>
    where
        B: Backend<FloatTensorPrimitive = CudaTensor>,
    {
        let invalid = |message: String| CommError::Invalid {
            group: control.name().to_string(),
            message: format!("NCCL initialisation: {message}"),
        };
        check_timeout(control.name(), config.timeout)?;
        let context = loading("the CUDA driver (libcuda)", || {
            CudaContext::new(device.index)
        })
        .map_err(&invalid)?
        .map_err(|e| invalid(format!("CUDA device {}: {e:?}", device.index)))?;
        let id = match control.rank() {
            0 => loading("NCCL (libnccl)", nccl::get_uniqueid)
                .map_err(&invalid)?
                .map_err(|e| invalid(nccl_error("ncclGetUniqueId", e)))?
                .internal
                .iter()
                .map(|&c| c as u8)
                .collect(),
            _ => Vec::new(),
        };
        // Every rank arrives here (with the control world's deadline) before the blocking init.
        let ids = control.all_gather_control("NCCL unique id", id)?;
        let id = ids[0].clone();
        if id.len() != 128 {
            return Err(invalid(format!(
                "rank 0 sent an NCCL id of {} bytes instead of 128",
                id.len()
            )));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (slot, byte) in internal.iter_mut().zip(&id) {
            *slot = *byte as std::ffi::c_char;
        }
        context
            .bind_to_thread()
            .map_err(|e| invalid(format!("{e:?}")))?;
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is written by NCCL; the id is the one every rank received.
        let raw = unsafe {
            nccl::comm_init_rank(
                raw.as_mut_ptr(),
                control.size() as c_int,
                nccl_sys::ncclUniqueId { internal },
                control.rank() as c_int,
            )
            .map_err(|e| invalid(nccl_error("ncclCommInitRank", e)))?;
            raw.assume_init()
        };
        let shared = Arc::new(Shared {
            context,
            device,
            config,
            wrap: Arc::new(|tensor| Payload::from_float::<B>(tensor)),
            stats: Mutex::new(CommStats::default()),
            aborted: AtomicBool::new(false),
        });
        let name = control.name().to_string();
        NcclComm::create(shared, control, RawNccl(raw), name, Arc::from(""))
    }
}

/// A send posted and not yet completed.
struct Outgoing {
    peer: usize,
    /// Keeps the tensor's memory alive until NCCL has read it.
    tensor: CudaTensor,
    bytes: usize,
    done: Arc<Mutex<Option<Result<(), CommError>>>>,
}

/// A receive posted on one link: its header arrives over the control communicator.
struct Incoming {
    header: Mutex<Option<PendingRecv>>,
    op: String,
    index: u64,
    slot: Mutex<Option<Result<Payload, CommError>>>,
}

#[derive(Default)]
struct Queues {
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
    shared: Arc<Shared>,
    control: Comm,
    raw: RawNccl,
    stream: Arc<CudaStream>,
    group: Group,
    queues: Mutex<Queues>,
    /// Held while NCCL calls are launched and waited for.
    launch: Mutex<()>,
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
    fn create(
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

    fn invalid(&self, message: String) -> CommError {
        self.group.invalid(message)
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The payload as a contiguous burn-cuda tensor, when it is one.
    fn cuda_tensor(data: &Payload) -> Option<CudaTensor> {
        let tensor = data.device_any()?.downcast_ref::<CudaTensor>()?.clone();
        let tensor = into_contiguous(tensor);
        (tensor.is_contiguous() && tensor.is_contiguous_buffer()).then_some(tensor)
    }

    /// Posts a message to `peer`: its header (and host bytes) over the control communicator,
    /// its device data queued for the next launch.
    fn queue_send(
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
            None => data
                .into_host()
                .map_err(|e| self.invalid(format!("{op}: {e}")))?
                .into_bytes()
                .to_vec(),
        };
        let message = encode(&header, &host).map_err(|e| self.invalid(format!("{op}: {e}")))?;
        let control = self.control.isend(peer, message.into())?;
        let shared = &self.shared;
        (self.group).count(&shared.stats, &shared.config, accounting, peer, bytes);
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
    fn post_incoming(&self, peer: usize, op: &str) -> Result<Arc<Incoming>, CommError> {
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
    fn receive(&self, targets: &[(usize, Arc<Incoming>)]) -> Result<Vec<Payload>, CommError> {
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
    fn handle(&self) -> Arc<NcclComm> {
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
            .map_err(|e| self.invalid(e))?
            .into_vec::<u8>()
            .map_err(|e| self.invalid(format!("{e:?}")))?;
        let (header, host) = decode(message).map_err(|e| self.protocol(peer, incoming, e))?;
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

/// A posted receive, with the communicator that launches it.
pub(crate) struct NcclRecv {
    comm: Arc<NcclComm>,
    peer: usize,
    incoming: Arc<Incoming>,
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
        _channel: Channel,
        data: Payload,
        op: &str,
        accounting: Accounting,
    ) -> Result<PendingSend, CommError> {
        self.queue_send(peer, data, op, accounting)
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
        receives
            .into_iter()
            .map(|r| {
                r.comm
                    .receive(&[(r.peer, r.incoming)])
                    .map(|mut d| d.remove(0))
            })
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_wrong_sizes() {
        let header = Header {
            op: "all-to-all".into(),
            index: 7,
            dtype: DType::F32,
            shape: vec![2, 3],
            on_device: false,
        };
        let host: Vec<u8> = (0..24).collect();
        let message = encode(&header, &host).unwrap().into_vec::<u8>().unwrap();
        let (decoded, bytes) = decode(message.clone()).unwrap();
        assert_eq!(decoded, header);
        assert_eq!(bytes, host);
        let short = message[..message.len() - 1].to_vec();
        let error = decode(short).unwrap_err();
        assert!(error.contains("23 host bytes instead of 24"), "{error}");
        let device = Header {
            on_device: true,
            ..header
        };
        let message = encode(&device, &[]).unwrap().into_vec::<u8>().unwrap();
        assert_eq!(decode(message).unwrap(), (device, Vec::new()));
        assert!(decode(vec![1, 0]).is_err());
    }
}
