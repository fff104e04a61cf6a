//! The forward: `out` and the f32 LSE, FlashAttention-2's loop on register fragments.
//!
//! A cube: `T` tokens ([`FlashConfig::tokens_per_cube`]) of query heads `g·hc..(g + 1)·hc`
//! (`hc` = `heads_per_cube`, all of one kv head; the cube's place in the launch gives its query
//! tile and group `g`, heaviest tiles first: [`launch_slot`](fn@launch_slot)); plane `p` owns `16·m` of
//! those tokens of one head (`m` = `row_tiles`). Its Q fragments are loaded once; per listed key tile (`block` keys,
//! double-buffered) each plane computes `S = Q·Kᵀ` into f32 accumulators, masks it in registers
//! if the tile is partial, runs the online softmax step on its rows (row max and sum across the
//! four lanes of a row), rescales its output accumulators and adds `P·V` with `P` converted in
//! registers. The end divides by the row sums and writes `out` and `lse`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::fragment::*;
use super::stage::*;
use super::tile::{add_product, mask_rows, scale_scores, scores};
use super::{fast_exp, FlashConfig};
use crate::cube::elementwise::{NONE, NONE_LIMIT};

/// The online softmax state of the lane's `2m` rows (`16i + g` and `16i + g + 8` of each of
/// the plane's `m` row tiles): running max, the lane's part of the running sum, the output
/// accumulators (`m · value_dim / 8` fragments, row tile by row tile), and where the rows'
/// spans start in the cube's.
#[derive(CubeType)]
pub struct RowState {
    pub max: Array<f32>,
    pub sum: Array<f32>,
    pub out: Array<Pair<f32>>,
    pub spans_at: Array<usize>,
}

#[cube]
impl RowState {
    pub fn new(#[comptime] value_dim: usize, #[comptime] row_tiles: usize) -> RowState {
        let mut max = Array::<f32>::new(2 * row_tiles);
        let mut sum = Array::<f32>::new(2 * row_tiles);
        #[unroll]
        for r in 0..2 * row_tiles {
            max[r] = NONE;
            sum[r] = 0.0;
        }
        RowState {
            max,
            sum,
            out: zero_accumulators(row_tiles * value_dim / 8),
            spans_at: Array::<usize>::new(2 * row_tiles),
        }
    }
}

/// The online softmax step of one tile of scaled (and masked) scores: updates the running max
/// (across the row's four lanes), turns the scores into probabilities in place, adds them to
/// the lane's part of the running sum and rescales the output accumulators.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn softmax_step(
    s: &mut Array<Pair<f32>>,
    state: &mut RowState,
    reduce: &mut Scratch<f32>,
    #[comptime] block: usize,
    #[comptime] value_dim: usize,
    #[comptime] row_tiles: usize,
    #[comptime] shuffles: bool,
    #[comptime] unrolled: bool,
) {
    #[unroll]
    for r in 0..2 * row_tiles {
        let (mi, v) = comptime!((r / 2, r % 2));
        let s_at = mi * (block / 4) + v;
        let mut tile_max = f32::new(NONE);
        #[unroll(unrolled)]
        for n in 0..block / 8 {
            let pair = s[s_at + 2 * n];
            tile_max = max(tile_max, max(pair[0], pair[1]));
        }
        let tile_max = row_max(tile_max, reduce, shuffles);
        let new_max = max(state.max[r], tile_max);
        // `exp(NONE - x)` is 0 for a real x; equal maxima (also NONE and NONE) give 1.
        let alpha = (state.max[r] - new_max).exp();
        state.max[r] = new_max;
        let mut total = 0.0f32;
        #[unroll(unrolled)]
        for n in 0..block / 8 {
            let mut pair = s[s_at + 2 * n];
            #[unroll]
            for e in 0..2usize {
                // A masked pair gives 0; a NaN score gives NaN, which reaches `out` and `lse`.
                let p = select(pair[e] < NONE_LIMIT, 0.0f32, (pair[e] - new_max).exp());
                total += p;
                pair[e] = p;
            }
            s[s_at + 2 * n] = pair;
        }
        state.sum[r] = state.sum[r] * alpha + total;
        let out_at = mi * (value_dim / 4) + v;
        #[unroll(unrolled)]
        for n in 0..value_dim / 8 {
            state.out[out_at + 2 * n] = state.out[out_at + 2 * n] * Pair::<f32>::new(alpha);
        }
    }
}

/// Forward: `out [Tq, H, Dv]` (input dtype) and `lse [H, Tq]` (f32). Tiles from
/// `tile_offsets` / `tile_runs` ([`crate::tiling::TileRuns`], query tiles of
/// `tokens_per_cube` tokens against key tiles of `block` keys); `order` lists the query tiles
/// heaviest first ([`launch_slot`](fn@launch_slot)).
#[cube(launch_unchecked, fast_math = fast_exp())]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    order: &Tensor<u32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    neg_inf: f32,
    #[comptime] config: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let units = comptime!(config.units());
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let (max_spans, row_tiles) = comptime!((config.max_spans, config.row_tiles));
    let (tensor_cores, shuffles) = comptime!((config.tensor_cores, config.shuffles));
    let tokens = comptime!(config.tokens_per_cube());
    let (_lane, g, t) = lane_coords();
    let plane = UNIT_POS_Y as usize;
    let cube = query_cube::<F>(q, k, order, config);
    let head = cube.head;
    let kv_head = cube.kv_head;
    let row0 = cube.row0;
    let first_token = cube.first_token;
    let q_tokens = q.shape(0);

    let q_size = comptime!(16 * config.row_tiles * padded(config.head_dim));
    // Q is staged for the copies and for two row tiles; one row tile with plain loads reads
    // its fragments from global memory once.
    let stage_q = comptime!(config.stages_own_rows());
    let q_tile = SharedMemory::<F>::new_aligned(
        comptime!(if stage_q { config.planes * q_size } else { 1 }),
        16usize,
    );
    // Staged in turn, V takes K's buffer.
    let (k_size, v_size) = comptime!(config.key_tile_sizes());
    let mut tiles = ForwardTiles::<F> {
        q: q_tile,
        k: SharedMemory::<F>::new_aligned(k_size, 16usize),
        v: SharedMemory::<F>::new_aligned(v_size, 16usize),
        spans: SharedMemory::<u32>::new(tokens * 2 * max_spans),
        scratch: Scratch::<F>::products(config),
        reduce: Scratch::<f32>::reductions(config),
    };
    let q_at = plane * q_size;

    let first_run = tile_offsets[cube.tile] as usize;
    let end_run = tile_offsets[cube.tile + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let mut state = RowState::new(value_dim, row_tiles);
    #[unroll]
    for r in 0..2 * row_tiles {
        state.spans_at[r] = (row0 + 16 * (r / 2) + g + 8 * (r % 2)) * 2 * max_spans;
    }
    // One row tile per plane keeps its Q fragments in registers; more read them per tile.
    let mut q_frags = Array::<Pair<F>>::new(comptime!(if config.row_tiles == 1 {
        config.head_dim / 4
    } else {
        1
    }));
    let first_row = first_token + row0;
    if stage_q {
        stage_plane_rows::<F>(q, &mut tiles.q, q_at, first_row, head, head_dim, config);
    }
    stage_spans(spans, &mut tiles.spans, 0usize, first_token, tokens, config);

    if comptime!(config.async_copy) {
        let q_ready = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        q_ready.commit_copy_async();
        if total > 0 {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head);
            stage_key_tile::<F>(k, v, &mut tiles.k, &mut tiles.v, &tile, config);
            ready_0.commit_copy_async();
        }
        q_ready.arrive_and_wait();
        if row_tiles == 1 {
            load_rows_into::<F>(&tiles.q, q_at, &mut q_frags, head_dim, tensor_cores);
        }
        for i in 0..total {
            let buffer = i % 2;
            let tile = Listed::at(&cursor, tile_runs, buffer, kv_head);
            if i + 1 < total {
                cursor.advance(tile_runs, first_run, end_run);
                let next = Listed::at(&cursor, tile_runs, 1 - buffer, kv_head);
                stage_key_tile::<F>(k, v, &mut tiles.k, &mut tiles.v, &next, config);
                if buffer == 0 {
                    ready_1.commit_copy_async();
                } else {
                    ready_0.commit_copy_async();
                }
            }
            if buffer == 0 {
                ready_0.arrive_and_wait();
            } else {
                ready_1.arrive_and_wait();
            }
            forward_tile::<F>(v, &q_frags, &mut tiles, &tile, &mut state, scale, config);
            // Nobody reads this buffer any more when the next iteration refills it.
            sync_cube();
        }
    } else {
        sync_cube();
        if row_tiles == 1 {
            load_rows_global_into::<F>(q, first_row, head, &mut q_frags, head_dim, tensor_cores);
        }
        for _ in 0..total {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head);
            stage_key_tile::<F>(k, v, &mut tiles.k, &mut tiles.v, &tile, config);
            sync_cube();
            forward_tile::<F>(v, &q_frags, &mut tiles, &tile, &mut state, scale, config);
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }

    // The end: row sums across the four lanes, `out = acc / sum`, `lse = max + ln(sum)`.
    #[unroll]
    for r in 0..2 * row_tiles {
        let (mi, v) = comptime!((r / 2, r % 2));
        let sum = row_sum(state.sum[r], &mut tiles.reduce, shuffles);
        // A row that attended a key has a real max, or a NaN sum (a NaN score).
        let seen = state.max[r] > NONE_LIMIT || !(sum == 0.0);
        let token = first_row + 16 * mi + g + 8 * v;
        if token < q_tokens {
            let base = token * out.stride(0) + head * out.stride(1);
            let out_at = mi * (value_dim / 4) + v;
            #[unroll(tensor_cores)]
            for n in 0..value_dim / 8 {
                let pair = state.out[out_at + 2 * n];
                #[unroll]
                for e in 0..2usize {
                    // A query without any key writes 0; padding columns are not written.
                    let value = select(seen, pair[e] / sum, 0.0f32);
                    let col = 8 * n + 2 * t + e;
                    if comptime!(config.exact_dims) || col < out.shape(2) {
                        out[base + col * out.stride(2)] = F::cast_from(value);
                    }
                }
            }
            if t == 0 {
                let value = select(seen, state.max[r] + sum.ln(), neg_inf);
                lse[head * lse.stride(0) + token * lse.stride(1)] = value;
            }
        }
    }
}

/// The forward's shared memory: Q rows, K and V tiles (one or two buffers), the cube's spans,
/// and the plain bodies' scratch for products and row reductions.
#[derive(CubeType)]
pub struct ForwardTiles<F: Float> {
    q: SharedMemory<F>,
    k: SharedMemory<F>,
    v: SharedMemory<F>,
    spans: SharedMemory<u32>,
    scratch: Scratch<F>,
    reduce: Scratch<f32>,
}

/// One key tile of the forward for the plane's rows: scores against the staged K tile, mask
/// (partial tiles), softmax step (which rescales the output accumulators), `acc += P·V`.
/// Staged in turn ([`FlashConfig::in_turn`]): V over K for the product.
#[cube]
fn forward_tile<F: Float>(
    v: &Tensor<F>,
    q_frags: &Array<Pair<F>>,
    tiles: &mut ForwardTiles<F>,
    tile: &Listed,
    state: &mut RowState,
    scale: f32,
    #[comptime] config: FlashConfig,
) {
    let (block, tc, m) = comptime!((config.block, config.tensor_cores, config.row_tiles));
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let q_row0 = UNIT_POS_Y as usize * comptime!(16 * m);
    let base = tile.buffer * block;
    let mut s = scores::<F>(
        q_frags,
        &tiles.q,
        q_row0,
        &tiles.k,
        base,
        &mut tiles.scratch,
        head_dim,
        config,
    );
    scale_scores(&mut s, scale, comptime!(m * block / 4), tc);
    if !tile.full {
        let first_key = tile.index * block;
        let max_spans = comptime!(config.max_spans);
        mask_rows(
            &mut s,
            &tiles.spans,
            &state.spans_at,
            first_key,
            block,
            m,
            max_spans,
            tc,
        );
    }
    softmax_step(
        &mut s,
        state,
        &mut tiles.reduce,
        block,
        value_dim,
        m,
        config.shuffles,
        tc,
    );
    if comptime!(config.in_turn) {
        sync_cube();
        stage_tile::<F>(v, &mut tiles.k, tile, value_dim, config);
        sync_cube();
        add_product::<F>(
            &s,
            &tiles.k,
            0usize,
            &mut state.out,
            &mut tiles.scratch,
            value_dim,
            config,
        );
    } else {
        add_product::<F>(
            &s,
            &tiles.v,
            base,
            &mut state.out,
            &mut tiles.scratch,
            value_dim,
            config,
        );
    }
}
