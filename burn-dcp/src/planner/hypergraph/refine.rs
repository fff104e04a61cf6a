//! Refinement of a partition level: rebalancing of over-full parts, greedy best-gain moves and
//! FM passes with rollback, all on incrementally updated pin counts and loads.

use super::{Hypergraph, PartitionConfig, SplitMix};

/// Pin counts per (hyperedge, part) and part loads, updated move by move.
pub(super) struct PartitionState<'a> {
    graph: &'a Hypergraph,
    parts: usize,
    pub(super) part: Vec<u32>,
    pin_count: Vec<u32>,
    compute: Vec<f64>,
    memory: Vec<f64>,
}

impl<'a> PartitionState<'a> {
    pub(super) fn new(graph: &'a Hypergraph, parts: usize, part: Vec<u32>) -> Self {
        let mut pin_count = vec![0u32; graph.edges() * parts];
        for e in 0..graph.edges() {
            for &p in graph.pins_of(e) {
                pin_count[e * parts + part[p as usize] as usize] += 1;
            }
        }
        let (compute, memory) = graph.loads(&part, parts);
        Self {
            graph,
            parts,
            part,
            pin_count,
            compute,
            memory,
        }
    }

    fn fits(&self, v: usize, to: usize, config: &PartitionConfig) -> bool {
        (self.graph.compute[v] == 0.0
            || self.compute[to] + self.graph.compute[v] <= config.compute_capacity)
            && (self.graph.memory[v] == 0.0
                || self.memory[to] + self.graph.memory[v] <= config.memory_capacity)
    }

    /// Whether `v` is the last pin of its part in one of its hyperedges: only then can moving
    /// it lower a connectivity, so only then can a single move have a positive gain.
    fn can_gain(&self, v: usize) -> bool {
        let from = self.part[v] as usize;
        self.graph
            .edges_of(v)
            .iter()
            .any(|&e| self.pin_count[e as usize * self.parts + from] == 1)
    }

    /// Gain of moving `v` to every part (`gains[p]`; the current part gets 0).
    fn gains(&self, v: usize, gains: &mut [f64]) {
        let from = self.part[v] as usize;
        gains.iter_mut().for_each(|g| *g = 0.0);
        let mut base = 0.0;
        for &e in self.graph.edges_of(v) {
            let e = e as usize;
            let w = self.graph.edge_weight[e];
            let counts = &self.pin_count[e * self.parts..(e + 1) * self.parts];
            if counts[from] == 1 {
                base += w;
            }
            for (p, &count) in counts.iter().enumerate() {
                if count == 0 {
                    gains[p] -= w;
                }
            }
        }
        for (p, g) in gains.iter_mut().enumerate() {
            *g = if p == from { 0.0 } else { *g + base };
        }
    }

    fn apply(&mut self, v: usize, to: usize) {
        let from = self.part[v] as usize;
        for &e in self.graph.edges_of(v) {
            let e = e as usize;
            self.pin_count[e * self.parts + from] -= 1;
            self.pin_count[e * self.parts + to] += 1;
        }
        self.compute[from] -= self.graph.compute[v];
        self.compute[to] += self.graph.compute[v];
        self.memory[from] -= self.graph.memory[v];
        self.memory[to] += self.graph.memory[v];
        self.part[v] = to as u32;
    }

    /// Relative load of a part (the larger of its two fill ratios).
    fn fill(&self, p: usize, config: &PartitionConfig) -> f64 {
        (self.compute[p] / config.compute_capacity).max(self.memory[p] / config.memory_capacity)
    }

    pub(super) fn overloaded(&self, p: usize, config: &PartitionConfig) -> bool {
        self.compute[p] > config.compute_capacity * (1.0 + 1e-12)
            || self.memory[p] > config.memory_capacity * (1.0 + 1e-12)
    }

    /// Moves vertices out of over-full parts, cheapest (highest gain) first.
    pub(super) fn rebalance(&mut self, config: &PartitionConfig) {
        let mut gains = vec![0.0; self.parts];
        for _round in 0..4 {
            let over: Vec<usize> = (0..self.parts)
                .filter(|&p| self.overloaded(p, config))
                .collect();
            if over.is_empty() {
                return;
            }
            for from in over {
                let compute_over = self.compute[from] > config.compute_capacity;
                let mut movable: Vec<(usize, usize, f64)> = Vec::new();
                for v in 0..self.graph.vertices() {
                    if self.part[v] as usize != from {
                        continue;
                    }
                    let relevant = if compute_over {
                        self.graph.compute[v] > 0.0
                    } else {
                        self.graph.memory[v] > 0.0
                    };
                    if !relevant {
                        continue;
                    }
                    if let Some((to, gain)) = self.best_move(v, &mut gains, config) {
                        movable.push((v, to, gain));
                    }
                }
                movable.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
                for (v, to, _) in movable {
                    if !self.overloaded(from, config) {
                        break;
                    }
                    if self.part[v] as usize == from && self.fits(v, to, config) {
                        self.apply(v, to);
                    }
                }
            }
        }
    }

    /// Best feasible target of `v` and its gain.
    fn best_move(
        &self,
        v: usize,
        gains: &mut [f64],
        config: &PartitionConfig,
    ) -> Option<(usize, f64)> {
        let from = self.part[v] as usize;
        self.gains(v, gains);
        (0..self.parts)
            .filter(|&p| p != from && self.fits(v, p, config))
            .max_by(|&a, &b| {
                gains[a]
                    .total_cmp(&gains[b])
                    .then(self.fill(b, config).total_cmp(&self.fill(a, config)))
            })
            .map(|p| (p, gains[p]))
    }

    /// FM passes: repeatedly move the unmoved cut vertex of best gain (negative gains too)
    /// within the capacities, then roll back to the best prefix of the move sequence. A pass
    /// stops after `patience` moves without a new best. Gains are kept in a max-heap and
    /// recomputed when popped (stale keys go back in); when a move leaves a single pin of its old
    /// part in a hyperedge, that pin (whose gain rose) is pushed again.
    pub(super) fn fm(&mut self, config: &PartitionConfig, passes: usize) {
        let mut gains = vec![0.0; self.parts];
        for _pass in 0..passes {
            if self.fm_pass(config, &mut gains) == 0 {
                break;
            }
        }
    }

    /// One FM pass; returns how many moves it kept.
    fn fm_pass(&mut self, config: &PartitionConfig, gains: &mut [f64]) -> usize {
        let n = self.graph.vertices();
        let patience = 64 + n / 64;
        let mut heap = GainHeap::default();
        for v in (0..n).filter(|&v| self.is_cut(v)) {
            if let Some((_, g)) = self.best_move(v, gains, config) {
                heap.push(g, v);
            }
        }
        let mut moved = vec![false; n];
        let mut moves: Vec<(usize, usize)> = Vec::new();
        let (mut total, mut best, mut best_len) = (0.0f64, 0.0f64, 0usize);
        while let Some((key, v)) = heap.pop() {
            if moved[v] {
                continue;
            }
            let Some((to, g)) = self.best_move(v, gains, config) else {
                continue;
            };
            if GainHeap::key(g) < key {
                heap.push(g, v);
                continue;
            }
            let from = self.part[v] as usize;
            self.apply(v, to);
            moved[v] = true;
            moves.push((v, from));
            total += g;
            if total > best + 1e-9 * (1.0 + best.abs()) {
                best = total;
                best_len = moves.len();
            } else if moves.len() - best_len > patience {
                break;
            }
            self.push_lone_pins(v, from, &moved, &mut heap, gains, config);
        }
        for &(v, from) in moves[best_len..].iter().rev() {
            self.apply(v, from);
        }
        best_len
    }

    /// Whether one of `v`'s hyperedges has pins outside `v`'s part.
    fn is_cut(&self, v: usize) -> bool {
        let from = self.part[v] as usize;
        self.graph.edges_of(v).iter().any(|&e| {
            (self.pin_count[e as usize * self.parts + from] as usize)
                < self.graph.pins_of(e as usize).len()
        })
    }

    /// After `v` left part `from`: in each of `v`'s hyperedges where a single pin of `from`
    /// remains, that pin's gain rose; push it again unless it has moved.
    fn push_lone_pins(
        &self,
        v: usize,
        from: usize,
        moved: &[bool],
        heap: &mut GainHeap,
        gains: &mut [f64],
        config: &PartitionConfig,
    ) {
        for &e in self.graph.edges_of(v) {
            let e = e as usize;
            if self.pin_count[e * self.parts + from] != 1 {
                continue;
            }
            let lone =
                (self.graph.pins_of(e).iter()).find(|&&u| self.part[u as usize] as usize == from);
            if let Some(&u) = lone {
                if !moved[u as usize] {
                    if let Some((_, g)) = self.best_move(u as usize, gains, config) {
                        heap.push(g, u as usize);
                    }
                }
            }
        }
    }

    /// Passes of best-gain moves (see the module docs).
    pub(super) fn refine(&mut self, config: &PartitionConfig, rng: &mut SplitMix) {
        let n = self.graph.vertices();
        let mut order: Vec<u32> = (0..n as u32).collect();
        let mut gains = vec![0.0; self.parts];
        for _pass in 0..config.refine_passes {
            rng.shuffle(&mut order);
            let mut moved = 0usize;
            for &v in &order {
                let v = v as usize;
                if self.graph.edges_of(v).is_empty() {
                    continue;
                }
                let from = self.part[v] as usize;
                if !self.can_gain(v) {
                    continue;
                }
                let Some((to, gain)) = self.best_move(v, &mut gains, config) else {
                    continue;
                };
                let evens_load =
                    gain == 0.0 && self.fill(to, config) + 1e-9 < self.fill(from, config) && {
                        // after the move the destination must still be the lighter one
                        let c = self.graph.compute[v] / config.compute_capacity;
                        let m = self.graph.memory[v] / config.memory_capacity;
                        self.fill(to, config) + c.max(m) < self.fill(from, config)
                    };
                if gain > 1e-12 * (1.0 + gain.abs()) || evens_load {
                    self.apply(v, to);
                    moved += 1;
                }
            }
            if moved * 1000 <= n {
                break;
            }
        }
    }
}

/// FM's max-heap of vertices by gain (rounded to 1e-6, so equal gains order by vertex).
#[derive(Default)]
struct GainHeap(std::collections::BinaryHeap<(i64, u32)>);

impl GainHeap {
    fn key(gain: f64) -> i64 {
        (gain * 1e6).round() as i64
    }

    fn push(&mut self, gain: f64, v: usize) {
        self.0.push((Self::key(gain), v as u32));
    }

    /// The highest (key, vertex).
    fn pop(&mut self) -> Option<(i64, usize)> {
        self.0.pop().map(|(key, v)| (key, v as usize))
    }
}
