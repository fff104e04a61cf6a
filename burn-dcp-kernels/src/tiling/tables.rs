//! The dense per-query span table the tile runs and the kernels read.

use crate::definition::KernelError;
use crate::spans::QuerySpans;
use crate::VarlenAttention;

/// Per query, its allowed packed key spans, padded to the same count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseSpans {
    pub queries: usize,
    /// Slots per query (at least 1).
    pub max_spans: usize,
    /// `[queries, max_spans, 2]`, half-open `[start, end)`; unused slots are `[0, 0)`.
    pub spans: Vec<u32>,
}

impl DenseSpans {
    /// The spans of every query of `problem`, adjacent spans merged. Errors when token indices do
    /// not fit the kernels' 32-bit tables.
    pub fn build(problem: &VarlenAttention) -> Result<Self, KernelError> {
        let kv_tokens = problem.kv_tokens();
        if kv_tokens > u32::MAX as usize || problem.q_tokens() > u32::MAX as usize {
            return Err(KernelError::InvalidShape(format!(
                "{} query and {kv_tokens} key tokens: the kernels index tokens with 32 bits (at most {})",
                problem.q_tokens(),
                u32::MAX
            )));
        }
        let query_spans = QuerySpans::build(problem);
        let queries = query_spans.queries();
        let merged: Vec<Vec<(u32, u32)>> = (0..queries)
            .map(|query| {
                let mut runs: Vec<(u32, u32)> = query_spans
                    .of(query)
                    .iter()
                    .map(|r| (r.start as u32, r.end as u32))
                    .collect();
                runs.sort_unstable();
                let mut out: Vec<(u32, u32)> = Vec::with_capacity(runs.len());
                for (start, end) in runs {
                    match out.last_mut() {
                        Some(last) if start <= last.1 => last.1 = last.1.max(end),
                        _ => out.push((start, end)),
                    }
                }
                out
            })
            .collect();
        let max_spans = merged.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut spans = vec![0u32; queries * max_spans * 2];
        for (query, runs) in merged.iter().enumerate() {
            for (slot, &(start, end)) in runs.iter().enumerate() {
                let at = (query * max_spans + slot) * 2;
                spans[at] = start;
                spans[at + 1] = end;
            }
        }
        Ok(Self {
            queries,
            max_spans,
            spans,
        })
    }

    /// The non-empty spans of `query`.
    pub fn of(&self, query: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        let at = query * self.max_spans * 2;
        self.spans[at..at + self.max_spans * 2]
            .chunks_exact(2)
            .map(|pair| (pair[0], pair[1]))
            .filter(|(start, end)| start < end)
    }

    /// Whether `query` may attend packed key `key`.
    pub fn allows(&self, query: usize, key: usize) -> bool {
        self.of(query)
            .any(|(start, end)| (start as usize..end as usize).contains(&key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MaskSpec;

    #[test]
    fn spans_agree_with_the_mask() {
        let problem =
            VarlenAttention::packed(vec![30], vec![MaskSpec::Lambda { sink: 2, window: 5 }]);
        let spans = DenseSpans::build(&problem).unwrap();
        assert_eq!(spans.max_spans, 2);
        for i in 0..30 {
            for j in 0..30 {
                assert_eq!(
                    spans.allows(i, j),
                    problem.masks[0].allows(i, j, 30),
                    "({i},{j})"
                );
            }
        }
    }
}
