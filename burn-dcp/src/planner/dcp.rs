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

use crate::error::CpError;
use crate::planner::cost::{
    direct_transfers, AttentionDims, RoutedPlan, UnitSizes, BACKWARD_FLOPS_FACTOR,
};
use crate::planner::hypergraph::{partition, FastMap, Hypergraph, PartitionConfig};
use crate::planner::plan::{BlockProblem, ComputeBlock, DcpStats, Plan, PlanStats, TileGrid};
use crate::planner::topology::Topology;

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

/// A non-empty tile and the vertex that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tile {
    seq: u32,
    head: u32,
    q_block: u32,
    kv_block: u32,
    vertex: u32,
}

/// The hypergraph of a problem and what its vertices stand for.
struct DcpGraph {
    graph: Hypergraph,
    /// Every non-empty tile; a vertex holds a `group × group` square of them.
    tiles: Vec<Tile>,
    /// Vertex of the data block (seq, head, block) — its Q, KV and O together:
    /// `data_base[seq][head] + block`.
    data_base: Vec<Vec<u32>>,
}

/// Compute vertices a rank should get at least: tiles are grouped `g × g` (g a power of two)
/// only while this many groups per rank remain, so balance stays fine-grained while very long
/// sequences do not flood the partitioner with vertices.
pub const MIN_COMPUTE_VERTICES_PER_RANK: usize = 256;

/// Side of the tile squares for `tiles` tiles on `ranks` ranks.
fn tile_group(tiles: usize, ranks: usize) -> usize {
    let mut group = 1;
    while tiles / ((2 * group) * (2 * group)) >= MIN_COMPUTE_VERTICES_PER_RANK * ranks {
        group *= 2;
    }
    group
}

fn build_graph(
    problem: &BlockProblem,
    grids: &[TileGrid],
    dims: &AttentionDims,
    group: usize,
) -> Result<DcpGraph, CpError> {
    let sizes = dims.unit_sizes(problem.head_groups)?;
    let mut builder = GraphBuilder {
        sizes,
        flops_per_pair: sizes.forward_flops_per_pair * (1.0 + BACKWARD_FLOPS_FACTOR),
        group,
        tiles: Vec::new(),
        compute: Vec::new(),
        memory: Vec::new(),
        edges: Vec::new(),
    };
    let mut data_base = Vec::with_capacity(problem.seq_lens.len());
    for (seq, grid) in grids.iter().enumerate() {
        let bases = (0..problem.head_groups)
            .map(|head| builder.add_head(problem, grid, seq, head))
            .collect();
        data_base.push(bases);
    }
    Ok(DcpGraph {
        graph: Hypergraph::new(builder.compute, builder.memory, builder.edges),
        tiles: builder.tiles,
        data_base,
    })
}

/// The vertices, weights and hyperedges of a [`DcpGraph`] as they are added, head by head.
struct GraphBuilder {
    sizes: UnitSizes,
    /// Forward plus backward FLOPs of one unmasked (query, key) pair.
    flops_per_pair: f64,
    /// Side of the tile squares one compute vertex holds.
    group: usize,
    tiles: Vec<Tile>,
    compute: Vec<f64>,
    memory: Vec<f64>,
    edges: Vec<(f64, Vec<u32>)>,
}

impl GraphBuilder {
    fn add_vertex(&mut self, compute: f64, memory: f64) -> u32 {
        self.compute.push(compute);
        self.memory.push(memory);
        (self.compute.len() - 1) as u32
    }

    /// Adds the vertices and hyperedges of head group `head` of sequence `seq`: one data vertex
    /// per token block (its Q, KV and O), one compute vertex per `group × group` square of
    /// non-empty tiles, a Q/O hyperedge per tile row and a KV hyperedge per tile column. Returns
    /// the vertex of block 0's data (the others follow it).
    fn add_head(
        &mut self,
        problem: &BlockProblem,
        grid: &TileGrid,
        seq: usize,
        head: usize,
    ) -> u32 {
        let blocks = problem.blocks_of(seq);
        let base = self.compute.len() as u32;
        for block in 0..blocks {
            let tokens = problem.block_tokens(seq, block).len() as f64;
            self.add_vertex(0.0, self.sizes.resident() * tokens);
        }
        let mut group_vertex: FastMap<(u32, u32), u32> = FastMap::default();
        let mut columns: Vec<EdgePins> = (0..blocks as u32)
            .map(|b| EdgePins::new(base + b))
            .collect();
        for (q_block, row) in grid.rows.iter().enumerate() {
            let mut pins = EdgePins::new(base + q_block as u32);
            for &(kv_block, pairs) in row {
                let key = ((q_block / self.group) as u32, kv_block / self.group as u32);
                let vertex = match group_vertex.get(&key) {
                    Some(&vertex) => vertex,
                    None => {
                        let vertex = self.add_vertex(0.0, 0.0);
                        group_vertex.insert(key, vertex);
                        vertex
                    }
                };
                self.compute[vertex as usize] += pairs as f64 * self.flops_per_pair;
                self.tiles.push(Tile {
                    seq: seq as u32,
                    head: head as u32,
                    q_block: q_block as u32,
                    kv_block,
                    vertex,
                });
                pins.push(vertex, kv_block as usize >= q_block);
                columns[kv_block as usize].push(vertex, q_block >= kv_block as usize);
            }
            let tokens = problem.block_tokens(seq, q_block).len() as f64;
            self.edges
                .push((self.sizes.qo_traffic() * tokens, pins.finish()));
        }
        for (kv_block, pins) in columns.into_iter().enumerate() {
            let tokens = problem.block_tokens(seq, kv_block).len() as f64;
            self.edges
                .push((self.sizes.kv_traffic() * tokens, pins.finish()));
        }
        base
    }
}

/// The pins of one hyperedge, a row (Q/O) or column (KV) of tiles: its compute vertices in tile
/// order, each once in a run, with the block's data vertex where the diagonal tile is (or
/// would be).
struct EdgePins {
    data: u32,
    data_placed: bool,
    pins: Vec<u32>,
}

impl EdgePins {
    fn new(data: u32) -> Self {
        Self {
            data,
            data_placed: false,
            pins: Vec::new(),
        }
    }

    /// Adds a tile's compute vertex; `past_diagonal`: the tile is on or past the diagonal, so
    /// the data vertex goes first.
    fn push(&mut self, vertex: u32, past_diagonal: bool) {
        if !self.data_placed && past_diagonal {
            self.pins.push(self.data);
            self.data_placed = true;
        }
        if self.pins.last() != Some(&vertex) {
            self.pins.push(vertex);
        }
    }

    fn finish(mut self) -> Vec<u32> {
        if !self.data_placed {
            self.pins.push(self.data);
        }
        self.pins
    }
}

/// Places every vertex on a rank: nodes first, then devices of each node.
fn place(graph: &Hypergraph, topology: &Topology, config: &DcpConfig) -> Vec<u32> {
    let ranks = topology.ranks();
    let total_compute: f64 = graph.compute.iter().sum();
    let total_memory: f64 = graph.memory.iter().sum();
    let node_of_vertex = if topology.nodes > 1 {
        let node_config = PartitionConfig::balanced(
            graph,
            topology.nodes,
            config.compute_epsilon / 2.0,
            config.memory_epsilon / 2.0,
            config.seed,
        );
        partition(graph, &node_config)
    } else {
        vec![0; graph.vertices()]
    };
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); topology.nodes];
    for (v, &node) in node_of_vertex.iter().enumerate() {
        members[node as usize].push(v as u32);
    }
    let mut rank = vec![0u32; graph.vertices()];
    for (node, members) in members.iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let sub = graph.induced(members);
        let device_config = PartitionConfig::with_capacities(
            topology.devices_per_node,
            (1.0 + config.compute_epsilon) * total_compute / ranks as f64,
            (1.0 + config.memory_epsilon) * total_memory / ranks as f64,
            config.seed.wrapping_add(node as u64 + 1),
        );
        let device = partition(&sub, &device_config);
        for (&v, &d) in members.iter().zip(&device) {
            rank[v as usize] = (node * topology.devices_per_node) as u32 + d;
        }
    }
    rank
}

/// Plans DCP for `problem` (head units = kv heads) on `topology`.
pub fn dcp_plan(
    problem: &BlockProblem,
    grids: Vec<TileGrid>,
    dims: &AttentionDims,
    topology: &Topology,
    config: &DcpConfig,
) -> Result<RoutedPlan, CpError> {
    problem.validate()?;
    topology.validate()?;
    config.validate()?;
    let sizes = dims.unit_sizes(problem.head_groups)?;
    let tile_count: usize = grids.iter().map(TileGrid::tiles).sum::<usize>() * problem.head_groups;
    let group = tile_group(tile_count, topology.ranks());
    let built = build_graph(problem, &grids, dims, group)?;
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

/// A data block a rank needs from another rank: its Q (`is_kv` false) or its K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct RemoteInput {
    is_kv: bool,
    seq: u32,
    head: u32,
    block: u32,
}

/// The remote inputs of one rank, in the order its tiles first need them, with their bytes.
struct RemoteInputs {
    bytes: Vec<f64>,
    index: FastMap<RemoteInput, usize>,
}

impl RemoteInputs {
    /// The inputs of `rank`'s tiles (indices into `built.tiles`) whose home is another rank.
    fn of_rank(
        rank: usize,
        tiles: &[usize],
        built: &DcpGraph,
        home: impl Fn(u32, u32, u32) -> usize,
        problem: &BlockProblem,
        sizes: &UnitSizes,
    ) -> Self {
        let mut inputs = Self {
            bytes: Vec::new(),
            index: FastMap::default(),
        };
        for &i in tiles {
            let t = built.tiles[i];
            for (is_kv, block, per_token) in
                [(false, t.q_block, sizes.q), (true, t.kv_block, sizes.kv)]
            {
                if home(t.seq, t.head, block) == rank {
                    continue;
                }
                let key = RemoteInput {
                    is_kv,
                    seq: t.seq,
                    head: t.head,
                    block,
                };
                let bytes = &mut inputs.bytes;
                inputs.index.entry(key).or_insert_with(|| {
                    let tokens = problem.block_tokens(t.seq as usize, block as usize).len() as f64;
                    bytes.push(per_token * tokens);
                    bytes.len() - 1
                });
            }
        }
        inputs
    }

    /// Splits the inputs, in order, into at most `stages` chunks of about equal bytes: the chunk
    /// of each input and the largest chunk's share of the bytes (0 when there are none).
    fn chunks(&self, stages: usize) -> (Vec<usize>, f64) {
        let total: f64 = self.bytes.iter().sum();
        let limit = total / stages as f64;
        let mut chunk_of_input = vec![0usize; self.bytes.len()];
        let (mut chunk, mut filled) = (0usize, 0.0f64);
        let mut chunk_bytes = vec![0.0f64; stages];
        for (i, &bytes) in self.bytes.iter().enumerate() {
            if filled > 0.0 && filled + bytes > limit * (1.0 + 1e-9) && chunk + 1 < stages {
                chunk += 1;
                filled = 0.0;
            }
            filled += bytes;
            chunk_bytes[chunk] += bytes;
            chunk_of_input[i] = chunk;
        }
        let largest = if total > 0.0 {
            chunk_bytes.iter().copied().fold(0.0, f64::max) / total
        } else {
            0.0
        };
        (chunk_of_input, largest)
    }
}

/// DCP's stage schedule, rank by rank: remote inputs in the order the rank's tiles first need
/// them, cut into `stages` chunks; a tile runs in the stage after its last remote input arrives
/// (stage 0 when all of its inputs are local).
struct StageSchedule {
    stage_of_tile: Vec<usize>,
    /// Over all ranks, the largest chunk's share of its rank's remote bytes.
    largest_chunk_fraction: f64,
}

impl StageSchedule {
    fn build(
        problem: &BlockProblem,
        built: &DcpGraph,
        rank: &[u32],
        sizes: &UnitSizes,
        ranks: usize,
        config: &DcpConfig,
    ) -> Self {
        let home = |seq: u32, head: u32, block: u32| {
            rank[(built.data_base[seq as usize][head as usize] + block) as usize] as usize
        };
        let mut tiles_of_rank: Vec<Vec<usize>> = vec![Vec::new(); ranks];
        for (i, tile) in built.tiles.iter().enumerate() {
            tiles_of_rank[rank[tile.vertex as usize] as usize].push(i);
        }
        let mut schedule = Self {
            stage_of_tile: vec![0; built.tiles.len()],
            largest_chunk_fraction: 0.0,
        };
        for (r, tiles) in tiles_of_rank.iter().enumerate() {
            let inputs = RemoteInputs::of_rank(r, tiles, built, home, problem, sizes);
            let (chunk_of_input, largest) = inputs.chunks(config.stages);
            schedule.largest_chunk_fraction = schedule.largest_chunk_fraction.max(largest);
            for &i in tiles {
                let t = built.tiles[i];
                schedule.stage_of_tile[i] = [(false, t.q_block), (true, t.kv_block)]
                    .iter()
                    .filter_map(|&(is_kv, block)| {
                        inputs.index.get(&RemoteInput {
                            is_kv,
                            seq: t.seq,
                            head: t.head,
                            block,
                        })
                    })
                    .map(|&input| chunk_of_input[input] + 1)
                    .max()
                    .unwrap_or(0);
            }
        }
        schedule
    }
}
