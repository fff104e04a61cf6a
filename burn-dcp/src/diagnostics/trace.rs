//! A trace of what each rank does, in the Chrome trace-event format (JSON; opens in Perfetto and
//! chrome://tracing), and the time a rank spends waiting on communication.
//!
//! A [`Tracer`] collects events. A rank thread records into it while a [`RankTrace`] guard names
//! its tracer and track (`tid` = the world rank; the caller of the training engine holds one) and
//! a [`StepTrace`] is open (the engine opens one per optimizer step, so what happens between
//! steps — a checkpoint's transfers, say — is not in the trace). [`span`] opens a span
//! (`"ph": "B"`) that its guard closes (`"ph": "E"`) on the same track; spans nest. Where nothing
//! is recorded, a span costs two thread-local reads.
//!
//! [`TracedComm`] wraps a communicator: every call (sends, receives and the waits on them,
//! collectives) becomes a span of category `"comm"` whose begin event has `args.bytes` — the
//! data bytes this rank sent in it, by the communicator's own count ([`Communicator::stats`]; 0
//! for waits) — and `args.peer` (world rank) or `args.group` (the span's two events are
//! recorded when the call returns, the begin at the call's start time); its wall time adds to the thread's [`comm_wait_time`] whether or not a
//! trace is recorded. Groups split from a traced communicator are traced.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::comm::{Comm, CommError, CommStats, Communicator, Payload, PendingRecv, PendingSend};

/// The events of a run, shared by its ranks.
///
/// Timestamps are microseconds since the Unix epoch (read once, then advanced by a monotonic
/// clock), so the files of ranks in different processes line up when merged.
#[derive(Debug)]
pub struct Tracer {
    started: Instant,
    epoch_us: f64,
    events: Mutex<Vec<Value>>,
}

impl Tracer {
    pub fn new() -> Arc<Self> {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Arc::new(Self {
            started: Instant::now(),
            epoch_us: epoch.as_secs_f64() * 1e6,
            events: Mutex::new(Vec::new()),
        })
    }

    fn now_us(&self) -> f64 {
        self.epoch_us + self.started.elapsed().as_secs_f64() * 1e6
    }

    fn push(&self, event: Value) {
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(event);
    }

    /// Names the track of `rank` ("rank r") in the trace.
    pub fn name_track(&self, rank: usize) {
        self.push(json!({
            "ph": "M", "name": "thread_name", "pid": 0, "tid": rank,
            "args": {"name": format!("rank {rank}")},
        }));
    }

    /// The trace so far: `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
    pub fn to_json(&self) -> Value {
        let events = self
            .events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// Writes the trace to `path`.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let text = serde_json::to_string(&self.to_json()).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

thread_local! {
    static RANK: RefCell<Option<(Arc<Tracer>, usize)>> = const { RefCell::new(None) };
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static COMM_WAIT: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Records this thread's steps into `tracer` on the track of `rank` while it lives.
#[must_use = "spans are recorded only while the guard lives"]
pub struct RankTrace {
    previous: Option<(Arc<Tracer>, usize)>,
}

impl RankTrace {
    pub fn enter(tracer: &Arc<Tracer>, rank: usize) -> Self {
        tracer.name_track(rank);
        let previous = RANK.with(|r| r.replace(Some((tracer.clone(), rank))));
        Self { previous }
    }
}

/// An optimizer step being recorded (see the module docs): a span `step N` on the rank's track,
/// and every span of the thread recorded while it is open.
#[must_use = "the step is recorded only while the guard lives"]
pub struct StepTrace {
    span: Option<Span>,
    was_active: bool,
}

impl StepTrace {
    pub fn open(step: usize) -> Self {
        let was_active = ACTIVE.with(|a| a.replace(true));
        let span = Some(span(
            format_args!("step {step}"),
            "step",
            json!({"step": step}),
        ));
        Self { span, was_active }
    }
}

impl Drop for StepTrace {
    fn drop(&mut self) {
        drop(self.span.take());
        let was_active = self.was_active;
        let _ = ACTIVE.try_with(|a| a.set(was_active));
    }
}

impl Drop for RankTrace {
    fn drop(&mut self) {
        let previous = self.previous.take();
        let _ = RANK.try_with(|r| r.replace(previous));
    }
}

/// An open span; dropping it closes it.
#[must_use = "a span ends when its guard is dropped"]
pub struct Span {
    open: Option<(Arc<Tracer>, usize, &'static str, String)>,
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((tracer, rank, category, name)) = self.open.take() {
            tracer.push(json!({
                "ph": "E", "name": name, "cat": category, "pid": 0, "tid": rank,
                "ts": tracer.now_us(),
            }));
        }
    }
}

/// Opens a span `name` of `category` with `args` on this thread's rank track, if the thread
/// records ([`RankTrace`] and [`StepTrace`]); else a span that records nothing.
pub fn span(name: impl fmt::Display, category: &'static str, args: Value) -> Span {
    if !ACTIVE.with(Cell::get) {
        return Span { open: None };
    }
    let open = RANK.with(|r| r.borrow().clone()).map(|(tracer, rank)| {
        let name = name.to_string();
        let mut event = json!({
            "ph": "B", "name": name, "cat": category, "pid": 0, "tid": rank,
            "ts": tracer.now_us(),
        });
        if !args.is_null() {
            event["args"] = args;
        }
        tracer.push(event);
        (tracer, rank, category, name)
    });
    Span { open }
}

/// A communication span already over: its begin (at `started`, with `args`) and its end (now),
/// recorded together so the begin carries what the call learned (its bytes).
fn comm_span(name: &str, started_us: Option<f64>, args: Value) {
    let Some(started_us) = started_us else {
        return;
    };
    if let Some((tracer, rank)) = RANK.with(|r| r.borrow().clone()) {
        tracer.push(json!({
            "ph": "B", "name": name, "cat": "comm", "pid": 0, "tid": rank, "ts": started_us,
            "args": args,
        }));
        tracer.push(json!({
            "ph": "E", "name": name, "cat": "comm", "pid": 0, "tid": rank, "ts": tracer.now_us(),
        }));
    }
}

/// Now on this thread's trace clock, if it records.
fn trace_now() -> Option<f64> {
    if !recording() {
        return None;
    }
    RANK.with(|r| r.borrow().as_ref().map(|(tracer, _)| tracer.now_us()))
}

/// Whether this thread records a trace now.
pub fn recording() -> bool {
    ACTIVE.with(Cell::get) && RANK.with(|r| r.borrow().is_some())
}

/// Wall time this thread has spent in calls of a [`TracedComm`] (sending, receiving, waiting,
/// collectives) so far. Take the difference of two readings for a step.
pub fn comm_wait_time() -> Duration {
    COMM_WAIT.with(Cell::get)
}

fn add_wait(elapsed: Duration) {
    let _ = COMM_WAIT.try_with(|total| total.set(total.get() + elapsed));
}

/// A communicator whose calls are timed and, where a trace is recorded, traced (see the module
/// docs).
#[derive(Debug)]
pub struct TracedComm {
    inner: Comm,
}

impl TracedComm {
    /// `comm`, traced (and the groups split from it).
    pub fn wrap(comm: Comm) -> Comm {
        Arc::new(Self { inner: comm })
    }

    /// Runs `op`, timed, as a span named `name` carrying the bytes this rank sent in it.
    fn call<T>(
        &self,
        name: &'static str,
        target: Value,
        op: impl FnOnce() -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let started_us = trace_now();
        let before = started_us.map(|_| self.inner.stats().total_bytes());
        let started = Instant::now();
        let result = op();
        add_wait(started.elapsed());
        if let Some(before) = before {
            let sent = self.inner.stats().total_bytes().saturating_sub(before);
            let mut args = json!({"bytes": sent, "group": self.inner.name()});
            if let (Value::Object(args), Value::Object(target)) = (&mut args, target) {
                args.extend(target);
            }
            comm_span(name, started_us, args);
        }
        result
    }
}

/// Runs `wait` (the wait on a pending send or receive with world rank `peer`), timed, as a span
/// `name` that sent nothing.
fn waited<T>(
    name: &str,
    peer: usize,
    wait: impl FnOnce() -> Result<T, CommError>,
) -> Result<T, CommError> {
    let started_us = trace_now();
    let started = Instant::now();
    let result = wait();
    add_wait(started.elapsed());
    comm_span(name, started_us, json!({"bytes": 0, "peer": peer}));
    result
}

impl Communicator for TracedComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn global_rank(&self, rank: usize) -> usize {
        self.inner.global_rank(rank)
    }

    fn isend(&self, peer: usize, data: Payload) -> Result<PendingSend, CommError> {
        let peer_global = self.inner.global_rank(peer);
        let target = json!({"peer": peer_global});
        let pending = self.call("send", target, || self.inner.isend(peer, data))?;
        Ok(PendingSend::new(move || {
            waited("wait send", peer_global, || pending.wait())
        }))
    }

    fn irecv(&self, peer: usize) -> Result<PendingRecv, CommError> {
        let peer_global = self.inner.global_rank(peer);
        let target = json!({"peer": peer_global});
        let pending = self.call("post recv", target, || self.inner.irecv(peer))?;
        Ok(PendingRecv::new(move || {
            waited("wait recv", peer_global, || pending.wait())
        }))
    }

    fn all_to_all(&self, parts: Vec<Payload>) -> Result<Vec<Payload>, CommError> {
        self.call("all-to-all", Value::Null, || self.inner.all_to_all(parts))
    }

    fn all_gather(&self, data: Payload) -> Result<Vec<Payload>, CommError> {
        self.call("all-gather", Value::Null, || self.inner.all_gather(data))
    }

    fn reduce_scatter(&self, parts: Vec<Payload>) -> Result<Payload, CommError> {
        self.call("reduce-scatter", Value::Null, || {
            self.inner.reduce_scatter(parts)
        })
    }

    fn all_reduce(&self, data: Payload) -> Result<Payload, CommError> {
        self.call("all-reduce", Value::Null, || self.inner.all_reduce(data))
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.call("barrier", Value::Null, || self.inner.barrier())
    }

    fn all_gather_control(&self, what: &str, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        self.call("control all-gather", Value::Null, || {
            self.inner.all_gather_control(what, payload)
        })
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm, CommError> {
        Ok(Self::wrap(self.inner.split(color, key)?))
    }

    fn split_labeled(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        Ok(Self::wrap(self.inner.split_labeled(color, key, label)?))
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
