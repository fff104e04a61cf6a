//! The per-rank, per-micro-batch CP context: how `ModuleOps::attention` learns about the
//! communicator, the strategy, the token placement and the masks.
//!
//! burn's attention op has no slot for sequence boundaries or a process group, so the training
//! loop sets them here (per thread — each in-process rank is a thread driving its device) before
//! the forward pass of a micro-batch. The autodiff node of every attention call keeps the context
//! its forward used, so the backward pass needs nothing set, and pipeline schedules with several
//! micro-batches in flight stay correct.

use std::cell::RefCell;
use std::sync::Arc;

use crate::strategy::{CpBatch, CpGroup};

/// Everything a context-parallel attention call of one micro-batch needs on one rank.
#[derive(Clone, Debug)]
pub struct CpContext {
    pub group: CpGroup,
    pub batch: CpBatch,
}

thread_local! {
    static CONTEXT: RefCell<Option<Arc<CpContext>>> = const { RefCell::new(None) };
}

/// Sets this thread's CP context until the returned guard is dropped (which restores the previous
/// one).
#[must_use = "the context is cleared when the guard is dropped"]
pub fn set_context(context: CpContext) -> CpContextGuard {
    let previous = CONTEXT.with(|c| c.replace(Some(Arc::new(context))));
    CpContextGuard { previous }
}

/// Removes this thread's CP context: attention forwards to the inner backend unchanged.
pub fn clear_context() {
    CONTEXT.with(|c| c.replace(None));
}

/// This thread's CP context, if any.
pub fn current_context() -> Option<Arc<CpContext>> {
    CONTEXT.with(|c| c.borrow().clone())
}

/// Restores the previous context when dropped.
pub struct CpContextGuard {
    previous: Option<Arc<CpContext>>,
}

impl Drop for CpContextGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CONTEXT.with(|c| c.replace(previous));
    }
}
