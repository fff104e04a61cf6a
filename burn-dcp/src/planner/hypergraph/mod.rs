//! A multilevel k-way hypergraph partitioner: heavy-edge coarsening, greedy initial placement,
//! gain-driven k-way refinement and rebalancing, under two balance constraints (compute and
//! memory) given as absolute per-part capacities.
//!
//! Objective: the connectivity cost `Σ_e w(e) · (λ(e) − 1)`, where `λ(e)` is the number of parts
//! that hold a pin of hyperedge `e`. With the data block itself among the pins, `(λ − 1)` is the
//! number of copies that must move.
//!
//! Why our own and not a crate: KaHyPar / Mt-KaHyPar / PaToH are C/C++ (no offline build here, and
//! the DCP paper reports seconds of planning with KaHyPar); the Rust crates we could find are
//! graph (not hypergraph) partitioners or unmaintained. This one is ~500 lines, deterministic for
//! a seed, and fast because the planner keeps `k` small (nodes, then devices of one node).
//!
//! Recipe (the known multilevel one, simplified), one file per step:
//! 1. **Coarsening** (`coarsen.rs`): vertices are visited in a seeded random order and matched
//!    with the unmatched neighbour of best rating `Σ_shared w(e)/(|e|−1)` divided by the product
//!    of the two (normalised) weights, never over a cluster weight cap. Neighbours are looked up
//!    in a window of ±2 pins around the vertex in each of its hyperedges (pin lists keep the
//!    order the caller gave, so for the DCP grid these are the adjacent tiles), which keeps a
//!    level at `O(pins)` even when hyperedges have hundreds of pins. Contraction drops
//!    single-pin hyperedges and merges parallel ones.
//! 2. **Initial partition** (`initial.rs`) of the coarsest hypergraph: several seeded greedy
//!    placements (heaviest first, into the part that already holds most of its hyperedges'
//!    weight, within the capacities), each refined; the cheapest balanced one wins.
//! 3. **Uncoarsening** (`refine.rs`): at every level, project, then rebalance (move the cheapest
//!    vertices out of over-full parts) and refine: passes of best-gain single-vertex moves with
//!    positive gain (or zero gain that evens the load), never breaking a capacity (the greedy
//!    k-way variant of FM, as in Mt-KaHyPar's label propagation refiner). Levels of up to
//!    16 384 vertices (and the coarsest level's candidates) also get FM passes: moves of best
//!    gain, negative ones too, rolled back to the best prefix.
//!
//! [`partition`] (`partition.rs`) drives the levels; the hypergraph and its queries are in
//! `graph.rs`, the capacities in `settings.rs`, the seeded hashing and random numbers in `random.rs`.

mod coarsen;
mod graph;
mod initial;
mod partition;
mod random;
mod refine;
mod settings;

pub use graph::Hypergraph;
pub use partition::partition;
pub use random::{FastHasher, FastMap, SplitMix};
pub use settings::PartitionConfig;
