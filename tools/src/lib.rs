//! The command-line tools of burn-dcp (`src/bin`): `cp_attention` (CP attention on in-process
//! ranks against one device; Mode 2 on a user's tensors), `plan_sim` (the planners on synthetic
//! or sampled batches, without running attention; `--svg`/`--png`: a picture of the plans),
//! `dataset_stats` (a corpus's document lengths and packing), `prepare_data` (token files) and
//! `plot_metrics` (runs' curves). This library holds what they share with the examples: the
//! `--backend` flag's check and its type ([`on_backend`]), how a tool ends on an error
//! ([`exit_on_error`]) and the pictures ([`pictures`]).
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin cp_attention -- --strategy ring --cp 4 --json
//! ```

pub mod pictures;

/// Checks a `--backend` flag of a program (`program`: how cargo names it, e.g. `--example
/// gpt_longctx` or `-p burn-dcp-tools --bin cp_attention`): `flex` always runs; `wgpu`/`cuda` run
/// when this crate was built with that cargo feature (the root package's and this crate's
/// features forward to it), and otherwise name the feature (never a silent CPU fallback).
pub fn check_backend(backend: &str, program: &str) -> Result<(), String> {
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
            "backend '{backend}' needs the cargo feature `{backend}`: cargo run --release --features {backend} {program} -- --backend {backend}"
        ));
    }
    Ok(())
}

/// The backend type a program runs for `--backend` (checked with [`check_backend`]) and
/// `--no-fusion`, as recorded in its outputs: `flex`; `wgpu-fusion` (burn-fusion's
/// `Fusion<CubeBackend<WgpuRuntime>>`, the type burn's default features make
/// `burn::backend::Wgpu`) or `wgpu` (the plain `CubeBackend`, `--no-fusion`); `cuda-fusion`
/// (`Fusion<CubeBackend<CudaRuntime>>`, burn's default `Cuda`) or `cuda` (the plain
/// `CubeBackend<CudaRuntime>`, `--no-fusion`: what NCCL's one process per rank runs).
pub fn backend_type(backend: &str, no_fusion: bool, program: &str) -> Result<&'static str, String> {
    check_backend(backend, program)?;
    match (backend, no_fusion) {
        ("wgpu", false) => Ok("wgpu-fusion"),
        ("wgpu", true) => Ok("wgpu"),
        ("cuda", false) => Ok("cuda-fusion"),
        ("cuda", true) => Ok("cuda"),
        (other, true) => Err(format!(
            "--no-fusion applies to --backend wgpu and cuda, not {other} (flex has no fusion layer)"
        )),
        _ => Ok("flex"),
    }
}

/// `$body` with the type `$B` set to the backend of `--backend $backend` and `--no-fusion
/// $no_fusion` (checked first by [`backend_type`]): burn-fusion's `WgpuFusion` or `CudaFusion`,
/// the plain `WgpuPlain` or `CudaPlain` (`--no-fusion`), or `Flex`.
#[macro_export]
macro_rules! on_backend {
    (@as $backend:ty, $B:ident => $body:expr) => {{
        type $B = $backend;
        $body
    }};
    ($backend:expr, $no_fusion:expr, $B:ident => $body:expr) => {
        match ($backend, $no_fusion) {
            #[cfg(feature = "wgpu")]
            ("wgpu", true) => $crate::on_backend!(@as ::burn_dcp_kernels::backends::WgpuPlain, $B => $body),
            #[cfg(feature = "wgpu")]
            ("wgpu", false) => $crate::on_backend!(@as ::burn_dcp_kernels::backends::WgpuFusion, $B => $body),
            #[cfg(feature = "cuda")]
            ("cuda", true) => $crate::on_backend!(@as ::burn_dcp_kernels::backends::CudaPlain, $B => $body),
            #[cfg(feature = "cuda")]
            ("cuda", false) => $crate::on_backend!(@as ::burn_dcp_kernels::backends::CudaFusion, $B => $body),
            _ => $crate::on_backend!(@as ::burn::backend::Flex, $B => $body),
        }
    };
}

/// Ends a tool whose `run` failed: the message on stderr after `error: `, exit status 2 (the
/// status of a usage error, as clap's).
pub fn exit_on_error(result: Result<(), String>) {
    if let Err(message) = result {
        eprintln!("error: {message}");
        std::process::exit(2);
    }
}
