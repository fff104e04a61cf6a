//! A DCP block plan made executable: the token placement it implies and, per rank and pass, an
//! explicit list of instructions (printable, testable, countable) that the executor
//! ([`super::dcp`]) runs.
//!
//! **Placement.** Every token block (`block` tokens of one sequence; the last may be shorter)
//! has one *token home*: the rank where the model keeps it (its token-local layers need every
//! head of a token). A rank holds its token blocks in (sequence, block) order — non-contiguous
//! token sets, pieces of many sequences, or nothing. A plan may split the heads into *head
//! units* (each an equal share of the query heads and the kv heads they read); each unit of a
//! token block has its own home holding its Q, K/V and O during attention, and the token home is
//! the rank homing the most of them ([`token_homes`]). With one head unit they coincide.
//!
//! **Program of a rank** (the same shape for the forward and the backward pass), for the plan's
//! compute stages `0..=S` (stage 0: tiles whose inputs are all local; stage `t`: tiles whose last
//! remote input arrives in chunk `t`):
//!
//! ```text
//! units: send my token blocks' units homed elsewhere to their homes; receive the units homed
//!        here from their token homes (none with one head unit)
//! copies for stage 0 (normally none)
//! for t in 1..=S:  send the copies of my home blocks needed at stage t   (they move while…)
//!                  attend the tiles of stage t−1                        (…this computes)
//!                  receive the copies from homes for stage t; forward those I relay to ranks of
//!                  my node; receive the copies relayed to me
//! attend the tiles of stage S
//! results: send mine where no one relays through me; as a relay, merge my node's results with
//! mine and send them home; as a home, merge every result into my blocks
//! units: send the results of units homed here back to their token homes; receive my token
//!        blocks' units' results
//! ```
//!
//! Copies follow [`routes`]: one per (block, head unit, destination) per pass, from the home, or through
//! the first rank of a remote node that needs the block (then over that node's links). Results go
//! back the same way reversed. Every rank derives every other rank's program from the same plan,
//! and sends and receives on each pair of ranks come in the same order on both sides, so nothing
//! waits on a message that is sent later (sends never block).

use std::fmt;

use burn_dcp_kernels::Segment;

use crate::batch::placement::Placement;
use crate::comm::nodes::NodeMap;
use crate::comm::LinkBytes;
use crate::error::CpError;
use crate::planner::bytes::RankVolume;
use crate::planner::cost::unit_moves;
use crate::planner::cost::{route_transfers, routes, AttentionDims, Pass, Route, Side, Transfer};
use crate::planner::plan::{token_homes, BlockProblem, Plan};
use crate::planner::topology::Topology;

mod programs;

use programs::ProgramBuilder;

/// A token block: block `block` of sequence `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    pub seq: usize,
    pub block: usize,
}

/// One instruction of a rank's program. `unit` is the head unit it concerns (always 0 in a plan
/// of one head unit).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Instruction {
    /// Send a copy of `side` of `block` (held here: home or relayed) to `to`.
    Send {
        side: Side,
        block: BlockId,
        unit: usize,
        to: usize,
    },
    /// Wait for a copy of `side` of `block` from `from`.
    Receive {
        side: Side,
        block: BlockId,
        unit: usize,
        from: usize,
    },
    /// Attention of query block `q` against key blocks `kv` (all held here), accumulated into
    /// this rank's partial results of those blocks.
    Attend {
        q: BlockId,
        unit: usize,
        kv: Vec<usize>,
    },
    /// Send this rank's (merged) result of `side` of `block` to `to`.
    SendResult {
        side: Side,
        block: BlockId,
        unit: usize,
        to: usize,
    },
    /// Wait for a result of `side` of `block` from `from` and merge it into this rank's.
    ReceiveResult {
        side: Side,
        block: BlockId,
        unit: usize,
        from: usize,
    },
    /// At the token home of `block`, before the pass: send head unit `unit` of it (both sides)
    /// to the unit's home `to`.
    SendUnit {
        block: BlockId,
        unit: usize,
        to: usize,
    },
    /// At the home of head unit `unit` of `block`, before the pass: receive it from its token
    /// home `from`.
    ReceiveUnit {
        block: BlockId,
        unit: usize,
        from: usize,
    },
    /// At the home of head unit `unit` of `block`, after the pass: send its final results to the
    /// token home `to`.
    SendUnitResult {
        block: BlockId,
        unit: usize,
        to: usize,
    },
    /// At the token home of `block`, after the pass: receive head unit `unit`'s final results
    /// from its home `from`.
    ReceiveUnitResult {
        block: BlockId,
        unit: usize,
        from: usize,
    },
}

/// `s{seq}b{block}`, and `h{unit}` for head units after the first.
struct Name(BlockId, usize);

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Name(block, unit) = self;
        write!(f, "s{}b{}", block.seq, block.block)?;
        match unit {
            0 => Ok(()),
            unit => write!(f, "h{unit}"),
        }
    }
}

impl fmt::Display for Instruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |s: &Side| match s {
            Side::QueryOutput => "q",
            Side::KeyValue => "kv",
        };
        match self {
            Instruction::Send {
                side: s,
                block,
                unit,
                to,
            } => write!(f, "send {} {} → {to}", side(s), Name(*block, *unit)),
            Instruction::Receive {
                side: s,
                block,
                unit,
                from,
            } => write!(f, "recv {} {} ← {from}", side(s), Name(*block, *unit)),
            Instruction::Attend { q, unit, kv } => {
                let unit = match unit {
                    0 => String::new(),
                    unit => format!(" h{unit}"),
                };
                write!(f, "attend s{}{unit}: q b{} × kv b{kv:?}", q.seq, q.block)
            }
            Instruction::SendResult {
                side: s,
                block,
                unit,
                to,
            } => write!(f, "send result {} {} → {to}", side(s), Name(*block, *unit)),
            Instruction::ReceiveResult {
                side: s,
                block,
                unit,
                from,
            } => write!(
                f,
                "recv result {} {} ← {from}, merge",
                side(s),
                Name(*block, *unit)
            ),
            Instruction::SendUnit { block, unit, to } => {
                write!(f, "send unit {} → {to}", Name(*block, *unit))
            }
            Instruction::ReceiveUnit { block, unit, from } => {
                write!(f, "recv unit {} ← {from}", Name(*block, *unit))
            }
            Instruction::SendUnitResult { block, unit, to } => {
                write!(f, "send unit result {} → {to}", Name(*block, *unit))
            }
            Instruction::ReceiveUnitResult { block, unit, from } => {
                write!(f, "recv unit result {} ← {from}", Name(*block, *unit))
            }
        }
    }
}

/// A compute tile of a rank: query block `q` against key block `kv_block` at `stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Tile {
    stage: usize,
    unit: usize,
    q: BlockId,
    kv_block: usize,
}

/// An executable block plan (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BlockSchedule {
    pub ranks: usize,
    pub block: usize,
    pub seq_lens: Vec<usize>,
    /// Head units (1: every head of a token block together).
    pub units: usize,
    /// The last compute stage.
    pub last_stage: usize,
    /// Token home of every token block, `homes[seq][block]` (see the module docs).
    pub homes: Vec<Vec<usize>>,
    /// Home rank of every head unit of every token block, `unit_homes[seq][block][unit]`.
    pub unit_homes: Vec<Vec<Vec<usize>>>,
    /// The plan's copies and where results go back.
    pub routes: Vec<Route>,
    /// Ranks per node of the topology the routes were made for.
    pub ranks_per_node: usize,
    /// Where every token lives: each rank's home blocks, in (sequence, block) order.
    placement: Placement,
    /// Every rank's instruction lists, built once (they run on every attention call).
    programs: Vec<Programs>,
}

/// A valid plan for as many ranks as `topology` has.
fn check_executable(
    plan: &Plan,
    problem: &BlockProblem,
    topology: &Topology,
) -> Result<(), CpError> {
    crate::planner::plan::validate_plan(plan, problem)?;
    if topology.ranks() != plan.ranks {
        return Err(CpError::Config(format!(
            "the plan is for {} ranks but the topology has {}",
            plan.ranks,
            topology.ranks()
        )));
    }
    Ok(())
}

/// The home rank of every head unit of every token block (`homes[seq][block][unit]`), checking
/// that its Q, KV and O share it.
fn shared_homes(plan: &Plan, problem: &BlockProblem) -> Result<Vec<Vec<Vec<usize>>>, CpError> {
    let homes = crate::planner::plan::unit_homes(plan, problem);
    for data in &plan.data {
        let home = homes[data.seq][data.block][data.head];
        if home != data.home_rank {
            return Err(CpError::Config(format!(
                "block {} of sequence {}, head unit {}: its {:?} lives on rank {} but its Q on rank {home}; an executed plan keeps a block's Q, KV and O of one head unit on one home",
                data.block, data.seq, data.head, data.kind, data.home_rank
            )));
        }
    }
    Ok(homes)
}

/// Each rank's tiles, sorted by (stage, q block, kv block).
fn rank_tiles(plan: &Plan) -> Vec<Vec<Tile>> {
    let mut tiles = vec![Vec::new(); plan.ranks];
    for b in &plan.blocks {
        tiles[b.rank].push(Tile {
            stage: b.stage,
            unit: b.head,
            q: BlockId {
                seq: b.seq,
                block: b.q_block,
            },
            kv_block: b.kv_block,
        });
    }
    tiles
        .iter_mut()
        .for_each(|t: &mut Vec<Tile>| t.sort_unstable());
    tiles
}

/// A rank's instruction lists.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Programs {
    forward: Vec<Instruction>,
    backward: Vec<Instruction>,
}

impl BlockSchedule {
    /// Checks that `plan` is executable for `problem` (Q, KV and O of a block's head unit on one
    /// home) and builds its routes on `topology`.
    pub fn new(plan: &Plan, problem: &BlockProblem, topology: &Topology) -> Result<Self, CpError> {
        check_executable(plan, problem, topology)?;
        let unit_homes = shared_homes(plan, problem)?;
        let homes = token_homes(&unit_homes);
        let tiles = rank_tiles(plan);
        let routes = routes(plan, topology);
        let last_stage = plan.blocks.iter().map(|b| b.stage).max().unwrap_or(0);
        let builder = ProgramBuilder {
            routes: &routes,
            tiles: &tiles,
            last_stage,
            homes: &homes,
            unit_homes: &unit_homes,
        };
        let programs = (0..plan.ranks)
            .map(|rank| Programs {
                forward: builder.program(rank, &[Side::QueryOutput]),
                backward: builder.program(rank, &[Side::QueryOutput, Side::KeyValue]),
            })
            .collect();
        let placement = home_placement(&homes, problem, plan.ranks)?;
        Ok(Self {
            ranks: plan.ranks,
            block: problem.block,
            seq_lens: problem.seq_lens.clone(),
            units: problem.head_groups,
            last_stage,
            homes,
            unit_homes,
            routes,
            ranks_per_node: topology.devices_per_node,
            placement,
            programs,
        })
    }

    /// The instruction list of `rank` for `pass`.
    pub fn program(&self, rank: usize, pass: Pass) -> &[Instruction] {
        let programs = &self.programs[rank];
        match pass {
            Pass::Forward => &programs.forward,
            Pass::Backward => &programs.backward,
        }
    }

    /// A hash of the whole schedule: equal on two ranks exactly when (barring collisions) they
    /// run the same plan.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.hash(&mut hasher);
        hasher.finish()
    }

    /// Every message of the plan under the cost model's byte model
    /// ([`route_transfers`], [`unit_moves`]) for `heads` query heads, `kv_heads` kv heads,
    /// `head_dim` and 4-byte elements.
    fn transfers(
        &self,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<Transfer>, CpError> {
        let dims = AttentionDims {
            heads,
            kv_heads,
            head_dim,
            element_bytes: 4,
        };
        let sizes = dims.unit_sizes(self.units)?;
        let tokens = |seq, block| self.block_tokens(BlockId { seq, block }).len() as f64;
        let mut transfers = route_transfers(&self.routes, &sizes, tokens);
        transfers.extend(unit_moves(&self.unit_homes, &self.homes, &sizes, tokens));
        Ok(transfers)
    }

    /// Bytes each rank sends, forward and backward, as the plan predicts them.
    pub fn predicted_volume(
        &self,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<RankVolume>, CpError> {
        let mut volume = vec![RankVolume::default(); self.ranks];
        for t in self.transfers(heads, kv_heads, head_dim)? {
            *volume[t.from].pass_mut(t.pass) += t.bytes as u64;
        }
        Ok(volume)
    }

    /// Bytes each rank sends by link class, forward plus backward, as the plan predicts them.
    pub fn predicted_links(
        &self,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<LinkBytes>, CpError> {
        let mut links = vec![LinkBytes::default(); self.ranks];
        // The topology may hold more ranks than the plan's group: nodes of `ranks_per_node`.
        let per_node = self.ranks_per_node.max(1);
        let nodes = NodeMap::uniform(self.ranks.div_ceil(per_node), per_node);
        for t in self.transfers(heads, kv_heads, head_dim)? {
            match nodes.same_node(t.from, t.to) {
                true => links[t.from].intra_node += t.bytes as u64,
                false => links[t.from].inter_node += t.bytes as u64,
            }
        }
        Ok(links)
    }

    /// Token range (positions) of a block.
    pub fn block_tokens(&self, block: BlockId) -> std::ops::Range<usize> {
        let start = block.block * self.block;
        start..(start + self.block).min(self.seq_lens[block.seq])
    }

    /// The home of head unit `unit` of `block`.
    pub fn unit_home(&self, block: BlockId, unit: usize) -> usize {
        self.unit_homes[block.seq][block.block][unit]
    }

    /// The token blocks of `rank` (it is their token home), in its local order.
    pub fn home_blocks(&self, rank: usize) -> Vec<BlockId> {
        let mut blocks = Vec::new();
        for (seq, homes) in self.homes.iter().enumerate() {
            for (block, &home) in homes.iter().enumerate() {
                if home == rank {
                    blocks.push(BlockId { seq, block });
                }
            }
        }
        blocks
    }

    /// Where every token lives: each rank's home blocks, in (sequence, block) order.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
}

/// The placement over `ranks` ranks of home blocks `homes[seq][block]` (checked: every token on
/// one rank).
fn home_placement(
    homes: &[Vec<usize>],
    problem: &BlockProblem,
    ranks: usize,
) -> Result<Placement, CpError> {
    let mut segments = vec![Vec::new(); ranks];
    for (seq, blocks) in homes.iter().enumerate() {
        for (block, &home) in blocks.iter().enumerate() {
            let tokens = problem.block_tokens(seq, block);
            segments[home].push(Segment::contiguous(seq, tokens.start, tokens.len()));
        }
    }
    Placement::from_segments(&problem.seq_lens, segments)
}

fn id(route: &Route) -> BlockId {
    BlockId {
        seq: route.seq,
        block: route.block,
    }
}
