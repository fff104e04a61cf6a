//! What a plan costs on a topology: bytes per link class, compute and memory balance, and an
//! estimated attention time (forward and backward) with communication overlapped stage by stage.
//!
//! A plan's communication is a list of [`Transfer`]s, each tagged with the compute stage that
//! needs it. Every strategy routes its own way (ring: hop by hop; DCP and all-to-all: directly,
//! one copy per remote node then forwarded inside the node), so the same evaluator measures all.
//!
//! **Bytes moved per block** follow the one byte model, [`crate::bytes`] (per token and head unit:
//! `q` = query heads × D × element bytes, `kv` = 2 × kv heads × D × element bytes, `o` = q + 4
//! bytes of LSE per query head, `dout` = q).
//!
//! **Time model.** Ranks do not wait for each other between stages: each runs a stage as soon as
//! its inputs are in. Per rank and pass over `S` stages: `comm(0) + Σ_t max(compute(t),
//! comm(t+1)) + comm(post)`, where `compute(t)` is the rank's unmasked FLOPs of stage `t` over
//! the device FLOP/s and `comm(t)` the time of the transfers stage `t` needs: the rank's own
//! NVLink bytes (in or out, the larger) over the intra-node bandwidth, plus, if it sends or
//! receives across nodes, its whole node's inter-node bytes of that stage over the node's NIC
//! bandwidth (the NICs are shared), plus one latency per link class used. Communication for
//! stage `t+1` overlaps compute of stage `t`; `comm(0)` (before any compute) and `comm(post)`
//! (results back home) do not overlap. The pass takes as long as its slowest rank. First-order
//! only: no congestion inside the fabric, no kernel launch overheads.

use serde::Serialize;

use crate::bytes::TokenBytes;
pub use crate::bytes::{Pass, Side};
use crate::error::CpError;
use crate::planner::hypergraph::FastMap;
use crate::planner::plan::{BlockProblem, DataKind, Plan, TileGrid};
pub use crate::planner::topology::BACKWARD_FLOPS_FACTOR;
use crate::planner::topology::{attention_flops, LinkClass, Topology};

/// Attention dimensions of the planned layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes per element of Q, K, V, O and their gradients (2 for bf16).
    pub element_bytes: usize,
}

/// Per-token, per-head-unit sizes of a plan whose problem has `units` head units.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitSizes {
    pub q: f64,
    pub kv: f64,
    pub o: f64,
    /// dO (the planner's dims have the value dim equal to the head dim: as many bytes as Q).
    pub dout: f64,
    /// Forward FLOPs per unmasked (query, key) pair of one unit.
    pub forward_flops_per_pair: f64,
}

impl AttentionDims {
    pub fn validate(&self) -> Result<(), CpError> {
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.element_bytes == 0 {
            return Err(CpError::Config(format!(
                "heads ({}), kv heads ({}), head dim ({}) and element bytes ({}) must be at least 1",
                self.heads, self.kv_heads, self.head_dim, self.element_bytes
            )));
        }
        let token_bytes = [self.heads, self.head_dim, self.element_bytes]
            .iter()
            .try_fold(1usize, |product, &x| product.checked_mul(x));
        if token_bytes.is_none_or(|bytes| bytes > 1 << 32) {
            return Err(CpError::Config(format!(
                "heads ({}) × head dim ({}) × element bytes ({}) exceed 4 GiB per token",
                self.heads, self.head_dim, self.element_bytes
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(CpError::Config(format!(
                "heads ({}) must be a multiple of kv heads ({})",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }

    /// Sizes for `units` head units. A unit holds `heads / units` query heads and, when there are
    /// more units than kv heads, a replica of its kv head (as Ulysses does past the kv head count).
    pub fn unit_sizes(&self, units: usize) -> Result<UnitSizes, CpError> {
        self.validate()?;
        if units == 0 || !self.heads.is_multiple_of(units) {
            return Err(CpError::Config(format!(
                "{units} head units do not divide {} query heads",
                self.heads
            )));
        }
        if !units.is_multiple_of(self.kv_heads) && !self.kv_heads.is_multiple_of(units) {
            return Err(CpError::Config(format!(
                "{units} head units and {} kv heads: one must divide the other",
                self.kv_heads
            )));
        }
        let q_heads = self.heads / units;
        let kv_heads = (self.kv_heads / units).max(1) as f64;
        let d = self.head_dim as f64;
        let e = self.element_bytes as f64;
        Ok(UnitSizes {
            q: q_heads as f64 * d * e,
            kv: 2.0 * kv_heads * d * e,
            o: q_heads as f64 * (d * e + 4.0),
            dout: q_heads as f64 * d * e,
            forward_flops_per_pair: attention_flops(1, q_heads, self.head_dim).0,
        })
    }
}

impl UnitSizes {
    /// Bytes of the (query, output) side of one token on the way to a compute rank and back,
    /// forward plus backward: the weight of a q/o hyperedge per token.
    pub fn qo_traffic(&self) -> f64 {
        self.token_bytes().round_trips(Side::QueryOutput)
    }

    /// Bytes of the kv side of one token, forward plus backward.
    pub fn kv_traffic(&self) -> f64 {
        self.token_bytes().round_trips(Side::KeyValue)
    }

    /// The sizes as the byte model's per-token bytes.
    pub fn token_bytes(&self) -> TokenBytes<f64> {
        TokenBytes {
            q: self.q,
            kv: self.kv,
            o: self.o,
            dout: self.dout,
        }
    }

    /// Memory one token's Q, KV and O occupy on their home.
    pub fn resident(&self) -> f64 {
        self.q + self.kv + self.o
    }
}

/// Stage tag of transfers that bring results home after the last compute stage.
pub const POST: usize = usize::MAX;

/// One point-to-point transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Transfer {
    pub pass: Pass,
    /// Compute stage that needs it, or [`POST`].
    pub stage: usize,
    pub from: usize,
    pub to: usize,
    pub bytes: f64,
}

/// A plan, the problem it covers, and its communication.
#[derive(Clone, Debug)]
pub struct RoutedPlan {
    pub name: String,
    pub plan: Plan,
    pub problem: BlockProblem,
    /// The problem's tile grids (one per sequence), as the planner computed them.
    pub grids: Vec<TileGrid>,
    pub sizes: UnitSizes,
    pub transfers: Vec<Transfer>,
}

/// What `plan_sim` reports per strategy (its JSON keys are the field names).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StrategyReport {
    pub name: String,
    pub inter_node_bytes: f64,
    pub intra_node_bytes: f64,
    /// max / mean forward FLOPs per rank.
    pub compute_imbalance: f64,
    /// max / mean resident bytes per rank.
    pub memory_imbalance: f64,
    pub attention_fwd_ms: f64,
    pub attention_bwd_ms: f64,
    pub planning_ms: f64,
    pub stages: usize,
    pub compute_blocks: usize,
}

fn max_over_mean(values: &[f64]) -> f64 {
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    let max = values.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 {
        max / mean
    } else {
        1.0
    }
}

/// Tokens of a data block.
fn block_tokens(problem: &BlockProblem, seq: usize, block: usize) -> f64 {
    problem.block_tokens(seq, block).len() as f64
}

/// Seconds each rank waits for the transfers of one stage: its own NVLink traffic (in or out,
/// whichever is larger) over the intra-node bandwidth, plus, if it sends or receives across
/// nodes, its node's inter-node traffic of the stage (the NICs are shared) over the inter-node
/// bandwidth; one latency per link class it uses.
fn stage_comm_seconds(transfers: &[&Transfer], topology: &Topology) -> Vec<f64> {
    let ranks = topology.ranks();
    let mut intra_in = vec![0.0; ranks];
    let mut intra_out = vec![0.0; ranks];
    let mut uses_inter = vec![false; ranks];
    let mut inter_in = vec![0.0; topology.nodes];
    let mut inter_out = vec![0.0; topology.nodes];
    for t in transfers {
        match topology.link(t.from, t.to) {
            LinkClass::Local => {}
            LinkClass::IntraNode => {
                intra_in[t.to] += t.bytes;
                intra_out[t.from] += t.bytes;
            }
            LinkClass::InterNode => {
                uses_inter[t.from] = true;
                uses_inter[t.to] = true;
                inter_in[topology.node_of(t.to)] += t.bytes;
                inter_out[topology.node_of(t.from)] += t.bytes;
            }
        }
    }
    (0..ranks)
        .map(|r| {
            let intra = intra_in[r].max(intra_out[r]);
            let mut seconds = 0.0;
            if intra > 0.0 {
                seconds += topology.transfer_seconds(LinkClass::IntraNode, intra);
            }
            if uses_inter[r] {
                let node = topology.node_of(r);
                let inter = inter_in[node].max(inter_out[node]);
                seconds += topology.transfer_seconds(LinkClass::InterNode, inter);
            }
            seconds
        })
        .collect()
}

/// Measures a routed plan on a topology (see the module docs). `planning_ms` is filled by the
/// caller, who timed the planning.
pub fn evaluate(routed: &RoutedPlan, topology: &Topology) -> Result<StrategyReport, CpError> {
    let plan = &routed.plan;
    let ranks = topology.ranks();
    if plan.ranks != ranks {
        return Err(CpError::Config(format!(
            "plan for {} ranks evaluated on a topology of {ranks}",
            plan.ranks
        )));
    }
    let loads = RankLoads::of(routed, ranks);
    let (inter, intra) = link_bytes(&routed.transfers, topology);
    let pass_ms = |pass, factor| 1e3 * pass_seconds(routed, &loads.flops, topology, pass, factor);
    Ok(StrategyReport {
        name: routed.name.clone(),
        inter_node_bytes: inter,
        intra_node_bytes: intra,
        compute_imbalance: max_over_mean(&loads.rank_flops),
        memory_imbalance: max_over_mean(&loads.memory),
        attention_fwd_ms: pass_ms(Pass::Forward, 1.0),
        attention_bwd_ms: pass_ms(Pass::Backward, BACKWARD_FLOPS_FACTOR),
        planning_ms: 0.0,
        stages: loads.flops.len(),
        compute_blocks: plan.blocks.len(),
    })
}

/// What each rank computes and holds under a routed plan.
struct RankLoads {
    /// Forward FLOPs per stage and rank (`flops[stage][rank]`); one row per stage of the plan's
    /// compute blocks or transfers, whichever has more.
    flops: Vec<Vec<f64>>,
    /// Forward FLOPs per rank, all stages.
    rank_flops: Vec<f64>,
    /// Resident bytes of the data blocks homed on each rank.
    memory: Vec<f64>,
}

impl RankLoads {
    fn of(routed: &RoutedPlan, ranks: usize) -> Self {
        let plan = &routed.plan;
        let last_compute = plan.blocks.iter().map(|b| b.stage + 1).max();
        let last_transfer = (routed.transfers.iter())
            .filter(|t| t.stage != POST)
            .map(|t| t.stage + 1)
            .max();
        let stages = last_compute.unwrap_or(1).max(last_transfer.unwrap_or(1));
        let mut flops = vec![vec![0.0f64; ranks]; stages];
        let mut rank_flops = vec![0.0f64; ranks];
        for b in &plan.blocks {
            let pairs = routed.grids[b.seq].pairs(b.q_block, b.kv_block) as f64;
            let f = pairs * routed.sizes.forward_flops_per_pair;
            flops[b.stage][b.rank] += f;
            rank_flops[b.rank] += f;
        }
        let mut memory = vec![0.0f64; ranks];
        for d in &plan.data {
            let per_token = match d.kind {
                DataKind::Q => routed.sizes.q,
                DataKind::Kv => routed.sizes.kv,
                DataKind::O => routed.sizes.o,
            };
            memory[d.home_rank] += per_token * block_tokens(&routed.problem, d.seq, d.block);
        }
        Self {
            flops,
            rank_flops,
            memory,
        }
    }
}

/// Bytes of `transfers` over (inter-node, intra-node) links.
fn link_bytes(transfers: &[Transfer], topology: &Topology) -> (f64, f64) {
    let (mut inter, mut intra) = (0.0, 0.0);
    for t in transfers {
        match topology.link(t.from, t.to) {
            LinkClass::Local => {}
            LinkClass::IntraNode => intra += t.bytes,
            LinkClass::InterNode => inter += t.bytes,
        }
    }
    (inter, intra)
}

/// Seconds of one pass (compute FLOPs × `factor`): each rank runs its stages as soon as their
/// inputs are in, `comm(0) + Σ_t max(compute(t), comm(t+1)) + comm(post)`; the pass takes the
/// slowest rank's time.
fn pass_seconds(
    routed: &RoutedPlan,
    flops: &[Vec<f64>],
    topology: &Topology,
    pass: Pass,
    factor: f64,
) -> f64 {
    let mut by_stage: FastMap<usize, Vec<&Transfer>> = FastMap::default();
    for t in routed.transfers.iter().filter(|t| t.pass == pass) {
        by_stage.entry(t.stage).or_default().push(t);
    }
    let comm: FastMap<usize, Vec<f64>> = by_stage
        .iter()
        .map(|(&stage, ts)| (stage, stage_comm_seconds(ts, topology)))
        .collect();
    let comm_of = |stage: usize, rank: usize| comm.get(&stage).map_or(0.0, |c| c[rank]);
    (0..topology.ranks())
        .map(|r| {
            let mut seconds = comm_of(0, r) + comm_of(POST, r);
            for (t, stage_flops) in flops.iter().enumerate() {
                let compute = topology.compute_seconds(factor * stage_flops[r]);
                seconds += compute.max(comm_of(t + 1, r));
            }
            seconds
        })
        .fold(0.0, f64::max)
}

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
/// by the byte model ([`TokenBytes::hop`]).
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
                transfers.push(Transfer {
                    pass,
                    stage: hop.stage,
                    from: hop.from,
                    to: hop.to,
                    bytes: to_bytes * tokens,
                });
                if back_bytes > 0.0 {
                    transfers.push(Transfer {
                        pass,
                        stage: POST,
                        from: hop.to,
                        to: hop.from,
                        bytes: back_bytes * tokens,
                    });
                }
            }
        }
    }
    transfers
}
