//! Shared helpers of the integration tests: what a test runs (`runs`: meshes, masks, layouts,
//! inputs, a run's specification) and how outputs are compared (`compare`).
#![allow(dead_code)]

use burn::backend::Flex;
use burn_dcp::Strategy;

mod compare;
mod runs;

pub use compare::*;
pub use runs::*;

pub type B = Flex;

pub const TOLERANCE: f64 = 1e-5;

/// USP with 2 Ulysses ranks × 2 ring ranks: the 4-rank mesh most tests run.
pub const USP_2X2: Strategy = Strategy::Usp {
    ulysses_degree: 2,
    ring_degree: 2,
};
