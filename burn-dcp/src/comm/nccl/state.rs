//! What the NCCL communicators of a process share: the CUDA context and device, the world's
//! settings and counters ([`Shared`]), the raw communicator handle, and the host side of a
//! message (its header, framed with the bytes of a host tensor).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use burn::tensor::{DType, TensorData};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use crate::comm::common::{frame, unframe, WireError};
use crate::comm::nodes::NodeMap;
use crate::comm::{CommError, CommStats, Payload, WorldConfig};

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
