//! Initial partition of the coarsest level: seeded greedy placement.

use super::{Hypergraph, PartitionConfig, SplitMix};

/// Greedy initial placement: heaviest first, into the feasible part that already holds most of
/// its hyperedges' weight (ties: the emptiest part).
pub(super) fn greedy_initial(
    graph: &Hypergraph,
    config: &PartitionConfig,
    rng: &mut SplitMix,
) -> Vec<u32> {
    let k = config.parts;
    let mut part = vec![u32::MAX; graph.vertices()];
    let mut compute = vec![0.0; k];
    let mut memory = vec![0.0; k];
    let mut affinity = vec![0.0; k];
    // placed pins per (hyperedge, part)
    let mut placed = vec![0u32; graph.edges() * k];
    for v in heaviest_first(graph, rng) {
        affinity.iter_mut().for_each(|a| *a = 0.0);
        for &e in graph.edges_of(v) {
            let e = e as usize;
            for (p, &count) in placed[e * k..(e + 1) * k].iter().enumerate() {
                if count > 0 {
                    affinity[p] += graph.edge_weight[e];
                }
            }
        }
        let fill = |p: usize| {
            (compute[p] / config.compute_capacity).max(memory[p] / config.memory_capacity)
        };
        let fits = |p: usize| {
            (graph.compute[v] == 0.0 || compute[p] + graph.compute[v] <= config.compute_capacity)
                && (graph.memory[v] == 0.0 || memory[p] + graph.memory[v] <= config.memory_capacity)
        };
        let target = (0..k)
            .filter(|&p| fits(p))
            .max_by(|&a, &b| {
                affinity[a]
                    .total_cmp(&affinity[b])
                    .then(fill(b).total_cmp(&fill(a)))
            })
            .unwrap_or_else(|| {
                (0..k)
                    .min_by(|&a, &b| fill(a).total_cmp(&fill(b)))
                    .expect("at least one part")
            });
        part[v] = target as u32;
        compute[target] += graph.compute[v];
        memory[target] += graph.memory[v];
        for &e in graph.edges_of(v) {
            placed[e as usize * k + target] += 1;
        }
    }
    part
}

/// The vertices in a seeded random order, then stably by decreasing normalised weight (compute
/// and memory as fractions of their totals).
fn heaviest_first(graph: &Hypergraph, rng: &mut SplitMix) -> Vec<usize> {
    let mut order: Vec<u32> = (0..graph.vertices() as u32).collect();
    rng.shuffle(&mut order);
    let total_compute: f64 = graph.compute.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let total_memory: f64 = graph.memory.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    order.sort_by(|&a, &b| {
        let weight = |v: u32| {
            graph.compute[v as usize] / total_compute + graph.memory[v as usize] / total_memory
        };
        weight(b).total_cmp(&weight(a))
    });
    order.into_iter().map(|v| v as usize).collect()
}
