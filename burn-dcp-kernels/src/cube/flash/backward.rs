//! The backward, FlashAttention-2's split: `delta = rowsum(dO ∘ O)` first (the vector
//! kernels' prepass), then a dk/dv kernel per key tile walking the query tiles of every query
//! head of its GQA group, and a dq kernel per query tile walking the key tiles, both on the
//! forward's pieces. Recomputing `S` in both costs one extra `Q·Kᵀ` per pair; in exchange there
//! are no atomics and the results are deterministic.
//!
//! - **dq** (the forward's cubes and key tiles): per key tile each plane recomputes `S = Q·Kᵀ`
//!   and `dP = dO·Vᵀ`, forms `P = exp(scale·S − lse)` and `dS = P ∘ (dP − delta)` in registers
//!   and adds `dS·K`; the end writes `scale · dQ`.
//! - **dk/dv** (cube = `16 · planes` keys of one kv head; plane `p` owns 16 of them): per query
//!   tile (`block` queries, double-buffered with their lse, delta and spans) each plane computes
//!   `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, then `Pᵀ`, `dSᵀ`, and adds `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.

// The kernels' builtins (`CUBE_COUNT_X`, `CUBE_POS_X`) are dummy constants in the Rust body
// the macro keeps beside the expansion; `count - 1 - position` overflows there, never on a device.
#![allow(arithmetic_overflow)]

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::forward::{add_product, load_rows_as_a, mask_rows, scale_scores, scores};

use super::fragment::*;
use super::stage::*;
use super::{fast_exp, FlashConfig};
use crate::cube::kernels::{NONE, NONE_LIMIT};

/// Turns scaled, masked scores `s` into `P = exp(s − lse)` (0 where masked) and `dp` into
/// `dS = P ∘ (dP − delta)`, in place. `row_values`: the lane's rows' `(lse, delta)`
/// (`per_row`), or the tile's columns' in shared memory at `column_at` (`!per_row`).
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn probabilities_and_ds(
    s: &mut Array<Pair<f32>>,
    dp: &mut Array<Pair<f32>>,
    row_lse: &Array<f32>,
    row_delta: &Array<f32>,
    column_lse: &SharedMemory<f32>,
    column_delta: &SharedMemory<f32>,
    column_at: usize,
    #[comptime] block: usize,
    #[comptime] per_row: bool,
    #[comptime] unrolled: bool,
) {
    let (_lane, _g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        // Pair `i`: fragment `i / 2`, row `i % 2`.
        let mut p = s[i];
        let mut ds = dp[i];
        #[unroll]
        for e in 0..2usize {
            let mut lse = 0.0f32;
            let mut delta = 0.0f32;
            if per_row {
                lse = row_lse[i % 2];
                delta = row_delta[i % 2];
            } else {
                let at = column_at + 8 * (i / 2) + 2 * t + e;
                lse = column_lse[at];
                delta = column_delta[at];
            }
            let prob = select(p[e] < NONE_LIMIT, 0.0f32, (p[e] - lse).exp());
            p[e] = prob;
            ds[e] = prob * (ds[e] - delta);
        }
        s[i] = p;
        dp[i] = ds;
    }
}

/// Sets the scores of the pairs the spans do not allow to `NONE` where the lane's rows are keys
/// `first_key + g + 8v` and its columns queries `8n + 2t + e` of a tile whose spans start at
/// `spans_at` of `spans`.
#[cube]
fn mask_columns(
    s: &mut Array<Pair<f32>>,
    spans: &SharedMemory<u32>,
    spans_at: usize,
    first_key: usize,
    #[comptime] block: usize,
    #[comptime] max_spans: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..block / 4 {
        let mut pair = s[i];
        #[unroll]
        for e in 0..2usize {
            let at = spans_at + (8 * (i / 2) + 2 * t + e) * 2 * max_spans;
            if !allowed(spans, at, first_key + g + 8 * (i % 2), max_spans) {
                pair[e] = NONE;
            }
        }
        s[i] = pair;
    }
}

/// Writes `factor ·` the plane's accumulators (`dim / 8` fragments, rows `first + g + 8v`) to
/// `target [tokens, heads, dim]` at head `head`, skipping rows past the end.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_rows<F: Float>(
    acc: &Array<Pair<f32>>,
    target: &mut Tensor<F>,
    first: usize,
    head: usize,
    factor: f32,
    #[comptime] dim: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, g, t) = lane_coords();
    #[unroll(unrolled)]
    for i in 0..dim / 4 {
        let token = first + g + 8 * (i % 2);
        if token < target.shape(0) {
            let base = token * target.stride(0) + head * target.stride(1);
            let pair = acc[i];
            #[unroll]
            for e in 0..2usize {
                let col = 8 * (i / 2) + 2 * t + e;
                target[base + col * target.stride(2)] = F::cast_from(pair[e] * factor);
            }
        }
    }
}

/// [`scores`] of one row tile whose A fragments are in registers.
#[cube]
#[allow(clippy::too_many_arguments)]
fn scores_in_registers<F: Float>(
    a: &Array<Pair<F>>,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] tensor_cores: bool,
) -> Array<Pair<f32>> {
    scores::<F>(
        a,
        tile,
        0usize,
        tile,
        base,
        scratch,
        scratch_at,
        dim,
        block,
        1usize,
        true,
        tensor_cores,
    )
}

/// Backward, query side: `dq [Tq, H, D]`. The forward's cubes and tile lists.
#[cube(launch_unchecked, fast_math = fast_exp())]
#[allow(clippy::too_many_arguments)]
pub fn flash_dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    dq: &mut Tensor<F>,
    scale: f32,
    #[comptime] config: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let planes = comptime!(config.planes);
    let units = comptime!(config.units());
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let block = comptime!(config.block);
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
    let copy = comptime!(config.async_copy);
    let tokens = comptime!(config.tokens_per_cube());
    let per_head = comptime!(config.planes / config.heads_per_cube);
    let (lane, g, _t) = lane_coords();
    let plane = UNIT_POS_Y as usize;
    let head = CUBE_POS_Y as usize * config.heads_per_cube + plane / per_head;
    let kv_head = head / (q.shape(1) / k.shape(1));
    let q_tokens = q.shape(0);
    // The heaviest query tiles (the last, under a causal mask) first.
    let q_tile_index = CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize;
    let first_token = q_tile_index * tokens;
    let row0 = (plane % per_head) * 16;
    let first_row = first_token + row0;

    let q_size = comptime!(16 * padded(config.head_dim));
    let do_size = comptime!(16 * padded(config.value_dim));
    let k_size = comptime!(config.block * padded(config.head_dim));
    let v_size = comptime!(config.block * padded(config.value_dim));
    let mut q_tile = SharedMemory::<F>::new_aligned(planes * q_size, 16usize);
    let mut do_tile = SharedMemory::<F>::new_aligned(planes * do_size, 16usize);
    let mut k_tile = SharedMemory::<F>::new_aligned(config.buffers() * k_size, 16usize);
    let mut v_tile = SharedMemory::<F>::new_aligned(config.buffers() * v_size, 16usize);
    let mut row_spans = SharedMemory::<u32>::new(tokens * 2 * max_spans);
    let mut scratch = SharedMemory::<F>::new(comptime!(if config.tensor_cores {
        1
    } else {
        config.planes * PRODUCT_SCRATCH
    }));
    let scratch_at = plane * PRODUCT_SCRATCH;
    // The dq kernel needs no row reductions and no per-column values.
    let unused = SharedMemory::<f32>::new(1usize);

    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    let mut spans_at = Array::<usize>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let token = first_row + g + 8 * v;
        let present = token < q_tokens;
        let at = head * lse.stride(0) + select(present, token, 0) * lse.stride(1);
        row_lse[v] = select(present, lse[at], 0.0f32);
        let at = head * delta.stride(0) + select(present, token, 0) * delta.stride(1);
        row_delta[v] = select(present, delta[at], 0.0f32);
        spans_at[v] = (row0 + g + 8 * v) * 2 * max_spans;
    }

    let first_run = tile_offsets[q_tile_index] as usize;
    let end_run = tile_offsets[q_tile_index + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let mut dq_acc = zero_accumulators(head_dim / 8);
    let q_at = plane * q_size;
    let do_at = plane * do_size;

    stage_rows::<F>(
        q,
        &mut q_tile,
        q_at,
        first_row,
        head,
        q_tokens,
        lane,
        16usize,
        head_dim,
        32usize,
        copy,
    );
    stage_rows::<F>(
        dout,
        &mut do_tile,
        do_at,
        first_row,
        head,
        q_tokens,
        lane,
        16usize,
        value_dim,
        32usize,
        copy,
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
    if copy {
        let rows_ready = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        rows_ready.commit_copy_async();
        if total > 0 {
            stage_kv::<F>(
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
        rows_ready.arrive_and_wait();
        let q_frags = load_rows_as_a::<F>(&q_tile, q_at, head_dim, tensor_cores);
        let do_frags = load_rows_as_a::<F>(&do_tile, do_at, value_dim, tensor_cores);
        for i in 0..total {
            let buffer = i % 2;
            let key_tile = cursor.tile;
            let full = cursor.full(tile_runs);
            if i + 1 < total {
                cursor.advance(tile_runs, first_run, end_run);
                let next = cursor.tile;
                stage_kv::<F>(
                    k,
                    v,
                    &mut k_tile,
                    &mut v_tile,
                    1 - buffer,
                    next,
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
            let base = buffer * block;
            let mut s = scores_in_registers::<F>(
                &q_frags,
                &k_tile,
                base,
                &mut scratch,
                scratch_at,
                head_dim,
                block,
                tensor_cores,
            );
            let mut dp = scores_in_registers::<F>(
                &do_frags,
                &v_tile,
                base,
                &mut scratch,
                scratch_at,
                value_dim,
                block,
                tensor_cores,
            );
            scale_scores(&mut s, scale, comptime!(block / 4), tensor_cores);
            if !full {
                let first_key = key_tile * block;
                mask_rows(
                    &mut s,
                    &row_spans,
                    &spans_at,
                    first_key,
                    block,
                    1usize,
                    max_spans,
                    tensor_cores,
                );
            }
            probabilities_and_ds(
                &mut s,
                &mut dp,
                &row_lse,
                &row_delta,
                &unused,
                &unused,
                0usize,
                block,
                true,
                tensor_cores,
            );
            add_product::<F>(
                &dp,
                &k_tile,
                base,
                &mut dq_acc,
                &mut scratch,
                scratch_at,
                head_dim,
                block,
                1usize,
                tensor_cores,
            );
            sync_cube();
        }
    } else {
        sync_cube();
        let q_frags = load_rows_as_a::<F>(&q_tile, q_at, head_dim, tensor_cores);
        let do_frags = load_rows_as_a::<F>(&do_tile, do_at, value_dim, tensor_cores);
        for _ in 0..total {
            let key_tile = cursor.tile;
            let full = cursor.full(tile_runs);
            stage_kv::<F>(
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
            let mut s = scores_in_registers::<F>(
                &q_frags,
                &k_tile,
                0usize,
                &mut scratch,
                scratch_at,
                head_dim,
                block,
                tensor_cores,
            );
            let mut dp = scores_in_registers::<F>(
                &do_frags,
                &v_tile,
                0usize,
                &mut scratch,
                scratch_at,
                value_dim,
                block,
                tensor_cores,
            );
            scale_scores(&mut s, scale, comptime!(block / 4), tensor_cores);
            if !full {
                let first_key = key_tile * block;
                mask_rows(
                    &mut s,
                    &row_spans,
                    &spans_at,
                    first_key,
                    block,
                    1usize,
                    max_spans,
                    tensor_cores,
                );
            }
            probabilities_and_ds(
                &mut s,
                &mut dp,
                &row_lse,
                &row_delta,
                &unused,
                &unused,
                0usize,
                block,
                true,
                tensor_cores,
            );
            add_product::<F>(
                &dp,
                &k_tile,
                0usize,
                &mut dq_acc,
                &mut scratch,
                scratch_at,
                head_dim,
                block,
                1usize,
                tensor_cores,
            );
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    write_rows::<F>(&dq_acc, dq, first_row, head, scale, head_dim, tensor_cores);
}

/// Stages key tile `key_tile` (`block` keys of `kv_head`) of K and V into buffer `buffer`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_kv<F: Float>(
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

/// Stages query tile `query_tile` of head `head` into buffer `buffer`: Q and dO rows (copies),
/// and their lse, delta and spans (plain stores, visible after the buffer's barrier or sync).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_tile<F: Float>(
    q: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tiles: &mut QueryTiles<F>,
    buffer: usize,
    query_tile: usize,
    head: usize,
    #[comptime] config: FlashConfig,
) {
    let block = comptime!(config.block);
    let units = comptime!(config.units());
    let max_spans = comptime!(config.max_spans);
    let unit = UNIT_POS as usize;
    let first = query_tile * block;
    let q_tokens = q.shape(0);
    let q_at = buffer * comptime!(config.block * padded(config.head_dim));
    let do_at = buffer * comptime!(config.block * padded(config.value_dim));
    let (hd, vd, copy) = comptime!((config.head_dim, config.value_dim, config.async_copy));
    stage_rows::<F>(
        q,
        &mut tiles.q,
        q_at,
        first,
        head,
        q_tokens,
        unit,
        block,
        hd,
        units,
        copy,
    );
    stage_rows::<F>(
        dout,
        &mut tiles.dout,
        do_at,
        first,
        head,
        q_tokens,
        unit,
        block,
        vd,
        units,
        copy,
    );
    let at = buffer * block;
    stage_row_values(lse, &mut tiles.lse, at, head, first, q_tokens, block, units);
    stage_row_values(
        delta,
        &mut tiles.delta,
        at,
        head,
        first,
        q_tokens,
        block,
        units,
    );
    let spans_at = at * 2 * max_spans;
    stage_spans(
        spans,
        &mut tiles.spans,
        spans_at,
        first,
        q_tokens,
        block,
        max_spans,
        units,
    );
}

/// The dk/dv kernel's staged query tiles (`buffers` of each).
#[derive(CubeType)]
struct QueryTiles<F: Float> {
    q: SharedMemory<F>,
    dout: SharedMemory<F>,
    lse: SharedMemory<f32>,
    delta: SharedMemory<f32>,
    spans: SharedMemory<u32>,
}

/// One query tile of the dk/dv kernel for the plane's 16 keys.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_tile<F: Float>(
    kv: &QueryTiles<F>,
    k_tile: &SharedMemory<F>,
    v_tile: &SharedMemory<F>,
    buffer: usize,
    first_key: usize,
    full: bool,
    dk_acc: &mut Array<Pair<f32>>,
    dv_acc: &mut Array<Pair<f32>>,
    scale: f32,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] config: FlashConfig,
) {
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let block = comptime!(config.block);
    let tc = comptime!(config.tensor_cores);
    let plane = UNIT_POS_Y as usize;
    let base = buffer * block;
    // The plane's keys and values, reloaded per tile (registers go to the accumulators).
    let k_frags = load_rows_as_a::<F>(
        k_tile,
        plane * comptime!(16 * padded(head_dim)),
        head_dim,
        tc,
    );
    let mut s = scores_in_registers::<F>(
        &k_frags, &kv.q, base, scratch, scratch_at, head_dim, block, tc,
    );
    let v_frags = load_rows_as_a::<F>(
        v_tile,
        plane * comptime!(16 * padded(value_dim)),
        value_dim,
        tc,
    );
    let mut dp = scores_in_registers::<F>(
        &v_frags, &kv.dout, base, scratch, scratch_at, value_dim, block, tc,
    );
    scale_scores(&mut s, scale, comptime!(block / 4), tc);
    if !full {
        let spans_at = base * 2 * config.max_spans;
        mask_columns(
            &mut s,
            &kv.spans,
            spans_at,
            first_key,
            block,
            config.max_spans,
            tc,
        );
    }
    let none = Array::<f32>::new(2usize);
    probabilities_and_ds(
        &mut s, &mut dp, &none, &none, &kv.lse, &kv.delta, base, block, false, tc,
    );
    add_product::<F>(
        &s, &kv.dout, base, dv_acc, scratch, scratch_at, value_dim, block, 1usize, tc,
    );
    add_product::<F>(
        &dp, &kv.q, base, dk_acc, scratch, scratch_at, head_dim, block, 1usize, tc,
    );
}

/// Backward, key side: `dk [Tk, K, D]`, `dv [Tk, K, Dv]`. Cube `(x, y)` = (keys
/// `16·planes·x..`, kv head `y`); tile lists per key tile (the transpose of query tiles of
/// `block` queries against key tiles of `16 · planes` keys), walked once per query head of the
/// group.
#[cube(launch_unchecked, fast_math = fast_exp())]
#[allow(clippy::too_many_arguments)]
pub fn flash_dkdv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    #[comptime] config: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let units = comptime!(config.units());
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let block = comptime!(config.block);
    let max_spans = comptime!(config.max_spans);
    let copy = comptime!(config.async_copy);
    let buffers = comptime!(config.buffers());
    let plane = UNIT_POS_Y as usize;
    let unit = UNIT_POS as usize;
    let key_tile = CUBE_POS_X as usize;
    let kv_head = CUBE_POS_Y as usize;
    let group = q.shape(1) / k.shape(1);
    let kv_tokens = k.shape(0);
    let cube_keys = comptime!(16 * config.planes);
    let first_key = key_tile * cube_keys;
    let plane_key = first_key + plane * 16;

    let mut k_tile =
        SharedMemory::<F>::new_aligned(comptime!(cube_keys * padded(head_dim)), 16usize);
    let mut v_tile =
        SharedMemory::<F>::new_aligned(comptime!(cube_keys * padded(value_dim)), 16usize);
    let mut tiles = QueryTiles::<F> {
        q: SharedMemory::<F>::new_aligned(comptime!(buffers * block * padded(head_dim)), 16usize),
        dout: SharedMemory::<F>::new_aligned(
            comptime!(buffers * block * padded(value_dim)),
            16usize,
        ),
        lse: SharedMemory::<f32>::new(buffers * block),
        delta: SharedMemory::<f32>::new(buffers * block),
        spans: SharedMemory::<u32>::new(buffers * block * 2 * max_spans),
    };
    let mut scratch = SharedMemory::<F>::new(comptime!(if config.tensor_cores {
        1
    } else {
        config.planes * PRODUCT_SCRATCH
    }));
    let scratch_at = plane * PRODUCT_SCRATCH;

    let first_run = tile_offsets[key_tile] as usize;
    let end_run = tile_offsets[key_tile + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run) * group;
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let mut dk_acc = zero_accumulators(head_dim / 8);
    let mut dv_acc = zero_accumulators(value_dim / 8);

    if total > 0 {
        let keys = cube_keys;
        let kt = kv_tokens;
        stage_rows::<F>(
            k,
            &mut k_tile,
            0usize,
            first_key,
            kv_head,
            kt,
            unit,
            keys,
            head_dim,
            units,
            copy,
        );
        stage_rows::<F>(
            v,
            &mut v_tile,
            0usize,
            first_key,
            kv_head,
            kt,
            unit,
            keys,
            value_dim,
            units,
            copy,
        );
    }
    if copy {
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        // The key rows travel with the first query tile.
        if total > 0 {
            let head = kv_head * group;
            stage_query_tile::<F>(
                q,
                dout,
                lse,
                delta,
                spans,
                &mut tiles,
                0usize,
                cursor.tile,
                head,
                config,
            );
            ready_0.commit_copy_async();
        }
        for i in 0..total {
            let buffer = i % 2;
            let full = cursor.full(tile_runs);
            if i + 1 < total {
                cursor.advance(tile_runs, first_run, end_run);
                let head = kv_head * group + cursor.round;
                let next = cursor.tile;
                stage_query_tile::<F>(
                    q,
                    dout,
                    lse,
                    delta,
                    spans,
                    &mut tiles,
                    1 - buffer,
                    next,
                    head,
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
            dkdv_tile::<F>(
                &tiles,
                &k_tile,
                &v_tile,
                buffer,
                plane_key,
                full,
                &mut dk_acc,
                &mut dv_acc,
                scale,
                &mut scratch,
                scratch_at,
                config,
            );
            sync_cube();
        }
    } else {
        for _ in 0..total {
            let head = kv_head * group + cursor.round;
            let full = cursor.full(tile_runs);
            stage_query_tile::<F>(
                q,
                dout,
                lse,
                delta,
                spans,
                &mut tiles,
                0usize,
                cursor.tile,
                head,
                config,
            );
            sync_cube();
            dkdv_tile::<F>(
                &tiles,
                &k_tile,
                &v_tile,
                0usize,
                plane_key,
                full,
                &mut dk_acc,
                &mut dv_acc,
                scale,
                &mut scratch,
                scratch_at,
                config,
            );
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    let tc = comptime!(config.tensor_cores);
    write_rows::<F>(&dk_acc, dk, plane_key, kv_head, scale, head_dim, tc);
    write_rows::<F>(&dv_acc, dv, plane_key, kv_head, 1.0, value_dim, tc);
}
