//! Planners: pure functions from sequence lengths, a mesh and a configuration to a plan — no
//! device, no communication — so they are unit- and property-tested on the CPU.
//!
//! - `topology`: nodes × devices, link and device speeds, attention/communication cost model.
//! - `dynamic`: Megatron-style dynamic CP group sizes and scheduling.
//! - `plan`: the block-level plan format (JSON), the non-empty tile grid, a ring-zigzag plan and
//!   the independent validator.
//!
//! (Work in progress for the planners issue: the Megatron-style dynamic CP scheduler, the DCP
//! block planner, the plan format and `plan_sim` come next.)

pub mod dynamic;
pub mod plan;
pub mod topology;

pub use topology::{attention_flops, LinkClass, Topology};
