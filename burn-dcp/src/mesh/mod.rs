//! The device mesh of hybrid parallelism: [`axes`] arranges one world of ranks as TP × CP × DP ×
//! PP (Megatron's rank order) with one communicator per axis group; [`tensor_parallel`] is TP's
//! communication as autodiff ops.

pub mod axes;
pub mod tensor_parallel;

pub use axes::{check_stage_layers, Axis, Coords, Mesh, MeshShape, PipelineError};
