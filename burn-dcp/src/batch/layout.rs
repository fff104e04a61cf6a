//! The static layouts: how each sequence of a packed micro-batch is cut over the ranks of a CP
//! group (each is a special case of a [`Placement`](crate::batch::placement::Placement)).
//!
//! Every sequence is split over the `cp` ranks independently, so a packed micro-batch of ragged
//! sequences needs no padding: a sequence shorter than `cp` simply leaves some ranks without tokens
//! of it, and chunk sizes differ by at most one token.
//!
//! - **contiguous**: sequence of length `L` cut into `cp` chunks; chunk `c` is positions
//!   `⌊c·L/cp⌋..⌊(c+1)·L/cp⌋`; rank `r` holds chunk `r`.
//! - **zigzag** (head-tail): cut into `2·cp` chunks the same way; rank `r` holds chunks `r` and
//!   `2·cp−1−r`, which balances causal work.
//! - **stripe**: rank `r` holds positions `r, r+cp, r+2·cp, …` (striped attention).
//!
//! A rank's local tensors hold its tokens sequence by sequence, in the order of its segments.

use std::fmt;
use std::str::FromStr;

use burn_dcp_kernels::Segment;

use crate::error::CpError;

/// How tokens of each sequence are distributed over the ranks of a CP group.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    Contiguous,
    Zigzag,
    Stripe,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::Contiguous => "contiguous",
            Layout::Zigzag => "zigzag",
            Layout::Stripe => "stripe",
        })
    }
}

impl FromStr for Layout {
    type Err = CpError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "contiguous" => Ok(Layout::Contiguous),
            "zigzag" => Ok(Layout::Zigzag),
            "stripe" => Ok(Layout::Stripe),
            other => Err(CpError::Config(format!(
                "unknown layout '{other}': expected contiguous, zigzag or stripe"
            ))),
        }
    }
}

impl Layout {
    /// The most tokens this layout puts on one rank for a sequence of `len` tokens over `cp`
    /// ranks (exact): `⌈len/cp⌉` for contiguous and stripe, the largest pair of head-tail chunks
    /// for zigzag (at most `⌈len/cp⌉ + 1`).
    pub fn max_rank_tokens(self, len: usize, cp: usize) -> usize {
        match self {
            Layout::Contiguous | Layout::Stripe => len.div_ceil(cp.max(1)),
            Layout::Zigzag => {
                let chunks = 2 * cp.max(1);
                let size = |c: usize| (c + 1) * len / chunks - c * len / chunks;
                (0..cp.max(1))
                    .map(|r| size(r) + size(chunks - 1 - r))
                    .max()
                    .unwrap_or(0)
            }
        }
    }
}

/// Bounds of chunk `chunk` of `chunks` over a sequence of `len` tokens.
fn chunk(seq: usize, len: usize, chunk: usize, chunks: usize) -> Segment {
    let (start, end) = (chunk * len / chunks, (chunk + 1) * len / chunks);
    Segment::contiguous(seq, start, end - start)
}

/// The segments of sequence `seq` (`len` tokens) that rank `rank` of `cp` holds under `layout`
/// (some may be empty).
pub(crate) fn rank_segments(
    seq: usize,
    len: usize,
    rank: usize,
    cp: usize,
    layout: Layout,
) -> Vec<Segment> {
    match layout {
        Layout::Contiguous => vec![chunk(seq, len, rank, cp)],
        Layout::Zigzag => vec![
            chunk(seq, len, rank, 2 * cp),
            chunk(seq, len, 2 * cp - 1 - rank, 2 * cp),
        ],
        Layout::Stripe => vec![Segment {
            seq,
            start: rank,
            len: len.saturating_sub(rank).div_ceil(cp),
            stride: cp,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::placement::Placement;

    #[test]
    fn max_rank_tokens_is_the_largest_shard() {
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            for cp in 1..12 {
                for len in 0..70 {
                    let placement = Placement::of_layout(&[len], cp, layout).unwrap();
                    let largest = (0..cp).map(|r| placement.tokens(r)).max().unwrap();
                    assert_eq!(
                        layout.max_rank_tokens(len, cp),
                        largest,
                        "{layout} cp {cp} len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn zigzag_holds_head_and_tail_chunks() {
        let placement = Placement::of_layout(&[16], 4, Layout::Zigzag).unwrap();
        assert_eq!(
            placement.segments(1),
            &[Segment::contiguous(0, 2, 2), Segment::contiguous(0, 12, 2)]
        );
    }
}
