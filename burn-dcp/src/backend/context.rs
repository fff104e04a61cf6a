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

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::CpError;
use crate::strategy::{CpBatch, CpGroup};

/// Everything a context-parallel attention call of one micro-batch needs on one rank.
#[derive(Clone, Debug)]
pub struct CpContext {
    pub group: CpGroup,
    pub batch: CpBatch,
}

/// A set context and the count of attention calls intercepted under it.
#[derive(Clone)]
struct Frame {
    context: Arc<CpContext>,
    calls: Arc<AtomicUsize>,
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
    };
    let calls = frame.calls.clone();
    let cp = frame.context.group.cp();
    let rank = frame.context.group.comm.rank();
    let previous = CONTEXT.with(|c| c.replace(Some(frame)));
    CpContextGuard {
        previous: Some(previous),
        calls,
        cp,
        rank,
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
    cp: usize,
    rank: usize,
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
