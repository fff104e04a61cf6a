//! The batch vocabulary: how a packed micro-batch's tokens sit on a CP group's ranks.
//!
//! [`layout`] (the static layouts: contiguous, zigzag, stripe) and [`placement`] (where every
//! token lives: a layout's, a dynamic-CP group's or a planner's), [`rows`] (the rows of
//! `[B, S, …]` batches in the packed order) and [`shard`] (a rank's tokens cut out of the packed
//! batch, and put back for checks).

pub mod layout;
pub mod placement;
pub mod rows;
pub mod shard;

pub use layout::Layout;
pub use placement::{Placement, PlacementKind};
pub use rows::{BatchRows, LocalRows};
