//! Shared helpers of the kernel tests: the problems (`cases`: the mask family, ragged varlen
//! cases with offset and strided segments), random inputs and their uploads (`inputs`), the
//! checks against the f64 oracle (`oracle`), and runs of one cubecl kernel (`cube`).
#![allow(dead_code)]

pub mod cases;
#[cfg(feature = "cube")]
pub mod cube;
pub mod inputs;
pub mod oracle;

pub use cases::*;
pub use inputs::*;
pub use oracle::*;
