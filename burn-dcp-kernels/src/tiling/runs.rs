//! Tile lists that also say which tiles the mask leaves whole. The FlashAttention-2-class kernels
//! ([`crate::cube::flash`]) mask partly allowed tiles element by element in registers and skip
//! that work on whole tiles: on a causal mask every tile but the diagonal ones.

use super::DenseSpans;

/// For each tile of one side (rows), the runs of tiles of the other side (columns) holding at
/// least one allowed pair, each marked **full** (every one of its `rows × cols` pairs exists —
/// no row or column past the end of its side — and is allowed) or **partial**. The runs of row
/// tile `r` are `runs[3·offsets[r] .. 3·offsets[r+1]]` as `[first, end, full]` triples
/// (half-open column tiles, `full` 1 or 0), in column order; adjacent runs differ in `full`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileRuns {
    pub offsets: Vec<u32>,
    pub runs: Vec<u32>,
}

/// One run: `[first, end)` and whether every pair of its tiles is allowed.
type Run = (usize, usize, bool);

impl TileRuns {
    /// Query tiles of `rows` queries against key tiles of `cols` keys.
    pub fn by_query_tile(spans: &DenseSpans, rows: usize, cols: usize) -> Self {
        let tiles = spans.queries.div_ceil(rows);
        let mut offsets = Vec::with_capacity(tiles + 1);
        let mut runs = Vec::new();
        offsets.push(0);
        let mut any = Vec::new();
        for tile in 0..tiles {
            let queries = tile * rows..((tile + 1) * rows).min(spans.queries);
            any.clear();
            for query in queries.clone() {
                any.extend(
                    spans
                        .of(query)
                        .map(|(start, end)| (start as usize / cols, (end as usize - 1) / cols + 1)),
                );
            }
            let any = merged(&mut any);
            // Only a tile whose rows all exist can be full (its columns all exist by
            // construction: a span ends at `kv_tokens` at most).
            let whole = if queries.len() == rows {
                queries.fold(None, |acc: Option<Vec<(usize, usize)>>, query| {
                    let own = whole_tiles(spans, query, cols);
                    Some(match acc {
                        None => own,
                        Some(acc) => intersect(&acc, &own),
                    })
                })
            } else {
                None
            };
            for (first, end, full) in split(&any, whole.as_deref().unwrap_or(&[])) {
                runs.extend([first as u32, end as u32, full as u32]);
            }
            offsets.push((runs.len() / 3) as u32);
        }
        Self { offsets, runs }
    }

    /// The transpose: for each of `column_tiles` column tiles, the runs of row tiles listing
    /// it, with the same flags.
    pub fn transpose(&self, column_tiles: usize) -> Self {
        let mut per_column: Vec<Vec<Run>> = vec![Vec::new(); column_tiles];
        for row in 0..self.tiles() {
            for (first, end, full) in self.runs(row) {
                for runs in &mut per_column[first..end] {
                    match runs.last_mut() {
                        Some(last) if last.1 == row && last.2 == full => last.1 = row + 1,
                        _ => runs.push((row, row + 1, full)),
                    }
                }
            }
        }
        let mut offsets = Vec::with_capacity(column_tiles + 1);
        let mut runs = Vec::new();
        offsets.push(0);
        for column in per_column {
            for (first, end, full) in column {
                runs.extend([first as u32, end as u32, full as u32]);
            }
            offsets.push((runs.len() / 3) as u32);
        }
        Self { offsets, runs }
    }

    /// Number of row tiles.
    pub fn tiles(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The runs `(first, end, full)` of row tile `row`.
    pub fn runs(&self, row: usize) -> impl Iterator<Item = Run> + '_ {
        let (from, to) = (self.offsets[row] as usize, self.offsets[row + 1] as usize);
        self.runs[3 * from..3 * to]
            .chunks_exact(3)
            .map(|run| (run[0] as usize, run[1] as usize, run[2] == 1))
    }

    /// The row tiles, heaviest first: by the number of column tiles listed, descending, ties
    /// the later tile first. The flash kernels launch their cubes in this order (every head
    /// group of the heaviest tile, then of the next), so the longest cubes start first and the
    /// launch does not end on a few long ones (a causal mask's last query tiles, a varlen
    /// batch's longest sequence) while the rest of the GPU idles.
    pub fn heaviest_first(&self) -> Vec<u32> {
        let weight =
            |row: usize| -> usize { self.runs(row).map(|(first, end, _)| end - first).sum() };
        let mut order: Vec<usize> = (0..self.tiles()).rev().collect();
        order.sort_by_cached_key(|&row| std::cmp::Reverse(weight(row)));
        order.into_iter().map(|row| row as u32).collect()
    }

    /// Number of (row tile, column tile) pairs listed, and how many of them are full.
    pub fn pairs(&self) -> (usize, usize) {
        (0..self.tiles()).flat_map(|row| self.runs(row)).fold(
            (0, 0),
            |(all, full), (first, end, whole)| {
                (
                    all + end - first,
                    full + if whole { end - first } else { 0 },
                )
            },
        )
    }
}

/// The column tiles all of whose keys `query` may attend, as sorted disjoint `[first, end)`.
fn whole_tiles(spans: &DenseSpans, query: usize, cols: usize) -> Vec<(usize, usize)> {
    let mut whole: Vec<(usize, usize)> = spans
        .of(query)
        .map(|(start, end)| ((start as usize).div_ceil(cols), end as usize / cols))
        .filter(|(first, end)| first < end)
        .collect();
    whole.sort_unstable();
    whole
}

/// The intersection of two sorted lists of disjoint half-open intervals.
fn intersect(a: &[(usize, usize)], b: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let (first, end) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if first < end {
            out.push((first, end));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// Sorts and merges overlapping or adjacent intervals.
fn merged(runs: &mut [(usize, usize)]) -> Vec<(usize, usize)> {
    runs.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(runs.len());
    for &(first, end) in runs.iter() {
        match out.last_mut() {
            Some(last) if first <= last.1 => last.1 = last.1.max(end),
            _ => out.push((first, end)),
        }
    }
    out
}

/// The runs of `any` cut at the edges of `whole` (a subset of `any`, both sorted and disjoint):
/// the parts inside `whole` full, the rest partial.
fn split(any: &[(usize, usize)], whole: &[(usize, usize)]) -> Vec<Run> {
    let mut out = Vec::new();
    let mut w = 0;
    for &(first, end) in any {
        let mut at = first;
        while at < end {
            while w < whole.len() && whole[w].1 <= at {
                w += 1;
            }
            match whole.get(w) {
                Some(&(a, b)) if a <= at => {
                    let stop = b.min(end);
                    out.push((at, stop, true));
                    at = stop;
                }
                Some(&(a, _)) if a < end => {
                    out.push((at, a, false));
                    at = a;
                }
                _ => {
                    out.push((at, end, false));
                    at = end;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MaskSpec, Segment, VarlenAttention};

    /// Per (row tile, column tile): (any pair allowed, every pair exists and is allowed).
    fn brute_force(
        spans: &DenseSpans,
        kv: usize,
        rows: usize,
        cols: usize,
    ) -> Vec<Vec<(bool, bool)>> {
        let (row_tiles, col_tiles) = (spans.queries.div_ceil(rows), kv.div_ceil(cols));
        (0..row_tiles)
            .map(|r| {
                (0..col_tiles)
                    .map(|c| {
                        let mut any = false;
                        let mut all = true;
                        for query in r * rows..(r + 1) * rows {
                            for key in c * cols..(c + 1) * cols {
                                let allowed =
                                    query < spans.queries && key < kv && spans.allows(query, key);
                                any |= allowed;
                                all &= allowed;
                            }
                        }
                        (any, all)
                    })
                    .collect()
            })
            .collect()
    }

    fn flag(tiles: &TileRuns, row: usize, column: usize) -> Option<bool> {
        tiles
            .runs(row)
            .find(|&(a, b, _)| (a..b).contains(&column))
            .map(|(_, _, full)| full)
    }

    #[test]
    fn runs_list_the_tiles_with_work_and_mark_the_whole_ones() {
        let masks = [
            MaskSpec::Causal,
            MaskSpec::Full,
            MaskSpec::Sliding { window: 9 },
            MaskSpec::Lambda { sink: 5, window: 6 },
            MaskSpec::Blockwise {
                block: 8,
                local_blocks: 2,
            },
            MaskSpec::SharedQuestion {
                question_fraction: 0.3,
                answers: 3,
            },
        ];
        for mask in masks {
            let mut problem = VarlenAttention::packed(vec![70, 41], vec![mask.clone()]);
            problem.q_segments = vec![
                Segment::contiguous(0, 10, 60),
                Segment::contiguous(1, 0, 41),
            ];
            problem.kv_segments = vec![
                Segment {
                    seq: 0,
                    start: 0,
                    len: 35,
                    stride: 2,
                },
                Segment {
                    seq: 0,
                    start: 1,
                    len: 35,
                    stride: 2,
                },
                Segment::contiguous(1, 0, 41),
            ];
            let spans = DenseSpans::build(&problem).unwrap();
            let kv = problem.kv_tokens();
            for (rows, cols) in [(4, 8), (8, 4), (1, 1), (16, 16), (64, 16), (3, 5)] {
                let by_query = TileRuns::by_query_tile(&spans, rows, cols);
                let by_key = by_query.transpose(kv.div_ceil(cols));
                let truth = brute_force(&spans, kv, rows, cols);
                let (mut pairs, mut full) = (0, 0);
                for (r, row) in truth.iter().enumerate() {
                    for (c, &(any, all)) in row.iter().enumerate() {
                        let expected = any.then_some(all);
                        let at = format!("{mask} {rows}x{cols} ({r},{c})");
                        assert_eq!(flag(&by_query, r, c), expected, "{at}");
                        assert_eq!(flag(&by_key, c, r), expected, "{at} transposed");
                        pairs += any as usize;
                        full += all as usize;
                    }
                }
                assert_eq!(by_query.pairs(), (pairs, full), "{mask} {rows}x{cols}");
                assert_eq!(by_key.pairs(), (pairs, full), "{mask} {rows}x{cols}");
            }
        }
    }

    #[test]
    fn a_causal_square_is_full_below_the_diagonal() {
        let problem = VarlenAttention::packed(vec![256], vec![MaskSpec::Causal]);
        let spans = DenseSpans::build(&problem).unwrap();
        let runs = TileRuns::by_query_tile(&spans, 64, 64);
        let listed: Vec<Vec<Run>> = (0..4).map(|r| runs.runs(r).collect()).collect();
        assert_eq!(listed[0], vec![(0, 1, false)]);
        assert_eq!(listed[3], vec![(0, 3, true), (3, 4, false)]);
        assert_eq!(runs.pairs(), (10, 6));
    }

    #[test]
    fn tiles_launch_heaviest_first_ties_later_first() {
        // Causal: the last query tile is the heaviest.
        let causal = VarlenAttention::packed(vec![256], vec![MaskSpec::Causal]);
        let runs = TileRuns::by_query_tile(&DenseSpans::build(&causal).unwrap(), 64, 64);
        assert_eq!(runs.heaviest_first(), vec![3, 2, 1, 0]);
        // Two sequences, 192 causal then 64 full: tile 2 lists 3 key tiles, tile 3 lists 1 (its
        // own sequence's), tile 1 lists 2, tile 0 lists 1; ties (0 and 3) the later first.
        let varlen = VarlenAttention::packed(vec![192, 64], vec![MaskSpec::Causal, MaskSpec::Full]);
        let runs = TileRuns::by_query_tile(&DenseSpans::build(&varlen).unwrap(), 64, 64);
        assert_eq!(runs.heaviest_first(), vec![2, 1, 3, 0]);
        // Every tile exactly once, on any mask.
        let window = VarlenAttention::packed(vec![100], vec![MaskSpec::Sliding { window: 7 }]);
        let runs = TileRuns::by_query_tile(&DenseSpans::build(&window).unwrap(), 16, 8);
        let mut order = runs.heaviest_first();
        order.sort_unstable();
        assert_eq!(order, (0..runs.tiles() as u32).collect::<Vec<_>>());
    }
}
