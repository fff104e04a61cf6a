//! Routing: every copy of a data block on its way from its home to the ranks that compute with
//! it (DCP and all-to-all fetch directly, one copy per remote node forwarded inside the node),
//! and the [`Transfer`]s of those copies, of a unit's moves and of a ring's hops, sized by the
//! byte model of [`crate::planner::bytes`] per head unit.

use crate::planner::bytes::{Pass, Side, UnitSizes};
use crate::planner::cost::{block_tokens, Ready, Transfer, POST};
use crate::planner::hypergraph::FastMap;
use crate::planner::plan::{BlockProblem, DataKind, Plan};
use crate::planner::topology::Topology;

/// One copy of a block on its way to a rank that computes with it: sent by `from` (the block's
/// home, or the first rank of `to`'s node that got it) for compute stage `stage` of `to`. Results
/// come back the same way reversed, after the last stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hop {
    pub from: usize,
    pub to: usize,
    pub stage: usize,
}

/// Every copy of one data block: the block, its home and its hops (a relay's own hop comes
/// before the hops it forwards).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Route {
    pub side: Side,
    pub seq: usize,
    pub head: usize,
    pub block: usize,
    pub home: usize,
    pub hops: Vec<Hop>,
}

/// Direct routing for plans whose compute ranks fetch blocks from their homes (DCP, all-to-all):
/// for each data block, one copy per remote node goes to the node's rank that needs it first and
/// is forwarded over NVLink to the node's other ranks; results come back the same way after the
/// last stage. Each copy is sent for the earliest stage that needs it. Routes are ordered by
/// side (Q before KV), sequence, head and block.
pub fn routes(plan: &Plan, topology: &Topology) -> Vec<Route> {
    let mut homes: FastMap<SideBlock, usize> = FastMap::default();
    for d in &plan.data {
        let side = match d.kind {
            DataKind::Q => Side::QueryOutput,
            DataKind::Kv => Side::KeyValue,
            DataKind::O => continue,
        };
        homes.insert(SideBlock::new(side, d.seq, d.head, d.block), d.home_rank);
    }
    let needs = needs(plan);
    let mut keys: Vec<SideBlock> = needs.keys().copied().collect();
    keys.sort_by_key(|k| (k.side == Side::KeyValue, k.seq, k.head, k.block));
    keys.into_iter()
        .filter_map(|key| {
            let home = *homes.get(&key)?;
            Some(Route {
                side: key.side,
                seq: key.seq,
                head: key.head,
                block: key.block,
                home,
                hops: hops(home, &needs[&key], topology),
            })
        })
        .collect()
}

/// One side of one data block: the key of a block's home and of the ranks that need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct SideBlock {
    side: Side,
    seq: usize,
    head: usize,
    block: usize,
}

impl SideBlock {
    fn new(side: Side, seq: usize, head: usize, block: usize) -> Self {
        Self {
            side,
            seq,
            head,
            block,
        }
    }
}

/// A rank that computes with a block, and the earliest stage it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Need {
    rank: usize,
    stage: usize,
}

/// For every block side a compute block reads, the ranks that read it (in order of first use).
fn needs(plan: &Plan) -> FastMap<SideBlock, Vec<Need>> {
    let mut needs: FastMap<SideBlock, Vec<Need>> = FastMap::default();
    for b in &plan.blocks {
        for (side, block) in [(Side::QueryOutput, b.q_block), (Side::KeyValue, b.kv_block)] {
            let list = needs
                .entry(SideBlock::new(side, b.seq, b.head, block))
                .or_default();
            match list.iter_mut().find(|need| need.rank == b.rank) {
                Some(need) => need.stage = need.stage.min(b.stage),
                None => list.push(Need {
                    rank: b.rank,
                    stage: b.stage,
                }),
            }
        }
    }
    needs
}

/// The copies of a block homed on `home` for the ranks that need it: per remote node, one copy
/// to the rank of that node that needs it first (nodes in order, ties to the lower rank), which
/// forwards it to the node's other ranks; ranks on the home's node get theirs from the home.
fn hops(home: usize, needs: &[Need], topology: &Topology) -> Vec<Hop> {
    let mut remote: Vec<Need> = needs.iter().copied().filter(|n| n.rank != home).collect();
    remote.sort_by_key(|n| (topology.node_of(n.rank), n.stage, n.rank));
    let home_node = topology.node_of(home);
    let mut hops = Vec::with_capacity(remote.len());
    let hop = |from: usize, to: &Need| Hop {
        from,
        to: to.rank,
        stage: to.stage,
    };
    for on_node in remote.chunk_by(|a, b| topology.node_of(a.rank) == topology.node_of(b.rank)) {
        let entry = &on_node[0];
        if topology.node_of(entry.rank) == home_node {
            hops.extend(on_node.iter().map(|to| hop(home, to)));
        } else {
            hops.push(hop(home, entry));
            hops.extend(on_node[1..].iter().map(|to| hop(entry.rank, to)));
        }
    }
    hops
}

/// Bytes per token of one copy of a `side` block, for `pass`: (to the compute rank, back home),
/// by the byte model ([`TokenBytes::hop`](crate::planner::bytes::TokenBytes::hop)).
pub fn hop_bytes(sizes: &UnitSizes, side: Side, pass: Pass) -> (f64, f64) {
    sizes.token_bytes().hop(side, pass)
}

/// The transfers of [`routes`] (see the module docs for the bytes of each pass).
pub fn direct_transfers(
    plan: &Plan,
    problem: &BlockProblem,
    sizes: &UnitSizes,
    topology: &Topology,
) -> Vec<Transfer> {
    route_transfers(&routes(plan, topology), sizes, |seq, block| {
        block_tokens(problem, seq, block)
    })
}

/// The moves of head units between their token block's token home
/// ([`crate::planner::plan::token_homes`]) and the unit's home, for a plan executed with several
/// head units (see [`unit_moves`]). None with one unit.
pub fn unit_move_transfers(
    plan: &Plan,
    problem: &BlockProblem,
    sizes: &UnitSizes,
) -> Vec<Transfer> {
    let unit_homes = crate::planner::plan::unit_homes(plan, problem);
    let token_homes = crate::planner::plan::token_homes(&unit_homes);
    unit_moves(&unit_homes, &token_homes, sizes, |seq, block| {
        block_tokens(problem, seq, block)
    })
}

/// The moves of head units homed away from their token block, `unit_homes[seq][block][unit]`
/// and `token_homes[seq][block]`, for blocks of `tokens(seq, block)` tokens: before each pass
/// (stage 0) the token home sends the unit's query and key sides (the bytes of a Q and a KV
/// copy); after it the unit's home sends the unit's results back (those of a Q and a KV result;
/// it holds them once its own copies' results are in).
pub fn unit_moves(
    unit_homes: &[Vec<Vec<usize>>],
    token_homes: &[Vec<usize>],
    sizes: &UnitSizes,
    tokens: impl Fn(usize, usize) -> f64,
) -> Vec<Transfer> {
    let mut transfers = Vec::new();
    for (seq, blocks) in unit_homes.iter().enumerate() {
        for (block, units) in blocks.iter().enumerate() {
            let token_home = token_homes[seq][block];
            let tokens = tokens(seq, block);
            for &home in units.iter().filter(|&&home| home != token_home) {
                for pass in [Pass::Forward, Pass::Backward] {
                    let (q_to, q_back) = hop_bytes(sizes, Side::QueryOutput, pass);
                    let (kv_to, kv_back) = hop_bytes(sizes, Side::KeyValue, pass);
                    transfers.push(Transfer {
                        pass,
                        stage: 0,
                        from: token_home,
                        to: home,
                        bytes: (q_to + kv_to) * tokens,
                        ready: Ready::Held,
                    });
                    transfers.push(Transfer {
                        pass,
                        stage: POST,
                        from: home,
                        to: token_home,
                        bytes: (q_back + kv_back) * tokens,
                        ready: Ready::Relayed,
                    });
                }
            }
        }
    }
    transfers
}

/// Every transfer of `routes` under the byte model ([`hop_bytes`]), for blocks of
/// `tokens(seq, block)` tokens: per hop and pass, the copy out (tagged with the hop's stage) and,
/// where the pass brings results back, the result home (tagged [`POST`]).
pub fn route_transfers(
    routes: &[Route],
    sizes: &UnitSizes,
    tokens: impl Fn(usize, usize) -> f64,
) -> Vec<Transfer> {
    let mut transfers = Vec::new();
    for route in routes {
        let tokens = tokens(route.seq, route.block);
        for hop in &route.hops {
            for pass in [Pass::Forward, Pass::Backward] {
                let (to_bytes, back_bytes) = hop_bytes(sizes, route.side, pass);
                let relayed = |rank: usize| match rank == route.home {
                    true => Ready::Held,
                    false => Ready::Relayed,
                };
                transfers.push(Transfer {
                    pass,
                    stage: hop.stage,
                    from: hop.from,
                    to: hop.to,
                    bytes: to_bytes * tokens,
                    ready: relayed(hop.from),
                });
                if back_bytes > 0.0 {
                    // A relay sends its result home once its own leaves' results are in.
                    let relay = route.hops.iter().any(|h| h.from == hop.to);
                    transfers.push(Transfer {
                        pass,
                        stage: POST,
                        from: hop.to,
                        to: hop.from,
                        bytes: back_bytes * tokens,
                        ready: if relay { Ready::Relayed } else { Ready::Held },
                    });
                }
            }
        }
    }
    transfers
}
