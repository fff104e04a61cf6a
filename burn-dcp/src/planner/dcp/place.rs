//! Hierarchical placement: the hypergraph partitioned into nodes, then each node's induced
//! sub-hypergraph into its devices.

use super::DcpConfig;
use crate::planner::hypergraph::{partition, Hypergraph, PartitionConfig};
use crate::planner::topology::Topology;

/// Places every vertex on a rank: nodes first, then devices of each node.
pub(super) fn place(graph: &Hypergraph, topology: &Topology, config: &DcpConfig) -> Vec<u32> {
    let ranks = topology.ranks();
    let total_compute: f64 = graph.compute.iter().sum();
    let total_memory: f64 = graph.memory.iter().sum();
    let node_of_vertex = if topology.nodes > 1 {
        let node_config = PartitionConfig::balanced(
            graph,
            topology.nodes,
            config.compute_epsilon / 2.0,
            config.memory_epsilon / 2.0,
            config.seed,
        );
        partition(graph, &node_config)
    } else {
        vec![0; graph.vertices()]
    };
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); topology.nodes];
    for (v, &node) in node_of_vertex.iter().enumerate() {
        members[node as usize].push(v as u32);
    }
    let mut rank = vec![0u32; graph.vertices()];
    for (node, members) in members.iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let sub = graph.induced(members);
        let device_config = PartitionConfig::with_capacities(
            topology.devices_per_node,
            (1.0 + config.compute_epsilon) * total_compute / ranks as f64,
            (1.0 + config.memory_epsilon) * total_memory / ranks as f64,
            config.seed.wrapping_add(node as u64 + 1),
        );
        let device = partition(&sub, &device_config);
        for (&v, &d) in members.iter().zip(&device) {
            rank[v as usize] = (node * topology.devices_per_node) as u32 + d;
        }
    }
    rank
}
