//! Planners: pure functions from sequence lengths, a mesh and a configuration to a plan — no
//! device, no communication — so they are unit- and property-tested on the CPU.
//!
//! - `topology`: nodes × devices, link and device speeds.
//! - `dynamic`: Megatron-style dynamic CP group sizes and scheduling.
//! - `plan`: the block-level plan format (JSON), the non-empty tile grid and the independent
//!   validator.
//! - `hypergraph`: the multilevel hypergraph partitioner the DCP planner uses: `coarsen`,
//!   `initial` (partition), `refine` (rebalance, greedy moves, FM).
//! - `dcp`: the DCP block planner: `graph` (hypergraph construction), `place` (hierarchical
//!   placement), `stages` (stage schedule).
//! - `strategies`: ring-zigzag, Ulysses, USP, all-gather and Megatron-dynamic as block plans
//!   with their communication (the builders each strategy's `plan` uses); `by_strategy`: the
//!   plan of a strategy named by its kind (`plan_strategy`) or given by value (`executed_plan`).
//! - `bytes`: the one byte model, and the sizes of a head unit (`AttentionDims`, `UnitSizes`).
//! - `routes`: the copies of every data block from its home to the ranks that compute with it,
//!   and their transfers (`hop_bytes`, `routes`).
//! - `cost`: bytes per link class, balance and estimated attention time of a plan.
//! - `auto`: the per-micro-batch choice of `--strategy auto` (lowest estimated time).
//!
//! The planners produce and measure plans; DCP plans are executed by `strategy::dcp`, the other
//! strategies' plans describe what the static strategies do.

pub mod auto;
pub mod by_strategy;
pub mod bytes;
pub mod cost;
pub mod dcp;
pub mod dynamic;
pub mod hypergraph;
pub mod plan;
pub mod routes;
pub mod strategies;
pub mod topology;

pub use auto::{choose_strategy, parse_candidates, plan_candidate, AutoChoice, AutoEstimate};
pub use by_strategy::{executed_plan, plan_strategy, plan_usp};
pub use cost::{evaluate, AttentionDims, RoutedPlan, StrategyReport};
pub use dcp::{dcp_plan, DcpConfig};
pub use plan::{validate_plan, BlockProblem, Plan, MAX_PLAN_TILES};
pub use strategies::PlanInput;
pub use topology::{attention_flops, LinkClass, Topology, MAX_PLAN_RANKS};
