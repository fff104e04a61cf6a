//! The tensor-core forward compiled to CUDA C++ without a GPU: the kernel is expanded into
//! cubecl's IR for CUDA's target and compiled by cubecl-cuda's own compiler (the one a CUDA
//! launch runs before NVRTC). This checks what can be checked here: the `cmma` branch expands
//! (no expansion-time panic), compiles to `wmma` fragment loads, products and stores on shared
//! memory, and the ordinary-units branch has none. Whether NVRTC accepts the source and the
//! results are right needs a GPU (`cube_cuda.rs`, `#[ignore]`d).
//!
//! Set `BURN_DCP_DUMP_CUDA=path` to write the generated source there.
#![cfg(feature = "cuda")]

use burn_dcp_kernels::cube::matrix::forward_tiles_kernel as kernel;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::{Compiler, CubeDim, ExecutionMode, KernelSettings};

/// CUDA C++ of the matrix-tile forward for `kind` inputs at head/value dim 128, 2 planes.
fn cuda_source(kind: FloatKind, tensor_cores: bool) -> String {
    let mut builder = KernelBuilder::default();
    builder.runtime_properties(CudaRuntime::target_properties());
    let dtype = StorageType::Scalar(ElemType::Float(kind));
    builder.scope.register_type::<kernel::F>(dtype);
    cubecl::ir::AddressType::U32.register(&mut builder.scope);
    let input = TensorCompilationArg { inplace: None };
    let q = <Tensor<kernel::F> as LaunchArg>::expand(&input, &mut builder);
    let k = <Tensor<kernel::F> as LaunchArg>::expand(&input, &mut builder);
    let v = <Tensor<kernel::F> as LaunchArg>::expand(&input, &mut builder);
    let spans = <Tensor<u32> as LaunchArg>::expand(&input, &mut builder);
    let offsets = <Tensor<u32> as LaunchArg>::expand(&input, &mut builder);
    let runs = <Tensor<u32> as LaunchArg>::expand(&input, &mut builder);
    let out = <Tensor<kernel::F> as LaunchArg>::expand_output(&input, &mut builder);
    let lse = <Tensor<f32> as LaunchArg>::expand_output(&input, &mut builder);
    let scale = <f32 as LaunchArg>::expand(&Default::default(), &mut builder);
    let neg_inf = <f32 as LaunchArg>::expand(&Default::default(), &mut builder);
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
        128,
        128,
        128,
        128,
        2,
        32,
        1,
        tensor_cores,
        dtype,
    );
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_2d(32, 2))
        .kernel_name("forward_tiles");
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
        std::fs::write(format!("{path}.{kind:?}.{tensor_cores}.cu"), &source).unwrap();
    }
    source
}

#[test]
fn the_tensor_core_branch_compiles_to_wmma_on_shared_memory() {
    for kind in [FloatKind::F16, FloatKind::BF16] {
        let source = cuda_source(kind, true);
        for needle in [
            "wmma::fragment",
            "wmma::mma_sync",
            "load_matrix_sync",
            "store_matrix_sync",
        ] {
            assert!(
                source.contains(needle),
                "{kind:?}: no {needle} in\n{source}"
            );
        }
        assert!(source.contains("__shared__") || source.contains("extern __shared__"));
    }
}

#[test]
fn the_ordinary_units_branch_has_no_wmma() {
    let source = cuda_source(FloatKind::F16, false);
    assert!(!source.contains("wmma"), "{source}");
}
