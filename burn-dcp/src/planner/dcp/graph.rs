//! The DCP hypergraph of a block problem (see the module docs of [`super`]).

use crate::error::CpError;
use crate::planner::cost::{AttentionDims, UnitSizes, BACKWARD_FLOPS_FACTOR};
use crate::planner::hypergraph::{FastMap, Hypergraph};
use crate::planner::plan::{BlockProblem, TileGrid};

/// A non-empty tile and the vertex that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tile {
    pub(super) seq: u32,
    pub(super) head: u32,
    pub(super) q_block: u32,
    pub(super) kv_block: u32,
    pub(super) vertex: u32,
}

/// The hypergraph of a problem and what its vertices stand for.
pub(super) struct DcpGraph {
    pub(super) graph: Hypergraph,
    /// Every non-empty tile; a vertex holds a `group × group` square of them.
    pub(super) tiles: Vec<Tile>,
    /// Vertex of the data block (seq, head, block) — its Q, KV and O together:
    /// `data_base[seq][head] + block`.
    pub(super) data_base: Vec<Vec<u32>>,
}

/// Compute vertices a rank should get at least: tiles are grouped `g × g` (g a power of two)
/// only while this many groups per rank remain, so balance stays fine-grained while very long
/// sequences do not flood the partitioner with vertices.
pub const MIN_COMPUTE_VERTICES_PER_RANK: usize = 256;

/// Side of the tile squares for `tiles` tiles on `ranks` ranks.
pub(super) fn tile_group(tiles: usize, ranks: usize) -> usize {
    let mut group = 1;
    while tiles / ((2 * group) * (2 * group)) >= MIN_COMPUTE_VERTICES_PER_RANK * ranks {
        group *= 2;
    }
    group
}

/// The hypergraph of `problem`. With `token_edges`, the data vertices of one token block's head
/// units are also joined by a hyperedge weighing a unit's move between ranks (its q/o and kv
/// bytes, forward + backward): an executed plan keeps a token's heads on one rank for the
/// model's other layers and moves the units homed elsewhere
/// ([`crate::planner::cost::unit_move_transfers`]), so splitting a token's units costs that.
pub(super) fn build_graph(
    problem: &BlockProblem,
    grids: &[TileGrid],
    dims: &AttentionDims,
    group: usize,
    token_edges: bool,
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
        let bases: Vec<u32> = (0..problem.head_groups)
            .map(|head| builder.add_head(problem, grid, seq, head))
            .collect();
        if token_edges && problem.head_groups > 1 {
            let unit_bytes = builder.sizes.qo_traffic() + builder.sizes.kv_traffic();
            for block in 0..problem.blocks_of(seq) {
                let tokens = problem.block_tokens(seq, block).len() as f64;
                let pins = bases.iter().map(|&base| base + block as u32).collect();
                builder.edges.push((unit_bytes * tokens, pins));
            }
        }
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
        // the compute vertex of each (q group, kv group) square of tiles
        let mut square_vertex: FastMap<TileSquare, u32> = FastMap::default();
        let mut columns: Vec<EdgePins> = (0..blocks as u32)
            .map(|b| EdgePins::new(base + b))
            .collect();
        for (q_block, row) in grid.rows.iter().enumerate() {
            let mut pins = EdgePins::new(base + q_block as u32);
            for &(kv_block, pairs) in row {
                let key = TileSquare {
                    q: (q_block / self.group) as u32,
                    kv: kv_block / self.group as u32,
                };
                let vertex = match square_vertex.get(&key) {
                    Some(&vertex) => vertex,
                    None => {
                        let vertex = self.add_vertex(0.0, 0.0);
                        square_vertex.insert(key, vertex);
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

/// A `group × group` square of tiles of one head: its q and kv block indices divided by the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TileSquare {
    q: u32,
    kv: u32,
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
