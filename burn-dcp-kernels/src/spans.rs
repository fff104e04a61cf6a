//! Which packed keys each query attends: the mask's key ranges (positions) mapped onto the packed
//! key segments of its sequence. Shared by the portable implementation and the cubecl launch tables.

use std::ops::Range;

use crate::definition::VarlenAttention;

/// For every query token, the runs of packed key tokens it may attend.
pub(crate) struct QuerySpans {
    offsets: Vec<usize>,
    spans: Vec<Range<usize>>,
}

impl QuerySpans {
    pub(crate) fn build(problem: &VarlenAttention) -> Self {
        // Packed start index of every key segment, and the key segments of each sequence.
        let mut kv_start = Vec::with_capacity(problem.kv_segments.len());
        let mut next = 0;
        for segment in &problem.kv_segments {
            kv_start.push(next);
            next += segment.len;
        }
        let mut kv_by_seq: Vec<Vec<usize>> = vec![Vec::new(); problem.seq_lens.len()];
        for (index, segment) in problem.kv_segments.iter().enumerate() {
            kv_by_seq[segment.seq].push(index);
        }
        let mut offsets = vec![0];
        let mut spans = Vec::new();
        for qs in &problem.q_segments {
            let len = problem.seq_lens[qs.seq];
            let mask = problem.mask(qs.seq);
            for t in 0..qs.len {
                let ranges = mask.key_ranges(qs.position(t), len);
                for &k_index in &kv_by_seq[qs.seq] {
                    let ks = &problem.kv_segments[k_index];
                    for range in ranges.iter() {
                        let tokens = ks.tokens_in(&range);
                        if !tokens.is_empty() {
                            let base = kv_start[k_index];
                            spans.push(base + tokens.start..base + tokens.end);
                        }
                    }
                }
                offsets.push(spans.len());
            }
        }
        Self { offsets, spans }
    }

    /// Number of queries.
    pub(crate) fn queries(&self) -> usize {
        self.offsets.len() - 1
    }

    pub(crate) fn of(&self, query: usize) -> &[Range<usize>] {
        &self.spans[self.offsets[query]..self.offsets[query + 1]]
    }
}
