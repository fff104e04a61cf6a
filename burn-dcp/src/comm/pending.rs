//! Handles of posted sends and receives, waited for later.

use super::{CommError, Payload};

/// A receive in flight: [`PendingRecv::wait`] blocks (up to the timeout) for the data.
pub struct PendingRecv(Box<dyn FnOnce() -> Result<Payload, CommError> + Send>);

impl PendingRecv {
    pub fn new(wait: impl FnOnce() -> Result<Payload, CommError> + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) -> Result<Payload, CommError> {
        (self.0)()
    }
}

/// A send in flight: [`PendingSend::wait`] returns once the buffer may be reused.
pub struct PendingSend(Box<dyn FnOnce() -> Result<(), CommError> + Send>);

impl PendingSend {
    pub fn new(wait: impl FnOnce() -> Result<(), CommError> + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) -> Result<(), CommError> {
        (self.0)()
    }
}
