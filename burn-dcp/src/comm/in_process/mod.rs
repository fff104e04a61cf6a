//! In-process communicator: ranks are threads of one process, messages move through shared
//! mailboxes. Used by tests, examples and single-machine CPU runs.
//!
//! Matching: every (group, sender, receiver, channel) pair has a delivery counter and a receive
//! counter; the n-th receive posted gets the n-th message delivered, whatever order receives are
//! waited in. Point-to-point, collective and control traffic use separate channels so they never
//! mix. Every message carries an envelope — the operation and the sender's index of the message
//! on that link — which the receiver checks: a message of another operation (ranks running
//! different protocols), or an index out of order (a lost or duplicated message), is a
//! [`CommError::Protocol`](crate::comm::CommError::Protocol) error, never wrong data.
//!
//! Failure (fail-fast, like an aborted NCCL or MPI job): the world records failures in the order
//! they happen. A rank fails when it returns an error or panics inside [`InProcessWorld::run`],
//! calls [`Communicator::abort`](crate::comm::Communicator::abort), drops a handle while panicking, times out, or receives an
//! unexpected message. From then on every operation of every rank fails with
//! [`CommError::PeerFailed`](crate::comm::CommError::PeerFailed) naming the rank that failed **first** and its reason (for a panic,
//! the panic message). A rank that leaves (its task returns, or its last handle on a group is
//! dropped) without sending a message a peer waits for is recorded as failed at that moment, so
//! the peer fails at once instead of at the timeout.

mod comm;
mod failure;
mod state;
mod world;

pub use comm::InProcessComm;
pub use failure::{RankFailure, RankFailureKind};
pub use state::{WorldConfig, MAX_IN_PROCESS_RANKS, MAX_TIMEOUT};
pub use world::InProcessWorld;
