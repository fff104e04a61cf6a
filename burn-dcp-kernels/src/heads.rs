//! The head split, validated once: query heads and key/value heads (grouped-query attention),
//! and their shares over tensor-parallel ranks, a Ulysses degree or a plan's head units. Every
//! crate of the workspace checks heads here — the kernels' shapes, CP attention's call, the
//! strategies, the planners, the models, the drop-in modules and the training engine — so each
//! rule has one text, naming its values.
//!
//! Two ways to share heads among `n` parts:
//! - [`Heads::split`]: each part owns whole query heads *and the key/value heads they read*, so
//!   `n` divides the query heads and `n` and the kv heads divide one another (kv heads are split
//!   when `n` divides them, replicated when they divide `n`): tensor parallelism, USP's and DCP's
//!   head units.
//! - [`Heads::split_queries`]: each part owns whole query heads; key/value heads go wherever
//!   their queries are, shared between parts when a group straddles two (Ulysses' all-to-all).

use std::fmt;

/// What heads are shared among: names the parts in messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeadParts {
    /// Tensor-parallel ranks (a rank owns whole heads).
    TensorParallel(usize),
    /// Ulysses' (or USP's) all-to-all degree.
    Ulysses(usize),
    /// A plan's head units (USP's and DCP's).
    Units(usize),
}

impl HeadParts {
    /// How many parts.
    pub fn count(self) -> usize {
        match self {
            Self::TensorParallel(n) | Self::Ulysses(n) | Self::Units(n) => n,
        }
    }
}

impl fmt::Display for HeadParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TensorParallel(n) => write!(f, "tensor parallelism over {n} ranks"),
            Self::Ulysses(n) => write!(f, "the ulysses degree {n}"),
            Self::Units(n) => write!(f, "{n} head units"),
        }
    }
}

/// Why heads cannot be had or shared: the rule and its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSplitError {
    /// No query heads or no key/value heads.
    Zero { heads: usize, kv_heads: usize },
    /// Key/value heads that do not divide the query heads.
    Grouping { heads: usize, kv_heads: usize },
    /// Parts that do not divide the query heads.
    Queries { parts: HeadParts, heads: usize },
    /// Parts and key/value heads of which neither divides the other.
    KeyValues { parts: HeadParts, kv_heads: usize },
    /// Key and value tensors with different numbers of heads.
    KeyValueMismatch { key: usize, value: usize },
}

impl HeadSplitError {
    /// The message with the parts named by the caller (a command line names its flag:
    /// `--tp 3 must divide the 4 query heads …`); [`Display`](fmt::Display) names them
    /// itself. The rule's text is the same.
    pub fn naming_parts(&self, parts: &str) -> String {
        match self {
            Self::Zero { .. } | Self::Grouping { .. } | Self::KeyValueMismatch { .. } => {
                self.to_string()
            }
            Self::Queries { heads, .. } => {
                format!("{parts} must divide the {heads} query heads (each part owns whole heads)")
            }
            Self::KeyValues { kv_heads, .. } => format!(
                "{parts} and the {kv_heads} kv heads: one must divide the other (kv heads are split, or replicated when the parts outnumber them)"
            ),
        }
    }

    /// Whether the message contains `text`.
    pub fn contains(&self, text: &str) -> bool {
        self.to_string().contains(text)
    }
}

impl fmt::Display for HeadSplitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero { heads, kv_heads } => write!(
                f,
                "q heads ({heads}) and kv heads ({kv_heads}) must be at least 1"
            ),
            Self::Grouping { heads, kv_heads } => write!(
                f,
                "kv heads {kv_heads} must divide q heads {heads} (grouped-query attention)"
            ),
            Self::KeyValueMismatch { key, value } => write!(
                f,
                "key and value need the same number of heads; got key {key} and value {value}"
            ),
            Self::Queries { parts, .. } | Self::KeyValues { parts, .. } => {
                let name = parts.to_string();
                f.write_str(&self.naming_parts(&name))
            }
        }
    }
}

impl std::error::Error for HeadSplitError {}

impl From<HeadSplitError> for String {
    fn from(error: HeadSplitError) -> Self {
        error.to_string()
    }
}

/// Query heads and the key/value heads they share (`heads / kv_heads` query heads per kv head:
/// `kv_heads == heads` is multi-head attention, 1 multi-query), valid by construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Heads {
    heads: usize,
    kv_heads: usize,
}

impl Heads {
    /// `heads` query heads over `kv_heads` key/value heads: both at least 1, and `kv_heads`
    /// divides `heads`.
    pub fn new(heads: usize, kv_heads: usize) -> Result<Self, HeadSplitError> {
        if heads == 0 || kv_heads == 0 {
            return Err(HeadSplitError::Zero { heads, kv_heads });
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(HeadSplitError::Grouping { heads, kv_heads });
        }
        Ok(Self { heads, kv_heads })
    }

    /// The heads of an attention call's tensors: query, key and value heads (key and value
    /// equal, then as [`Heads::new`]).
    pub fn of_tensors(heads: usize, key: usize, value: usize) -> Result<Self, HeadSplitError> {
        if key != value {
            return Err(HeadSplitError::KeyValueMismatch { key, value });
        }
        Self::new(heads, key)
    }

    /// Query heads.
    pub fn heads(self) -> usize {
        self.heads
    }

    /// Key/value heads.
    pub fn kv_heads(self) -> usize {
        self.kv_heads
    }

    /// Query heads per key/value head.
    pub fn group_size(self) -> usize {
        self.heads / self.kv_heads
    }

    /// One part's heads when `parts` each own whole query heads and the kv heads they read:
    /// `heads / n` query heads over `max(kv_heads / n, 1)` kv heads (replicated past their count).
    pub fn split(self, parts: HeadParts) -> Result<Heads, HeadSplitError> {
        self.split_queries(parts)?;
        let n = parts.count();
        if !self.kv_heads.is_multiple_of(n) && !n.is_multiple_of(self.kv_heads) {
            return Err(HeadSplitError::KeyValues {
                parts,
                kv_heads: self.kv_heads,
            });
        }
        Ok(Heads {
            heads: self.heads / n,
            kv_heads: (self.kv_heads / n).max(1),
        })
    }

    /// The first kv head that part `part` of a [`split`](Self::split) into `parts` reads:
    /// `part · kv_heads / n` (parts sharing a replicated kv head read the same one).
    pub fn first_kv_head(self, part: usize, parts: HeadParts) -> usize {
        part * self.kv_heads / parts.count()
    }

    /// One part's query heads when `parts` each own whole query heads (the kv heads go where
    /// their queries are): `heads / n`.
    pub fn split_queries(self, parts: HeadParts) -> Result<usize, HeadSplitError> {
        let n = parts.count();
        if n == 0 || !self.heads.is_multiple_of(n) {
            return Err(HeadSplitError::Queries {
                parts,
                heads: self.heads,
            });
        }
        Ok(self.heads / n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_group_and_split() {
        let heads = Heads::new(8, 2).unwrap();
        assert_eq!(heads.group_size(), 4);
        assert_eq!(
            heads.split(HeadParts::TensorParallel(2)).unwrap(),
            Heads::new(4, 1).unwrap()
        );
        // More parts than kv heads: each part keeps a replica of its kv head.
        assert_eq!(
            heads.split(HeadParts::Units(4)).unwrap(),
            Heads::new(2, 1).unwrap()
        );
        assert_eq!(heads.split_queries(HeadParts::Ulysses(8)).unwrap(), 1);
        // Ulysses shares kv heads between parts; units do not.
        let straddling = Heads::new(12, 6).unwrap();
        assert_eq!(straddling.split_queries(HeadParts::Ulysses(4)).unwrap(), 3);
        assert!(straddling.split(HeadParts::Units(4)).is_err());
        // The kv heads each part reads: its own share, or the replica its queries belong to.
        let firsts = |parts: HeadParts| -> Vec<usize> {
            (0..parts.count())
                .map(|part| heads.first_kv_head(part, parts))
                .collect()
        };
        assert_eq!(firsts(HeadParts::TensorParallel(2)), [0, 1]);
        assert_eq!(firsts(HeadParts::Units(4)), [0, 0, 1, 1]);
        assert_eq!(firsts(HeadParts::Units(8)), [0, 0, 0, 0, 1, 1, 1, 1]);
        let eight = Heads::new(16, 8).unwrap();
        assert_eq!(eight.first_kv_head(3, HeadParts::TensorParallel(4)), 6);
    }

    #[test]
    fn every_rule_names_its_values() {
        let split = |heads, kv_heads, parts| Heads::new(heads, kv_heads).unwrap().split(parts);
        let cases = [
            (
                Heads::new(0, 1).unwrap_err(),
                "q heads (0) and kv heads (1) must be at least 1",
            ),
            (
                Heads::new(6, 4).unwrap_err(),
                "kv heads 4 must divide q heads 6",
            ),
            (
                Heads::of_tensors(4, 2, 1).unwrap_err(),
                "key and value need the same number of heads; got key 2 and value 1",
            ),
            (
                Heads::new(6, 2)
                    .unwrap()
                    .split_queries(HeadParts::Ulysses(4))
                    .unwrap_err(),
                "the ulysses degree 4 must divide the 6 query heads",
            ),
            (
                split(6, 6, HeadParts::Units(4)).unwrap_err(),
                "4 head units must divide the 6 query heads",
            ),
            (
                split(12, 6, HeadParts::TensorParallel(4)).unwrap_err(),
                "tensor parallelism over 4 ranks and the 6 kv heads: one must divide the other",
            ),
            (
                split(4, 4, HeadParts::Units(0)).unwrap_err(),
                "0 head units must divide the 4 query heads",
            ),
        ];
        for (error, text) in cases {
            assert!(error.contains(text), "{error}");
        }
        let error = Heads::new(4, 2)
            .unwrap()
            .split(HeadParts::TensorParallel(3))
            .unwrap_err();
        assert!(error
            .naming_parts("--tp 3")
            .starts_with("--tp 3 must divide the 4 query heads"));
    }
}
