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

pub use burn_dcp_tools::{backend_type, check_backend};

pub use burn_dcp;
pub use burn_dcp_datasets as datasets;
pub use burn_dcp_kernels as kernels;
pub use burn_dcp_models as models;
pub use burn_dcp_train as train;
pub use burn_dcp_train::launch;
