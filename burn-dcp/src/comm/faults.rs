//! Injected faults (tests and `--inject-fault`): what fails, on which rank, at which operation.

use std::time::Duration;

/// A fault to inject into an in-process world (tests of failure behaviour): when global rank
/// `rank` makes its communication call number `at_call` (0-based, counting every operation of
/// every group of that rank), `kind` happens.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub rank: usize,
    pub at_call: u64,
    pub kind: FaultKind,
}

/// What an injected [`Fault`] does.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// The rank panics inside the call.
    Panic,
    /// The call returns [`CommError::Injected`](super::CommError::Injected).
    Error,
    /// The call sleeps this long first (past the timeout, peers waiting on the rank time out).
    Delay(Duration),
    /// The rank leaves the world at once, as if its task returned without finishing the
    /// protocol (its peers must notice at once, not at the timeout).
    Exit,
    /// The next message this rank sends to another rank (from this call on) is never delivered.
    DropMessage,
    /// The next message this rank sends to another rank (from this call on) is delivered twice.
    DuplicateMessage,
}
