//! The hypergraph in compressed form and its queries.

/// A hypergraph in compressed form: vertex weights (compute, memory), hyperedge weights and pins.
#[derive(Clone, Debug, Default)]
pub struct Hypergraph {
    pub compute: Vec<f64>,
    pub memory: Vec<f64>,
    pub edge_weight: Vec<f64>,
    pub(super) edge_start: Vec<usize>,
    pub(super) pins: Vec<u32>,
    pub(super) vertex_start: Vec<usize>,
    pub(super) incident: Vec<u32>,
}

impl Hypergraph {
    /// Builds a hypergraph from vertex weights and `(weight, pins)` hyperedges. Pins must be
    /// vertex indices; duplicates inside one hyperedge are removed, and hyperedges with fewer than
    /// two distinct pins are dropped (they can never be cut).
    pub fn new(compute: Vec<f64>, memory: Vec<f64>, edges: Vec<(f64, Vec<u32>)>) -> Self {
        assert_eq!(compute.len(), memory.len(), "one memory weight per vertex");
        let n = compute.len();
        let mut seen = vec![u32::MAX; n];
        let mut edge_weight = Vec::with_capacity(edges.len());
        let mut edge_start = vec![0];
        let mut pins = Vec::new();
        for (index, (weight, edge_pins)) in edges.into_iter().enumerate() {
            let before = pins.len();
            for pin in edge_pins {
                assert!((pin as usize) < n, "pin {pin} of a {n}-vertex hypergraph");
                if seen[pin as usize] != index as u32 {
                    seen[pin as usize] = index as u32;
                    pins.push(pin);
                }
            }
            if pins.len() - before < 2 {
                pins.truncate(before);
                continue;
            }
            edge_weight.push(weight);
            edge_start.push(pins.len());
        }
        let mut graph = Self {
            compute,
            memory,
            edge_weight,
            edge_start,
            pins,
            vertex_start: Vec::new(),
            incident: Vec::new(),
        };
        graph.index_incidence();
        graph
    }

    fn index_incidence(&mut self) {
        let n = self.vertices();
        let mut degree = vec![0usize; n + 1];
        for &pin in &self.pins {
            degree[pin as usize + 1] += 1;
        }
        for v in 0..n {
            degree[v + 1] += degree[v];
        }
        let mut fill = degree.clone();
        let mut incident = vec![0u32; self.pins.len()];
        for e in 0..self.edges() {
            for &pin in self.pins_of(e) {
                incident[fill[pin as usize]] = e as u32;
                fill[pin as usize] += 1;
            }
        }
        self.vertex_start = degree;
        self.incident = incident;
    }

    pub fn vertices(&self) -> usize {
        self.compute.len()
    }

    pub fn edges(&self) -> usize {
        self.edge_weight.len()
    }

    pub fn pins_of(&self, edge: usize) -> &[u32] {
        &self.pins[self.edge_start[edge]..self.edge_start[edge + 1]]
    }

    pub fn edges_of(&self, vertex: usize) -> &[u32] {
        &self.incident[self.vertex_start[vertex]..self.vertex_start[vertex + 1]]
    }

    /// `Σ_e w(e) · (λ(e) − 1)` for a partition.
    pub fn connectivity_cost(&self, part: &[u32]) -> f64 {
        let mut cost = 0.0;
        let mut seen: Vec<u32> = Vec::new();
        for e in 0..self.edges() {
            seen.clear();
            for &pin in self.pins_of(e) {
                let p = part[pin as usize];
                if !seen.contains(&p) {
                    seen.push(p);
                }
            }
            cost += self.edge_weight[e] * (seen.len() as f64 - 1.0);
        }
        cost
    }

    /// Compute and memory load of every part.
    pub fn loads(&self, part: &[u32], parts: usize) -> (Vec<f64>, Vec<f64>) {
        let mut compute = vec![0.0; parts];
        let mut memory = vec![0.0; parts];
        for v in 0..self.vertices() {
            compute[part[v] as usize] += self.compute[v];
            memory[part[v] as usize] += self.memory[v];
        }
        (compute, memory)
    }

    /// The sub-hypergraph induced by `vertices` (pins outside are dropped), and for each of its
    /// vertices the index in `self`.
    pub fn induced(&self, vertices: &[u32]) -> Hypergraph {
        let mut local = vec![u32::MAX; self.vertices()];
        for (i, &v) in vertices.iter().enumerate() {
            local[v as usize] = i as u32;
        }
        let mut touched = vec![false; self.edges()];
        let mut edges = Vec::new();
        for &v in vertices {
            for &e in self.edges_of(v as usize) {
                if !touched[e as usize] {
                    touched[e as usize] = true;
                    let pins: Vec<u32> = self
                        .pins_of(e as usize)
                        .iter()
                        .filter_map(|&p| Some(local[p as usize]).filter(|&l| l != u32::MAX))
                        .collect();
                    edges.push((self.edge_weight[e as usize], pins));
                }
            }
        }
        Hypergraph::new(
            vertices.iter().map(|&v| self.compute[v as usize]).collect(),
            vertices.iter().map(|&v| self.memory[v as usize]).collect(),
            edges,
        )
    }
}
