//! Coarsening: heavy-edge clustering of neighbouring vertices (within a window of pins) under
//! weight caps, then contraction into the next, smaller level.

use super::{FastMap, Hypergraph, SplitMix};

/// Neighbours of a vertex are looked up within ±`WINDOW` pins of it in each hyperedge.
const WINDOW: usize = 2;

impl Hypergraph {
    /// One coarsening level: a matching (vertex → cluster) and the contracted hypergraph.
    pub(super) fn coarsen(
        &self,
        rng: &mut SplitMix,
        cap_compute: f64,
        cap_memory: f64,
    ) -> (Vec<u32>, Self) {
        let cluster = self.cluster_vertices(
            rng,
            Caps {
                compute: cap_compute,
                memory: cap_memory,
            },
        );
        let coarse = self.contract(&cluster);
        (cluster, coarse)
    }

    /// Each vertex's size for the rating: its compute and memory as fractions of the totals
    /// (plus a tiny constant, so weightless vertices still have a size).
    fn normalised_sizes(&self) -> Vec<f64> {
        let n = self.vertices();
        let total_compute: f64 = self.compute.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let total_memory: f64 = self.memory.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        (0..n)
            .map(|v| {
                self.compute[v] / total_compute + self.memory[v] / total_memory + 1e-9 / n as f64
            })
            .collect()
    }

    /// For every incidence (in `incident` order), the position of the vertex inside its
    /// hyperedge's pin list.
    fn incidence_positions(&self) -> Vec<u32> {
        let mut position = vec![0u32; self.incident.len()];
        let mut next = self.vertex_start.clone();
        for e in 0..self.edges() {
            for (i, &pin) in self.pins_of(e).iter().enumerate() {
                position[next[pin as usize]] = i as u32;
                next[pin as usize] += 1;
            }
        }
        position
    }

    /// Heavy-edge clustering: in a shuffled order, each unclustered vertex joins the best-rated
    /// neighbouring cluster, or pairs with an unclustered neighbour, within the weight caps.
    fn cluster_vertices(&self, rng: &mut SplitMix, caps: Caps) -> Vec<u32> {
        let n = self.vertices();
        let sizes = self.normalised_sizes();
        let position = self.incidence_positions();
        let mut clusters = Clusters::new(n);
        // visit order: shuffled inside windows of 64 consecutive vertices, so the walk stays
        // cache friendly (callers number vertices with locality) yet is not biased by it
        let mut order: Vec<u32> = (0..n as u32).collect();
        for chunk in order.chunks_mut(64) {
            rng.shuffle(chunk);
        }
        let mut neighbours = Neighbours::new(n);
        for &v in &order {
            let v = v as usize;
            if clusters.of[v] != u32::MAX {
                continue;
            }
            neighbours.rate(self, v, &position, &clusters.of);
            let target = match self.best_neighbour(v, &neighbours.found, &clusters, &sizes, caps) {
                Some(Neighbour {
                    id,
                    is_cluster: true,
                    ..
                }) => id,
                best => {
                    let id = clusters.open();
                    if let Some(Neighbour { id: u, .. }) = best {
                        clusters.add(id, u as usize, self, &sizes);
                    }
                    id
                }
            };
            clusters.add(target, v, self, &sizes);
        }
        clusters.of
    }

    /// The neighbour (vertex or cluster) with the best rating (score per size) that `v` can join
    /// within the caps; ties go to the smaller id.
    fn best_neighbour(
        &self,
        v: usize,
        candidates: &[Neighbour],
        clusters: &Clusters,
        sizes: &[f64],
        caps: Caps,
    ) -> Option<Neighbour> {
        let mut best: Option<Neighbour> = None;
        for candidate in candidates {
            let id = candidate.id as usize;
            let (c, m, s) = if candidate.is_cluster {
                (clusters.compute[id], clusters.memory[id], clusters.size[id])
            } else {
                (self.compute[id], self.memory[id], sizes[id])
            };
            if c + self.compute[v] > caps.compute || m + self.memory[v] > caps.memory {
                continue;
            }
            let rating = candidate.score / s;
            if best.is_none_or(|b| rating > b.score || (rating == b.score && candidate.id < b.id)) {
                best = Some(Neighbour {
                    score: rating,
                    ..*candidate
                });
            }
        }
        best
    }

    /// The hypergraph of the clusters: summed weights, hyperedges over clusters with fewer than
    /// two pins dropped and parallel ones (same pin set) merged, summing their weights.
    fn contract(&self, cluster: &[u32]) -> Self {
        let coarse_n = cluster.iter().map(|&c| c as usize + 1).max().unwrap_or(0);
        let mut compute = vec![0.0; coarse_n];
        let mut memory = vec![0.0; coarse_n];
        for (v, &c) in cluster.iter().enumerate() {
            compute[c as usize] += self.compute[v];
            memory[c as usize] += self.memory[v];
        }
        let mut edges = ParallelEdges::default();
        let mut seen = vec![u32::MAX; coarse_n];
        for e in 0..self.edges() {
            let mut pins = Vec::with_capacity(self.pins_of(e).len());
            for &p in self.pins_of(e) {
                let c = cluster[p as usize];
                if seen[c as usize] != e as u32 {
                    seen[c as usize] = e as u32;
                    pins.push(c);
                }
            }
            if pins.len() >= 2 {
                edges.add(self.edge_weight[e], pins);
            }
        }
        Hypergraph::new(compute, memory, edges.edges)
    }
}

/// Weight caps of one cluster.
#[derive(Clone, Copy, Debug)]
struct Caps {
    compute: f64,
    memory: f64,
}

/// The clusters of one coarsening level, grown vertex by vertex.
struct Clusters {
    /// Cluster of each vertex (`u32::MAX`: none yet).
    of: Vec<u32>,
    compute: Vec<f64>,
    memory: Vec<f64>,
    size: Vec<f64>,
}

impl Clusters {
    fn new(vertices: usize) -> Self {
        Self {
            of: vec![u32::MAX; vertices],
            compute: Vec::new(),
            memory: Vec::new(),
            size: Vec::new(),
        }
    }

    /// A new, empty cluster.
    fn open(&mut self) -> u32 {
        let id = self.compute.len() as u32;
        self.compute.push(0.0);
        self.memory.push(0.0);
        self.size.push(0.0);
        id
    }

    /// Puts vertex `v` of `graph` into cluster `id`.
    fn add(&mut self, id: u32, v: usize, graph: &Hypergraph, sizes: &[f64]) {
        self.of[v] = id;
        let id = id as usize;
        self.compute[id] += graph.compute[v];
        self.memory[id] += graph.memory[v];
        self.size[id] += sizes[v];
    }
}

/// A vertex or cluster next to the vertex being clustered, with its summed heavy-edge score.
#[derive(Clone, Copy, Debug)]
struct Neighbour {
    id: u32,
    is_cluster: bool,
    score: f64,
}

/// The neighbours of one vertex with their scores, collected without clearing `n`-sized maps.
struct Neighbours {
    found: Vec<Neighbour>,
    /// Index in `found` of a vertex (`[0]`) or cluster (`[1]`), `u32::MAX` when absent.
    slot: [Vec<u32>; 2],
}

impl Neighbours {
    fn new(vertices: usize) -> Self {
        Self {
            found: Vec::new(),
            slot: [vec![u32::MAX; vertices], vec![u32::MAX; vertices]],
        }
    }

    /// Collects the neighbours of `v` within ±`WINDOW` pins in each of its hyperedges, each
    /// hyperedge adding `weight / (pins − 1)` to the score of every neighbour it holds.
    fn rate(&mut self, graph: &Hypergraph, v: usize, position: &[u32], cluster: &[u32]) {
        self.found.clear();
        let slots = graph.vertex_start[v]..graph.vertex_start[v + 1];
        for (&e, &at) in graph.incident[slots.clone()].iter().zip(&position[slots]) {
            let (e, at) = (e as usize, at as usize);
            let pins = graph.pins_of(e);
            let score = graph.edge_weight[e] / (pins.len() - 1) as f64;
            let window = at.saturating_sub(WINDOW)..(at + WINDOW + 1).min(pins.len());
            for &u in &pins[window] {
                if u as usize != v {
                    self.credit(u, cluster, score);
                }
            }
        }
        for found in &self.found {
            self.slot[found.is_cluster as usize][found.id as usize] = u32::MAX;
        }
    }

    /// Adds `score` to `u`'s cluster, or to `u` itself when it has none.
    fn credit(&mut self, u: u32, cluster: &[u32], score: f64) {
        let (id, is_cluster) = match cluster[u as usize] {
            u32::MAX => (u, false),
            c => (c, true),
        };
        let slot = &mut self.slot[is_cluster as usize][id as usize];
        if *slot == u32::MAX {
            *slot = self.found.len() as u32;
            self.found.push(Neighbour {
                id,
                is_cluster,
                score,
            });
        } else {
            self.found[*slot as usize].score += score;
        }
    }
}

/// Hyperedges with parallel ones merged: bucketed by a hash of the sorted pins, compared on
/// collision.
#[derive(Default)]
struct ParallelEdges {
    buckets: FastMap<u64, Vec<usize>>,
    edges: Vec<(f64, Vec<u32>)>,
    sorted_pins: Vec<Vec<u32>>,
}

impl ParallelEdges {
    fn add(&mut self, weight: f64, pins: Vec<u32>) {
        let mut key = pins.clone();
        key.sort_unstable();
        let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &p| {
            (h ^ p as u64).wrapping_mul(0x0100_0000_01b3)
        });
        let bucket = self.buckets.entry(hash).or_default();
        match bucket.iter().find(|&&i| self.sorted_pins[i] == key) {
            Some(&index) => self.edges[index].0 += weight,
            None => {
                bucket.push(self.edges.len());
                self.edges.push((weight, pins));
                self.sorted_pins.push(key);
            }
        }
    }
}
