//! The root package of the workspace: it holds the top-level `examples/`, `tests/` and `benches/`,
//! helpers of the examples, and re-exports the crates they use (the training engine is
//! `burn-dcp-train`).

/// The README's Rust code, compiled and run as doctests (`cargo test --workspace --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// docs/models.md's Rust code, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/models.md")]
pub struct ModelsDoctests;

/// Checks a `--backend` flag of the examples: `flex` always runs; `wgpu`/`cuda` run when the
/// binary was built with that cargo feature, and otherwise name the feature (never a silent CPU
/// fallback).
pub fn check_backend(backend: &str, example: &str) -> Result<(), String> {
    let compiled = match backend {
        "flex" => return Ok(()),
        "wgpu" => cfg!(feature = "wgpu"),
        "cuda" => cfg!(feature = "cuda"),
        other => {
            return Err(format!(
                "unknown backend '{other}': expected flex, wgpu or cuda"
            ))
        }
    };
    if !compiled {
        return Err(format!(
            "backend '{backend}' needs the cargo feature `{backend}`: cargo run --release --features {backend} --example {example} -- --backend {backend}"
        ));
    }
    Ok(())
}

/// The backend type an example runs for `--backend` (checked with [`check_backend`]) and
/// `--no-fusion`, as recorded in its outputs: `flex`; `wgpu-fusion` (burn-fusion's
/// `Fusion<CubeBackend<WgpuRuntime>>`, the type burn's default features make
/// `burn::backend::Wgpu`) or `wgpu` (the plain `CubeBackend`, `--no-fusion`); `cuda` (the plain
/// `CubeBackend<CudaRuntime>`: NCCL reads its tensors' device memory).
pub fn backend_type(backend: &str, no_fusion: bool, example: &str) -> Result<&'static str, String> {
    check_backend(backend, example)?;
    match (backend, no_fusion) {
        ("wgpu", false) => Ok("wgpu-fusion"),
        ("wgpu", true) => Ok("wgpu"),
        (other, true) => Err(format!(
            "--no-fusion applies to --backend wgpu only, not {other} (flex has no fusion layer; cuda runs burn's plain CubeBackend already)"
        )),
        ("cuda", false) => Ok("cuda"),
        _ => Ok("flex"),
    }
}

pub use burn_dcp;
pub use burn_dcp_datasets as datasets;
pub use burn_dcp_kernels as kernels;
pub use burn_dcp_models as models;
pub use burn_dcp_train as train;
pub use burn_dcp_train::launch;
