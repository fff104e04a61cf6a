//! Planning: the hypergraph built, partitioned over the topology, scheduled into stages, and
//! written into a [`Plan`] with its transfers.

use crate::error::CpError;
use crate::planner::cost::{direct_transfers, unit_move_transfers, AttentionDims, RoutedPlan};
use crate::planner::plan::{BlockProblem, ComputeBlock, DcpStats, Plan, PlanStats, TileGrid};
use crate::planner::topology::Topology;

use super::graph::{build_graph, tile_group, DcpGraph};
use super::place::place;
use super::stages::StageSchedule;
use super::DcpConfig;

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
        name: crate::strategy::StrategyKind::Dcp.plan_name().into(),
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
