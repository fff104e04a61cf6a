//! Where every token of a packed micro-batch lives in a CP group.
//!
//! A [`Placement`] gives each rank of the group a list of [`Segment`]s — runs of tokens of one
//! sequence, at positions `start, start + stride, …` — in the rank's local token order. Every
//! strategy works from it alone: they never assume a layout, because attention is defined on
//! (sequence, global position) pairs. The static layouts (contiguous, zigzag, stripe) are special
//! cases built by [`Placement::of_layout`]; a planner that places tokens itself (dynamic CP's
//! groups, a block-level plan) builds one with [`Placement::from_segments`], which checks that
//! every token is held by exactly one rank.

use std::fmt;
use std::hash::{Hash, Hasher};

use burn_dcp_kernels::Segment;

use crate::batch::layout::{rank_segments, Layout};
use crate::error::CpError;

/// What built a placement (for messages and the ranks' agreement).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlacementKind {
    /// A static layout of every sequence over the group.
    Layout(Layout),
    /// Segments given explicitly (by a planner).
    Explicit,
}

impl fmt::Display for PlacementKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlacementKind::Layout(layout) => write!(f, "{layout} layout"),
            PlacementKind::Explicit => f.write_str("explicit placement"),
        }
    }
}

/// The tokens every rank of a CP group holds for one packed micro-batch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    pub kind: PlacementKind,
    pub seq_lens: Vec<usize>,
    /// Segments of each rank, in local token order (no empty segment).
    pub ranks: Vec<Vec<Segment>>,
}

impl Placement {
    /// Every sequence cut over `cp` ranks by `layout` (see [`Layout`]).
    pub fn of_layout(seq_lens: &[usize], cp: usize, layout: Layout) -> Result<Self, CpError> {
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
            kind: PlacementKind::Layout(layout),
            seq_lens: seq_lens.to_vec(),
            ranks,
        })
    }

    /// A placement given rank by rank. Every token of every sequence must be held by exactly one
    /// rank; segments need a stride ≥ 1 and must lie inside their sequence. Empty segments are
    /// dropped.
    pub fn from_segments(seq_lens: &[usize], ranks: Vec<Vec<Segment>>) -> Result<Self, CpError> {
        if ranks.is_empty() {
            return Err(CpError::Config(
                "a placement needs at least one rank, got 0".into(),
            ));
        }
        let mut starts = Vec::with_capacity(seq_lens.len());
        let mut total = 0usize;
        for &len in seq_lens {
            starts.push(total);
            total = total.checked_add(len).ok_or_else(|| {
                CpError::Input(format!(
                    "sequence lengths {seq_lens:?} overflow when summed"
                ))
            })?;
        }
        let mut holder: Vec<Option<usize>> = vec![None; total];
        for (rank, segments) in ranks.iter().enumerate() {
            for segment in segments.iter().filter(|s| s.len > 0) {
                check_segment(segment, seq_lens, rank)?;
                for t in 0..segment.len {
                    let position = segment.position(t);
                    let index = starts[segment.seq] + position;
                    if let Some(other) = holder[index].replace(rank) {
                        return Err(CpError::Input(format!(
                            "token {position} of sequence {} is placed on rank {other} and on rank {rank}; every token must be on exactly one rank",
                            segment.seq
                        )));
                    }
                }
            }
        }
        if let Some(index) = holder.iter().position(Option::is_none) {
            let seq = starts.partition_point(|&s| s <= index) - 1;
            return Err(CpError::Input(format!(
                "token {} of sequence {seq} is placed on no rank; every token must be on exactly one rank",
                index - starts[seq]
            )));
        }
        let ranks = ranks
            .into_iter()
            .map(|segments| segments.into_iter().filter(|s| s.len > 0).collect())
            .collect();
        Ok(Self {
            kind: PlacementKind::Explicit,
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

    /// The most tokens one rank holds.
    pub fn max_rank_tokens(&self) -> usize {
        (0..self.cp()).map(|r| self.tokens(r)).max().unwrap_or(0)
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

    /// A hash of the sequence lengths and every rank's segments: equal on two ranks exactly when
    /// (barring collisions) they place the tokens alike.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.seq_lens.hash(&mut hasher);
        self.ranks.hash(&mut hasher);
        hasher.finish()
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} over {} ranks (fingerprint {:016x})",
            self.kind,
            self.cp(),
            self.fingerprint()
        )
    }
}

fn check_segment(segment: &Segment, seq_lens: &[usize], rank: usize) -> Result<(), CpError> {
    let Some(&len) = seq_lens.get(segment.seq) else {
        return Err(CpError::Input(format!(
            "rank {rank} holds a segment of sequence {}, but the micro-batch has {} sequences",
            segment.seq,
            seq_lens.len()
        )));
    };
    let last = segment
        .stride
        .checked_mul(segment.len - 1)
        .and_then(|span| span.checked_add(segment.start));
    match last {
        Some(last) if segment.stride >= 1 && last < len => Ok(()),
        _ => Err(CpError::Input(format!(
            "rank {rank} holds {segment:?}, which does not lie inside sequence {} of {len} tokens with a stride of at least 1",
            segment.seq
        ))),
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
                let placement = Placement::of_layout(&lens, cp, layout).unwrap();
                let total: usize = lens.iter().sum();
                let mut seen = vec![0; total];
                for rank in 0..cp {
                    for index in placement.packed_indices(rank) {
                        seen[index] += 1;
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{layout} cp {cp}: {seen:?}");
                // A layout is a special case of an explicit placement: the same segments pass its
                // checks and place the tokens alike.
                let explicit = Placement::from_segments(&lens, placement.ranks.clone()).unwrap();
                assert_eq!(explicit.fingerprint(), placement.fingerprint());
            }
        }
    }

    #[test]
    fn explicit_placements_must_cover_every_token_once() {
        let lens = [4, 3];
        let block = |seq, start, len| Segment::contiguous(seq, start, len);
        // Rank 0 holds pieces of both sequences, rank 1 the rest, rank 2 nothing.
        let ok = Placement::from_segments(
            &lens,
            vec![
                vec![block(0, 2, 2), block(1, 0, 1)],
                vec![block(0, 0, 2), block(1, 1, 2)],
                vec![],
            ],
        )
        .unwrap();
        assert_eq!(ok.packed_indices(0), vec![2, 3, 4]);
        assert_eq!(ok.tokens(2), 0);
        let twice = Placement::from_segments(
            &lens,
            vec![vec![block(0, 0, 4), block(1, 0, 3)], vec![block(0, 3, 1)]],
        );
        assert!(twice
            .unwrap_err()
            .to_string()
            .contains("token 3 of sequence 0 is placed on rank 0 and on rank 1"));
        let missing = Placement::from_segments(&lens, vec![vec![block(0, 0, 4), block(1, 0, 2)]]);
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("token 2 of sequence 1 is placed on no rank"));
        let outside = Placement::from_segments(&lens, vec![vec![block(0, 2, 3)]]);
        assert!(outside
            .unwrap_err()
            .to_string()
            .contains("does not lie inside sequence 0"));
        let unknown = Placement::from_segments(&lens, vec![vec![block(2, 0, 1)]]);
        assert!(unknown.unwrap_err().to_string().contains("2 sequences"));
        let zero_stride = Segment {
            seq: 0,
            start: 0,
            len: 2,
            stride: 0,
        };
        assert!(Placement::from_segments(&lens, vec![vec![zero_stride]]).is_err());
        assert!(Placement::from_segments(&lens, vec![]).is_err());
    }
}
