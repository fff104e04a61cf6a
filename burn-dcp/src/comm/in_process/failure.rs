//! How one rank of [`InProcessWorld::run`](super::InProcessWorld::run) failed.

use std::fmt;
use std::ops::Deref;

/// What ended a rank of [`InProcessWorld::run`](super::InProcessWorld::run) without a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankFailureKind {
    /// The rank's task returned an error.
    Error,
    /// The rank's task panicked (an injected panic fault included).
    Panic,
    /// The rank left the world early (an injected exit fault).
    Exit,
    /// The rank's thread could not be started or joined.
    Thread,
}

/// One rank's failure in [`InProcessWorld::run`](super::InProcessWorld::run): which rank, how
/// it failed, and the message — "rank 1 returned an error: …", "rank 0 panicked: …".
///
/// The message is the failure's text everywhere: [`Display`](fmt::Display), [`Self::as_str`],
/// `String::from`, comparisons with strings, and — so that code written when a rank's error
/// was its message as a `String` still reads and builds — `Deref<Target = str>`
/// (`failure.contains("rank 1")`, `&*failure`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    rank: usize,
    kind: RankFailureKind,
    detail: String,
    message: String,
}

impl RankFailure {
    /// Rank `rank`'s task returned `error`.
    pub(super) fn error(rank: usize, error: impl fmt::Display) -> Self {
        let detail = error.to_string();
        let message = format!("rank {rank} returned an error: {detail}");
        Self::new(rank, RankFailureKind::Error, detail, message)
    }

    /// Rank `rank`'s task panicked with `panic` (the panic's message).
    pub(super) fn panic(rank: usize, panic: String) -> Self {
        let message = format!("rank {rank} panicked: {panic}");
        Self::new(rank, RankFailureKind::Panic, panic, message)
    }

    /// Rank `rank` left the world early (an injected exit).
    pub(super) fn exit(rank: usize) -> Self {
        let message = format!("rank {rank} left the world early (injected fault)");
        Self::new(rank, RankFailureKind::Exit, "injected exit".into(), message)
    }

    /// Rank `rank`'s thread: `what` went wrong (could not be started, or joined).
    pub(super) fn thread(rank: usize, what: String) -> Self {
        let message = format!("rank {rank} {what}");
        Self::new(rank, RankFailureKind::Thread, what, message)
    }

    fn new(rank: usize, kind: RankFailureKind, detail: String, message: String) -> Self {
        Self {
            rank,
            kind,
            detail,
            message,
        }
    }

    /// The rank that failed.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How it failed.
    pub fn kind(&self) -> RankFailureKind {
        self.kind
    }

    /// The task's own words: its error's text or its panic's message (without "rank N …").
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The whole message, naming the rank.
    pub fn as_str(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RankFailure {}

impl Deref for RankFailure {
    type Target = str;

    fn deref(&self) -> &str {
        &self.message
    }
}

impl AsRef<str> for RankFailure {
    fn as_ref(&self) -> &str {
        &self.message
    }
}

impl From<RankFailure> for String {
    fn from(failure: RankFailure) -> Self {
        failure.message
    }
}

impl PartialEq<str> for RankFailure {
    fn eq(&self, other: &str) -> bool {
        self.message == other
    }
}

impl PartialEq<&str> for RankFailure {
    fn eq(&self, other: &&str) -> bool {
        self.message == *other
    }
}

impl PartialEq<String> for RankFailure {
    fn eq(&self, other: &String) -> bool {
        &self.message == other
    }
}
