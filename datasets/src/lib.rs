//! Long-context datasets for burn-dcp: documents, tokenization, token-budget packing into
//! micro-batches with `cu_seqlens`, global positions and per-sequence mask specs
//! ([`burn_dcp_kernels::MaskSpec`]), and length samplers.
//!
//! Not implemented yet: it comes with the datasets issue. The crate exists so the workspace layout
//! is in place.

pub use burn_dcp_kernels::MaskSpec;
