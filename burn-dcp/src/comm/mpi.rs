//! MPI communicator (cargo feature `mpi`): one process per rank, over the system MPI (OpenMPI
//! or MPICH, through the `mpi` crate's raw bindings).
//!
//! Launch with `mpirun -n P program …` (or Slurm's `srun --mpi=pmix`); [`MpiWorld::launched`]
//! tells from the launcher's environment whether this process is one of several ranks.
//!
//! **Same results as the in-process world.** Every operation moves the same messages as
//! [`InProcessComm`](super::in_process) does: collectives are point-to-point exchanges, and
//! sums (reduce-scatter, all-reduce) are taken locally in rank order with the same code. A run
//! under `mpirun` therefore computes bit for bit what the in-process run computes, and counts the
//! same bytes ([`CommStats`]).
//!
//! **Nothing waits forever.** Only non-blocking MPI calls are used (`MPI_Isend`, `MPI_Improbe`,
//! `MPI_Test`), polled against the world's timeout. A wait that times out fails with
//! [`CommError::Timeout`] naming the peer; the program then aborts the job (`MPI_Abort`, see
//! [`MpiWorld::abort`]), which makes the launcher kill every rank.
//!
//! **Receives are posted, sends may be rendezvous.** A message's size is not known before it
//! arrives, so a posted receive is a registered (source, tag) that the process matches with
//! `MPI_Improbe` + `MPI_Mrecv` *whenever it waits on anything* — a send, a receive or a
//! collective. A rank waiting on its send to a peer therefore still takes in the messages its
//! own posted receives expect, so two ranks that post their receives, then their sends, then
//! wait, never deadlock, whatever the MPI's eager limit.
//!
//! **Matching.** Every message of a (group, sender, receiver, channel) link carries a tag made
//! of its sequence number on the link, and an envelope (operation, index) the receiver checks,
//! as the in-process world does: the n-th receive posted gets the n-th message sent, whatever
//! order receives are waited in.
//!
//! **Threads.** MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it (at
//! least `MPI_THREAD_SERIALIZED` is required); every MPI call of the process is made under one
//! lock, and no call blocks while holding it except `MPI_Comm_split`, made only after every
//! member has been seen to arrive (a control exchange with a deadline).

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use mpi::ffi;

use crate::comm::collectives::agree_split;
use crate::comm::common::{check_nodes, check_timeout, frame, unframe, Accounting};
use crate::comm::transport::{check_envelope, Channel, Group, Transport};
use crate::comm::{Comm, CommError, CommStats, Payload, PendingSend, WorldConfig};

/// Environment variables set by MPI launchers for each rank they start: OpenMPI's `mpirun`,
/// PMIx (`srun --mpi=pmix`, OpenMPI 5), PMI-1/2 (MPICH's hydra, `srun --mpi=pmi2`), MVAPICH.
pub const LAUNCHER_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MV2_COMM_WORLD_SIZE",
];

/// Every MPI call of the process is made under this lock (see the module docs).
static MPI_LOCK: Mutex<()> = Mutex::new(());
/// The process's world, once initialised (MPI can be initialised once per process).
static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();

fn mpi_lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A raw MPI communicator handle (a pointer under OpenMPI), used only under [`MPI_LOCK`].
#[derive(Clone, Copy)]
struct RawComm(ffi::MPI_Comm);
// SAFETY: the handle is only passed to MPI calls made under `MPI_LOCK`, with the library
// initialised for at least `MPI_THREAD_SERIALIZED`.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// What every communicator of the process shares: this process is one rank.
struct Shared {
    config: WorldConfig,
    rank: usize,
    size: usize,
    stats: Mutex<CommStats>,
    /// Receives posted and not yet matched, matched by [`Shared::progress`].
    posted: Mutex<Vec<Arc<Posted>>>,
    /// Sequence numbers wrap at this bound (tags are `seq % bound * Channel::COUNT + channel`).
    seq_bound: u64,
    /// Set once the job is being aborted or MPI finalised: no further MPI calls.
    closed: AtomicBool,
}

impl Shared {
    /// Matches every posted receive whose message has arrived (`MPI_Improbe` + `MPI_Mrecv`).
    fn progress(&self) {
        let mut posted = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        if posted.is_empty() || self.closed.load(Ordering::SeqCst) {
            return;
        }
        let _mpi = mpi_lock();
        posted.retain(|p| !p.try_match());
    }

    fn unpost(&self, which: &Arc<Posted>) {
        let mut posted = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        posted.retain(|p| !Arc::ptr_eq(p, which));
    }
}

/// A receive posted on (communicator, source, tag); `slot` holds the message once matched.
struct Posted {
    comm: RawComm,
    source: c_int,
    tag: c_int,
    slot: Mutex<Option<Result<Vec<u8>, String>>>,
}

impl Posted {
    /// Under `MPI_LOCK`: takes the message in if it has arrived; whether it did.
    fn try_match(&self) -> bool {
        let mut flag: c_int = 0;
        // SAFETY: plain MPI calls on a live communicator, under MPI_LOCK; the status and message
        // are written by MPI.
        unsafe {
            let mut message: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
            let mut status: ffi::MPI_Status = std::mem::zeroed();
            let code = ffi::MPI_Improbe(
                self.source,
                self.tag,
                self.comm.0,
                &mut flag,
                &mut message,
                &mut status,
            );
            let result = if code != 0 {
                Some(Err(format!("MPI_Improbe failed with error code {code}")))
            } else if flag == 0 {
                None
            } else {
                let mut count: c_int = 0;
                ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count);
                let mut buffer = vec![0u8; count.max(0) as usize];
                let code = ffi::MPI_Mrecv(
                    buffer.as_mut_ptr() as *mut c_void,
                    count,
                    ffi::RSMPI_UINT8_T,
                    &mut message,
                    ffi::RSMPI_STATUS_IGNORE,
                );
                Some(match code {
                    0 => Ok(buffer),
                    _ => Err(format!("MPI_Mrecv failed with error code {code}")),
                })
            };
            match result {
                Some(result) => {
                    *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
                    true
                }
                None => false,
            }
        }
    }

    fn take(&self) -> Option<Result<Vec<u8>, String>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Polls with a short spin, then sleeps growing to 1 ms (ranks may outnumber cores).
struct Backoff(u32);

impl Backoff {
    fn pause(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let micros = (self.0 as u64 - 63).min(50) * 20;
            std::thread::sleep(Duration::from_micros(micros));
        }
    }
}

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
        let (rank, size, seq_bound) = unsafe {
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
            )
        };
        if let Err(error) = check_nodes(size, &config) {
            // SAFETY: initialised above; nothing else uses MPI yet.
            unsafe { ffi::MPI_Finalize() };
            return Err(error);
        }
        let shared = Arc::new(Shared {
            config,
            rank,
            size,
            stats: Mutex::new(CommStats::default()),
            posted: Mutex::new(Vec::new()),
            seq_bound,
            closed: AtomicBool::new(false),
        });
        let _ = SHARED.set(shared.clone());
        let group = Group::new("world".into(), Arc::from(""), (0..size).collect(), rank);
        let world = MpiComm::create(
            &shared,
            RawComm(unsafe { ffi::RSMPI_COMM_WORLD }),
            false,
            group,
        );
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

/// Prints `message` for world rank `rank` and aborts the job; never returns.
fn abort_job(rank: usize, message: &str) -> ! {
    log::error!("rank {rank} aborts the MPI job: {message}");
    if let Some(shared) = SHARED.get() {
        shared.closed.store(true, Ordering::SeqCst);
    }
    // The lock is not taken: another thread may hold it in a poll, and the job ends anyway.
    // SAFETY: MPI_Abort on the world communicator of an initialised MPI.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
    }
    std::process::exit(1)
}

/// A group of MPI processes as seen by one of them.
pub struct MpiComm {
    shared: Arc<Shared>,
    comm: RawComm,
    /// Whether this handle owns `comm` (split groups are freed on drop; the world is not).
    owned: bool,
    group: Group,
    /// Per peer and channel: messages sent, receives posted.
    sent: Mutex<Vec<[u64; Channel::COUNT]>>,
    received: Mutex<Vec<[u64; Channel::COUNT]>>,
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

/// The serialised message header: what the receiver checks, and how to rebuild the tensor.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    op: String,
    index: u64,
    dtype: DType,
    shape: Vec<usize>,
}

fn encode(op: &str, index: u64, data: &TensorData) -> Result<Vec<u8>, String> {
    let header = Header {
        op: op.to_string(),
        index,
        dtype: data.dtype,
        shape: data.shape.as_slice().to_vec(),
    };
    frame(&header, data.as_bytes())
}

fn decode(message: Vec<u8>) -> Result<(Header, TensorData), String> {
    let (header, payload): (Header, _) = unframe(message)?;
    let expected = header.shape.iter().product::<usize>() * header.dtype.size();
    if payload.len() != expected {
        return Err(format!(
            "a {:?} {:?} message with {} bytes instead of {expected}",
            header.shape,
            header.dtype,
            payload.len()
        ));
    }
    let data = TensorData::from_bytes_vec(payload, header.shape.clone(), header.dtype);
    Ok((header, data))
}

/// A send in flight: the request, and the buffer MPI reads until it completes.
pub(crate) struct SendHandle {
    shared: Arc<Shared>,
    request: ffi::MPI_Request,
    buffer: Option<Vec<u8>>,
    group: String,
    rank: usize,
    peer: usize,
    peer_global: usize,
    op: String,
}

// SAFETY: the request is only tested under MPI_LOCK; the buffer is owned.
unsafe impl Send for SendHandle {}

impl SendHandle {
    fn wait(mut self) -> Result<(), CommError> {
        let started = Instant::now();
        let mut backoff = Backoff(0);
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
                return Ok(());
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
    shared: Arc<Shared>,
    posted: Arc<Posted>,
    group: String,
    rank: usize,
    peer: usize,
    peer_global: usize,
    op: String,
    index: u64,
}

impl RecvHandle {
    fn wait(self) -> Result<Payload, CommError> {
        let started = Instant::now();
        let mut backoff = Backoff(0);
        loop {
            if let Some(message) = self.posted.take() {
                return self.open(message);
            }
            if self.shared.closed.load(Ordering::SeqCst) {
                return Err(self.protocol("the MPI job is shutting down".into()));
            }
            self.shared.progress();
            if let Some(message) = self.posted.take() {
                return self.open(message);
            }
            if started.elapsed() >= self.shared.config.timeout {
                self.shared.unpost(&self.posted);
                return Err(CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: self.peer,
                    peer_global: self.peer_global,
                    op: self.op.clone(),
                    waited: self.shared.config.timeout,
                });
            }
            backoff.pause();
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

    fn open(&self, message: Result<Vec<u8>, String>) -> Result<Payload, CommError> {
        let (header, data) = message
            .and_then(decode)
            .map_err(|e| self.protocol(format!("{} message #{}: {e}", self.op, self.index)))?;
        check_envelope((&self.op, self.index), (&header.op, header.index))
            .map_err(|message| self.protocol(message))?;
        Ok(Payload::Host(data))
    }
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        self.shared.unpost(&self.posted);
    }
}

impl MpiComm {
    fn create(shared: &Arc<Shared>, comm: RawComm, owned: bool, group: Group) -> Comm {
        let size = group.size();
        Arc::new(MpiComm {
            shared: shared.clone(),
            comm,
            owned,
            group,
            sent: Mutex::new(vec![[0; Channel::COUNT]; size]),
            received: Mutex::new(vec![[0; Channel::COUNT]; size]),
        })
    }

    fn tag(&self, seq: u64, channel: Channel) -> c_int {
        ((seq % self.shared.seq_bound) * Channel::COUNT as u64 + channel.index() as u64) as c_int
    }

    fn next(counters: &Mutex<Vec<[u64; Channel::COUNT]>>, peer: usize, channel: Channel) -> u64 {
        let mut counters = counters.lock().unwrap_or_else(|p| p.into_inner());
        counters[peer][channel.index()] += 1;
        counters[peer][channel.index()] - 1
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
        channel: Channel,
        data: Payload,
        op: &str,
        accounting: Accounting,
    ) -> Result<PendingSend, CommError> {
        self.begin(op)?;
        let group = &self.group;
        // MPI moves host bytes: a device tensor is read back once, here.
        let data = data
            .into_host()
            .map_err(|e| group.invalid(format!("{op}: {e}")))?;
        let index = Self::next(&self.sent, peer, channel);
        let buffer = encode(op, index, &data).map_err(|e| group.invalid(format!("{op}: {e}")))?;
        let count = c_int::try_from(buffer.len()).map_err(|_| {
            group.invalid(format!(
                "{op}: a message of {} bytes exceeds MPI's limit of {} bytes per message",
                buffer.len(),
                c_int::MAX
            ))
        })?;
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
            &self.shared.config,
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
        let index = Self::next(&self.received, peer, channel);
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

    fn wait(receives: Vec<RecvHandle>) -> Result<Vec<Payload>, CommError> {
        receives.into_iter().map(RecvHandle::wait).collect()
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
