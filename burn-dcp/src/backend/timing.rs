//! How long this thread has spent in context-parallel attention: the measured side of the
//! planners' predicted attention time.
//!
//! Every `ContextParallel` attention call under a CP context — the forward, and the backward
//! node's step — adds its wall time (kernels and communication waits, as the rank lives them) to
//! a per-thread total. A rank is one thread (threads-as-ranks) or one process, and burn-autodiff
//! runs the backward on the thread that calls `backward()`, so the total is the rank's. On
//! asynchronous backends (wgpu, CUDA) a kernel's time is only seen where the strategy waits on
//! its results (every communication does), so read it after a sync.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    static ATTENTION_TIME: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Wall time this thread has spent in `ContextParallel` attention (forward and backward) so far.
/// Take the difference of two readings for a step.
pub fn attention_time() -> Duration {
    ATTENTION_TIME.with(Cell::get)
}

/// Runs `work` (the `pass` of a CP attention call of `strategy`), adding its wall time to this
/// thread's attention time, as a span `attention <pass>` of the trace ([`crate::diagnostics::trace`]).
pub(crate) fn timed<T>(
    pass: &str,
    strategy: &impl std::fmt::Display,
    work: impl FnOnce() -> T,
) -> T {
    let _span = crate::diagnostics::trace::span(
        format_args!("attention {pass}"),
        "attention",
        serde_json::json!({"strategy": strategy.to_string()}),
    );
    let started = Instant::now();
    let result = work();
    let elapsed = started.elapsed();
    ATTENTION_TIME.with(|total| total.set(total.get() + elapsed));
    result
}
