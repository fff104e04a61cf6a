//! The block-level plan format shared by every strategy, and its validator.
//!
//! Per sequence and head group, tokens are cut into blocks of `block` tokens (the last may be
//! shorter). A **compute block** is a (q block, kv block) pair whose mask tile is not empty; a
//! **data block** is a q, kv or o block with a home rank. JSON (stable):
//!
//! ```json
//! {"ranks": R,
//!  "blocks": [{"seq": s, "head": h, "q_block": i, "kv_block": j, "rank": r, "stage": t}, …],
//!  "data":   [{"kind": "q"|"kv"|"o", "seq": s, "head": h, "block": i, "home_rank": r}, …],
//!  "stats":  {"strategy": "dcp", "block": B, …}}
//! ```
//!
//! `stats` is a [`PlanStats`]: what the planner reports, tagged by its strategy.
//!
//! `head` is the head group (one kv head and the query heads sharing it). The validator checks
//! that every non-empty mask tile is computed exactly once and every data block has exactly one
//! home, independently of how the plan was made.

use std::ops::Range;

use burn_dcp_kernels::{mask_of, validate_masks, MaskSpec};
use serde::{Deserialize, Serialize};

use crate::error::CpError;
use crate::strategy::StrategyKind;

mod validate;

pub use validate::validate_plan;

/// A compute block: attention of one q block against one kv block of one head group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ComputeBlock {
    pub seq: usize,
    pub head: usize,
    pub q_block: usize,
    pub kv_block: usize,
    pub rank: usize,
    pub stage: usize,
}

/// What a data block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    Q,
    Kv,
    O,
}

/// A data block and the rank where it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DataBlock {
    pub kind: DataKind,
    pub seq: usize,
    pub head: usize,
    pub block: usize,
    pub home_rank: usize,
}

/// A plan (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub ranks: usize,
    pub blocks: Vec<ComputeBlock>,
    pub data: Vec<DataBlock>,
    pub stats: PlanStats,
}

/// What a planner reports about its plan: the plan JSON's `"stats"` object, tagged by
/// `"strategy"` (the strategy names of `plan_sim --strategies`). Every variant has the block size
/// the plan was made with (static strategies may halve `--block`, see
/// [`crate::planner::strategies::PlanInput::static_problem`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case")]
pub enum PlanStats {
    RingZigzag {
        block: usize,
    },
    Ulysses(MeshStats),
    Usp(MeshStats),
    AllGather {
        block: usize,
    },
    MegatronDynamic {
        block: usize,
        /// Micro-batches the dynamic CP schedule needed (their stages follow each other).
        micro_batches: usize,
        /// The scheduler's token budget per rank.
        max_seq_len_per_rank: usize,
    },
    Dcp(DcpStats),
    /// Statistics of a plan made elsewhere: any JSON that is not one of the objects above (also
    /// a known strategy name with other fields), kept as it is. Statistics are informational:
    /// they never make a plan invalid, so the plan format stays open to other planners.
    #[serde(untagged)]
    Other(serde_json::Value),
}

/// Ulysses / USP: the 2D mesh the plan was made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshStats {
    pub block: usize,
    pub ulysses_degree: usize,
    pub ring_degree: usize,
    /// Head units: `max(kv heads, ulysses degree)`.
    pub head_units: usize,
}

/// DCP: the hypergraph, its partition and the stage schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DcpStats {
    pub block: usize,
    pub communication_stages: usize,
    /// Over all ranks, the largest communication chunk's share of its rank's remote bytes.
    pub largest_stage_fraction: f64,
    /// The partition's connectivity cost `Σ_e w(e)·(λ(e) − 1)`, in bytes.
    pub connectivity_cost_bytes: f64,
    pub vertices: usize,
    pub hyperedges: usize,
    /// Side of the tile squares one compute vertex holds.
    pub tile_group: usize,
    pub compute_epsilon: f64,
    pub memory_epsilon: f64,
}

impl PlanStats {
    /// The strategy name (the `"strategy"` tag); for [`PlanStats::Other`], its `"strategy"`
    /// string if it has one, else `""`.
    pub fn strategy(&self) -> &str {
        match self {
            Self::Other(value) => value["strategy"].as_str().unwrap_or_default(),
            typed => typed.kind().map_or("", StrategyKind::plan_name),
        }
    }

    /// The strategy of the typed statistics (their `"strategy"` tag is its
    /// [`plan_name`](StrategyKind::plan_name)); `None` for [`PlanStats::Other`].
    pub fn kind(&self) -> Option<StrategyKind> {
        Some(match self {
            Self::RingZigzag { .. } => StrategyKind::RING_ZIGZAG,
            Self::Ulysses(_) => StrategyKind::Ulysses,
            Self::Usp(_) => StrategyKind::Usp,
            Self::AllGather { .. } => StrategyKind::AllGather,
            Self::MegatronDynamic { .. } => StrategyKind::Dynamic,
            Self::Dcp(_) => StrategyKind::Dcp,
            Self::Other(_) => return None,
        })
    }

    /// The block size of the plan (for [`PlanStats::Other`], its `"block"` if it has one).
    pub fn block(&self) -> Option<usize> {
        match self {
            Self::RingZigzag { block }
            | Self::AllGather { block }
            | Self::MegatronDynamic { block, .. } => Some(*block),
            Self::Ulysses(mesh) | Self::Usp(mesh) => Some(mesh.block),
            Self::Dcp(dcp) => Some(dcp.block),
            Self::Other(value) => value["block"].as_u64().map(|block| block as usize),
        }
    }
}

impl Plan {
    /// A plan with no blocks yet.
    pub fn new(ranks: usize, stats: PlanStats) -> Self {
        Self {
            ranks,
            blocks: Vec::new(),
            data: Vec::new(),
            stats,
        }
    }

    /// Homes the Q, KV and O blocks of token block `block` of (`seq`, `head`) on `home_rank`.
    pub fn home_token_block(&mut self, seq: usize, head: usize, block: usize, home_rank: usize) {
        for kind in [DataKind::Q, DataKind::Kv, DataKind::O] {
            self.data.push(DataBlock {
                kind,
                seq,
                head,
                block,
                home_rank,
            });
        }
    }
}

/// The problem every plan covers.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockProblem {
    pub seq_lens: Vec<usize>,
    /// One mask per sequence, or one for all.
    pub masks: Vec<MaskSpec>,
    pub head_groups: usize,
    pub block: usize,
}

/// The most (q block, kv block) pairs, `Σ ⌈len/block⌉²`, a problem may have: 2²² pairs (a
/// 1 M-token sequence in blocks of 512) plan in about 25 s and 3 GB on one core.
pub const MAX_PLAN_TILES: usize = 1 << 22;

impl BlockProblem {
    pub fn validate(&self) -> Result<(), CpError> {
        if self.block == 0 || self.head_groups == 0 {
            return Err(CpError::Config(format!(
                "block size ({}) and head groups ({}) must be at least 1",
                self.block, self.head_groups
            )));
        }
        if let Some(seq) = self.seq_lens.iter().position(|&len| len == 0) {
            return Err(CpError::Config(format!(
                "sequence {seq} has length 0: every planned sequence needs at least one token"
            )));
        }
        let tiles = self.seq_lens.iter().try_fold(0usize, |sum, &len| {
            let blocks = len.div_ceil(self.block);
            sum.checked_add(blocks.checked_mul(blocks)?)
        });
        match tiles {
            Some(tiles) if tiles <= MAX_PLAN_TILES => {}
            _ => {
                return Err(CpError::Config(format!(
                    "{} sequences ({} tokens, longest {}) in blocks of {} make more than {MAX_PLAN_TILES} block pairs: planning would take minutes and gigabytes; use a larger block or fewer tokens",
                    self.seq_lens.len(),
                    self.seq_lens.iter().fold(0usize, |a, &b| a.saturating_add(b)),
                    self.seq_lens.iter().max().copied().unwrap_or(0),
                    self.block
                )))
            }
        }
        validate_masks(&self.masks, &self.seq_lens)?;
        Ok(())
    }

    pub fn mask(&self, seq: usize) -> &MaskSpec {
        mask_of(&self.masks, seq)
    }

    /// Number of blocks of sequence `seq`.
    pub fn blocks_of(&self, seq: usize) -> usize {
        self.seq_lens[seq].div_ceil(self.block)
    }

    /// Token range of block `index` of sequence `seq`.
    pub fn block_tokens(&self, seq: usize, index: usize) -> Range<usize> {
        index * self.block..((index + 1) * self.block).min(self.seq_lens[seq])
    }

    /// For each q block of `seq`, the kv blocks whose mask tile is not empty (sorted). Cost
    /// `O(len · log block)`: each query's ≤ 2 key ranges become block intervals, merged per q block.
    pub fn nonempty_tiles(&self, seq: usize) -> Vec<Vec<usize>> {
        let len = self.seq_lens[seq];
        let mask = self.mask(seq);
        (0..self.blocks_of(seq))
            .map(|q_block| {
                let mut intervals: Vec<(usize, usize)> = self
                    .block_tokens(seq, q_block)
                    .flat_map(|i| {
                        mask.key_ranges(i, len)
                            .iter()
                            .map(|r| (r.start / self.block, (r.end - 1) / self.block))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                intervals.sort_unstable();
                let mut blocks = Vec::new();
                let mut next = 0;
                for (first, last) in intervals {
                    for kv in first.max(next)..=last {
                        blocks.push(kv);
                    }
                    next = next.max(last + 1);
                }
                blocks
            })
            .collect()
    }
}

/// Unmasked (query, key) pairs of every non-empty tile of one sequence: `rows[q_block]` lists
/// `(kv_block, pairs)` sorted by kv block. Built in `O(len + tiles)`: each query's ≤ 2 key ranges
/// add partial counts to their end blocks and a +1 over the full blocks between them (difference
/// array), so a long causal sequence costs no more than its tile count.
#[derive(Clone, Debug, PartialEq)]
pub struct TileGrid {
    pub rows: Vec<Vec<(u32, u64)>>,
}

impl TileGrid {
    pub fn new(problem: &BlockProblem, seq: usize) -> Self {
        let len = problem.seq_lens[seq];
        let block = problem.block;
        let blocks = problem.blocks_of(seq);
        let mask = problem.mask(seq);
        let mut partial = vec![0u64; blocks];
        let mut full = vec![0i64; blocks + 1];
        let rows = (0..blocks)
            .map(|q_block| {
                partial.iter_mut().for_each(|p| *p = 0);
                full.iter_mut().for_each(|f| *f = 0);
                for i in problem.block_tokens(seq, q_block) {
                    for range in mask.key_ranges(i, len).iter() {
                        if range.is_empty() {
                            continue;
                        }
                        let (first, last) = (range.start / block, (range.end - 1) / block);
                        if first == last {
                            partial[first] += range.len() as u64;
                        } else {
                            partial[first] += ((first + 1) * block - range.start) as u64;
                            partial[last] += (range.end - last * block) as u64;
                            full[first + 1] += 1;
                            full[last] -= 1;
                        }
                    }
                }
                let mut running = 0i64;
                let mut row = Vec::new();
                for kv in 0..blocks {
                    running += full[kv];
                    let pairs = partial[kv] + running as u64 * block as u64;
                    if pairs > 0 {
                        row.push((kv as u32, pairs));
                    }
                }
                row
            })
            .collect();
        Self { rows }
    }

    /// Pairs of tile `(q_block, kv_block)` (0 when the tile is empty).
    pub fn pairs(&self, q_block: usize, kv_block: usize) -> u64 {
        let row = &self.rows[q_block];
        row.binary_search_by_key(&(kv_block as u32), |&(kv, _)| kv)
            .map(|i| row[i].1)
            .unwrap_or(0)
    }

    pub fn tiles(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }
}

/// The tile grids of every sequence of a problem.
pub fn tile_grids(problem: &BlockProblem) -> Vec<TileGrid> {
    (0..problem.seq_lens.len())
        .map(|seq| TileGrid::new(problem, seq))
        .collect()
}

/// The home rank of every head unit's Q block, `unit_homes[seq][block][unit]`, of a plan valid
/// for `problem` (see [`validate_plan`]).
pub fn unit_homes(plan: &Plan, problem: &BlockProblem) -> Vec<Vec<Vec<usize>>> {
    let mut homes: Vec<Vec<Vec<usize>>> = (0..problem.seq_lens.len())
        .map(|seq| vec![vec![0; problem.head_groups]; problem.blocks_of(seq)])
        .collect();
    for d in plan.data.iter().filter(|d| d.kind == DataKind::Q) {
        homes[d.seq][d.block][d.head] = d.home_rank;
    }
    homes
}

/// Where the model keeps each token block of an executed plan, `token_homes[seq][block]`, from its
/// units' homes ([`unit_homes`]): the rank homing the block's Q for the most head units (ties:
/// the one of the lowest unit). The model's token-local layers need every head of a token on one
/// rank, so a head unit homed elsewhere moves there before the pass and its results come back
/// after it ([`crate::planner::cost::unit_move_transfers`]). With one head unit: that unit's home.
pub fn token_homes(unit_homes: &[Vec<Vec<usize>>]) -> Vec<Vec<usize>> {
    unit_homes
        .iter()
        .map(|blocks| blocks.iter().map(|units| majority(units)).collect())
        .collect()
}

/// The most frequent rank of `units` (ties: the first to appear).
fn majority(units: &[usize]) -> usize {
    let count = |rank: usize| units.iter().filter(|&&r| r == rank).count();
    let mut best = units[0];
    for &rank in units {
        if count(rank) > count(best) {
            best = rank;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unmasked (query, key) pairs of one tile, query by query: the oracle for [`TileGrid`].
    fn tile_pairs(p: &BlockProblem, seq: usize, q_block: usize, kv_block: usize) -> u64 {
        let len = p.seq_lens[seq];
        let keys = p.block_tokens(seq, kv_block);
        p.block_tokens(seq, q_block)
            .map(|i| {
                p.mask(seq)
                    .key_ranges(i, len)
                    .iter()
                    .map(|r| r.end.min(keys.end).saturating_sub(r.start.max(keys.start)) as u64)
                    .sum::<u64>()
            })
            .sum()
    }

    fn problem(mask: &str) -> BlockProblem {
        BlockProblem {
            seq_lens: vec![1000, 300, 2049],
            masks: vec![mask.parse().unwrap()],
            head_groups: 2,
            block: 128,
        }
    }

    /// One causal sequence of 3 tokens.
    fn three_causal_tokens(head_groups: usize, block: usize) -> BlockProblem {
        BlockProblem {
            seq_lens: vec![3],
            masks: vec![MaskSpec::Causal],
            head_groups,
            block,
        }
    }

    /// One mask of each kind the planners cut differently.
    const MASKS: [&str; 5] = [
        "causal",
        "full",
        "lambda:64,256",
        "blockwise:128,2",
        "shared-question:0.2,4",
    ];

    #[test]
    fn nonempty_tiles_match_a_scan() {
        for mask in MASKS.into_iter().chain(["sliding:100"]) {
            let p = problem(mask);
            for seq in 0..3 {
                let grid = TileGrid::new(&p, seq);
                let tiles = p.nonempty_tiles(seq);
                for (q, row) in grid.rows.iter().enumerate() {
                    let kvs: Vec<usize> = row.iter().map(|&(kv, _)| kv as usize).collect();
                    assert_eq!(kvs, tiles[q], "{mask} seq {seq} q {q}");
                    for &(kv, pairs) in row {
                        assert_eq!(pairs, tile_pairs(&p, seq, q, kv as usize));
                    }
                }
                for (q, q_tiles) in tiles.iter().enumerate() {
                    for kv in 0..p.blocks_of(seq) {
                        let any = p.mask(seq).any_allowed(
                            p.block_tokens(seq, q),
                            p.block_tokens(seq, kv),
                            p.seq_lens[seq],
                        );
                        assert_eq!(q_tiles.contains(&kv), any, "{mask} seq {seq} q {q} kv {kv}");
                        assert_eq!(tile_pairs(&p, seq, q, kv) > 0, any);
                    }
                }
            }
        }
    }

    /// Sequences of `seq_lens` under `mask`, `heads` query heads over 2 kv heads of dim 64 in
    /// bf16, blocks of 128, on one a100-p4d node.
    fn plan_input(
        seq_lens: Vec<usize>,
        mask: MaskSpec,
        heads: usize,
    ) -> crate::planner::strategies::PlanInput {
        crate::planner::strategies::PlanInput {
            seq_lens,
            masks: vec![mask],
            dims: crate::planner::cost::AttentionDims {
                heads,
                kv_heads: 2,
                head_dim: 64,
                element_bytes: 2,
            },
            topology: crate::planner::topology::Topology::preset("a100-p4d", 1).unwrap(),
            block: 128,
            dcp: Default::default(),
            max_seq_len_per_rank: None,
        }
    }

    #[test]
    fn every_plan_is_tagged_with_its_kinds_plan_name() {
        let input = plan_input(vec![1000, 300], MaskSpec::Causal, 8);
        for kind in StrategyKind::ALL {
            let routed = crate::planner::by_strategy::plan_strategy(kind, &input).unwrap();
            assert_eq!(routed.name, kind.plan_name());
            assert_eq!(routed.plan.stats.kind(), Some(kind));
            assert_eq!(routed.plan.stats.strategy(), kind.plan_name());
            let json = serde_json::to_value(&routed.plan.stats).unwrap();
            assert_eq!(json["strategy"], kind.plan_name());
        }
    }

    #[test]
    fn validator_accepts_a_ring_plan_and_rejects_broken_ones() {
        for mask in MASKS {
            let input = plan_input(vec![1000, 300, 2049], mask.parse().unwrap(), 4);
            let routed = crate::planner::by_strategy::plan_strategy(
                crate::strategy::StrategyKind::RING_ZIGZAG,
                &input,
            )
            .unwrap();
            let (plan, p) = (routed.plan, routed.problem);
            validate_plan(&plan, &p).unwrap();
            let json = serde_json::to_string(&plan).unwrap();
            assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
            let refusal = |broken: Plan| validate_plan(&broken, &p).unwrap_err().to_string();
            let mut twice = plan.clone();
            twice.blocks.push(plan.blocks[0]);
            assert!(refusal(twice).contains("computed 2 times"));
            let mut missing = plan.clone();
            missing.blocks.pop();
            assert!(refusal(missing).contains("never computed"));
            let mut homeless = plan.clone();
            homeless.data.pop();
            assert!(refusal(homeless).contains("has no home"));
        }
    }

    /// A plan written by another tool keeps its statistics as they are: it deserializes,
    /// validates and serializes back unchanged; plans of ours parse into their typed stats.
    #[test]
    fn plans_with_foreign_statistics_round_trip() {
        let problem = three_causal_tokens(1, 2);
        let text = r#"{"ranks": 2,
            "blocks": [{"seq": 0, "head": 0, "q_block": 0, "kv_block": 0, "rank": 0, "stage": 0},
                       {"seq": 0, "head": 0, "q_block": 1, "kv_block": 0, "rank": 1, "stage": 1},
                       {"seq": 0, "head": 0, "q_block": 1, "kv_block": 1, "rank": 1, "stage": 0}],
            "data": [{"kind": "q", "seq": 0, "head": 0, "block": 0, "home_rank": 0},
                     {"kind": "kv", "seq": 0, "head": 0, "block": 0, "home_rank": 0},
                     {"kind": "o", "seq": 0, "head": 0, "block": 0, "home_rank": 0},
                     {"kind": "q", "seq": 0, "head": 0, "block": 1, "home_rank": 1},
                     {"kind": "kv", "seq": 0, "head": 0, "block": 1, "home_rank": 1},
                     {"kind": "o", "seq": 0, "head": 0, "block": 1, "home_rank": 1}],
            "stats": {"strategy": "hand-made", "note": "two ranks"}}"#;
        let plan: Plan = serde_json::from_str(text).unwrap();
        validate_plan(&plan, &problem).unwrap();
        assert_eq!(plan.stats.strategy(), "hand-made");
        assert_eq!(plan.stats.block(), None);
        let again: serde_json::Value = serde_json::to_value(&plan).unwrap();
        assert_eq!(
            again["stats"],
            serde_json::json!({"strategy": "hand-made", "note": "two ranks"})
        );
        let ours: PlanStats =
            serde_json::from_str(r#"{"strategy": "all-gather", "block": 64}"#).unwrap();
        assert_eq!(ours, PlanStats::AllGather { block: 64 });
        // statistics never make a plan invalid: a known name with other fields stays as written
        let odd: PlanStats = serde_json::from_str(r#"{"strategy": "dcp", "block": "x"}"#).unwrap();
        assert_eq!(
            odd,
            PlanStats::Other(serde_json::json!({"strategy": "dcp", "block": "x"}))
        );
    }

    /// The token home of a block is the rank homing most of its head units; ties go to the
    /// lowest unit's.
    #[test]
    fn token_homes_follow_the_most_units() {
        let problem = three_causal_tokens(4, 1);
        let mut plan = Plan::new(4, PlanStats::RingZigzag { block: 1 });
        for (block, homes) in [[2, 1, 1, 3], [0, 1, 2, 3], [3, 0, 3, 0]]
            .iter()
            .enumerate()
        {
            for (unit, &home) in homes.iter().enumerate() {
                plan.home_token_block(0, unit, block, home);
            }
        }
        assert_eq!(unit_homes(&plan, &problem)[0][1], vec![0, 1, 2, 3]);
        assert_eq!(
            token_homes(&unit_homes(&plan, &problem)),
            vec![vec![1, 0, 3]]
        );
    }
}
