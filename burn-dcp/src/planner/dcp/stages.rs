//! The stage schedule: each rank's remote inputs cut into communication chunks, each tile in
//! the compute stage after its last remote input arrives.

use super::graph::DcpGraph;
use super::DcpConfig;
use crate::planner::cost::UnitSizes;
use crate::planner::hypergraph::FastMap;
use crate::planner::plan::BlockProblem;

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
pub(super) struct StageSchedule {
    pub(super) stage_of_tile: Vec<usize>,
    /// Over all ranks, the largest chunk's share of its rank's remote bytes.
    pub(super) largest_chunk_fraction: f64,
}

impl StageSchedule {
    pub(super) fn build(
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
