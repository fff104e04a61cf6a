//! Every strategy as a block plan with its communication, so one validator and one cost model
//! measure them all: ring (zigzag), Ulysses, USP, Megatron-style dynamic CP and DCP.
//!
//! Static strategies at block granularity:
//! - **ring-zigzag**: a sequence's blocks are cut into `2R` zigzag chunks (chunk `c` and `2R−1−c`
//!   on ring position `c`), rotated by the sequence index so sequences shorter than `2R` blocks do
//!   not all start on rank 0 (the real layout splits at token granularity; blocks are the plan's
//!   unit). Q and O stay home; KV travels the ring hop by hop, `R − 1` hops forward, and KV plus
//!   the dK/dV accumulators backward (the accumulators take one more hop home). Stage = ring step.
//! - **ulysses** (degree `R`) and **usp** (Ulysses degree `u` inside a node × ring of `R/u`): head
//!   units are `max(kv heads, u)` (past the kv head count, kv heads are replicated); tokens live
//!   round-robin on the ranks of their ring position; an all-to-all before compute brings each
//!   head unit to its rank (not overlapped), the ring passes KV between ring positions, and an
//!   all-to-all brings O (and dQ, dK, dV) back.
//! - **all-gather** (llama3-style): tokens zigzag like ring-zigzag, every tile on its query
//!   block's rank; before compute every rank's KV goes to every other rank (forward, and again in
//!   backward), after the backward every rank sends each block's partial dK/dV home (the
//!   reduce-scatter). One stage, not overlapped; KV moves whatever the mask needs, as it runs.
//! - **megatron-dynamic**: the dynamic CP schedule ([`crate::planner::dynamic`]) puts each
//!   sequence on a group of its size; each group runs ring-zigzag on its own sequences; micro-
//!   batches the schedule needs run one after the other (their stages follow each other).
//! - **dcp**: see [`crate::planner::dcp`].
//!
//! These are the builders the strategies' [`plan`](crate::strategy::AttentionStrategy::plan)s
//! compose; [`crate::planner::by_strategy`] plans a strategy by kind or value.

use burn_dcp_kernels::{mask_of, MaskSpec};

use crate::batch::layout::Layout;
use crate::error::CpError;
use crate::planner::cost::{AttentionDims, Pass, Ready, RoutedPlan, Transfer, UnitSizes, POST};
use crate::planner::dcp::DcpConfig;
use crate::planner::dynamic::{schedule_with, DynamicCpConfig, DynamicCpSchedule};
use crate::planner::plan::{
    tile_grids, BlockProblem, ComputeBlock, MeshStats, Plan, PlanStats, TileGrid,
};
use crate::planner::topology::Topology;
use crate::strategy::StrategyKind;
use burn_dcp_kernels::heads::HeadParts;

/// Most (q, kv) block pairs (full-mask count) a static strategy's plan may have.
pub const STATIC_TILE_BUDGET: usize = 1 << 21;

/// Everything a planner needs.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub seq_lens: Vec<usize>,
    /// One mask per sequence, or one for all.
    pub masks: Vec<MaskSpec>,
    pub dims: AttentionDims,
    pub topology: Topology,
    pub block: usize,
    pub dcp: DcpConfig,
    /// Megatron's per-rank token budget; `None`: twice the tokens of an even split.
    pub max_seq_len_per_rank: Option<usize>,
}

impl PlanInput {
    pub fn validate(&self) -> Result<(), CpError> {
        self.dims.validate()?;
        self.topology.validate()?;
        self.dcp.validate()?;
        if self.max_seq_len_per_rank == Some(0) {
            return Err(CpError::Config(
                "max_seq_len_per_rank must be at least 1 token".into(),
            ));
        }
        self.problem(self.dims.kv_heads).validate()
    }

    /// The block problem with `units` head units.
    pub fn problem(&self, units: usize) -> BlockProblem {
        BlockProblem {
            seq_lens: self.seq_lens.clone(),
            masks: self.masks.clone(),
            head_groups: units,
            block: self.block,
        }
    }

    /// The problem a static strategy over rings of `ring` positions is planned on. Their real
    /// layouts cut every sequence into `2·ring` chunks at token granularity, so the block is
    /// halved (down to 16 tokens) while some sequence still has fewer than `2·ring` blocks and
    /// the grid stays under [`STATIC_TILE_BUDGET`] tiles; otherwise short sequences would land
    /// whole on one rank and the static strategies would look worse balanced than they are.
    pub fn static_problem(&self, units: usize, ring: usize) -> BlockProblem {
        let mut problem = self.problem(units);
        let tiles = |block: usize| -> usize {
            self.seq_lens
                .iter()
                .map(|&len| len.div_ceil(block).pow(2))
                .sum()
        };
        while problem.block > 16
            && self
                .seq_lens
                .iter()
                .any(|&len| len.div_ceil(problem.block) < 2 * ring && len > problem.block / 2)
            && tiles(problem.block / 2) <= STATIC_TILE_BUDGET
        {
            problem.block /= 2;
        }
        problem
    }
}

/// USP's Ulysses degree: the largest divisor of the devices per node that also divides the query
/// heads and is compatible with the kv heads (one divides the other).
pub fn usp_ulysses_degree(input: &PlanInput) -> Result<usize, CpError> {
    let per_node = input.topology.devices_per_node;
    let heads = input.dims.head_pair()?;
    (1..=per_node)
        .rev()
        .find(|&d| per_node.is_multiple_of(d) && heads.split(HeadParts::Units(d)).is_ok())
        .ok_or_else(|| CpError::Config("no Ulysses degree fits the heads and the node".into()))
}

/// Ring position of block `block` of a sequence of `blocks` blocks among `ring` positions, zigzag,
/// rotated by `rotation`.
pub fn zigzag_position(blocks: usize, block: usize, ring: usize, rotation: usize) -> usize {
    let chunk = block * 2 * ring / blocks.max(1);
    let position = if chunk < ring {
        chunk
    } else {
        2 * ring - 1 - chunk
    };
    (position + rotation) % ring
}

/// Ring passes of KV over `ring` (ranks in ring order): `kv_bytes_at[p]` bytes live on position
/// `p`; steps `1..g` move them one hop at stages `offset + step`; backward also moves the dK/dV
/// accumulators, which take one more hop home after the last step.
fn ring_hops(ring: &[usize], kv_bytes_at: &[f64], offset: usize, transfers: &mut Vec<Transfer>) {
    let g = ring.len();
    for step in 1..g {
        for p in 0..g {
            let bytes = kv_bytes_at[(p + g - step) % g];
            if bytes == 0.0 {
                continue;
            }
            let (from, to) = (ring[(p + g - 1) % g], ring[p]);
            // KV leaves as the step before starts; backward, the dK/dV accumulators follow it
            // once that step has computed them.
            for (pass, ready) in [
                (Pass::Forward, Ready::Held),
                (Pass::Backward, Ready::Held),
                (Pass::Backward, Ready::Computed),
            ] {
                transfers.push(Transfer {
                    pass,
                    stage: offset + step,
                    from,
                    to,
                    bytes,
                    ready,
                });
            }
        }
    }
    if g > 1 {
        for p in 0..g {
            let bytes = kv_bytes_at[(p + 1) % g];
            if bytes > 0.0 {
                transfers.push(Transfer {
                    pass: Pass::Backward,
                    stage: POST,
                    from: ring[p],
                    to: ring[(p + 1) % g],
                    bytes,
                    ready: Ready::Computed,
                });
            }
        }
    }
}

/// The zigzag layout of one sequence's blocks over a ring (see [`zigzag_position`]).
#[derive(Clone, Copy, Debug)]
struct Zigzag {
    blocks: usize,
    ring: usize,
    rotation: usize,
}

impl Zigzag {
    /// Sequence `seq` of `problem` over `ring` positions, rotated by the sequence index.
    fn of(problem: &BlockProblem, seq: usize, ring: usize) -> Self {
        Self {
            blocks: problem.blocks_of(seq),
            ring,
            rotation: seq % ring,
        }
    }

    fn position(&self, block: usize) -> usize {
        zigzag_position(self.blocks, block, self.ring, self.rotation)
    }
}

/// Homes every token block of `seq` (all head units) on the rank of its zigzag position of
/// `ring`, and adds its KV bytes to that position's `kv_bytes_at`.
fn home_zigzag(
    problem: &BlockProblem,
    seq: usize,
    ring: &[usize],
    sizes: &UnitSizes,
    plan: &mut Plan,
    kv_bytes_at: &mut [f64],
) -> Zigzag {
    let zigzag = Zigzag::of(problem, seq, ring.len());
    for block in 0..zigzag.blocks {
        let p = zigzag.position(block);
        kv_bytes_at[p] +=
            sizes.kv * problem.block_tokens(seq, block).len() as f64 * problem.head_groups as f64;
        for head in 0..problem.head_groups {
            plan.home_token_block(seq, head, block, ring[p]);
        }
    }
    zigzag
}

/// Pushes every tile of `seq` for `units` head units; `place(q position, kv position, unit)`
/// gives a tile's (rank, stage).
fn push_tiles(
    plan: &mut Plan,
    grid: &TileGrid,
    seq: usize,
    units: usize,
    zigzag: Zigzag,
    place: impl Fn(usize, usize, usize) -> (usize, usize),
) {
    for (q_block, row) in grid.rows.iter().enumerate() {
        let q = zigzag.position(q_block);
        for &(kv_block, _) in row {
            let kv = zigzag.position(kv_block as usize);
            for head in 0..units {
                let (rank, stage) = place(q, kv, head);
                plan.blocks.push(ComputeBlock {
                    seq,
                    head,
                    q_block,
                    kv_block: kv_block as usize,
                    rank,
                    stage,
                });
            }
        }
    }
}

/// Ring-zigzag of `seqs` over `ring`, every head unit, stages from `offset`.
#[allow(clippy::too_many_arguments)]
fn ring_over(
    problem: &BlockProblem,
    grids: &[TileGrid],
    seqs: &[usize],
    ring: &[usize],
    offset: usize,
    sizes: &UnitSizes,
    plan: &mut Plan,
    transfers: &mut Vec<Transfer>,
) {
    let g = ring.len();
    let mut kv_bytes_at = vec![0.0; g];
    for &seq in seqs {
        let zigzag = home_zigzag(problem, seq, ring, sizes, plan, &mut kv_bytes_at);
        push_tiles(
            plan,
            &grids[seq],
            seq,
            problem.head_groups,
            zigzag,
            |q, kv, _| (ring[q], offset + (q + g - kv) % g),
        );
    }
    ring_hops(ring, &kv_bytes_at, offset, transfers);
}

pub(crate) fn ring_zigzag(input: &PlanInput) -> Result<RoutedPlan, CpError> {
    let problem = input.static_problem(input.dims.kv_heads, input.topology.ranks());
    let sizes = input.dims.unit_sizes(problem.head_groups)?;
    let grids = tile_grids(&problem);
    let ranks = input.topology.ranks();
    let mut plan = Plan::new(
        ranks,
        PlanStats::RingZigzag {
            block: problem.block,
        },
    );
    let mut transfers = Vec::new();
    let seqs: Vec<usize> = (0..problem.seq_lens.len()).collect();
    let ring: Vec<usize> = (0..ranks).collect();
    ring_over(
        &problem,
        &grids,
        &seqs,
        &ring,
        0,
        &sizes,
        &mut plan,
        &mut transfers,
    );
    Ok(RoutedPlan {
        name: StrategyKind::RING_ZIGZAG.plan_name().into(),
        plan,
        problem,
        grids,
        sizes,
        transfers,
    })
}

/// Megatron's scheduler configuration for `input`: the whole mesh as the pool, power-of-two
/// groups from 1, and the per-rank budget (default: twice the tokens of an even split).
pub fn megatron_config(input: &PlanInput) -> DynamicCpConfig {
    let ranks = input.topology.ranks();
    let tokens: usize = input.seq_lens.iter().sum();
    DynamicCpConfig {
        world: ranks,
        max_seq_len_per_rank: input
            .max_seq_len_per_rank
            .unwrap_or_else(|| (2 * tokens.div_ceil(ranks)).max(1)),
        min_cp_size: 1,
        power_of_two: true,
    }
}

/// The dynamic CP schedule megatron-dynamic plans (and `gpt_longctx --strategy auto` runs): the
/// same scheduler as training (`gpt_longctx --strategy dynamic`), balancing the attention work of
/// each sequence's mask (training's own dynamic CP adds the token-linear FLOPs of its model),
/// groups laid out zigzag.
pub fn megatron_schedule(input: &PlanInput) -> Result<DynamicCpSchedule, CpError> {
    let works: Vec<f64> = input
        .seq_lens
        .iter()
        .enumerate()
        .map(|(seq, &len)| {
            let mask = mask_of(&input.masks, seq);
            (0..len)
                .map(|i| mask.key_ranges(i, len).count() as f64)
                .sum()
        })
        .collect();
    schedule_with(
        &input.seq_lens,
        &works,
        &megatron_config(input),
        Layout::Zigzag,
    )
}

pub(crate) fn megatron_dynamic(input: &PlanInput) -> Result<RoutedPlan, CpError> {
    let problem = input.static_problem(input.dims.kv_heads, input.topology.ranks());
    let sizes = input.dims.unit_sizes(problem.head_groups)?;
    let grids = tile_grids(&problem);
    let ranks = input.topology.ranks();
    let config = megatron_config(input);
    let schedule = megatron_schedule(input)?;
    let mut plan = Plan::new(
        ranks,
        PlanStats::MegatronDynamic {
            block: problem.block,
            micro_batches: schedule.micro_batches.len(),
            max_seq_len_per_rank: config.max_seq_len_per_rank,
        },
    );
    let mut transfers = Vec::new();
    let mut offset = 0;
    for micro_batch in &schedule.micro_batches {
        let mut longest = 1;
        for group in &micro_batch.groups {
            let ring: Vec<usize> = group.ranks.clone().collect();
            longest = longest.max(ring.len());
            ring_over(
                &problem,
                &grids,
                &group.sequences,
                &ring,
                offset,
                &sizes,
                &mut plan,
                &mut transfers,
            );
        }
        offset += longest;
    }
    Ok(RoutedPlan {
        name: StrategyKind::Dynamic.plan_name().into(),
        plan,
        problem,
        grids,
        sizes,
        transfers,
    })
}

/// All-gather KV over every rank (see the module docs).
pub(crate) fn all_gather(input: &PlanInput) -> Result<RoutedPlan, CpError> {
    let ranks = input.topology.ranks();
    let problem = input.static_problem(input.dims.kv_heads, ranks);
    let sizes = input.dims.unit_sizes(problem.head_groups)?;
    let grids = tile_grids(&problem);
    let mut plan = Plan::new(
        ranks,
        PlanStats::AllGather {
            block: problem.block,
        },
    );
    let all: Vec<usize> = (0..ranks).collect();
    let mut kv_bytes_at = vec![0.0; ranks];
    for (seq, grid) in grids.iter().enumerate() {
        let zigzag = home_zigzag(&problem, seq, &all, &sizes, &mut plan, &mut kv_bytes_at);
        push_tiles(
            &mut plan,
            grid,
            seq,
            problem.head_groups,
            zigzag,
            |q, _, _| (q, 0),
        );
    }
    Ok(RoutedPlan {
        name: StrategyKind::AllGather.plan_name().into(),
        plan,
        problem,
        grids,
        sizes,
        transfers: gather_transfers(&kv_bytes_at),
    })
}

/// All-gather's communication: every rank's KV (`kv_bytes_at[rank]`) to every other rank before
/// the forward and again before the backward; the partial dK/dV back home after it.
fn gather_transfers(kv_bytes_at: &[f64]) -> Vec<Transfer> {
    let ranks = kv_bytes_at.len();
    let mut transfers = Vec::new();
    for (home, &bytes) in kv_bytes_at.iter().enumerate() {
        if bytes == 0.0 {
            continue;
        }
        for peer in (0..ranks).filter(|&peer| peer != home) {
            for (pass, stage, from, to) in [
                (Pass::Forward, 0, home, peer),
                (Pass::Backward, 0, home, peer),
                (Pass::Backward, POST, peer, home),
            ] {
                transfers.push(Transfer {
                    pass,
                    stage,
                    from,
                    to,
                    bytes,
                    ready: Ready::Held,
                });
            }
        }
    }
    transfers
}

/// USP's 2D mesh: `degree` Ulysses columns × `ring_degree` ring positions, rank
/// `position · degree + column`; head unit `u` of `units` is computed in column
/// `u · degree / units`.
#[derive(Clone, Copy, Debug)]
struct UspMesh {
    degree: usize,
    ring_degree: usize,
    units: usize,
}

impl UspMesh {
    fn column(&self, unit: usize) -> usize {
        unit * self.degree / self.units
    }

    /// The rank computing `unit` at ring position `position`.
    fn rank(&self, position: usize, unit: usize) -> usize {
        position * self.degree + self.column(unit)
    }

    /// Homes `seq`'s token blocks round-robin on the ranks of their zigzag ring position, adds
    /// each unit's KV bytes to `kv_at[column][position]` and pushes the all-to-all that brings
    /// each head unit to its column's rank (and the results back).
    fn home_blocks(
        &self,
        problem: &BlockProblem,
        seq: usize,
        sizes: &UnitSizes,
        plan: &mut Plan,
        kv_at: &mut [Vec<f64>],
        transfers: &mut Vec<Transfer>,
    ) -> Zigzag {
        let zigzag = Zigzag::of(problem, seq, self.ring_degree);
        for block in 0..zigzag.blocks {
            let p = zigzag.position(block);
            let home = p * self.degree + (block + seq) % self.degree;
            let tokens = problem.block_tokens(seq, block).len() as f64;
            for unit in 0..self.units {
                plan.home_token_block(seq, unit, block, home);
                kv_at[self.column(unit)][p] += sizes.kv * tokens;
                let rank = self.rank(p, unit);
                if rank != home {
                    all_to_all(home, rank, tokens, sizes, transfers);
                }
            }
        }
        zigzag
    }
}

/// The all-to-all of one head unit of a token block between its `home` and the `rank` that
/// computes it, per pass: Q and KV (backward: also O and dO) out before compute, the results
/// (O; backward: dQ, dK, dV) back after; bytes as the byte model's `both_sides`.
fn all_to_all(home: usize, rank: usize, tokens: f64, sizes: &UnitSizes, out: &mut Vec<Transfer>) {
    for pass in [Pass::Forward, Pass::Backward] {
        let (to, back) = sizes.token_bytes().both_sides(pass);
        out.push(Transfer {
            pass,
            stage: 0,
            from: home,
            to: rank,
            bytes: to * tokens,
            ready: Ready::Held,
        });
        out.push(Transfer {
            pass,
            stage: POST,
            from: rank,
            to: home,
            bytes: back * tokens,
            ready: Ready::Held,
        });
    }
}

/// USP with Ulysses degree `degree`; `strategy` (ulysses: `degree` is every rank, or usp) names
/// the plan.
pub(crate) fn usp(
    input: &PlanInput,
    degree: usize,
    strategy: StrategyKind,
) -> Result<RoutedPlan, CpError> {
    let name = strategy.plan_name();
    let ranks = input.topology.ranks();
    if degree == 0 || !ranks.is_multiple_of(degree) {
        return Err(CpError::Config(format!(
            "{name}: Ulysses degree {degree} must divide the {ranks} ranks"
        )));
    }
    let mesh = UspMesh {
        degree,
        ring_degree: ranks / degree,
        units: input.dims.kv_heads.max(degree),
    };
    let ring_degree = mesh.ring_degree;
    let problem = input.static_problem(mesh.units, ring_degree);
    let sizes = input.dims.unit_sizes(mesh.units)?;
    let grids = tile_grids(&problem);
    let stats = MeshStats {
        block: problem.block,
        ulysses_degree: degree,
        ring_degree,
        head_units: mesh.units,
    };
    let stats = match strategy {
        StrategyKind::Ulysses => PlanStats::Ulysses(stats),
        _ => PlanStats::Usp(stats),
    };
    let mut plan = Plan::new(ranks, stats);
    let mut transfers = Vec::new();
    // kv bytes at (column, ring position) after the all-to-all
    let mut kv_at = vec![vec![0.0; ring_degree]; degree];
    for (seq, grid) in grids.iter().enumerate() {
        let zigzag = mesh.home_blocks(&problem, seq, &sizes, &mut plan, &mut kv_at, &mut transfers);
        push_tiles(&mut plan, grid, seq, mesh.units, zigzag, |q, kv, unit| {
            (mesh.rank(q, unit), (q + ring_degree - kv) % ring_degree)
        });
    }
    for (c, kv_bytes_at) in kv_at.iter().enumerate() {
        let ring: Vec<usize> = (0..ring_degree).map(|p| p * degree + c).collect();
        ring_hops(&ring, kv_bytes_at, 0, &mut transfers);
    }
    Ok(RoutedPlan {
        name: name.into(),
        plan,
        problem,
        grids,
        sizes,
        transfers,
    })
}
