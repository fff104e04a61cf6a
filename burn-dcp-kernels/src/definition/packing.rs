//! How tokens of a packed micro-batch map to (sequence, position).
//!
//! A rank's tokens are a list of [`Segment`]s in packing order. A segment is a run of tokens of one
//! sequence whose positions are `start, start + stride, start + 2·stride, …` — `stride` 1 for
//! contiguous and zigzag chunks, `stride` P for the stripe layout. Describing tokens by position
//! (not by index into a padded buffer) is what lets one kernel serve every layout, ring step and
//! Ulysses gather: a query attends the keys *of its own sequence* according to the mask on global
//! positions, whatever order the tokens arrive in.

use std::ops::Range;

use crate::definition::error::KernelError;

/// A run of tokens of sequence `seq` at positions `start + t·stride` for `t in 0..len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index of the sequence in the micro-batch.
    pub seq: usize,
    /// Position (within the sequence) of the first token.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
    /// Distance between consecutive positions (≥ 1).
    pub stride: usize,
}

impl Segment {
    /// Contiguous tokens `start..start + len` of sequence `seq`.
    pub fn contiguous(seq: usize, start: usize, len: usize) -> Self {
        Self {
            seq,
            start,
            len,
            stride: 1,
        }
    }

    /// Position of the segment's `t`-th token.
    pub fn position(&self, t: usize) -> usize {
        self.start + t * self.stride
    }

    /// The range of token indices `t` whose positions lie in `positions`.
    pub fn tokens_in(&self, positions: &Range<usize>) -> Range<usize> {
        let first = div_ceil_from(positions.start, self.start, self.stride).min(self.len);
        let end = div_ceil_from(positions.end, self.start, self.stride).min(self.len);
        first..end.max(first)
    }

    /// Smallest and largest position, or `None` when empty.
    pub fn position_bounds(&self) -> Option<(usize, usize)> {
        (self.len > 0).then(|| (self.start, self.position(self.len - 1)))
    }
}

/// `ceil((value − start) / stride)`, or 0 when `value ≤ start`.
fn div_ceil_from(value: usize, start: usize, stride: usize) -> usize {
    value.saturating_sub(start).div_ceil(stride)
}

/// Per-token (sequence, position) of a list of segments, in packing order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenPositions {
    pub seq: Vec<usize>,
    pub pos: Vec<usize>,
}

impl TokenPositions {
    pub fn of(segments: &[Segment]) -> Self {
        let mut out = Self::default();
        for segment in segments {
            for t in 0..segment.len {
                out.seq.push(segment.seq);
                out.pos.push(segment.position(t));
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.seq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }
}

/// Number of tokens of a list of segments.
pub fn token_count(segments: &[Segment]) -> usize {
    segments.iter().map(|s| s.len).sum()
}

/// Checks `cu_seqlens` (cumulative sequence lengths: starts at 0, non-decreasing, ends at the token
/// count) and returns the sequence lengths.
pub fn validate_cu_seqlens(cu_seqlens: &[i64], tokens: usize) -> Result<Vec<usize>, KernelError> {
    let bad = |reason: String| {
        Err(KernelError::InvalidPacking(format!(
            "cu_seqlens {cu_seqlens:?}: {reason}"
        )))
    };
    if cu_seqlens.len() < 2 {
        return bad("needs at least two entries (0 and the token count)".into());
    }
    if cu_seqlens[0] != 0 {
        return bad(format!("must start at 0, starts at {}", cu_seqlens[0]));
    }
    if let Some(w) = cu_seqlens.windows(2).find(|w| w[1] < w[0]) {
        return bad(format!(
            "must be non-decreasing, but {} follows {}",
            w[1], w[0]
        ));
    }
    let last = *cu_seqlens.last().unwrap_or(&0);
    if last != tokens as i64 {
        return bad(format!(
            "must end at the token count {tokens}, ends at {last}"
        ));
    }
    Ok(cu_seqlens
        .windows(2)
        .map(|w| (w[1] - w[0]) as usize)
        .collect())
}

/// One contiguous segment per sequence: the whole micro-batch, packed.
pub fn whole_sequences(seq_lens: &[usize]) -> Vec<Segment> {
    seq_lens
        .iter()
        .enumerate()
        .map(|(seq, &len)| Segment::contiguous(seq, 0, len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_in_matches_a_scan_for_strided_segments() {
        for stride in 1..5 {
            for start in 0..6 {
                let segment = Segment {
                    seq: 0,
                    start,
                    len: 7,
                    stride,
                };
                for a in 0..40 {
                    for b in a..40 {
                        let expected: Vec<usize> = (0..7)
                            .filter(|&t| (a..b).contains(&segment.position(t)))
                            .collect();
                        let got: Vec<usize> = segment.tokens_in(&(a..b)).collect();
                        assert_eq!(
                            got, expected,
                            "start {start} stride {stride} range {a}..{b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn cu_seqlens_errors_name_the_rule() {
        assert!(validate_cu_seqlens(&[0, 3, 2, 5], 5)
            .unwrap_err()
            .to_string()
            .contains("non-decreasing"));
        assert!(validate_cu_seqlens(&[0, 3, 4], 5)
            .unwrap_err()
            .to_string()
            .contains("token count 5"));
        assert!(validate_cu_seqlens(&[1, 5], 5)
            .unwrap_err()
            .to_string()
            .contains("start at 0"));
        assert_eq!(
            validate_cu_seqlens(&[0, 3, 3, 5], 5).unwrap(),
            vec![3, 0, 2]
        );
    }
}
