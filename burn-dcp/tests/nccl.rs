//! The NCCL communicator on a real GPU (feature `gpu-tests`, opt-in: `cargo test -p burn-dcp
//! --features gpu-tests --test nccl -- --ignored`, or `scripts/gpu_check.sh`). Never built in CI
//! (no GPU there; the host-side check without CUDA is a unit test of `comm::nccl::world`);
//! passed on an H100 (2026-11-26).
#![cfg(feature = "gpu-tests")]

use std::time::Duration;

use burn::backend::cuda::CudaDevice;
use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dcp::comm::{InProcessWorld, NcclWorld, Payload, WorldConfig};

type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// World size 1: a send to itself goes through `ncclSend`/`ncclRecv` on the device; the
/// collectives return this rank's own tensors; host payloads use the control world.
#[test]
#[ignore = "needs an NVIDIA GPU with NCCL"]
fn nccl_world_of_one_moves_device_tensors() {
    let config = WorldConfig {
        timeout: Duration::from_secs(60),
        ..WorldConfig::default()
    };
    let control = InProcessWorld::new(1, config.clone()).unwrap();
    let results = control.run(|control| -> Result<(), String> {
        let device = CudaDevice { index: 0 };
        let comm = NcclWorld::init::<Cuda>(control, device.clone(), config.clone())
            .map_err(|e| e.to_string())?;
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let tensor =
            Tensor::<Cuda, 2>::from_data(TensorData::new(values.clone(), [10, 100]), &device);
        // What the NCCL path sees of the sent tensor (printed: a host fallback says why).
        let sent_primitive = burn_cubecl::kernel::into_contiguous(
            tensor.clone().transpose().into_primitive().tensor(),
        );
        eprintln!(
            "sent tensor: contiguous {}, handle {} bytes in use for {} elements of {:?}",
            sent_primitive.is_contiguous(),
            sent_primitive.handle.size_in_used(),
            sent_primitive.meta.shape().num_elements(),
            sent_primitive.dtype
        );
        let pending = comm.irecv(0).map_err(|e| e.to_string())?;
        let sent = comm
            .isend(0, Payload::device(tensor.clone().transpose()))
            .map_err(|e| e.to_string())?;
        let received = pending.wait().map_err(|e| e.to_string())?;
        sent.wait().map_err(|e| e.to_string())?;
        assert!(received.is_device(), "{received:?}");
        let received = received.into_tensor::<Cuda, 2>(&device)?;
        let want = tensor.clone().transpose().into_data();
        assert_eq!(received.into_data(), want);
        let reduced = comm
            .all_reduce(Payload::device(tensor.clone()))
            .map_err(|e| e.to_string())?
            .into_tensor::<Cuda, 2>(&device)?;
        assert_eq!(reduced.into_data(), TensorData::new(values, [10, 100]));
        let host = comm
            .all_gather(TensorData::new(vec![3u8, 4], [2]).into())
            .map_err(|e| e.to_string())?;
        assert_eq!(
            host[0].clone().into_host()?.to_vec::<u8>().unwrap(),
            vec![3, 4]
        );
        Ok(())
    });
    results.into_iter().for_each(|r| r.unwrap());
}
