//! The root package of the workspace: it holds the top-level `examples/`, `tests/` and `benches/`,
//! the training engine they share ([`train`]) and re-exports the crates they use.

pub mod train;

pub use burn_dcp;
pub use burn_dcp_datasets as datasets;
pub use burn_dcp_kernels as kernels;
pub use burn_dcp_models as models;
