//! The tensor-core kernels (forward, dq, dk/dv) compiled to CUDA C++ without a GPU: each is
//! expanded into cubecl's IR for CUDA's target and compiled by cubecl-cuda's own compiler (the
//! one a CUDA launch runs before NVRTC). This checks what can be checked here: the `cmma`
//! branches expand (no expansion-time panic) and compile to `wmma` fragment loads, products and
//! stores on shared memory, and the ordinary-units branches have none. Whether NVRTC accepts the
//! source and the results are right needs a GPU (burn-dcp-kernels/tests/cube_cuda.rs,
//! `#[ignore]`d).
//!
//! Set `BURN_DCP_DUMP_CUDA=path` to write the generated source there. (It tests
//! burn-dcp-kernels but lives here so that CI builds it with the NCCL test's feature set, in the
//! same cargo invocation.)
#![cfg(feature = "cuda")]

use burn_dcp_kernels::cube::matrix;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::{Compiler, CubeDim, ExecutionMode, KernelSettings};

/// The kernels of the matrix-tile path.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    Forward,
    Dq,
    DkDv,
}

/// CUDA C++ of a matrix-tile kernel for `kind` inputs at head/value dim 128, 2 planes.
fn cuda_source(which: Kernel, kind: FloatKind, tensor_cores: bool) -> String {
    let mut builder = KernelBuilder::default();
    builder.runtime_properties(CudaRuntime::target_properties());
    let dtype = StorageType::Scalar(ElemType::Float(kind));
    cubecl::ir::AddressType::U32.register(&mut builder.scope);
    let arg = TensorCompilationArg { inplace: None };
    let config = matrix::TileConfig {
        head_dim: 128,
        value_dim: 128,
        head_pad: 128,
        value_pad: 128,
        planes: 2,
        plane_dim: 32,
        max_spans: 1,
        tensor_cores,
    };
    match which {
        Kernel::Forward => {
            use matrix::forward_tiles_kernel as kernel;
            builder.scope.register_type::<kernel::F>(dtype);
            let q = <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder);
            let k = <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder);
            let v = <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder);
            let spans = <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder);
            let offsets = <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder);
            let runs = <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder);
            let out = <Tensor<kernel::F> as LaunchArg>::expand_output(&arg, &mut builder);
            let lse = <Tensor<f32> as LaunchArg>::expand_output(&arg, &mut builder);
            let scale = <f32 as LaunchArg>::expand(&(), &mut builder);
            let neg_inf = <f32 as LaunchArg>::expand(&(), &mut builder);
            kernel::expand::<kernel::F>(
                &mut builder.scope,
                q,
                k,
                v,
                spans,
                offsets,
                runs,
                out,
                lse,
                scale,
                neg_inf,
                config,
                dtype,
            );
        }
        Kernel::Dq => {
            use matrix::dq_tiles_kernel as kernel;
            builder.scope.register_type::<kernel::F>(dtype);
            let [q, k, v, dout] =
                [(); 4].map(|_| <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder));
            let [lse, delta] =
                [(); 2].map(|_| <Tensor<f32> as LaunchArg>::expand(&arg, &mut builder));
            let [spans, offsets, runs] =
                [(); 3].map(|_| <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder));
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
                dq,
                scale,
                config,
                dtype,
            );
        }
        Kernel::DkDv => {
            use matrix::dkdv_tiles_kernel as kernel;
            builder.scope.register_type::<kernel::F>(dtype);
            let [q, k, v, dout] =
                [(); 4].map(|_| <Tensor<kernel::F> as LaunchArg>::expand(&arg, &mut builder));
            let [lse, delta] =
                [(); 2].map(|_| <Tensor<f32> as LaunchArg>::expand(&arg, &mut builder));
            let [spans, offsets, runs] =
                [(); 3].map(|_| <Tensor<u32> as LaunchArg>::expand(&arg, &mut builder));
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
                dk,
                dv,
                scale,
                config,
                dtype,
            );
        }
    }
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_2d(32, 2))
        .kernel_name(format!("{which:?}").to_lowercase());
    let definition = builder.build(settings);
    let mut compiler = CudaCompiler::default();
    let compiled = compiler
        .compile(
            definition,
            &Default::default(),
            ExecutionMode::Unchecked,
            cubecl::ir::AddressType::U32.unsigned_type(),
        )
        .expect("cubecl-cuda compiles the kernel");
    let source = compiled.to_string();
    if let Ok(path) = std::env::var("BURN_DCP_DUMP_CUDA") {
        let file = format!("{path}.{which:?}.{kind:?}.{tensor_cores}.cu");
        std::fs::write(file, &source).unwrap();
    }
    source
}

#[test]
fn the_tensor_core_branches_compile_to_wmma_on_shared_memory() {
    for which in [Kernel::Forward, Kernel::Dq, Kernel::DkDv] {
        for kind in [FloatKind::F16, FloatKind::BF16] {
            let source = cuda_source(which, kind, true);
            for needle in [
                "wmma::fragment",
                "wmma::mma_sync",
                "load_matrix_sync",
                "store_matrix_sync",
                "__shared__",
            ] {
                assert!(source.contains(needle), "{which:?} {kind:?}: no {needle}");
            }
        }
    }
}

#[test]
fn the_ordinary_units_branches_have_no_wmma() {
    for which in [Kernel::Forward, Kernel::Dq, Kernel::DkDv] {
        let source = cuda_source(which, FloatKind::F16, false);
        assert!(!source.contains("wmma"), "{which:?}");
    }
}
