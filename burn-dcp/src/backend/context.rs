//! The per-rank, per-micro-batch CP context: how `ModuleOps::attention` learns about the
//! communicator, the strategy, the token placement and the masks.
//!
//! burn's attention op has no slot for sequence boundaries or a process group, so the training
//! loop sets them here (per thread — each in-process rank is a thread driving its device) before
//! the forward pass of a micro-batch. The autodiff node of every attention call keeps the context
//! its forward used, so the backward pass needs nothing set, and pipeline schedules with several
//! micro-batches in flight stay correct.
//!
//! # Never silent: [`CpContextGuard::finish`]
//!
//! A model that computes attention *without* burn's `attention` op (burn-nn 0.21's
//! `MultiHeadAttention`, and so `TransformerEncoder`, `TransformerDecoder` and `CrossAttention`,
//! which use matmul + softmax) is never seen by the decorator: under a context each rank would
//! attend only to its own shard, with no error. The guard counts the attention calls the
//! decorator intercepted while it was set; [`CpContextGuard::finish`] turns "none at CP size > 1"
//! into an error naming the likely cause and the fix ([`crate::nn`]).
//!
//! A model only partly ported (a `burn_dcp::nn` layer beside a burn-nn one) makes some calls, so
//! the count alone would pass it. The decorator also watches `float_matmul` under a context at CP
//! size > 1 for the signature of attention scores computed on a shard: an output `[…, L, L]` of
//! rank ≥ 4 whose operands have the same leading (batch, head) dimensions, `L ≥ 2` being this
//! rank's local token count (a packed row's tokens, or the width of its padded rows) — burn-nn's
//! `MultiHeadAttention` computes `Q·Kᵀ` so, as does a hand-written `[B, H, L, d]` attention.
//! [`CpContextGuard::finish`] refuses such a micro-batch too, naming the shapes it saw. Linear
//! layers (`ModuleOps::linear`, which the decorator forwards whole), rank-3 matmuls (an MLP or the
//! LM head on `[B, L, d]`) and a weight broadcast over the batch (leading dimensions of 1) never
//! match. What it cannot see: a single-head `[B, L, d]` attention written by hand (rank 3), and
//! scores computed by a custom backend op.
//!
//! A guard dropped without [`CpContextGuard::finish`] at CP size > 1 after no intercepted call
//! logs a warning (a drop never panics).
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::CpError;
use crate::strategy::{CpBatch, CpGroup};

/// Everything a context-parallel attention call of one micro-batch needs on one rank.
#[derive(Clone, Debug)]
pub struct CpContext {
    pub group: CpGroup,
    pub batch: CpBatch,
}

/// A set context, the count of attention calls intercepted under it, and the local attention
/// scores seen outside them.
#[derive(Clone)]
struct Frame {
    context: Arc<CpContext>,
    calls: Arc<AtomicUsize>,
    scores: Arc<Mutex<LocalScores>>,
}

/// Matmuls whose output had the shape of a shard's attention scores.
#[derive(Default)]
struct LocalScores {
    count: usize,
    /// The first one: `lhs · rhs → out` shapes.
    first: String,
}

/// `float_matmul` of the decorator: [`note_matmul`], then the inner backend's.
pub(crate) fn matmul<B: burn::tensor::backend::Backend>(
    lhs: burn::tensor::ops::FloatTensor<B>,
    rhs: burn::tensor::ops::FloatTensor<B>,
) -> burn::tensor::ops::FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    note_matmul(lhs.shape().as_slice(), rhs.shape().as_slice());
    B::float_matmul(lhs, rhs)
}

/// Notes a `float_matmul` of `lhs` and `rhs` (shapes) made under this thread's context when it
/// has the signature of attention scores over this rank's shard (see the module docs).
pub(crate) fn note_matmul(lhs: &[usize], rhs: &[usize]) {
    let rank = lhs.len();
    if rank < 4 || rhs.len() != rank || lhs[..rank - 2] != rhs[..rank - 2] {
        return;
    }
    let (rows, cols) = (lhs[rank - 2], rhs[rank - 1]);
    if rows != cols || rows < 2 {
        return;
    }
    CONTEXT.with(|c| {
        let borrowed = c.borrow();
        let Some(frame) = borrowed.as_ref() else {
            return;
        };
        let (group, batch) = (&frame.context.group, &frame.context.batch);
        if group.cp() < 2 {
            return;
        }
        let me = group.comm.rank();
        let packed = batch.placement.tokens(me);
        let width = batch
            .rows
            .as_ref()
            .and_then(|rows| rows.local(&batch.placement, me).ok())
            .map(|local| local.width());
        if packed != rows && width != Some(rows) {
            return;
        }
        let mut scores = frame.scores.lock().unwrap_or_else(|e| e.into_inner());
        if scores.count == 0 {
            let mut out = lhs[..rank - 1].to_vec();
            out.push(cols);
            scores.first = format!("{lhs:?} · {rhs:?} → {out:?}");
        }
        scores.count += 1;
    });
}

thread_local! {
    static CONTEXT: RefCell<Option<Frame>> = const { RefCell::new(None) };
}

/// Sets this thread's CP context until the returned guard is dropped or
/// [finished](CpContextGuard::finish) (either restores the previous one).
#[must_use = "the context is cleared when the guard is dropped; call `finish()` to check that the model's attention ran under it"]
pub fn set_context(context: CpContext) -> CpContextGuard {
    let frame = Frame {
        context: Arc::new(context),
        calls: Arc::new(AtomicUsize::new(0)),
        scores: Arc::new(Mutex::new(LocalScores::default())),
    };
    let calls = frame.calls.clone();
    let scores = frame.scores.clone();
    let cp = frame.context.group.cp();
    let rank = frame.context.group.comm.rank();
    let previous = CONTEXT.with(|c| c.replace(Some(frame)));
    CpContextGuard {
        previous: Some(previous),
        calls,
        scores,
        cp,
        rank,
        finished: false,
    }
}

/// Removes this thread's CP context: attention forwards to the inner backend unchanged.
pub fn clear_context() {
    CONTEXT.with(|c| c.replace(None));
}

/// This thread's CP context, if any.
pub fn current_context() -> Option<Arc<CpContext>> {
    CONTEXT.with(|c| c.borrow().as_ref().map(|frame| frame.context.clone()))
}

/// This thread's CP context, counting one intercepted attention call under it.
pub(crate) fn intercept() -> Option<Arc<CpContext>> {
    CONTEXT.with(|c| {
        c.borrow().as_ref().map(|frame| {
            frame.calls.fetch_add(1, Ordering::Relaxed);
            frame.context.clone()
        })
    })
}

/// Restores the previous context when dropped or finished.
pub struct CpContextGuard {
    /// `Some` until the guard restores it (once).
    previous: Option<Option<Frame>>,
    calls: Arc<AtomicUsize>,
    scores: Arc<Mutex<LocalScores>>,
    cp: usize,
    rank: usize,
    /// Whether [`Self::finish`] ran (a drop without it may warn).
    finished: bool,
}

impl CpContextGuard {
    /// The number of attention calls `ContextParallel` intercepted under this context so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Ends the context (restoring the previous one) and returns the number of attention calls
    /// `ContextParallel` intercepted under it.
    ///
    /// At CP size > 1, zero calls is an error: the model's attention did not go through burn's
    /// `attention` op on a `ContextParallel` backend, so every rank attended only to its own shard.
    /// Call it after each micro-batch's forward pass (the training engine does).
    pub fn finish(mut self) -> Result<usize, CpError> {
        self.restore();
        self.finished = true;
        let calls = self.calls();
        if calls == 0 && self.cp > 1 {
            return Err(CpError::Bypassed(format!(
                "no attention call was intercepted under the CP context of rank {} (CP size {}): the model \
                 computed attention without burn's `attention` op, so each rank attended only to its own \
                 shard. burn-nn's `MultiHeadAttention` (and `TransformerEncoder`, `TransformerDecoder` and \
                 `CrossAttention`, built on it) computes softmax(QKᵀ/√d)V with matmul and softmax; use the \
                 drop-in modules of `burn_dcp::nn` (same API and records) or call \
                 `burn::tensor::module::attention`, on a `ContextParallel<…>` backend",
                self.rank, self.cp
            )));
        }
        let scores = self.scores.lock().unwrap_or_else(|e| e.into_inner());
        if scores.count > 0 && self.cp > 1 {
            return Err(CpError::Bypassed(format!(
                "rank {} (CP size {}) computed attention scores over its own shard outside burn's \
                 `attention` op: {} matmul(s) gave a [.., L, L] matrix of its L local tokens (first: \
                 {}), beside {calls} intercepted attention call(s) — a model only partly ported \
                 (burn-nn's `MultiHeadAttention` or `TransformerEncoder` next to `burn_dcp::nn` \
                 layers, or a hand-written softmax(QKᵀ)V), whose bypassed layers see only this \
                 rank's tokens. Use the drop-in modules of `burn_dcp::nn` or call \
                 `burn::tensor::module::attention` for every attention",
                self.rank, self.cp, scores.count, scores.first
            )));
        }
        Ok(calls)
    }

    fn restore(&mut self) {
        if let Some(previous) = self.previous.take() {
            CONTEXT.with(|c| c.replace(previous));
        }
    }
}

impl Drop for CpContextGuard {
    fn drop(&mut self) {
        self.restore();
        if !self.finished && self.cp > 1 && self.calls() == 0 && !std::thread::panicking() {
            log::warn!(
                "a CP context of rank {} (CP size {}) ended without `finish()` and no attention call \
                 was intercepted under it: the model's attention may have bypassed context \
                 parallelism (call `CpContextGuard::finish()` after the forward to make it an error)",
                self.rank,
                self.cp
            );
        }
    }
}

impl std::fmt::Debug for CpContextGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpContextGuard")
            .field("rank", &self.rank)
            .field("cp", &self.cp)
            .field("calls", &self.calls())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::layout::Layout;
    use crate::batch::placement::Placement;
    use crate::comm::{InProcessWorld, WorldConfig};
    use crate::strategy::Strategy;
    use burn_dcp_kernels::MaskSpec;

    static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

    struct Capture;

    impl log::Log for Capture {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }

        fn log(&self, record: &log::Record<'_>) {
            LOGGED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(record.args().to_string());
        }

        fn flush(&self) {}
    }

    /// A guard dropped without `finish()` at CP size 2 after no intercepted call warns (and
    /// does not panic); a finished one does not.
    #[test]
    fn a_guard_dropped_without_calls_warns() {
        let _ = log::set_logger(&Capture);
        log::set_max_level(log::LevelFilter::Warn);
        let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
        for result in world.run(|comm| -> Result<(), CpError> {
            let placement = Placement::of_layout(&[4], 2, Layout::Zigzag)?;
            let batch = CpBatch::new(placement, vec![MaskSpec::Causal]);
            let group = CpGroup::new(comm, Strategy::Ring)?;
            drop(set_context(CpContext {
                group: group.clone(),
                batch: batch.clone(),
            }));
            assert!(set_context(CpContext { group, batch }).finish().is_err());
            Ok(())
        }) {
            result.unwrap();
        }
        let logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
        let warnings = logged
            .iter()
            .filter(|m| m.contains("ended without `finish()`") && m.contains("CP size 2"))
            .count();
        assert_eq!(warnings, 2, "one per rank: {logged:?}");
    }
}
