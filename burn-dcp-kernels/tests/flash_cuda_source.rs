//! The flash kernels (forward, dq, dk/dv) compiled to CUDA C++ without a GPU, as a CUDA launch
//! would compile them (cubecl-cuda's compiler; NVRTC then runs on the device): their tensor-core
//! bodies must expand and reach `mma.sync`, `ldmatrix` and `cp.async`, with no `wmma`. For bf16
//! and f16 at head dims 64 and 128, with the plans an H100 gets.
//!
//! `BURN_DCP_DUMP_CUDA=DIR/PREFIX` writes each source to `DIR/PREFIX.flash_<pass>_<dtype>_d<dim>.cu`
//! (the kernel inside is named the same): `scripts/cuda_report.sh` compiles them with NVRTC and
//! ptxas and reads registers, spills and instructions. Whether they run right needs a GPU
//! (`cube_cuda.rs`).
#![cfg(feature = "cuda")]

use burn::tensor::DType;
use burn_dcp_kernels::cube::flash::{backward, forward, FlashBody, FlashConfig, FlashPlan};
use burn_dcp_kernels::AttentionShape;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::{Compiler, CubeDim, ExecutionMode, KernelSettings};

/// The passes of the flash path.
#[derive(Clone, Copy, Debug)]
enum Pass {
    Forward,
    Dq,
    Dkdv,
}

/// H100's shared memory per cube (227 KiB with the opt-in cubecl-cuda sets).
const H100_SHARED: usize = 232_448;

fn plan(dtype: DType, dim: usize) -> FlashPlan {
    let shape = AttentionShape {
        q_tokens: 8192,
        kv_tokens: 8192,
        heads: 32,
        kv_heads: 32,
        head_dim: dim,
        value_dim: dim,
    };
    FlashPlan::sized(H100_SHARED, dtype, &shape, 1, FlashBody::TensorCores)
        .expect("the H100 plan fits")
}

type Expand<T> = <T as CubeType>::ExpandType;

/// The inputs of both backward passes: `q, k, v, dout` of float type `F` (registered as
/// `storage`), `lse, delta` in f32, and the four tile tables.
#[allow(clippy::type_complexity)]
fn backward_inputs<F: Float>(
    builder: &mut KernelBuilder,
    storage: StorageType,
) -> (
    [Expand<Tensor<F>>; 4],
    [Expand<Tensor<f32>>; 2],
    [Expand<Tensor<u32>>; 4],
) {
    let arg = TensorCompilationArg { inplace: None };
    builder.scope.register_type::<F>(storage);
    let floats = [(); 4].map(|_| <Tensor<F> as LaunchArg>::expand(&arg, builder));
    let f32s = [(); 2].map(|_| <Tensor<f32> as LaunchArg>::expand(&arg, builder));
    let tables = [(); 4].map(|_| <Tensor<u32> as LaunchArg>::expand(&arg, builder));
    (floats, f32s, tables)
}

/// CUDA C++ of one pass, and its kernel's name.
fn cuda_source(pass: Pass, kind: FloatKind, dim: usize) -> (String, String) {
    let dtype = match kind {
        FloatKind::F16 => DType::F16,
        _ => DType::BF16,
    };
    let plan = plan(dtype, dim);
    let name = format!("flash_{pass:?}_{kind:?}_d{dim}").to_lowercase();
    let mut builder = KernelBuilder::default();
    builder.runtime_properties(CudaRuntime::target_properties());
    let storage = StorageType::Scalar(ElemType::Float(kind));
    cubecl::ir::AddressType::U32.register(&mut builder.scope);
    let arg = TensorCompilationArg { inplace: None };
    let config: FlashConfig = match pass {
        Pass::Forward => {
            use forward::flash_forward_kernel as kernel;
            builder.scope.register_type::<kernel::F>(storage);
            let [q, k, v] =
                [(); 3].map(|_| <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder));
            let [spans, offsets, runs, order] =
                [(); 4].map(|_| <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder));
            let out = <Tensor<kernel::F> as LaunchArg>::expand_output(&arg, &mut builder);
            let lse = <Tensor<f32> as LaunchArg>::expand_output(&arg, &mut builder);
            let [scale, neg_inf] = [(); 2].map(|_| <f32 as LaunchArg>::expand(&(), &mut builder));
            kernel::expand::<kernel::F>(
                &mut builder.scope,
                q,
                k,
                v,
                spans,
                offsets,
                runs,
                order,
                out,
                lse,
                scale,
                neg_inf,
                plan.forward,
                storage,
            );
            plan.forward
        }
        Pass::Dq => {
            use backward::flash_dq_kernel as kernel;
            let ([q, k, v, dout], [lse, delta], [spans, offsets, runs, order]) =
                backward_inputs::<kernel::F>(&mut builder, storage);
            let dq = <Tensor<kernel::F> as LaunchArg>::expand_output(&arg, &mut builder);
            let scale = <f32 as LaunchArg>::expand(&(), &mut builder);
            kernel::expand::<kernel::F>(
                &mut builder.scope,
                q,
                k,
                v,
                dout,
                lse,
                delta,
                spans,
                offsets,
                runs,
                order,
                dq,
                scale,
                plan.dq,
                storage,
            );
            plan.dq
        }
        Pass::Dkdv => {
            use backward::flash_dkdv_kernel as kernel;
            let ([q, k, v, dout], [lse, delta], [spans, offsets, runs, order]) =
                backward_inputs::<kernel::F>(&mut builder, storage);
            let [dk, dv] = [(); 2]
                .map(|_| <Tensor<kernel::F> as LaunchArg>::expand_output(&arg, &mut builder));
            let scale = <f32 as LaunchArg>::expand(&(), &mut builder);
            kernel::expand::<kernel::F>(
                &mut builder.scope,
                q,
                k,
                v,
                dout,
                lse,
                delta,
                spans,
                offsets,
                runs,
                order,
                dk,
                dv,
                scale,
                plan.dkdv,
                storage,
            );
            plan.dkdv
        }
    };
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_2d(32, config.planes as u32))
        .kernel_name(name.clone());
    let definition = builder.build(settings);
    let compiled = CudaCompiler::default()
        .compile(
            definition,
            &Default::default(),
            ExecutionMode::Unchecked,
            cubecl::ir::AddressType::U32.unsigned_type(),
        )
        .expect("cubecl-cuda compiles the kernel");
    let source = compiled.to_string();
    if let Ok(prefix) = std::env::var("BURN_DCP_DUMP_CUDA") {
        std::fs::write(format!("{prefix}.{name}.cu"), &source).expect("writable dump path");
    }
    (source, name)
}

#[test]
fn every_flash_kernel_reaches_mma_sync_ldmatrix_and_cp_async() {
    for pass in [Pass::Forward, Pass::Dq, Pass::Dkdv] {
        for kind in [FloatKind::BF16, FloatKind::F16] {
            for dim in [64, 128] {
                let (source, name) = cuda_source(pass, kind, dim);
                for needle in ["mma.sync.aligned.m16n8k16", "ldmatrix.sync", "cp.async"] {
                    assert!(source.contains(needle), "{name}: no {needle}");
                }
                assert!(!source.contains("wmma"), "{name}: wmma");
                assert!(source.contains(&name), "{name}: kernel name");
            }
        }
    }
}
