//! Where each token of a packed micro-batch lives: layouts and the resulting sharding.
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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

/// The tokens every rank of a CP group holds for one packed micro-batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sharding {
    pub layout: Layout,
    pub seq_lens: Vec<usize>,
    /// Segments of each rank, in local token order.
    pub ranks: Vec<Vec<Segment>>,
}

impl Sharding {
    pub fn new(seq_lens: &[usize], cp: usize, layout: Layout) -> Result<Self, CpError> {
        if cp == 0 {
            return Err(CpError::Config("cp size must be at least 1, got 0".into()));
        }
        let ranks = (0..cp)
            .map(|rank| {
                seq_lens
                    .iter()
                    .enumerate()
                    .flat_map(|(seq, &len)| rank_segments(seq, len, rank, cp, layout))
                    .filter(|segment| segment.len > 0)
                    .collect()
            })
            .collect();
        Ok(Self {
            layout,
            seq_lens: seq_lens.to_vec(),
            ranks,
        })
    }

    /// Number of ranks.
    pub fn cp(&self) -> usize {
        self.ranks.len()
    }

    pub fn segments(&self, rank: usize) -> &[Segment] {
        &self.ranks[rank]
    }

    /// Number of tokens rank `rank` holds.
    pub fn tokens(&self, rank: usize) -> usize {
        self.ranks[rank].iter().map(|s| s.len).sum()
    }

    /// Total number of tokens of the micro-batch.
    pub fn total_tokens(&self) -> usize {
        self.seq_lens.iter().sum()
    }

    /// For each local token of `rank`, its index in the packed micro-batch (`cu_seqlens[seq] + pos`).
    /// Use it to shard packed tensors (select rows) and to unshard outputs (scatter rows back).
    pub fn packed_indices(&self, rank: usize) -> Vec<usize> {
        let mut starts = Vec::with_capacity(self.seq_lens.len());
        let mut next = 0;
        for len in &self.seq_lens {
            starts.push(next);
            next += len;
        }
        self.ranks[rank]
            .iter()
            .flat_map(|s| (0..s.len).map(move |t| (s.seq, s.position(t))))
            .map(|(seq, pos)| starts[seq] + pos)
            .collect()
    }
}

/// Bounds of chunk `chunk` of `chunks` over a sequence of `len` tokens.
fn chunk(seq: usize, len: usize, chunk: usize, chunks: usize) -> Segment {
    let (start, end) = (chunk * len / chunks, (chunk + 1) * len / chunks);
    Segment::contiguous(seq, start, end - start)
}

fn rank_segments(seq: usize, len: usize, rank: usize, cp: usize, layout: Layout) -> Vec<Segment> {
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

    #[test]
    fn every_token_is_on_exactly_one_rank() {
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            for cp in 1..9 {
                let lens = [1, 2, 7, 16, 33, 0, 5];
                let sharding = Sharding::new(&lens, cp, layout).unwrap();
                let total: usize = lens.iter().sum();
                let mut seen = vec![0; total];
                for rank in 0..cp {
                    for index in sharding.packed_indices(rank) {
                        seen[index] += 1;
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{layout} cp {cp}: {seen:?}");
            }
        }
    }

    #[test]
    fn max_rank_tokens_is_the_largest_shard() {
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            for cp in 1..12 {
                for len in 0..70 {
                    let sharding = Sharding::new(&[len], cp, layout).unwrap();
                    let largest = (0..cp).map(|r| sharding.tokens(r)).max().unwrap();
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
        let sharding = Sharding::new(&[16], 4, Layout::Zigzag).unwrap();
        assert_eq!(
            sharding.segments(1),
            &[Segment::contiguous(0, 2, 2), Segment::contiguous(0, 12, 2)]
        );
    }
}
