//! Planners: pure functions from sequence lengths, a mesh and a configuration to a plan — no
//! device, no communication — so they are unit- and property-tested on the CPU.
//!
//! - `topology`: nodes × devices, link and device speeds.
//! - `dynamic`: Megatron-style dynamic CP group sizes and scheduling.
//! - `plan`: the block-level plan format (JSON), the non-empty tile grid and the independent
//!   validator.
//! - `hypergraph`: the multilevel hypergraph partitioner the DCP planner uses.
//! - `dcp`: the DCP block planner (hierarchical placement + stage schedule).
//! - `strategies`: ring-zigzag, Ulysses, USP, Megatron-dynamic and DCP as block plans with their
//!   communication.
//! - `cost`: bytes per link class, balance and estimated attention time of a plan.
//!
//! The planners produce and measure plans; executing a block plan inside the decorator is not
//! implemented yet (the decorator runs the static strategies).

pub mod cost;
pub mod dcp;
pub mod dynamic;
pub mod hypergraph;
pub mod plan;
pub mod strategies;
pub mod topology;

pub use cost::{evaluate, AttentionDims, RoutedPlan, StrategyReport};
pub use dcp::{dcp_plan, DcpConfig};
pub use plan::{validate_plan, BlockProblem, Plan, MAX_PLAN_TILES};
pub use strategies::{plan_strategy, PlanInput, PlanStrategy};
pub use topology::{attention_flops, LinkClass, Topology, MAX_PLAN_RANKS};
