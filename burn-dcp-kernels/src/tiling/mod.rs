//! Launch tables of the tiled kernels, built on the host from the problem (no device needed).
//!
//! Every mask of [`MaskSpec`](crate::MaskSpec), on packed varlen sequences with global offsets,
//! reduces to the same thing per query: a few *spans* of packed key indices it may attend
//! (`crate::spans`). The kernels therefore know nothing about masks or sequences:
//!
//! - `spans [q_tokens, max_spans, 2]` (`u32`, half-open `[start, end)`, unused slots `[0, 0)`) is
//!   the per-element predicate of partially masked tiles;
//! - for a tile geometry (`rows` queries × `cols` keys), [`TileRuns`] lists per row tile the
//!   runs of column tiles holding at least one allowed pair (marking the whole ones, which need
//!   no mask), and its transpose lists per key tile the query tiles. Kernels loop over these
//!   lists only, so fully masked tiles cost nothing: they are never loaded, never computed.

mod runs;
mod tables;

pub use runs::TileRuns;
pub use tables::DenseSpans;
