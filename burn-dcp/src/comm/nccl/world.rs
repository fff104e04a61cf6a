//! The NCCL world: a communicator initialised over a control communicator, the headers its
//! messages carry over that control communicator.

use std::ffi::c_int;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use burn::prelude::Backend;
use burn::tensor::{DType, TensorData};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::comm::NcclComm;
use crate::comm::common::{check_timeout, frame, unframe, WireError};
use crate::comm::{Comm, CommError, CommStats, Payload, WorldConfig};
use crate::nodes::NodeMap;

/// A burn-cuda float tensor.
pub type CudaTensor = CubeTensor<CudaRuntime>;

/// Turns a received tensor into a payload of the user's backend.
pub(super) type Wrap = Arc<dyn Fn(CudaTensor) -> Payload + Send + Sync>;

/// A raw NCCL communicator handle.
pub(super) struct RawNccl(pub(super) nccl_sys::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread as long as calls on one communicator
// are not concurrent; every call on it is made under `NcclComm::launch`'s lock.
unsafe impl Send for RawNccl {}
// SAFETY: as `Send`: calls through a shared reference are serialised by the same lock.
unsafe impl Sync for RawNccl {}

/// The message header, sent over the control communicator.
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
pub(super) struct Header {
    pub(super) op: String,
    pub(super) index: u64,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    /// Whether the data follows over NCCL (else it is appended to the header, host bytes).
    pub(super) on_device: bool,
}

impl Header {
    pub(super) fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// One control message: the header, then the host bytes (none for data that follows over NCCL).
pub(super) fn encode(header: &Header, host: &[u8]) -> Result<TensorData, WireError> {
    let message = frame(header, host)?;
    let len = message.len();
    Ok(TensorData::new(message, [len]))
}

pub(super) fn decode(message: Vec<u8>) -> Result<(Header, Vec<u8>), WireError> {
    let (header, host): (Header, _) = unframe(message)?;
    let expected = if header.on_device { 0 } else { header.bytes() };
    if host.len() != expected {
        return Err(WireError::HostBytes {
            shape: header.shape.clone(),
            dtype: header.dtype,
            bytes: host.len(),
            expected,
        });
    }
    Ok((header, host))
}

pub(super) fn nccl_error(what: &str, error: nccl::NcclError) -> String {
    format!("{what} failed: {:?}", error.0)
}

/// Runs `f`, which loads a CUDA library on first use: cudarc panics when the library is
/// missing, which becomes an error naming it.
pub(super) fn loading<T>(
    invalid: &dyn Fn(String) -> CommError,
    library: &str,
    f: impl FnOnce() -> T,
) -> Result<T, CommError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        invalid(format!(
            "{library} could not be loaded (NCCL needs an NVIDIA GPU with its driver and NCCL installed): {}",
            crate::comm::panic_message(panic.as_ref())
        ))
    })
}

/// What the communicators of one process (or thread) share.
pub(super) struct Shared {
    pub(super) context: Arc<CudaContext>,
    pub(super) device: CudaDevice,
    pub(super) config: WorldConfig,
    pub(super) nodes: NodeMap,
    pub(super) wrap: Wrap,
    pub(super) stats: Mutex<CommStats>,
    /// Set once an NCCL communicator was aborted: nothing more is launched.
    pub(super) aborted: AtomicBool,
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
        let context = loading(&invalid, "the CUDA driver (libcuda)", || {
            CudaContext::new(device.index)
        })?
        .map_err(|e| invalid(format!("CUDA device {}: {e:?}", device.index)))?;
        let id = match control.rank() {
            0 => loading(&invalid, "NCCL (libnccl)", nccl::get_uniqueid)?
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
        let nodes = config.nodes(control.size())?;
        let shared = Arc::new(Shared {
            context,
            device,
            config,
            nodes,
            wrap: Arc::new(|tensor| Payload::from_float::<B>(tensor)),
            stats: Mutex::new(CommStats::default()),
            aborted: AtomicBool::new(false),
        });
        let name = control.name().to_string();
        NcclComm::create(shared, control, RawNccl(raw), name, Arc::from(""))
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
        let error = error.to_string();
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
