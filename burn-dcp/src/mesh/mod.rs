//! The device mesh of hybrid parallelism: [`axes`] arranges one world of ranks as TP × CP × DP ×
//! PP (Megatron's rank order) with one communicator per axis group. TP's communication as
//! autodiff ops is the decorator's: [`crate::backend::tensor_parallel`].

pub mod axes;

pub use axes::{check_stage_layers, Axis, Coords, Mesh, MeshShape, PipelineError};
