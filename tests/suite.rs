//! The integration tests of the decorator, the strategies and the engine, one module per file,
//! in one test binary: one build and link of the engine over Flex and wgpu instead of one per
//! file (the root package lists its test targets: `autotests = false` in Cargo.toml).
//! `cli_errors` (the examples as processes) and `mpi_stall` (itself under `mpirun`) stay apart.

mod common;

#[path = "cp_strategies.rs"]
mod cp_strategies;

#[path = "cp_volume_and_errors.rs"]
mod cp_volume_and_errors;

#[path = "custom_strategy.rs"]
mod custom_strategy;

#[path = "dcp_execution.rs"]
mod dcp_execution;

#[path = "decorator.rs"]
mod decorator;

#[path = "failures.rs"]
mod failures;

#[path = "nn.rs"]
mod nn;

#[path = "training.rs"]
mod training;
