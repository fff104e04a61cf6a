//! What a plan costs on a topology: bytes per link class, compute and memory balance, and an
//! estimated attention time (forward and backward) with communication overlapped stage by stage.
//!
//! A plan's communication is a list of [`Transfer`]s, each tagged with the compute stage that
//! needs it. Every strategy routes its own way (ring: hop by hop; DCP and all-to-all: directly,
//! one copy per remote node then forwarded inside the node), so the same evaluator measures all.
//!
//! **Bytes moved per block** follow the one byte model, [`crate::planner::bytes`] (per token and head unit:
//! `q` = query heads × D × element bytes, `kv` = 2 × kv heads × D × element bytes, `o` = q + 4
//! bytes of LSE per query head, `dout` = q).
//!
//! **Time model**, event by event. Ranks do not wait for each other between stages: rank `r`
//! starts stage `t` once it has finished stage `t − 1` and the transfers stage `t` needs have
//! arrived. A transfer for stage `t` leaves its sender when the sender starts stage `t − 1` (a
//! ring forwards the block it received as it starts computing with it; stage 0's leave at once,
//! so they are not overlapped), or, as its [`Ready`] says, once the sender has computed it (a
//! ring's dK/dV accumulators) or received what it forwards (a DCP relay). It waits until its
//! links are free (an intra-node transfer: its sender's NVLink out and its receiver's in; an
//! inter-node one: its nodes' NICs, shared by their ranks; each link carries one transfer at a
//! time, in the order they leave), holds them for its bytes over their bandwidth, and arrives a
//! latency later. Results go home (`POST`) after their sender's last stage. `compute(t)` is the
//! rank's FLOPs of stage `t` over the device FLOP/s. A pass starts with the ranks' agreement on
//! the call (a small all-gather: one latency of the slowest link) and takes as long as its
//! slowest rank. So latencies pipeline along a ring and a rank waits only for what it receives.
//! First-order only: no congestion inside the fabric.
//!
//! **How a device computes** is a [`ComputeModel`]: [`evaluate`] uses the GPU presets' (every
//! rank its own device, backward 2.5× the forward's FLOPs at the same efficiency, no per-call
//! overhead, exact masked pairs); [`evaluate_with`] takes another, e.g. the one `--emulate-links`
//! measures for ranks that are threads sharing this machine's cores (`burn-dcp-train`'s
//! `links::cpu_compute`): a kernel call's fixed overhead, the backward's measured cost per
//! forward FLOP, the masked pairs a partially masked block still computes, and the ranks sharing
//! one processor (a stage's compute is processor-shared among the ranks computing at once: rank
//! `r`'s work `w_r` ends after `Σ_j min(w_j, w_r)` of the machine's FLOPs).

use serde::{Deserialize, Serialize};

use crate::error::CpError;
pub use crate::planner::bytes::{AttentionDims, Pass, Side, UnitSizes};
use crate::planner::hypergraph::FastMap;
use crate::planner::plan::{BlockProblem, DataKind, Plan, TileGrid};
pub use crate::planner::routes::{
    direct_transfers, hop_bytes, route_transfers, routes, unit_move_transfers, unit_moves, Hop,
    Route,
};
pub use crate::planner::topology::BACKWARD_FLOPS_FACTOR;
use crate::planner::topology::{LinkClass, Topology};

/// How a device runs the attention kernels, beyond its FLOP/s (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeModel {
    /// Backward seconds per forward second of the same pairs ([`BACKWARD_FLOPS_FACTOR`] when the
    /// backward runs at the forward's efficiency).
    pub backward_factor: f64,
    /// Seconds of fixed cost per kernel call: once per (rank, stage) that computes, each pass.
    pub call_overhead: f64,
    /// Share of a partially masked block's masked pairs the kernel computes anyway (0: exactly
    /// the allowed pairs; 1: the whole block).
    pub masked_pair_cost: f64,
    /// The ranks share one processor (threads of one process), instead of a device each.
    pub shared_processor: bool,
}

impl Default for ComputeModel {
    /// The GPU presets: a device per rank, the backward at the forward's efficiency, no overheads.
    fn default() -> Self {
        Self {
            backward_factor: BACKWARD_FLOPS_FACTOR,
            call_overhead: 0.0,
            masked_pair_cost: 0.0,
            shared_processor: false,
        }
    }
}

impl ComputeModel {
    pub fn validate(&self) -> Result<(), CpError> {
        let values = [
            ("backward factor", self.backward_factor, true),
            ("call overhead", self.call_overhead, false),
            ("masked pair cost", self.masked_pair_cost, false),
        ];
        for (name, value, positive) in values {
            if !value.is_finite() || value < 0.0 || (positive && value == 0.0) {
                return Err(CpError::Config(format!(
                    "the compute model's {name} must be a finite {}, got {value}",
                    if positive {
                        "positive number"
                    } else {
                        "number ≥ 0"
                    }
                )));
            }
        }
        if self.masked_pair_cost > 1.0 {
            return Err(CpError::Config(format!(
                "the compute model's masked pair cost is a share of the masked pairs (0 to 1), got {}",
                self.masked_pair_cost
            )));
        }
        Ok(())
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
    /// When its sender has it to send.
    pub ready: Ready,
}

/// When a transfer for stage `t` (or [`POST`]) can leave its sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ready {
    /// The sender holds it when it starts stage `t − 1` (stage 0 and `POST`: at the pass's start
    /// and after the sender's last stage).
    Held,
    /// It is a result of the sender's stage `t − 1` (a ring's dK/dV accumulators): after it.
    Computed,
    /// The sender forwards it: it leaves once the sender has finished stage `t − 1` and received
    /// the stage's transfers that are not forwarded (a DCP relay, forward copies and results).
    Relayed,
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
pub(crate) fn block_tokens(problem: &BlockProblem, seq: usize, block: usize) -> f64 {
    problem.block_tokens(seq, block).len() as f64
}

/// The links of a topology, each busy until some time: every rank's NVLink out and in, every
/// node's NIC out and in (its ranks share it).
struct Links<'a> {
    topology: &'a Topology,
    /// `[rank out, rank in]` per rank, then `[node out, node in]` per node.
    free: Vec<[f64; 2]>,
}

impl<'a> Links<'a> {
    fn new(topology: &'a Topology) -> Self {
        Self {
            topology,
            free: vec![[0.0; 2]; topology.ranks() + topology.nodes],
        }
    }

    /// When `transfer`, leaving at `leaves`, arrives: it starts once its sender's and receiver's
    /// links are free, holds both for its bytes over their bandwidth, then takes the latency.
    fn send(&mut self, transfer: &Transfer, leaves: f64) -> f64 {
        let topology = self.topology;
        let (from, to) = (transfer.from, transfer.to);
        let (out, into, bandwidth, latency) = match topology.link(from, to) {
            LinkClass::Local => return leaves,
            LinkClass::IntraNode => (
                from,
                to,
                topology.intra_node_bandwidth,
                topology.intra_node_latency,
            ),
            LinkClass::InterNode => {
                let ranks = topology.ranks();
                (
                    ranks + topology.node_of(from),
                    ranks + topology.node_of(to),
                    topology.inter_node_bandwidth,
                    topology.inter_node_latency,
                )
            }
        };
        let start = leaves.max(self.free[out][0]).max(self.free[into][1]);
        let sent = start + transfer.bytes / bandwidth;
        self.free[out][0] = sent;
        self.free[into][1] = sent;
        sent + latency
    }
}

/// Measures a routed plan on a topology of GPUs (see the module docs). `planning_ms` is filled by
/// the caller, who timed the planning.
pub fn evaluate(routed: &RoutedPlan, topology: &Topology) -> Result<StrategyReport, CpError> {
    evaluate_with(routed, topology, &ComputeModel::default())
}

/// [`evaluate`] for devices that compute as `model` says.
pub fn evaluate_with(
    routed: &RoutedPlan,
    topology: &Topology,
    model: &ComputeModel,
) -> Result<StrategyReport, CpError> {
    model.validate()?;
    let plan = &routed.plan;
    let ranks = topology.ranks();
    if plan.ranks != ranks {
        return Err(CpError::Config(format!(
            "plan for {} ranks evaluated on a topology of {ranks}",
            plan.ranks
        )));
    }
    let loads = RankLoads::of(routed, ranks, model.masked_pair_cost);
    let (inter, intra) = link_bytes(&routed.transfers, topology);
    let pass_ms =
        |pass, factor| 1e3 * pass_seconds(routed, &loads.flops, topology, model, pass, factor);
    Ok(StrategyReport {
        name: routed.name.clone(),
        inter_node_bytes: inter,
        intra_node_bytes: intra,
        compute_imbalance: max_over_mean(&loads.rank_flops),
        memory_imbalance: max_over_mean(&loads.memory),
        attention_fwd_ms: pass_ms(Pass::Forward, 1.0),
        attention_bwd_ms: pass_ms(Pass::Backward, model.backward_factor),
        planning_ms: 0.0,
        stages: loads.flops.len(),
        compute_blocks: plan.blocks.len(),
    })
}

/// What each rank computes and holds under a routed plan.
struct RankLoads {
    /// Forward FLOPs per stage and rank (`flops[stage][rank]`), masked pairs of partial blocks
    /// counted at the model's cost; one row per stage of the plan's compute blocks or transfers,
    /// whichever has more.
    flops: Vec<Vec<f64>>,
    /// Forward FLOPs of the allowed pairs per rank, all stages.
    rank_flops: Vec<f64>,
    /// Resident bytes of the data blocks homed on each rank.
    memory: Vec<f64>,
}

impl RankLoads {
    fn of(routed: &RoutedPlan, ranks: usize, masked_pair_cost: f64) -> Self {
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
            let masked = if masked_pair_cost > 0.0 {
                let area = block_tokens(&routed.problem, b.seq, b.q_block)
                    * block_tokens(&routed.problem, b.seq, b.kv_block);
                masked_pair_cost * (area - pairs).max(0.0) * routed.sizes.forward_flops_per_pair
            } else {
                0.0
            };
            flops[b.stage][b.rank] += f + masked;
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

/// Seconds each rank computes in one stage whose forward FLOPs per rank are `flops`, the pass
/// costing `factor` times them: its own device's time, or, on a shared processor, the
/// processor-shared time (`Σ_j min(w_j, w_r)` over the machine's FLOP/s, every rank's share
/// `device_flops`); plus the call overhead where it computes.
fn stage_compute_seconds(
    flops: &[f64],
    topology: &Topology,
    model: &ComputeModel,
    factor: f64,
) -> Vec<f64> {
    let overhead = |w: f64| if w > 0.0 { model.call_overhead } else { 0.0 };
    if !model.shared_processor {
        return flops
            .iter()
            .map(|&w| topology.compute_seconds(factor * w) + overhead(w))
            .collect();
    }
    let machine = topology.device_flops * flops.len() as f64;
    flops
        .iter()
        .map(|&w| {
            let shared: f64 = flops.iter().map(|&other| other.min(w)).sum();
            factor * shared / machine + overhead(w)
        })
        .collect()
}

/// Seconds of one pass (compute FLOPs × `factor`), event by event (see the module docs): rank
/// `r` starts stage `t` when it has finished stage `t − 1` and every transfer stage `t` needs has
/// arrived; a transfer leaves as its [`Ready`] says and waits for its links ([`Links`]). The
/// pass takes as long as its slowest rank.
fn pass_seconds(
    routed: &RoutedPlan,
    flops: &[Vec<f64>],
    topology: &Topology,
    model: &ComputeModel,
    pass: Pass,
    factor: f64,
) -> f64 {
    let ranks = topology.ranks();
    let mut by_stage: FastMap<usize, Vec<&Transfer>> = FastMap::default();
    for t in routed.transfers.iter().filter(|t| t.pass == pass) {
        by_stage.entry(t.stage).or_default().push(t);
    }
    let mut links = Links::new(topology);
    // Every CP call starts with the ranks agreeing on it (one small all-gather): a latency of
    // the slowest link between them.
    let agreement = match (topology.nodes, topology.devices_per_node) {
        (1, 1) => 0.0,
        (1, _) => topology.intra_node_latency,
        _ => topology.inter_node_latency,
    };
    // `started`/`finished`: each rank's start and finish of the stage before.
    let mut started = vec![agreement; ranks];
    let mut finished = vec![agreement; ranks];
    let mut arrivals_of = |stage: usize, started: &[f64], finished: &[f64]| {
        let empty = Vec::new();
        let transfers = by_stage.get(&stage).unwrap_or(&empty);
        let mut arrivals = vec![f64::NEG_INFINITY; ranks];
        // First what the senders hold or computed, then what relays forward once it is in.
        for relayed in [false, true] {
            let before = arrivals.clone();
            let leaves = |t: &Transfer| match (t.ready, stage) {
                (Ready::Held, POST) | (Ready::Computed, _) => finished[t.from],
                (Ready::Held, _) => started[t.from],
                (Ready::Relayed, _) => finished[t.from].max(before[t.from]),
            };
            let mut sends: Vec<(f64, &Transfer)> = transfers
                .iter()
                .filter(|t| (t.ready == Ready::Relayed) == relayed)
                .map(|t| (leaves(t), *t))
                .collect();
            // Each link sends in the order transfers leave (ties: sender, receiver).
            sends.sort_by(|(a, x), (b, y)| {
                (a.total_cmp(b))
                    .then(x.from.cmp(&y.from))
                    .then(x.to.cmp(&y.to))
            });
            for (leaves, transfer) in sends {
                let arrives = links.send(transfer, leaves);
                arrivals[transfer.to] = arrivals[transfer.to].max(arrives);
            }
        }
        arrivals
    };
    for (t, stage_flops) in flops.iter().enumerate() {
        let arrivals = arrivals_of(t, &started, &finished);
        let compute = stage_compute_seconds(stage_flops, topology, model, factor);
        for r in 0..ranks {
            started[r] = finished[r].max(arrivals[r]);
            finished[r] = started[r] + compute[r];
        }
    }
    let arrivals = arrivals_of(POST, &started, &finished);
    (0..ranks)
        .map(|r| finished[r].max(arrivals[r]))
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::by_strategy::plan_strategy;
    use crate::planner::dcp::DcpConfig;
    use crate::planner::strategies::PlanInput;
    use burn_dcp_kernels::MaskSpec;

    /// Links of (almost) unlimited bandwidth, 0.1 s inside a node and 1 s between nodes, and
    /// (almost) instant devices: only latencies count.
    fn latency_only(nodes: usize, devices_per_node: usize) -> Topology {
        Topology {
            nodes,
            devices_per_node,
            intra_node_bandwidth: 1e30,
            inter_node_bandwidth: 1e30,
            intra_node_latency: 0.1,
            inter_node_latency: 1.0,
            device_flops: 1e30,
            device_memory: 1e12,
        }
    }

    #[test]
    fn ring_latencies_pipeline_along_the_ring_after_the_agreement() {
        let input = PlanInput {
            seq_lens: vec![4096],
            masks: vec![MaskSpec::Causal],
            dims: AttentionDims {
                heads: 8,
                kv_heads: 2,
                head_dim: 64,
                element_bytes: 2,
            },
            topology: latency_only(2, 4),
            block: 64,
            dcp: DcpConfig::default(),
            max_seq_len_per_rank: None,
        };
        let routed = plan_strategy(crate::strategy::StrategyKind::RING_ZIGZAG, &input).unwrap();
        let report = evaluate(&routed, &input.topology).unwrap();
        // Forward: the agreement (1 s), then the block a rank computes last has come 7 hops,
        // 2 of them between the nodes (1 s each) and 5 inside one (0.1 s each), each hop leaving
        // as the block arrived: 1 + 2.5 s, not 7 × the slowest hop.
        assert!(
            (report.attention_fwd_ms - 3500.0).abs() < 1e-6,
            "{}",
            report.attention_fwd_ms
        );
        // Backward: the dK/dV accumulators take an eighth hop home (a full circle: 2 + 0.6 s).
        assert!(
            (report.attention_bwd_ms - 3600.0).abs() < 1e-6,
            "{}",
            report.attention_bwd_ms
        );
    }

    #[test]
    fn ranks_sharing_a_processor_finish_as_processor_sharing_says() {
        let mut topology = latency_only(1, 2);
        topology.device_flops = 1e12;
        let shared = ComputeModel {
            shared_processor: true,
            ..ComputeModel::default()
        };
        let flops = [1e12, 3e12];
        // Each rank alone would take 1 s and 3 s; sharing 2e12 FLOP/s, the light rank ends at
        // (1 + 1) / 2 = 1 s and the heavy one at (1 + 3) / 2 = 2 s.
        assert_eq!(
            stage_compute_seconds(&flops, &topology, &ComputeModel::default(), 1.0),
            [1.0, 3.0]
        );
        assert_eq!(
            stage_compute_seconds(&flops, &topology, &shared, 1.0),
            [1.0, 2.0]
        );
        let overhead = ComputeModel {
            call_overhead: 0.5,
            ..shared
        };
        assert_eq!(
            stage_compute_seconds(&[0.0, 3e12], &topology, &overhead, 1.0),
            [0.0, 2.0]
        );
        for bad in [f64::NAN, -1.0] {
            let model = ComputeModel {
                call_overhead: bad,
                ..ComputeModel::default()
            };
            assert!(model
                .validate()
                .unwrap_err()
                .to_string()
                .contains("call overhead"));
        }
        let model = ComputeModel {
            masked_pair_cost: 1.5,
            ..ComputeModel::default()
        };
        assert!(model.validate().is_err());
    }
}
