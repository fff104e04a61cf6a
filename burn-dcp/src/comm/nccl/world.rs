//! The NCCL world: a communicator initialised over a control communicator, the headers its
//! messages carry over that control communicator.

use std::ffi::c_int;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use burn::prelude::Backend;
use cubecl::cuda::CudaDevice;
use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::comm::NcclComm;
pub use super::state::CudaTensor;
use super::state::{loading, nccl_error, RawNccl, Shared};
use crate::comm::common::check_timeout;
use crate::comm::{Comm, CommError, CommStats, Payload, WorldConfig};

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
