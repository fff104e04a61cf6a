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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;

    type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

    /// Without a GPU (or without NCCL), initialisation is an error naming what is missing — not a
    /// panic inside cudarc. Runs everywhere; on a GPU machine it checks nothing and says so.
    #[test]
    fn without_cuda_init_is_a_clear_error() {
        // libcuda where the loader finds it: its cache, the usual directories, LD_LIBRARY_PATH.
        let in_cache = std::process::Command::new("ldconfig")
            .arg("-p")
            .output()
            .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("libcuda.so"));
        let library_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let cuda_present = in_cache
            || [
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib64",
                "/usr/local/nvidia/lib64",
            ]
            .into_iter()
            .chain(library_path.split(':'))
            .filter(|dir| !dir.is_empty())
            .any(|dir| std::path::Path::new(dir).join("libcuda.so.1").exists());
        if cuda_present {
            eprintln!("libcuda is installed: this check only applies to machines without it");
            return;
        }
        let control = InProcessWorld::new(1, WorldConfig::default()).unwrap();
        let results = control.run(|control| -> Result<(), String> {
            let error =
                NcclWorld::init::<Cuda>(control, CudaDevice { index: 0 }, WorldConfig::default())
                    .err()
                    .ok_or("initialisation succeeded without CUDA")?
                    .to_string();
            assert!(
                error.contains("libcuda") && error.contains("could not be loaded"),
                "{error}"
            );
            Ok(())
        });
        results.into_iter().for_each(|r| r.unwrap());
    }
}
