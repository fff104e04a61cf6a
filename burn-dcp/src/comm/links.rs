//! Emulated links for the in-process world, so that time tells strategies apart on one machine.
//!
//! Threads of one process exchange messages as memory copies, so a strategy that moves 10× the
//! bytes is barely slower there. With [`LinkEmulation`] set on an
//! [`InProcessWorld`](super::InProcessWorld) ([`emulate_links`](super::InProcessWorld::emulate_links)),
//! every message between two ranks becomes available to its receiver only at the time it would
//! arrive over its link:
//!
//! - **Links.** A message between ranks of one virtual node (`WorldConfig::ranks_per_node`) goes
//!   over its sender's intra-node link (NVLink: one per rank); a message to another node over
//!   the sender's *node's* inter-node link, which all ranks of that node share (the NICs).
//! - **Time.** A link sends one message after the other: a message posted at `t` starts when its
//!   link is free (`start = max(t, free)`), occupies it for `bytes / bandwidth`, and arrives one
//!   `latency` after it finished. The receiver's wait returns no earlier than that. Sends are
//!   eager, so whatever a strategy computes between posting and waiting (ring's next block,
//!   DCP's next stage) overlaps the transfer, exactly as far as the strategy overlaps it.
//! - **Scale.** CPU threads compute ~10⁴× slower than the GPUs of a topology preset, so the
//!   preset's links are slowed by the same factor ([`LinkEmulation::of_topology`]: bandwidth ÷
//!   `time_scale`, latency × `time_scale`); communication then keeps the share of a step's time
//!   it has on the real cluster. `time_scale` is the preset's device FLOP/s over the CPU's
//!   attention FLOP/s per rank (`gpt_longctx --link-scale`, documented in docs/training.md).
//!
//! Bytes are unchanged: the same messages are sent and counted; only when they are received
//! changes. A rank's message to itself is never delayed. First-order only, as the planners' cost
//! model ([`crate::planner::cost`]): no receiver-side contention, no congestion in the fabric.

use std::time::{Duration, Instant};

use super::CommError;
use crate::comm::nodes::NodeMap;
use crate::planner::topology::Topology;

/// Link speeds of an emulated cluster (already scaled to the compute they sit beside).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkEmulation {
    /// Bytes/s one rank sends to ranks of its node.
    pub intra_node_bandwidth: f64,
    /// Bytes/s one node sends to other nodes (its ranks share it).
    pub inter_node_bandwidth: f64,
    pub intra_node_latency: Duration,
    pub inter_node_latency: Duration,
}

impl LinkEmulation {
    /// `topology`'s links slowed `time_scale` times (bandwidth ÷ `time_scale`, latency ×
    /// `time_scale`): the links beside a device `time_scale` times slower than the topology's.
    pub fn of_topology(topology: &Topology, time_scale: f64) -> Result<Self, CommError> {
        if !(time_scale.is_finite() && time_scale > 0.0) {
            return Err(invalid(format!(
                "the link time scale must be a positive number, got {time_scale}"
            )));
        }
        let slowed = topology.slowed(time_scale);
        let links = Self {
            intra_node_bandwidth: slowed.intra_node_bandwidth,
            inter_node_bandwidth: slowed.inter_node_bandwidth,
            intra_node_latency: Duration::try_from_secs_f64(slowed.intra_node_latency)
                .map_err(|e| invalid(format!("intra-node latency × {time_scale}: {e}")))?,
            inter_node_latency: Duration::try_from_secs_f64(slowed.inter_node_latency)
                .map_err(|e| invalid(format!("inter-node latency × {time_scale}: {e}")))?,
        };
        links.validate()?;
        Ok(links)
    }

    /// Bandwidths must be positive and finite.
    pub fn validate(&self) -> Result<(), CommError> {
        for (name, value) in [
            ("intra-node bandwidth", self.intra_node_bandwidth),
            ("inter-node bandwidth", self.inter_node_bandwidth),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(invalid(format!(
                    "the emulated {name} must be a positive number of bytes/s, got {value}"
                )));
            }
        }
        Ok(())
    }
}

fn invalid(message: String) -> CommError {
    CommError::Invalid {
        group: "world".into(),
        message,
    }
}

/// When each emulated link is free again.
#[derive(Debug)]
pub(crate) struct LinkClock {
    links: LinkEmulation,
    nodes: NodeMap,
    /// Per rank: its intra-node link.
    rank_free: Vec<Instant>,
    /// Per node: its inter-node link.
    node_free: Vec<Instant>,
}

impl LinkClock {
    pub(crate) fn new(links: LinkEmulation, nodes: NodeMap) -> Self {
        let now = Instant::now();
        Self {
            links,
            rank_free: vec![now; nodes.ranks()],
            node_free: vec![now; nodes.nodes()],
            nodes,
        }
    }

    /// When a message of `bytes` posted now by world rank `from` to world rank `to` arrives
    /// (and the link it takes is busy until it has been sent).
    pub(crate) fn arrival(&mut self, from: usize, to: usize, bytes: u64) -> Instant {
        let now = Instant::now();
        if from == to {
            return now;
        }
        let node = self.nodes.node_of(from);
        let (free, bandwidth, latency) = if self.nodes.same_node(from, to) {
            (
                &mut self.rank_free[from],
                self.links.intra_node_bandwidth,
                self.links.intra_node_latency,
            )
        } else {
            (
                &mut self.node_free[node],
                self.links.inter_node_bandwidth,
                self.links.inter_node_latency,
            )
        };
        let start = (*free).max(now);
        let sent = start + Duration::from_secs_f64(bytes as f64 / bandwidth);
        *free = sent;
        sent + latency
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links() -> LinkEmulation {
        LinkEmulation {
            intra_node_bandwidth: 1e6,
            inter_node_bandwidth: 1e5,
            intra_node_latency: Duration::from_millis(1),
            inter_node_latency: Duration::from_millis(2),
        }
    }

    #[test]
    fn a_link_sends_one_message_after_the_other() {
        let mut clock = LinkClock::new(links(), NodeMap::with_ranks_per_node(4, 2).unwrap());
        let posted = Instant::now();
        // 1000 bytes at 1 MB/s: 1 ms on the wire, +1 ms latency; the second queues behind it.
        let first = clock.arrival(0, 1, 1000);
        let second = clock.arrival(0, 1, 1000);
        let near = |at: Instant, ms: f64| {
            let got = at.duration_since(posted).as_secs_f64() * 1e3;
            assert!((got - ms).abs() < 0.5, "{got} ms, expected {ms}");
        };
        near(first, 2.0);
        near(second, 3.0);
        // Another rank's intra-node link is free; the node's inter-node link is shared.
        near(clock.arrival(1, 0, 1000), 2.0);
        near(clock.arrival(0, 2, 100), 3.0);
        near(clock.arrival(1, 3, 100), 4.0);
        // Rank 2 is on the other node: its node's link is free.
        near(clock.arrival(2, 0, 100), 3.0);
        assert!(clock.arrival(3, 3, 1 << 30) <= Instant::now());
    }

    #[test]
    fn topology_links_scale_with_compute() {
        let topology = Topology::preset("a100-p4d", 2).unwrap();
        let links = LinkEmulation::of_topology(&topology, 1000.0).unwrap();
        assert_eq!(
            links.inter_node_bandwidth,
            topology.inter_node_bandwidth / 1000.0
        );
        assert_eq!(links.inter_node_latency, Duration::from_millis(20));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let error = LinkEmulation::of_topology(&topology, bad).unwrap_err();
            assert!(error.to_string().contains("time scale"), "{error}");
        }
    }
}
