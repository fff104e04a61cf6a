//! Staging into shared memory: tiles of rows (asynchronous 16-byte copies or plain loads), the
//! per-row spans and f32 row values, and the cursor over a cube's listed tiles.
//!
//! Tiles are row-major with [`padded`] columns: `dim + 8`, so the eight 16-byte rows an
//! `ldmatrix` phase reads fall in distinct banks (a row of `dim` elements, a multiple of 64
//! bytes, would put them all in the same four).

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

use super::FlashConfig;

/// Elements per 16-byte copy of f16/bf16.
pub const CHUNK: usize = 8;

/// Columns of a staged tile of `dim`-element rows.
pub fn padded(dim: usize) -> usize {
    dim + CHUNK
}

/// Copies rows `first_row..first_row + rows` of head `head` of `source` (`[tokens, heads, dim]`)
/// into `tile` at `at` (row-major, `padded(dim)` columns), by `units` units (`unit` is this
/// one's index among them: the cube's, or a plane's lanes for a plane's own rows). Rows past
/// the source's end repeat its last row (their pairs are masked). With `async_copy` each unit issues
/// 16-byte `cp.async` copies (the host checked the alignment: contiguous last dim, strides and
/// offset multiples of 8 elements, `dim` the source's) that the caller commits to a barrier;
/// otherwise plain loads, which fill the columns from the source's dim to `dim` with zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows_by<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<F>,
    at: usize,
    first_row: usize,
    head: usize,
    unit: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
    #[comptime] async_copy: bool,
) {
    let rows_total = source.shape(0);
    let per_row = comptime!(dim / CHUNK);
    let chunks = comptime!(rows * per_row);
    let stride = comptime!(padded(dim));
    #[unroll]
    for pass in 0..chunks.div_ceil(units) {
        let chunk = pass * units + unit;
        if chunks % units == 0 || chunk < chunks {
            let row = chunk / per_row;
            let col = (chunk % per_row) * CHUNK;
            let token = min(first_row + row, rows_total - 1);
            let from = token * source.stride(0) + head * source.stride(1) + col;
            let to = at + row * stride + col;
            if async_copy {
                copy_async(
                    &source.slice(from, from + CHUNK),
                    &mut tile.slice_mut(to, to + CHUNK),
                    CHUNK as u32,
                );
            } else {
                // Columns past the source's dim (a `dim` padded to a multiple of 16) are zeros,
                // which add nothing to any product.
                let real = source.shape(2);
                #[unroll]
                for e in 0..CHUNK {
                    let mut value = F::new(0.0);
                    if col + e < real {
                        value = source[from + e * source.stride(2)];
                    }
                    tile[to + e] = value;
                }
            }
        }
    }
}

/// `stage_rows_by` the cube's units, with the config's copies or plain loads.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<F>,
    at: usize,
    first_row: usize,
    head: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) {
    let (units, copy) = comptime!((config.units(), config.async_copy));
    let unit = UNIT_POS as usize;
    stage_rows_by::<F>(
        source, tile, at, first_row, head, unit, rows, dim, units, copy,
    );
}

/// The plane's own `16 · row_tiles` rows from `first_row`, `stage_rows_by` its 32 lanes.
#[cube]
pub fn stage_plane_rows<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<F>,
    at: usize,
    first_row: usize,
    head: usize,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) {
    let (rows, copy) = comptime!((16 * config.row_tiles, config.async_copy));
    let lane = UNIT_POS_X as usize;
    stage_rows_by::<F>(
        source, tile, at, first_row, head, lane, rows, dim, 32usize, copy,
    );
}

/// The spans of tokens `first..first + rows` into `into` at `at` (empty past the last token, so
/// that no key is allowed), all the cube's units together.
#[cube]
pub fn stage_spans(
    spans: &Tensor<u32>,
    into: &mut SharedMemory<u32>,
    at: usize,
    first: usize,
    #[comptime] rows: usize,
    #[comptime] config: FlashConfig,
) {
    let (max_spans, units) = comptime!((config.max_spans, config.units()));
    let tokens = spans.len() / comptime!(2 * max_spans);
    let unit = UNIT_POS as usize;
    let len = comptime!(rows * 2 * max_spans);
    #[unroll]
    for pass in 0..len.div_ceil(units) {
        let index = pass * units + unit;
        if index < len {
            let token = first + index / (2 * max_spans);
            let mut value = 0u32;
            if token < tokens {
                value = spans[token * 2 * max_spans + index % (2 * max_spans)];
            }
            into[at + index] = value;
        }
    }
}

/// Per-token f32 values `source [H, T]` of head `head`, tokens `first..first + rows`, into
/// `into` at `at` (0 past the last token), all the cube's units together.
#[cube]
pub fn stage_row_values(
    source: &Tensor<f32>,
    into: &mut SharedMemory<f32>,
    at: usize,
    head: usize,
    first: usize,
    #[comptime] rows: usize,
    #[comptime] config: FlashConfig,
) {
    let units = comptime!(config.units());
    let unit = UNIT_POS as usize;
    #[unroll]
    for pass in 0..rows.div_ceil(units) {
        let index = pass * units + unit;
        if index < rows {
            let token = first + index;
            let mut value = 0.0f32;
            if token < source.shape(1) {
                value = source[head * source.stride(0) + token * source.stride(1)];
            }
            into[at + index] = value;
        }
    }
}

/// Whether `key` lies in one of the `max_spans` spans staged at `at` of `spans`.
#[cube]
pub fn allowed(
    spans: &SharedMemory<u32>,
    at: usize,
    key: usize,
    #[comptime] max_spans: usize,
) -> bool {
    let mut allowed = false;
    #[unroll]
    for s in 0..max_spans {
        let start = spans[at + 2 * s] as usize;
        let end = spans[at + 2 * s + 1] as usize;
        allowed = allowed || (key >= start && key < end);
    }
    allowed
}

/// A position in a cube's list of tiles: runs `[first, end, full]` of the launch table
/// ([`crate::tiling::TileRuns`]), walked tile by tile, `rounds` times over (the dk/dv kernel
/// walks its list once per query head of the group).
#[derive(CubeType)]
pub struct Cursor {
    pub run: usize,
    pub tile: usize,
    pub round: usize,
}

#[cube]
impl Cursor {
    /// The first tile of runs `first_run..end_run` (none when the range is empty).
    pub fn start(runs: &Tensor<u32>, first_run: usize, end_run: usize) -> Cursor {
        let mut tile = 0;
        if first_run < end_run {
            tile = runs[3 * first_run] as usize;
        }
        Cursor {
            run: first_run,
            tile,
            round: 0,
        }
    }

    /// Whether the current run marks its tiles full.
    pub fn full(&self, runs: &Tensor<u32>) -> bool {
        runs[3 * self.run + 2] == 1
    }

    /// Moves to the next tile (past the end of the last run, to the next round's first).
    pub fn advance(&mut self, runs: &Tensor<u32>, first_run: usize, end_run: usize) {
        self.tile += 1;
        if self.tile == runs[3 * self.run + 1] as usize {
            self.run += 1;
            if self.run == end_run {
                self.run = first_run;
                self.round += 1;
            }
            self.tile = runs[3 * self.run] as usize;
        }
    }
}

/// This cube's index in its launch, x fastest: the order CUDA starts cubes in. The host lays
/// a launch's cubes out over x and y (`launch::grid`), one per (tile, head group), the groups
/// fastest and the tiles in [`crate::tiling::TileRuns::heaviest_first`] order; cubes past the
/// last return at once.
#[cube]
pub fn launch_slot() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The number of tiles in runs `first_run..end_run`.
#[cube]
pub fn count_tiles(runs: &Tensor<u32>, first_run: usize, end_run: usize) -> usize {
    let mut total = 0;
    for run in first_run..end_run {
        total += (runs[3 * run + 1] - runs[3 * run]) as usize;
    }
    total
}

/// Stages listed tile `tile` (`block` rows of its head) of `source` into its buffer of
/// `into` (`padded(dim)` columns).
#[cube]
pub fn stage_tile<F: Float>(
    source: &Tensor<F>,
    into: &mut SharedMemory<F>,
    tile: &Listed,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) {
    let block = comptime!(config.block);
    let at = tile.buffer * comptime!(block * padded(dim));
    stage_rows::<F>(
        source,
        into,
        at,
        tile.index * block,
        tile.head,
        block,
        dim,
        config,
    );
}

/// Stages key tile `tile` (`block` keys of its head) of K and V into its buffer; K alone when
/// the tiles are staged in turn ([`FlashConfig::in_turn`]).
#[cube]
pub fn stage_key_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_tile: &mut SharedMemory<F>,
    v_tile: &mut SharedMemory<F>,
    tile: &Listed,
    #[comptime] config: FlashConfig,
) {
    let (hd, vd) = comptime!((config.head_dim, config.value_dim));
    stage_tile::<F>(k, k_tile, tile, hd, config);
    if comptime!(!config.in_turn) {
        stage_tile::<F>(v, v_tile, tile, vd, config);
    }
}

/// One listed tile of the other side (key tiles; query tiles in the dk/dv kernel): the buffer
/// it is staged into, its index, the head it is staged from, and whether all its pairs are
/// allowed (no mask to apply).
#[derive(CubeType)]
pub struct Listed {
    pub buffer: usize,
    pub index: usize,
    pub head: usize,
    pub full: bool,
}

#[cube]
impl Listed {
    /// The cursor's tile, of head `first_head + round`, into `buffer`.
    pub fn at(cursor: &Cursor, runs: &Tensor<u32>, buffer: usize, first_head: usize) -> Listed {
        Listed {
            buffer,
            index: cursor.tile,
            head: first_head + cursor.round,
            full: cursor.full(runs),
        }
    }
}

/// Where a cube of the forward or the dq kernel works, from its place in the launch
/// ([`launch_slot`](fn@launch_slot)): its query tile (`order`'s entry), first token, and the
/// plane's query head, kv head and first row among the cube's tokens. Ends the cube past the
/// launch's last slot.
#[derive(CubeType)]
pub struct QueryCube {
    pub tile: usize,
    pub first_token: usize,
    pub head: usize,
    pub kv_head: usize,
    pub row0: usize,
}

#[cube]
pub fn query_cube<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    order: &Tensor<u32>,
    #[comptime] config: FlashConfig,
) -> QueryCube {
    let per_head = comptime!(config.planes / config.heads_per_cube);
    let plane = UNIT_POS_Y as usize;
    let slot = launch_slot();
    let groups = q.shape(1) / config.heads_per_cube;
    if slot >= order.len() * groups {
        terminate!();
    }
    let head = (slot % groups) * config.heads_per_cube + plane / per_head;
    let tile = order[slot / groups] as usize;
    QueryCube {
        tile,
        first_token: tile * comptime!(config.tokens_per_cube()),
        head,
        kv_head: head / (q.shape(1) / k.shape(1)),
        row0: (plane % per_head) * comptime!(16 * config.row_tiles),
    }
}
