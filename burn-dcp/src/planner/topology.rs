//! Cluster topology and cost model for planners: which ranks share a node, how fast links and
//! devices are, and what attention work and communication cost.
//!
//! Costs are first-order: attention time = unmasked FLOPs / device FLOP/s; a transfer of `b` bytes
//! over a link class costs `latency + b / bandwidth`. Only *unmasked* (query, key) pairs count.

use std::str::FromStr;

use crate::error::CpError;

/// Where a transfer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkClass {
    /// Same device (free).
    Local,
    /// Another device of the same node (NVLink).
    IntraNode,
    /// A device of another node (InfiniBand / EFA).
    InterNode,
}

/// Nodes × devices per node, with link and device speeds.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    pub nodes: usize,
    pub devices_per_node: usize,
    /// Bytes/s one device can send to another device of its node (per direction).
    pub intra_node_bandwidth: f64,
    /// Bytes/s a *node* can send to other nodes (per direction, all NICs together).
    pub inter_node_bandwidth: f64,
    pub intra_node_latency: f64,
    pub inter_node_latency: f64,
    /// Sustained attention FLOP/s of one device.
    pub device_flops: f64,
    /// Memory of one device, bytes.
    pub device_memory: f64,
}

const GB: f64 = 1e9;

/// The most ranks a plan may have (4096 ranks plan in seconds; the DCP paper evaluates 64).
pub const MAX_PLAN_RANKS: usize = 4096;

impl Topology {
    /// AWS p4d: 8 × A100 per node, NVLink ~300 GB/s per direction, 4 × 100 Gb/s EFA per node.
    /// Attention at ~60% of the A100's 312 TFLOP/s bf16 peak, 40 GB.
    pub fn a100_p4d(nodes: usize) -> Self {
        Self {
            nodes,
            devices_per_node: 8,
            intra_node_bandwidth: 300.0 * GB,
            inter_node_bandwidth: 4.0 * 100.0 / 8.0 * GB,
            intra_node_latency: 5e-6,
            inter_node_latency: 20e-6,
            device_flops: 0.6 * 312e12,
            device_memory: 40.0 * GB,
        }
    }

    /// DGX H100: 8 × H100 per node, NVLink 4 450 GB/s per direction, 8 × 400 Gb/s InfiniBand per
    /// node. Attention at ~60% of the H100's 989 TFLOP/s bf16 peak, 80 GB.
    pub fn h100_dgx(nodes: usize) -> Self {
        Self {
            nodes,
            devices_per_node: 8,
            intra_node_bandwidth: 450.0 * GB,
            inter_node_bandwidth: 8.0 * 400.0 / 8.0 * GB,
            intra_node_latency: 3e-6,
            inter_node_latency: 10e-6,
            device_flops: 0.6 * 989e12,
            device_memory: 80.0 * GB,
        }
    }

    /// A preset by name (`a100-p4d`, `h100-dgx`) with `nodes` nodes.
    pub fn preset(name: &str, nodes: usize) -> Result<Self, CpError> {
        let topology = match name {
            "a100-p4d" => Self::a100_p4d(nodes),
            "h100-dgx" => Self::h100_dgx(nodes),
            other => {
                return Err(CpError::Config(format!(
                    "unknown topology '{other}': expected a100-p4d or h100-dgx"
                )))
            }
        };
        topology.validate()?;
        Ok(topology)
    }

    /// A preset's links and devices with `ranks` ranks spread evenly over `nodes` nodes
    /// (`nodes` must divide `ranks`), as the in-process world maps ranks to virtual nodes.
    pub fn for_ranks(name: &str, nodes: usize, ranks: usize) -> Result<Self, CpError> {
        crate::comm::nodes::NodeMap::new(ranks, nodes)?;
        let topology = Self {
            devices_per_node: ranks / nodes,
            ..Self::preset(name, nodes)?
        };
        topology.validate()?;
        Ok(topology)
    }

    pub fn validate(&self) -> Result<(), CpError> {
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err(CpError::Config(format!(
                "a topology needs at least one node and one device per node, got {} × {}",
                self.nodes, self.devices_per_node
            )));
        }
        match self.nodes.checked_mul(self.devices_per_node) {
            Some(ranks) if ranks <= MAX_PLAN_RANKS => {}
            _ => {
                return Err(CpError::Config(format!(
                    "{} nodes × {} devices exceed the {MAX_PLAN_RANKS} ranks the planners accept",
                    self.nodes, self.devices_per_node
                )))
            }
        }
        let speeds = [
            ("intra-node bandwidth", self.intra_node_bandwidth),
            ("inter-node bandwidth", self.inter_node_bandwidth),
            ("device FLOP/s", self.device_flops),
            ("device memory", self.device_memory),
        ];
        if let Some((name, value)) = speeds.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(CpError::Config(format!(
                "{name} must be positive, got {value}"
            )));
        }
        Ok(())
    }

    pub fn ranks(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// Its ranks as nodes of consecutive ranks.
    pub fn node_map(&self) -> crate::comm::nodes::NodeMap {
        crate::comm::nodes::NodeMap::uniform(self.nodes, self.devices_per_node)
    }

    pub fn node_of(&self, rank: usize) -> usize {
        self.node_map().node_of(rank)
    }

    /// The link between two ranks.
    pub fn link(&self, from: usize, to: usize) -> LinkClass {
        if from == to {
            LinkClass::Local
        } else if self.node_of(from) == self.node_of(to) {
            LinkClass::IntraNode
        } else {
            LinkClass::InterNode
        }
    }

    /// Seconds to move `bytes` over one link of `class` (one message).
    pub fn transfer_seconds(&self, class: LinkClass, bytes: f64) -> f64 {
        match class {
            LinkClass::Local => 0.0,
            LinkClass::IntraNode => self.intra_node_latency + bytes / self.intra_node_bandwidth,
            LinkClass::InterNode => self.inter_node_latency + bytes / self.inter_node_bandwidth,
        }
    }

    /// Seconds of attention compute for `flops` unmasked FLOPs on one device.
    pub fn compute_seconds(&self, flops: f64) -> f64 {
        flops / self.device_flops
    }

    /// This topology with every time `time_scale` times longer: bandwidths and device FLOP/s ÷
    /// `time_scale`, latencies × `time_scale` (what `--emulate-links` runs: the same machine,
    /// slowed to a CPU's speed).
    pub fn slowed(&self, time_scale: f64) -> Self {
        Self {
            intra_node_bandwidth: self.intra_node_bandwidth / time_scale,
            inter_node_bandwidth: self.inter_node_bandwidth / time_scale,
            intra_node_latency: self.intra_node_latency * time_scale,
            inter_node_latency: self.inter_node_latency * time_scale,
            device_flops: self.device_flops / time_scale,
            ..self.clone()
        }
    }
}

/// Backward FLOPs are this many times the forward's (flash-attention's recompute of Q·Kᵀ plus
/// dV, dP, dQ, dK).
pub const BACKWARD_FLOPS_FACTOR: f64 = 2.5;

/// FLOPs of attention over `pairs` unmasked (query, key) pairs for `heads` heads of `head_dim`:
/// forward `4·D` per pair and head (Q·Kᵀ and P·V), backward [`BACKWARD_FLOPS_FACTOR`]× that.
pub fn attention_flops(pairs: u64, heads: usize, head_dim: usize) -> (f64, f64) {
    let forward = 4.0 * pairs as f64 * heads as f64 * head_dim as f64;
    (forward, BACKWARD_FLOPS_FACTOR * forward)
}

impl FromStr for LinkClass {
    type Err = CpError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "local" => Ok(Self::Local),
            "intra" => Ok(Self::IntraNode),
            "inter" => Ok(Self::InterNode),
            other => Err(CpError::Config(format!(
                "unknown link class '{other}': expected local, intra or inter"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_place_ranks_on_nodes() {
        let topology = Topology::preset("a100-p4d", 4).unwrap();
        assert_eq!(topology.ranks(), 32);
        assert_eq!(topology.link(3, 3), LinkClass::Local);
        assert_eq!(topology.link(0, 7), LinkClass::IntraNode);
        assert_eq!(topology.link(7, 8), LinkClass::InterNode);
        assert!(
            topology.transfer_seconds(LinkClass::InterNode, 1e9)
                > topology.transfer_seconds(LinkClass::IntraNode, 1e9)
        );
        assert!(Topology::preset("tpu-pod", 2)
            .unwrap_err()
            .to_string()
            .contains("unknown topology 'tpu-pod'"));
        assert!(Topology::preset("h100-dgx", 0)
            .unwrap_err()
            .to_string()
            .contains("at least one node"));
    }

    #[test]
    fn attention_flops_count_unmasked_pairs() {
        let (forward, backward) = attention_flops(1000, 8, 128);
        assert_eq!(forward, 4.0 * 1000.0 * 8.0 * 128.0);
        assert_eq!(backward, 2.5 * forward);
    }
}
