//! Seeing what ranks do: [`trace`] (a Chrome trace per rank and the time spent waiting on
//! communication). With the feature `harness`, the checking tools of the tests and the
//! `cp_attention` tool: [`harness`] (CP attention end to end on in-process ranks, against one
//! device) and [`volume`] (the analytic bytes each static strategy sends).

#[cfg(feature = "harness")]
pub mod harness;
pub mod trace;
#[cfg(feature = "harness")]
pub mod volume;
