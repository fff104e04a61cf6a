//! Seeing what ranks do: [`trace`] (a Chrome trace per rank and the time spent waiting on
//! communication) and [`volume`] (the analytic bytes each static strategy sends: every
//! strategy's [`AttentionStrategy::volume`](crate::strategy::AttentionStrategy::volume)). With
//! the feature `harness`, the checking tool of the tests and the `cp_attention` tool:
//! [`harness`] (CP attention end to end on in-process ranks, against one device).

#[cfg(feature = "harness")]
pub mod harness;
pub mod trace;
pub mod volume;
