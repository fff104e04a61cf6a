//! The DCP block planner (Jiang et al., SOSP'25): place data and compute blocks on ranks by
//! hypergraph partitioning, then schedule each rank's blocks into stages.
//!
//! **Hypergraph.** Per sequence and head group (one kv head and its query heads), tokens form
//! blocks of `B`. Vertices: one *data vertex* per token block (its Q, KV and O live together, as in
//! the paper; memory weight = their bytes) and one *compute vertex* per non-empty mask tile
//! (compute weight = unmasked pairs × FLOPs per pair, forward + backward). Hyperedges: for every
//! token block, a q/o edge joining its data vertex with the tiles of its query row (weight: the
//! q/o bytes a remote tile costs, forward + backward) and a kv edge joining it with the tiles of
//! its key column (weight: kv bytes). A partition's connectivity cost `Σ w·(λ−1)` is then exactly
//! the bytes the plan moves when each remote part receives one copy.
//!
//! **Hierarchy.** First `nodes` parts (inter-node bytes are the expensive ones), then each node's
//! induced sub-hypergraph into its devices. Tolerances: the final per-device compute load is at
//! most `(1 + compute_epsilon)` × mean and the memory load `(1 + memory_epsilon)` × mean; the
//! node level uses half of each ε, which leaves the device level room inside every node.
//!
//! **Schedule.** Each rank's remote inputs (in the order its tiles first need them) are cut into
//! `stages` chunks greedily: a chunk closes when the next block would take it past 1/`stages` of
//! the rank's incoming bytes (whole blocks, so the last chunk may exceed that by a few blocks). Compute
//! stage 0 runs the tiles whose inputs are all local while chunk 1 moves; compute stage `t ≥ 1`
//! runs the tiles whose last remote input is in chunk `t`, while chunk `t + 1` moves. So a plan
//! has up to `stages + 1` compute stages and `stages` communication stages, local work first.

mod graph;
mod place;
mod planning;
mod settings;
mod stages;

pub use graph::MIN_COMPUTE_VERTICES_PER_RANK;
pub use planning::{dcp_execution_plan, dcp_plan};
pub use settings::{DcpConfig, MAX_STAGES};
