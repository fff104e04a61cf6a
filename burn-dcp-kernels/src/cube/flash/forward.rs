//! The forward: `out` and the f32 LSE, FlashAttention-2's loop on register fragments.
//!
//! Cube `(x, y)`: tokens `x·T..(x + 1)·T` (`T` = [`FlashConfig::tokens_per_cube`]) of query heads
//! `y·hc..(y + 1)·hc` (`hc` = `heads_per_cube`, all of one kv head); plane `p` owns 16 of those
//! tokens of one head. Its Q fragments are loaded once; per listed key tile (`block` keys,
//! double-buffered) each plane computes `S = Q·Kᵀ` into f32 accumulators, masks it in registers
//! if the tile is partial, runs the online softmax step on its rows (row max and sum across the
//! four lanes of a row), rescales its output accumulators and adds `P·V` with `P` converted in
//! registers. The end divides by the row sums and writes `out` and `lse`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::fragment::*;
use super::stage::*;
use super::{fast_exp, FlashConfig};
use crate::cube::kernels::{NONE, NONE_LIMIT};

/// The online softmax state of the lane's two rows (`g` and `g + 8`): running max, the lane's
/// part of the running sum, and the output accumulators (`value_dim / 8` fragments).
#[derive(CubeType)]
pub struct RowState {
    pub max: Array<f32>,
    pub sum: Array<f32>,
    pub out: Array<Pair<f32>>,
}

#[cube]
impl RowState {
    pub fn new(#[comptime] value_dim: usize) -> RowState {
        let mut max = Array::<f32>::new(2usize);
        let mut sum = Array::<f32>::new(2usize);
        #[unroll]
        for v in 0..2usize {
            max[v] = NONE;
            sum[v] = 0.0;
        }
        RowState {
            max,
            sum,
            out: zero_accumulators(value_dim / 8),
        }
    }
}

/// `S = A·Bᵀ` for the plane's 16 rows against `block` rows of `tile` starting at row `base`:
/// `a` holds the plane's A fragments (`dim / 16` of them), `tile` the other side row-major
/// (`padded(dim)` columns). `block / 8` accumulator fragments.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores<F: Float>(
    a: &Array<Pair<F>>,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] tensor_cores: bool,
) -> Array<Pair<f32>> {
    let mut s = zero_accumulators(block / 8);
    #[unroll(tensor_cores)]
    for kk in 0..dim / 16 {
        #[unroll(tensor_cores)]
        for np in 0..block / 16 {
            let b = load_b_pair::<F>(
                tile,
                base + 16 * np,
                16 * kk,
                comptime!(padded(dim)),
                false,
                tensor_cores,
            );
            mma_pair::<F>(
                a,
                4 * kk,
                &b,
                &mut s,
                4 * np,
                scratch,
                scratch_at,
                tensor_cores,
            );
        }
    }
    s
}

/// `acc += P·B` for the plane's 16 rows: `p` holds `P` as accumulator fragments (`block / 8`
/// of them, `block` columns), `tile` the `block` rows of B from row `base` (row-major, `dim`
/// columns, `padded(dim)` stride); `acc` has `dim / 8` fragments.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_product<F: Float>(
    p: &Array<Pair<f32>>,
    tile: &SharedMemory<F>,
    base: usize,
    acc: &mut Array<Pair<f32>>,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] tensor_cores: bool,
) {
    #[unroll(tensor_cores)]
    for kk in 0..block / 16 {
        let a = accumulators_as_a::<F>(p, kk);
        #[unroll(tensor_cores)]
        for np in 0..dim / 16 {
            let b = load_b_pair::<F>(
                tile,
                16 * np,
                base + 16 * kk,
                comptime!(padded(dim)),
                true,
                tensor_cores,
            );
            mma_pair::<F>(&a, 0, &b, acc, 4 * np, scratch, scratch_at, tensor_cores);
        }
    }
}

/// Multiplies every score by `scale`.
#[cube]
pub fn scale_scores(
    s: &mut Array<Pair<f32>>,
    scale: f32,
    #[comptime] block: usize,
    #[comptime] unrolled: bool,
) {
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        s[i] = s[i] * Pair::<f32>::new(scale);
    }
}

/// Sets the scores of the pairs the spans do not allow to `NONE`. The lane's rows are
/// queries whose spans start at `spans_at[v]` of `spans`; its columns are keys
/// `first_key + 8n + 2t + e`.
#[cube]
pub fn mask_rows(
    s: &mut Array<Pair<f32>>,
    spans: &SharedMemory<u32>,
    spans_at: &Array<usize>,
    first_key: usize,
    #[comptime] block: usize,
    #[comptime] max_spans: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, _g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        // Pair `i`: fragment `i / 2`, row `v = i % 2`.
        let mut pair = s[i];
        #[unroll]
        for e in 0..2usize {
            let key = first_key + 8 * (i / 2) + 2 * t + e;
            if !allowed(spans, spans_at[i % 2], key, max_spans) {
                pair[e] = NONE;
            }
        }
        s[i] = pair;
    }
}

/// The online softmax step of one tile of scaled (and masked) scores: updates the running max
/// (across the row's four lanes), turns the scores into probabilities in place, adds them to
/// the lane's part of the running sum and rescales the output accumulators.
#[cube]
pub fn softmax_step(
    s: &mut Array<Pair<f32>>,
    state: &mut RowState,
    reduce: &mut SharedMemory<f32>,
    reduce_at: usize,
    #[comptime] block: usize,
    #[comptime] value_dim: usize,
    #[comptime] shuffles: bool,
    #[comptime] unrolled: bool,
) {
    #[unroll]
    for v in 0..2usize {
        let mut tile_max = f32::new(NONE);
        #[unroll(unrolled)]
        for n in 0..block / 8 {
            let pair = s[2 * n + v];
            tile_max = max(tile_max, max(pair[0], pair[1]));
        }
        let tile_max = row_max(tile_max, reduce, reduce_at, shuffles);
        let new_max = max(state.max[v], tile_max);
        // `exp(NONE - x)` is 0 for a real x; equal maxima (also NONE and NONE) give 1.
        let alpha = (state.max[v] - new_max).exp();
        state.max[v] = new_max;
        let mut total = 0.0f32;
        #[unroll(unrolled)]
        for n in 0..block / 8 {
            let mut pair = s[2 * n + v];
            #[unroll]
            for e in 0..2usize {
                // A masked pair gives 0; a NaN score gives NaN, which reaches `out` and `lse`.
                let p = select(pair[e] < NONE_LIMIT, 0.0f32, (pair[e] - new_max).exp());
                total += p;
                pair[e] = p;
            }
            s[2 * n + v] = pair;
        }
        state.sum[v] = state.sum[v] * alpha + total;
        #[unroll(unrolled)]
        for n in 0..value_dim / 8 {
            state.out[2 * n + v] = state.out[2 * n + v] * Pair::<f32>::new(alpha);
        }
    }
}

/// Forward: `out [Tq, H, Dv]` (input dtype) and `lse [H, Tq]` (f32). Tiles from
/// `tile_offsets` / `tile_runs` ([`crate::tiling::TileRuns`], query tiles of
/// `tokens_per_cube` tokens against key tiles of `block` keys).
#[cube(launch_unchecked, fast_math = fast_exp())]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    neg_inf: f32,
    #[comptime] config: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let planes = comptime!(config.planes);
    let units = comptime!(config.units());
    let head_dim = comptime!(config.head_dim);
    let value_dim = comptime!(config.value_dim);
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
    let shuffles = comptime!(config.shuffles);
    let tokens = comptime!(config.tokens_per_cube());
    let per_head = comptime!(config.planes / config.heads_per_cube);
    let (lane, g, t) = lane_coords();
    let plane = UNIT_POS_Y as usize;
    let head = CUBE_POS_Y as usize * config.heads_per_cube + plane / per_head;
    let kv_head = head / (q.shape(1) / k.shape(1));
    let q_tokens = q.shape(0);
    let first_token = CUBE_POS_X as usize * tokens;
    // The plane's first row among the cube's tokens.
    let row0 = (plane % per_head) * 16;

    let q_size = comptime!(16 * padded(config.head_dim));
    let k_size = comptime!(config.block * padded(config.head_dim));
    let v_size = comptime!(config.block * padded(config.value_dim));
    let mut q_tile = SharedMemory::<F>::new_aligned(planes * q_size, 16usize);
    let mut k_tile = SharedMemory::<F>::new_aligned(config.buffers() * k_size, 16usize);
    let mut v_tile = SharedMemory::<F>::new_aligned(config.buffers() * v_size, 16usize);
    let mut row_spans = SharedMemory::<u32>::new(tokens * 2 * max_spans);
    let mut scratch = SharedMemory::<F>::new(comptime!(if config.tensor_cores {
        1
    } else {
        config.planes * PRODUCT_SCRATCH
    }));
    let mut reduce = SharedMemory::<f32>::new(comptime!(if config.shuffles {
        1
    } else {
        config.planes * REDUCE_SCRATCH
    }));
    let scratch_at = plane * PRODUCT_SCRATCH;
    let reduce_at = plane * REDUCE_SCRATCH;

    let q_tile_index = CUBE_POS_X as usize;
    let first_run = tile_offsets[q_tile_index] as usize;
    let end_run = tile_offsets[q_tile_index + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let mut state = RowState::new(value_dim);
    let mut spans_at = Array::<usize>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        spans_at[v] = (row0 + g + 8 * v) * 2 * max_spans;
    }

    if config.async_copy {
        let q_ready = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        let q_at = plane * q_size;
        stage_rows::<F>(
            q,
            &mut q_tile,
            q_at,
            first_token + row0,
            head,
            q_tokens,
            lane,
            16usize,
            head_dim,
            32usize,
            true,
        );
        q_ready.commit_copy_async();
        if total > 0 {
            stage_key_tile::<F>(
                k,
                v,
                &mut k_tile,
                &mut v_tile,
                0usize,
                cursor.tile,
                kv_head,
                config,
            );
            ready_0.commit_copy_async();
        }
        stage_spans(
            spans,
            &mut row_spans,
            0usize,
            first_token,
            q_tokens,
            tokens,
            max_spans,
            units,
        );
        q_ready.arrive_and_wait();
        let q_frags = load_rows_as_a::<F>(&q_tile, q_at, head_dim, tensor_cores);
        for i in 0..total {
            let buffer = i % 2;
            let key_tile = cursor.tile;
            let full = cursor.full(tile_runs);
            if i + 1 < total {
                cursor.advance(tile_runs, first_run, end_run);
                stage_key_tile::<F>(
                    k,
                    v,
                    &mut k_tile,
                    &mut v_tile,
                    1 - buffer,
                    cursor.tile,
                    kv_head,
                    config,
                );
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
            forward_tile::<F>(
                &q_frags,
                &k_tile,
                &v_tile,
                buffer,
                key_tile,
                full,
                &row_spans,
                &spans_at,
                &mut state,
                scale,
                &mut scratch,
                scratch_at,
                &mut reduce,
                reduce_at,
                config,
            );
            // Nobody reads this buffer any more when the next iteration refills it.
            sync_cube();
        }
    } else {
        let q_at = plane * q_size;
        stage_rows::<F>(
            q,
            &mut q_tile,
            q_at,
            first_token + row0,
            head,
            q_tokens,
            lane,
            16usize,
            head_dim,
            32usize,
            false,
        );
        stage_spans(
            spans,
            &mut row_spans,
            0usize,
            first_token,
            q_tokens,
            tokens,
            max_spans,
            units,
        );
        sync_cube();
        let q_frags = load_rows_as_a::<F>(&q_tile, q_at, head_dim, tensor_cores);
        for _ in 0..total {
            let key_tile = cursor.tile;
            let full = cursor.full(tile_runs);
            stage_key_tile::<F>(
                k,
                v,
                &mut k_tile,
                &mut v_tile,
                0usize,
                key_tile,
                kv_head,
                config,
            );
            sync_cube();
            forward_tile::<F>(
                &q_frags,
                &k_tile,
                &v_tile,
                0usize,
                key_tile,
                full,
                &row_spans,
                &spans_at,
                &mut state,
                scale,
                &mut scratch,
                scratch_at,
                &mut reduce,
                reduce_at,
                config,
            );
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }

    // The end: row sums across the four lanes, `out = acc / sum`, `lse = max + ln(sum)`.
    #[unroll]
    for v in 0..2usize {
        let sum = row_sum(state.sum[v], &mut reduce, reduce_at, shuffles);
        // A row that attended a key has a real max, or a NaN sum (a NaN score).
        let seen = state.max[v] > NONE_LIMIT || !(sum == 0.0);
        let token = first_token + row0 + g + 8 * v;
        if token < q_tokens {
            let base = token * out.stride(0) + head * out.stride(1);
            #[unroll(tensor_cores)]
            for n in 0..value_dim / 8 {
                let pair = state.out[2 * n + v];
                #[unroll]
                for e in 0..2usize {
                    // A query without any key writes 0.
                    let value = select(seen, pair[e] / sum, 0.0f32);
                    out[base + (8 * n + 2 * t + e) * out.stride(2)] = F::cast_from(value);
                }
            }
            if t == 0 {
                let value = select(seen, state.max[v] + sum.ln(), neg_inf);
                lse[head * lse.stride(0) + token * lse.stride(1)] = value;
            }
        }
    }
}

/// The plane's 16 staged rows at `at` of `tile` (`padded(dim)` columns) as `dim / 16` A
/// fragments.
#[cube]
pub fn load_rows_as_a<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] dim: usize,
    #[comptime] tensor_cores: bool,
) -> Array<Pair<F>> {
    let mut frags = Array::<Pair<F>>::new(dim / 4);
    let stride = comptime!(padded(dim));
    #[unroll(tensor_cores)]
    for kk in 0..dim / 16 {
        load_a::<F>(
            tile,
            at / stride,
            16 * kk,
            &mut frags,
            4 * kk,
            stride,
            tensor_cores,
        );
    }
    frags
}

/// Stages key tile `key_tile` (`block` keys of `kv_head`) of K and V into buffer `buffer`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_key_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_tile: &mut SharedMemory<F>,
    v_tile: &mut SharedMemory<F>,
    buffer: usize,
    key_tile: usize,
    kv_head: usize,
    #[comptime] config: FlashConfig,
) {
    let block = comptime!(config.block);
    let units = comptime!(config.units());
    let unit = UNIT_POS as usize;
    let first = key_tile * block;
    let kv_tokens = k.shape(0);
    let k_at = buffer * comptime!(config.block * padded(config.head_dim));
    let v_at = buffer * comptime!(config.block * padded(config.value_dim));
    let (hd, vd, copy) = comptime!((config.head_dim, config.value_dim, config.async_copy));
    stage_rows::<F>(
        k, k_tile, k_at, first, kv_head, kv_tokens, unit, block, hd, units, copy,
    );
    stage_rows::<F>(
        v, v_tile, v_at, first, kv_head, kv_tokens, unit, block, vd, units, copy,
    );
}

/// One key tile of the forward for the plane's rows: scores, mask (partial tiles), softmax
/// step, `acc += P·V`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn forward_tile<F: Float>(
    q_frags: &Array<Pair<F>>,
    k_tile: &SharedMemory<F>,
    v_tile: &SharedMemory<F>,
    buffer: usize,
    key_tile: usize,
    full: bool,
    row_spans: &SharedMemory<u32>,
    spans_at: &Array<usize>,
    state: &mut RowState,
    scale: f32,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    reduce: &mut SharedMemory<f32>,
    reduce_at: usize,
    #[comptime] config: FlashConfig,
) {
    let block = comptime!(config.block);
    let tensor_cores = comptime!(config.tensor_cores);
    let base = buffer * block;
    let mut s = scores::<F>(
        q_frags,
        k_tile,
        base,
        scratch,
        scratch_at,
        config.head_dim,
        block,
        tensor_cores,
    );
    scale_scores(&mut s, scale, block, tensor_cores);
    if !full {
        let first_key = key_tile * block;
        mask_rows(
            &mut s,
            row_spans,
            spans_at,
            first_key,
            block,
            config.max_spans,
            tensor_cores,
        );
    }
    softmax_step(
        &mut s,
        state,
        reduce,
        reduce_at,
        block,
        config.value_dim,
        config.shuffles,
        tensor_cores,
    );
    add_product::<F>(
        &s,
        v_tile,
        base,
        &mut state.out,
        scratch,
        scratch_at,
        config.value_dim,
        block,
        tensor_cores,
    );
}
