//! Attention masks over positions *within one sequence*.
//!
//! Every mask answers one question: may query position `i` attend key position `j` of a sequence
//! of length `len` (0-based, both inside the same sequence)? Two ways to ask it:
//!
//! - [`MaskSpec::allows`] — the definition, written as the rule reads (used by the naive oracle);
//! - [`MaskSpec::key_ranges`] — the same set as at most two half-open key ranges per query (DCP's
//!   representation, used by the kernels to visit only unmasked keys and to skip empty tiles).
//!
//! Tests check that both agree for every mask, query and key.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use crate::definition::error::KernelError;

/// Which keys each query of a sequence may attend.
#[derive(Clone, Debug, PartialEq)]
pub enum MaskSpec {
    /// Every key: `j < len`.
    Full,
    /// `j ≤ i`.
    Causal,
    /// Sliding window of `window` keys ending at the query: `i − window < j ≤ i`.
    Sliding { window: usize },
    /// λ mask: `sink` first tokens plus a window: `j ≤ i` and (`j < sink` or `i − window < j`).
    Lambda { sink: usize, window: usize },
    /// DCP's causal-blockwise mask (block size `B = block`, `k = local_blocks`). Query `i` lies in
    /// block `b = ⌊i/B⌋` of `n = ⌈len/B⌉`: in the first (`b = 0`) and the last (`b = n − 1`) block
    /// it is causal (keys `[0, i]`); otherwise it sees the first block as a sink and a window of
    /// `k·B` *tokens*: keys `[0, B) ∪ [max(B, i − k·B), i]`.
    Blockwise { block: usize, local_blocks: usize },
    /// The first `⌊question_fraction·len⌋` tokens are a question (causal among themselves); the rest
    /// splits into `answers` answers of equal length (the last takes the remainder); each answer
    /// token attends the whole question and causally within its own answer.
    SharedQuestion {
        question_fraction: f64,
        answers: usize,
    },
    /// General form: for query position `i`, the keys in `ranges[i]` (at most two ranges).
    /// Its length must equal the sequence length.
    KeyRanges(Arc<[KeyRanges]>),
}

/// The keys a query may attend: the union of at most two half-open ranges of key positions.
///
/// Ranges returned by [`MaskSpec::key_ranges`] are normalised: clipped to the sequence, sorted,
/// disjoint and non-adjacent (overlapping ranges are merged), empty ones are `0..0`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct KeyRanges {
    pub first: Range<usize>,
    pub second: Range<usize>,
}

impl KeyRanges {
    /// One range.
    pub fn one(range: Range<usize>) -> Self {
        Self::two(range, 0..0)
    }

    /// Two ranges (in any order, possibly overlapping or empty).
    pub fn two(first: Range<usize>, second: Range<usize>) -> Self {
        Self { first, second }
    }

    /// Clip to `0..len`, drop empties, sort and merge overlapping or adjacent ranges.
    pub fn normalized(&self, len: usize) -> Self {
        let clip = |r: &Range<usize>| r.start.min(len)..r.end.min(len);
        let (mut a, mut b) = (clip(&self.first), clip(&self.second));
        if a.is_empty() {
            a = 0..0;
        }
        if b.is_empty() {
            b = 0..0;
        }
        if a.is_empty() {
            return Self::one(b);
        }
        if b.is_empty() {
            return Self::one(a);
        }
        if b.start < a.start {
            std::mem::swap(&mut a, &mut b);
        }
        if b.start <= a.end {
            return Self::one(a.start..a.end.max(b.end));
        }
        Self::two(a, b)
    }

    /// Non-empty ranges, in order.
    pub fn iter(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        [self.first.clone(), self.second.clone()]
            .into_iter()
            .filter(|r| !r.is_empty())
    }

    /// Whether key position `key` is in one of the ranges.
    pub fn contains(&self, key: usize) -> bool {
        self.first.contains(&key) || self.second.contains(&key)
    }

    /// Number of keys covered (ranges must be normalised).
    pub fn count(&self) -> usize {
        self.first.len() + self.second.len()
    }
}

impl MaskSpec {
    /// The mask rule as written: may query position `query` attend key position `key` in a
    /// sequence of `len` tokens? Positions outside the sequence are never allowed.
    pub fn allows(&self, query: usize, key: usize, len: usize) -> bool {
        if query >= len || key >= len {
            return false;
        }
        let (i, j) = (query, key);
        match self {
            MaskSpec::Full => true,
            MaskSpec::Causal => j <= i,
            MaskSpec::Sliding { window } => j <= i && i < j + window,
            MaskSpec::Lambda { sink, window } => j <= i && (j < *sink || i < j + window),
            MaskSpec::Blockwise {
                block,
                local_blocks,
            } => {
                let (b, blocks) = (i / block, len.div_ceil(*block));
                let causal_block = b == 0 || b + 1 == blocks;
                // `i − k·B ≤ j` without underflow: `i ≤ j + k·B`.
                j <= i
                    && (causal_block
                        || j < *block
                        || i <= j.saturating_add(local_blocks.saturating_mul(*block)))
            }
            MaskSpec::SharedQuestion {
                question_fraction,
                answers,
            } => {
                let split = SharedQuestionSplit::new(*question_fraction, *answers, len);
                match (split.answer_of(i), split.answer_of(j)) {
                    (None, None) => j <= i,
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (Some(a), Some(b)) => a == b && j <= i,
                }
            }
            MaskSpec::KeyRanges(ranges) => {
                ranges.get(i).is_some_and(|r| r.normalized(len).contains(j))
            }
        }
    }

    /// The keys query position `query` may attend, as normalised ranges (see [`KeyRanges`]).
    pub fn key_ranges(&self, query: usize, len: usize) -> KeyRanges {
        if query >= len {
            return KeyRanges::default();
        }
        let i = query;
        let causal_end = i + 1;
        let raw = match self {
            MaskSpec::Full => KeyRanges::one(0..len),
            MaskSpec::Causal => KeyRanges::one(0..causal_end),
            MaskSpec::Sliding { window } => {
                KeyRanges::one((causal_end.saturating_sub(*window))..causal_end)
            }
            MaskSpec::Lambda { sink, window } => KeyRanges::two(
                0..(*sink).min(causal_end),
                causal_end.saturating_sub(*window)..causal_end,
            ),
            MaskSpec::Blockwise {
                block,
                local_blocks,
            } => {
                let (b, blocks) = (i / block, len.div_ceil(*block));
                if b == 0 || b + 1 == blocks {
                    KeyRanges::one(0..causal_end)
                } else {
                    // The window starts at i − k·B, never inside the sink block.
                    let window_start = i
                        .saturating_sub(local_blocks.saturating_mul(*block))
                        .max(*block);
                    KeyRanges::two(0..(*block).min(causal_end), window_start..causal_end)
                }
            }
            MaskSpec::SharedQuestion {
                question_fraction,
                answers,
            } => {
                let split = SharedQuestionSplit::new(*question_fraction, *answers, len);
                match split.answer_of(i) {
                    None => KeyRanges::one(0..causal_end),
                    Some(answer) => {
                        KeyRanges::two(0..split.question, split.answer_start(answer)..causal_end)
                    }
                }
            }
            MaskSpec::KeyRanges(ranges) => ranges.get(i).cloned().unwrap_or_default(),
        };
        raw.normalized(len)
    }

    /// Whether any query in `queries` may attend any key in `keys` (positions of one sequence of
    /// `len` tokens). Exact; cost proportional to the number of queries.
    pub fn any_allowed(&self, queries: Range<usize>, keys: Range<usize>, len: usize) -> bool {
        queries.into_iter().any(|i| {
            self.key_ranges(i, len)
                .iter()
                .any(|r| r.start < keys.end && keys.start < r.end)
        })
    }

    /// Checks the mask's parameters (and, for [`MaskSpec::KeyRanges`], its length against `len`).
    pub fn validate(&self, len: usize) -> Result<(), KernelError> {
        let invalid = |reason: String| {
            Err(KernelError::InvalidMask {
                mask: self.to_string(),
                reason,
            })
        };
        match self {
            MaskSpec::Sliding { window } | MaskSpec::Lambda { window, .. } if *window == 0 => {
                invalid("the window must be at least 1 token".into())
            }
            MaskSpec::Blockwise { block: 0, .. } => {
                invalid("the block size must be at least 1".into())
            }
            MaskSpec::Blockwise {
                local_blocks: 0, ..
            } => invalid("the number of local blocks must be at least 1".into()),
            MaskSpec::SharedQuestion {
                question_fraction, ..
            } if !(0.0..=1.0).contains(question_fraction) => invalid(format!(
                "the question fraction {question_fraction} must lie in [0, 1]"
            )),
            MaskSpec::SharedQuestion { answers: 0, .. } => {
                invalid("the number of answers must be at least 1".into())
            }
            MaskSpec::KeyRanges(ranges) if ranges.len() != len => invalid(format!(
                "it lists key ranges for {} queries but the sequence has {len} tokens",
                ranges.len()
            )),
            _ => Ok(()),
        }
    }
}

/// The mask of sequence `seq` when `masks` holds one mask per sequence or a single one for all.
pub fn mask_of(masks: &[MaskSpec], seq: usize) -> &MaskSpec {
    &masks[if masks.len() == 1 { 0 } else { seq }]
}

/// Checks that `masks` holds one mask per sequence or a single one for all, and that each mask
/// is valid for its sequence's length.
pub fn validate_masks(masks: &[MaskSpec], seq_lens: &[usize]) -> Result<(), KernelError> {
    if masks.len() != 1 && masks.len() != seq_lens.len() {
        return Err(KernelError::InvalidPacking(format!(
            "{} masks for {} sequences: give one mask per sequence or a single mask for all",
            masks.len(),
            seq_lens.len()
        )));
    }
    for (seq, &len) in seq_lens.iter().enumerate() {
        mask_of(masks, seq).validate(len)?;
    }
    Ok(())
}

/// Question/answer boundaries of a shared-question sequence.
#[derive(Clone, Copy, Debug)]
struct SharedQuestionSplit {
    /// Number of question tokens, `⌊F·len⌋`.
    question: usize,
    /// Length of every answer but the last (which takes the remainder).
    answer_len: usize,
    answers: usize,
}

impl SharedQuestionSplit {
    fn new(question_fraction: f64, answers: usize, len: usize) -> Self {
        let question = ((question_fraction * len as f64).floor() as usize).min(len);
        let answers = answers.max(1);
        Self {
            question,
            answer_len: (len - question) / answers,
            answers,
        }
    }

    /// The answer index of position `pos`, or `None` for a question token.
    fn answer_of(&self, pos: usize) -> Option<usize> {
        if pos < self.question {
            return None;
        }
        if self.answer_len == 0 {
            return Some(self.answers - 1);
        }
        Some(((pos - self.question) / self.answer_len).min(self.answers - 1))
    }

    fn answer_start(&self, answer: usize) -> usize {
        if self.answer_len == 0 {
            return self.question;
        }
        self.question + answer * self.answer_len
    }
}

impl fmt::Display for MaskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaskSpec::Full => write!(f, "full"),
            MaskSpec::Causal => write!(f, "causal"),
            MaskSpec::Sliding { window } => write!(f, "sliding:{window}"),
            MaskSpec::Lambda { sink, window } => write!(f, "lambda:{sink},{window}"),
            MaskSpec::Blockwise {
                block,
                local_blocks,
            } => write!(f, "blockwise:{block},{local_blocks}"),
            MaskSpec::SharedQuestion {
                question_fraction,
                answers,
            } => write!(f, "shared-question:{question_fraction},{answers}"),
            MaskSpec::KeyRanges(ranges) => write!(f, "key-ranges[{}]", ranges.len()),
        }
    }
}

impl FromStr for MaskSpec {
    type Err = KernelError;

    /// Parses `full`, `causal`, `sliding:W`, `lambda:S,W`, `blockwise:B,L` and
    /// `shared-question:F,N`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| KernelError::InvalidMask {
            mask: text.to_string(),
            reason: reason.to_string(),
        };
        let (name, args) = text.split_once(':').unwrap_or((text, ""));
        let numbers = |count: usize| -> Result<Vec<&str>, KernelError> {
            let parts: Vec<&str> = args.split(',').map(str::trim).collect();
            if parts.len() != count || parts.iter().any(|p| p.is_empty()) {
                return Err(bad(&format!(
                    "expected {count} comma-separated parameter(s) after ':'"
                )));
            }
            Ok(parts)
        };
        let integer = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| bad(&format!("'{s}' is not a non-negative integer")))
        };
        let spec = match name.trim() {
            "full" if args.is_empty() => MaskSpec::Full,
            "causal" if args.is_empty() => MaskSpec::Causal,
            "sliding" => MaskSpec::Sliding {
                window: integer(numbers(1)?[0])?,
            },
            "lambda" => {
                let p = numbers(2)?;
                MaskSpec::Lambda {
                    sink: integer(p[0])?,
                    window: integer(p[1])?,
                }
            }
            "blockwise" => {
                let p = numbers(2)?;
                MaskSpec::Blockwise {
                    block: integer(p[0])?,
                    local_blocks: integer(p[1])?,
                }
            }
            "shared-question" => {
                let p = numbers(2)?;
                let question_fraction = p[0]
                    .parse::<f64>()
                    .map_err(|_| bad(&format!("'{}' is not a number", p[0])))?;
                MaskSpec::SharedQuestion {
                    question_fraction,
                    answers: integer(p[1])?,
                }
            }
            _ => {
                return Err(bad(
                    "expected full | causal | sliding:W | lambda:S,W | blockwise:B,L | shared-question:F,N",
                ))
            }
        };
        spec.validate(0)?;
        Ok(spec)
    }
}
