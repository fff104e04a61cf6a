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
mod stages;

use crate::error::CpError;
use crate::planner::cost::{direct_transfers, unit_move_transfers, AttentionDims, RoutedPlan};
use crate::planner::plan::{BlockProblem, ComputeBlock, DcpStats, Plan, PlanStats, TileGrid};
use crate::planner::topology::Topology;
pub use graph::MIN_COMPUTE_VERTICES_PER_RANK;
use graph::{build_graph, tile_group, DcpGraph};
use place::place;
use stages::StageSchedule;

/// Settings of the DCP planner.
#[derive(Clone, Debug, PartialEq)]
pub struct DcpConfig {
    /// Per-device compute imbalance tolerance (max ≤ (1 + ε) · mean).
    pub compute_epsilon: f64,
    /// Per-device memory imbalance tolerance.
    pub memory_epsilon: f64,
    /// Communication stages.
    pub stages: usize,
    pub seed: u64,
}

impl Default for DcpConfig {
    fn default() -> Self {
        Self {
            compute_epsilon: 0.1,
            memory_epsilon: 0.4,
            stages: 4,
            seed: 0,
        }
    }
}

/// The most communication stages a DCP schedule may have.
pub const MAX_STAGES: usize = 64;

impl DcpConfig {
    pub fn validate(&self) -> Result<(), CpError> {
        for (name, value) in [
            ("compute epsilon", self.compute_epsilon),
            ("memory epsilon", self.memory_epsilon),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CpError::Config(format!(
                    "{name} must be a non-negative number, got {value}"
                )));
            }
        }
        if self.stages == 0 || self.stages > MAX_STAGES {
            return Err(CpError::Config(format!(
                "DCP needs 1 to {MAX_STAGES} communication stages, got {}",
                self.stages
            )));
        }
        Ok(())
    }
}

/// Plans DCP for `problem` (head units = kv heads) on `topology`: every head unit's data and
/// tiles placed freely (the paper's model; no cost for a token whose units land on several ranks).
pub fn dcp_plan(
    problem: &BlockProblem,
    grids: Vec<TileGrid>,
    dims: &AttentionDims,
    topology: &Topology,
    config: &DcpConfig,
) -> Result<RoutedPlan, CpError> {
    plan_dcp(problem, grids, dims, topology, config, false)
}

/// Plans DCP for execution with `problem.head_groups` head units: as [`dcp_plan`], but the
/// planner also weighs the moves of units homed away from their token's home (each token block's
/// units joined by a hyperedge of one unit's move bytes), and the plan's transfers include those
/// moves ([`unit_move_transfers`]). With one head unit, the same plan as [`dcp_plan`].
pub fn dcp_execution_plan(
    problem: &BlockProblem,
    grids: Vec<TileGrid>,
    dims: &AttentionDims,
    topology: &Topology,
    config: &DcpConfig,
) -> Result<RoutedPlan, CpError> {
    let mut routed = plan_dcp(problem, grids, dims, topology, config, true)?;
    let moves = unit_move_transfers(&routed.plan, &routed.problem, &routed.sizes);
    routed.transfers.extend(moves);
    Ok(routed)
}

fn plan_dcp(
    problem: &BlockProblem,
    grids: Vec<TileGrid>,
    dims: &AttentionDims,
    topology: &Topology,
    config: &DcpConfig,
    token_edges: bool,
) -> Result<RoutedPlan, CpError> {
    problem.validate()?;
    topology.validate()?;
    config.validate()?;
    let sizes = dims.unit_sizes(problem.head_groups)?;
    let tile_count: usize = grids.iter().map(TileGrid::tiles).sum::<usize>() * problem.head_groups;
    let group = tile_group(tile_count, topology.ranks());
    let built = build_graph(problem, &grids, dims, group, token_edges)?;
    let rank = place(&built.graph, topology, config);
    let schedule = StageSchedule::build(problem, &built, &rank, &sizes, topology.ranks(), config);
    let stats = DcpStats {
        block: problem.block,
        communication_stages: config.stages,
        largest_stage_fraction: schedule.largest_chunk_fraction,
        connectivity_cost_bytes: built.graph.connectivity_cost(&rank),
        vertices: built.graph.vertices(),
        hyperedges: built.graph.edges(),
        tile_group: group,
        compute_epsilon: config.compute_epsilon,
        memory_epsilon: config.memory_epsilon,
    };
    let mut plan = Plan::new(topology.ranks(), PlanStats::Dcp(stats));
    place_plan(&mut plan, problem, &built, &rank, &schedule.stage_of_tile);
    let transfers = direct_transfers(&plan, problem, &sizes, topology);
    Ok(RoutedPlan {
        name: "dcp".into(),
        plan,
        problem: problem.clone(),
        grids,
        sizes,
        transfers,
    })
}

/// Fills `plan` with a placement: each data block at its vertex's rank, each tile at its
/// vertex's rank and stage.
fn place_plan(
    plan: &mut Plan,
    problem: &BlockProblem,
    built: &DcpGraph,
    rank: &[u32],
    stage_of_tile: &[usize],
) {
    for (seq, bases) in built.data_base.iter().enumerate() {
        for (head, &base) in bases.iter().enumerate() {
            for block in 0..problem.blocks_of(seq) {
                plan.home_token_block(seq, head, block, rank[base as usize + block] as usize);
            }
        }
    }
    for (i, t) in built.tiles.iter().enumerate() {
        plan.blocks.push(ComputeBlock {
            seq: t.seq as usize,
            head: t.head as usize,
            q_block: t.q_block as usize,
            kv_block: t.kv_block as usize,
            rank: rank[t.vertex as usize] as usize,
            stage: stage_of_tile[i],
        });
    }
}
