//! Per-part capacities and search settings of a partition.

use super::Hypergraph;

/// Per-part capacities and search settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionConfig {
    pub parts: usize,
    /// Largest compute weight a part may hold.
    pub compute_capacity: f64,
    /// Largest memory weight a part may hold.
    pub memory_capacity: f64,
    pub seed: u64,
    /// Stop coarsening at `coarsest_per_part · parts` vertices.
    pub coarsest_per_part: usize,
    pub initial_tries: usize,
    pub refine_passes: usize,
}

impl PartitionConfig {
    /// Capacities `(1 + ε) · total / parts` for the hypergraph's totals.
    pub fn balanced(
        graph: &Hypergraph,
        parts: usize,
        compute_epsilon: f64,
        memory_epsilon: f64,
        seed: u64,
    ) -> Self {
        let total_compute: f64 = graph.compute.iter().sum();
        let total_memory: f64 = graph.memory.iter().sum();
        Self::with_capacities(
            parts,
            (1.0 + compute_epsilon) * total_compute / parts as f64,
            (1.0 + memory_epsilon) * total_memory / parts as f64,
            seed,
        )
    }

    /// Given capacities, default search settings.
    pub fn with_capacities(
        parts: usize,
        compute_capacity: f64,
        memory_capacity: f64,
        seed: u64,
    ) -> Self {
        Self {
            parts,
            compute_capacity,
            memory_capacity,
            seed,
            coarsest_per_part: 24,
            initial_tries: 3,
            refine_passes: 4,
        }
    }
}
