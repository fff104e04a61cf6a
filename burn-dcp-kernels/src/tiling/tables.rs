//! The dense per-query span table and the per-tile interval lists built from it.

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

/// For each tile of one side (rows), the runs of tiles of the other side (columns) holding at
/// least one allowed pair, in compressed-row form: the runs of row tile `r` are
/// `intervals[2·offsets[r] .. 2·offsets[r+1]]` as half-open `[first, end)` pairs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileIntervals {
    pub offsets: Vec<u32>,
    pub intervals: Vec<u32>,
}

impl TileIntervals {
    /// Query tiles of `rows` queries against key tiles of `cols` keys.
    pub fn by_query_tile(spans: &DenseSpans, rows: usize, cols: usize) -> Self {
        let tiles = spans.queries.div_ceil(rows);
        let mut offsets = Vec::with_capacity(tiles + 1);
        let mut intervals = Vec::new();
        offsets.push(0);
        let mut runs = Vec::new();
        for tile in 0..tiles {
            runs.clear();
            for query in tile * rows..((tile + 1) * rows).min(spans.queries) {
                runs.extend(
                    spans
                        .of(query)
                        .map(|(start, end)| (start as usize / cols, (end as usize - 1) / cols + 1)),
                );
            }
            push_merged(&mut runs, &mut intervals);
            offsets.push((intervals.len() / 2) as u32);
        }
        Self { offsets, intervals }
    }

    /// The transpose: for each of `column_tiles` column tiles, the runs of row tiles listing it.
    pub fn transpose(&self, column_tiles: usize) -> Self {
        let mut per_column: Vec<Vec<(usize, usize)>> = vec![Vec::new(); column_tiles];
        for row in 0..self.tiles() {
            for (first, end) in self.runs(row) {
                for runs in &mut per_column[first..end] {
                    match runs.last_mut() {
                        Some(last) if last.1 == row => last.1 = row + 1,
                        _ => runs.push((row, row + 1)),
                    }
                }
            }
        }
        let mut offsets = Vec::with_capacity(column_tiles + 1);
        let mut intervals = Vec::new();
        offsets.push(0);
        for runs in per_column {
            for (first, end) in runs {
                intervals.extend([first as u32, end as u32]);
            }
            offsets.push((intervals.len() / 2) as u32);
        }
        Self { offsets, intervals }
    }

    /// Number of row tiles.
    pub fn tiles(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The runs `[first, end)` of row tile `row`.
    pub fn runs(&self, row: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (from, to) = (self.offsets[row] as usize, self.offsets[row + 1] as usize);
        self.intervals[2 * from..2 * to]
            .chunks_exact(2)
            .map(|pair| (pair[0] as usize, pair[1] as usize))
    }

    /// Number of (row tile, column tile) pairs listed: the tiles the kernels compute.
    pub fn pairs(&self) -> usize {
        (0..self.tiles())
            .flat_map(|row| self.runs(row))
            .map(|(first, end)| end - first)
            .sum()
    }
}

/// Sorts and merges overlapping or adjacent runs, appending them to `intervals`.
fn push_merged(runs: &mut [(usize, usize)], intervals: &mut Vec<u32>) {
    runs.sort_unstable();
    let mut current: Option<(usize, usize)> = None;
    for &(first, end) in runs.iter() {
        current = match current {
            Some((a, b)) if first <= b => Some((a, b.max(end))),
            Some((a, b)) => {
                intervals.extend([a as u32, b as u32]);
                Some((first, end))
            }
            None => Some((first, end)),
        };
    }
    if let Some((a, b)) = current {
        intervals.extend([a as u32, b as u32]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MaskSpec, Segment};

    fn brute_force_pairs(
        spans: &DenseSpans,
        kv: usize,
        rows: usize,
        cols: usize,
    ) -> Vec<Vec<bool>> {
        let (row_tiles, col_tiles) = (spans.queries.div_ceil(rows), kv.div_ceil(cols));
        let mut any = vec![vec![false; col_tiles]; row_tiles];
        for query in 0..spans.queries {
            for key in 0..kv {
                if spans.allows(query, key) {
                    any[query / rows][key / cols] = true;
                }
            }
        }
        any
    }

    fn listed(tiles: &TileIntervals, row: usize, column: usize) -> bool {
        tiles.runs(row).any(|(a, b)| (a..b).contains(&column))
    }

    #[test]
    fn tables_list_exactly_the_tiles_with_work() {
        let masks = [
            MaskSpec::Causal,
            MaskSpec::Full,
            MaskSpec::Sliding { window: 5 },
            MaskSpec::Lambda { sink: 3, window: 4 },
            MaskSpec::Blockwise {
                block: 4,
                local_blocks: 2,
            },
            MaskSpec::SharedQuestion {
                question_fraction: 0.3,
                answers: 3,
            },
        ];
        for mask in masks {
            // Two sequences; the keys of sequence 0 come as two strided segments (a stripe
            // layout), queries at an offset (a ring step).
            let mut problem = VarlenAttention::packed(vec![37, 20], vec![mask.clone()]);
            problem.q_segments = vec![
                Segment::contiguous(0, 10, 27),
                Segment::contiguous(1, 0, 20),
            ];
            problem.kv_segments = vec![
                Segment {
                    seq: 0,
                    start: 0,
                    len: 19,
                    stride: 2,
                },
                Segment {
                    seq: 0,
                    start: 1,
                    len: 18,
                    stride: 2,
                },
                Segment::contiguous(1, 0, 20),
            ];
            let spans = DenseSpans::build(&problem).unwrap();
            let kv = problem.kv_tokens();
            for (rows, cols) in [(4, 8), (8, 4), (1, 1), (64, 16)] {
                let by_query = TileIntervals::by_query_tile(&spans, rows, cols);
                let by_key = by_query.transpose(kv.div_ceil(cols));
                let truth = brute_force_pairs(&spans, kv, rows, cols);
                let mut pairs = 0;
                for (r, row) in truth.iter().enumerate() {
                    for (c, &work) in row.iter().enumerate() {
                        assert_eq!(
                            listed(&by_query, r, c),
                            work,
                            "{mask} {rows}x{cols} ({r},{c})"
                        );
                        assert_eq!(listed(&by_key, c, r), work, "{mask} transpose ({c},{r})");
                        pairs += work as usize;
                    }
                }
                assert_eq!(by_query.pairs(), pairs);
                assert_eq!(by_key.pairs(), pairs);
            }
        }
    }

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
