//! The dq kernel: the forward's cubes and key tiles; per key tile each plane recomputes
//! `S = Q·Kᵀ` and `dP = dO·Vᵀ`, forms `P = exp(scale·S − lse)` and `dS = P ∘ (dP − delta)` in
//! registers and adds `dS·K`; the end writes `scale · dQ`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::backward::{probabilities_and_ds, write_rows};
use super::fragment::*;
use super::stage::*;
use super::tile::{add_product, mask_rows, scale_scores, scores_in_registers};
use super::{fast_exp, FlashConfig};

/// One key tile of the dq kernel for the plane's 16 rows: `dP = dO·Vᵀ`, `S = Q·Kᵀ`, mask
/// (partial tiles), `P` and `dS` in registers, `dQ += dS·K`. Staged in turn
/// ([`FlashConfig::in_turn`]): V first (for `dP`), then K into the same buffer.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    rows: &mut QueryRows<F>,
    tiles: &mut KeyTiles<F>,
    tile: &Listed,
    scale: f32,
    scratch: &mut Scratch<F>,
    #[comptime] config: FlashConfig,
) {
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let (block, tc, in_turn) = comptime!((config.block, config.tensor_cores, config.in_turn));
    let base = tile.buffer * block;
    let mut dp = if in_turn {
        stage_tile::<F>(v, &mut tiles.k, tile, value_dim, config);
        sync_cube();
        let dp = scores_in_registers::<F>(&rows.dout, &tiles.k, 0usize, scratch, value_dim, config);
        sync_cube();
        stage_tile::<F>(k, &mut tiles.k, tile, head_dim, config);
        sync_cube();
        dp
    } else {
        scores_in_registers::<F>(&rows.dout, &tiles.v, base, scratch, value_dim, config)
    };
    let mut s = scores_in_registers::<F>(&rows.q, &tiles.k, base, scratch, head_dim, config);
    scale_scores(&mut s, scale, comptime!(block / 4), tc);
    if !tile.full {
        let first_key = tile.index * block;
        let spans_at = &rows.spans_at;
        let max_spans = comptime!(config.max_spans);
        mask_rows(
            &mut s,
            &tiles.spans,
            spans_at,
            first_key,
            block,
            1usize,
            max_spans,
            tc,
        );
    }
    let unused = SharedMemory::<f32>::new(1usize);
    probabilities_and_ds(
        &mut s,
        &mut dp,
        &rows.lse,
        &rows.delta,
        &unused,
        &unused,
        0usize,
        block,
        true,
        tc,
    );
    add_product::<F>(&dp, &tiles.k, base, &mut rows.dq, scratch, head_dim, config);
}

/// The plane's 16 query rows: their Q and dO fragments, the lse, delta and span offsets of the
/// lane's two rows, and the `dQ` accumulators.
#[derive(CubeType)]
struct QueryRows<F: Float> {
    q: Array<Pair<F>>,
    dout: Array<Pair<F>>,
    lse: Array<f32>,
    delta: Array<f32>,
    spans_at: Array<usize>,
    dq: Array<Pair<f32>>,
}

/// The dq kernel's staged key and value tiles (one or two buffers) and the cube's spans.
#[derive(CubeType)]
struct KeyTiles<F: Float> {
    k: SharedMemory<F>,
    v: SharedMemory<F>,
    spans: SharedMemory<u32>,
}

/// Backward, query side: `dq [Tq, H, D]`. The forward's cubes, tile lists and launch order.
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
    order: &Tensor<u32>,
    dq: &mut Tensor<F>,
    scale: f32,
    #[comptime] config: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let (units, max_spans) = comptime!((config.units(), config.max_spans));
    let tokens = comptime!(config.tokens_per_cube());
    let (_lane, g, _t) = lane_coords();
    let plane = UNIT_POS_Y as usize;
    let cube = query_cube::<F>(q, k, order, config);
    let head = cube.head;
    let kv_head = cube.kv_head;
    let row0 = cube.row0;
    let first_token = cube.first_token;
    let q_tokens = q.shape(0);
    let first_row = first_token + row0;

    let (q_size, do_size) = comptime!((16 * padded(head_dim), 16 * padded(value_dim)));
    // The plane's Q and dO rows are staged for the copies; plain loads read their fragments
    // from global memory once.
    let staged = comptime!(config.stages_own_rows());
    let mut q_tile = SharedMemory::<F>::new_aligned(
        comptime!(if staged { config.planes * q_size } else { 1 }),
        16usize,
    );
    let mut do_tile = SharedMemory::<F>::new_aligned(
        comptime!(if staged { config.planes * do_size } else { 1 }),
        16usize,
    );
    // Staged in turn, K takes V's buffer.
    let (k_size, v_size) = comptime!(config.key_tile_sizes());
    let mut tiles = KeyTiles::<F> {
        k: SharedMemory::<F>::new_aligned(k_size, 16usize),
        v: SharedMemory::<F>::new_aligned(v_size, 16usize),
        spans: SharedMemory::<u32>::new(tokens * 2 * max_spans),
    };
    let mut scratch = Scratch::<F>::products(config);
    let mut rows = QueryRows::<F> {
        q: Array::<Pair<F>>::new(comptime!(head_dim / 4)),
        dout: Array::<Pair<F>>::new(comptime!(value_dim / 4)),
        lse: Array::<f32>::new(2usize),
        delta: Array::<f32>::new(2usize),
        spans_at: Array::<usize>::new(2usize),
        dq: zero_accumulators(head_dim / 8),
    };
    #[unroll]
    for v in 0..2usize {
        let token = first_row + g + 8 * v;
        let present = token < q_tokens;
        let at = head * lse.stride(0) + select(present, token, 0) * lse.stride(1);
        rows.lse[v] = select(present, lse[at], 0.0f32);
        let at = head * delta.stride(0) + select(present, token, 0) * delta.stride(1);
        rows.delta[v] = select(present, delta[at], 0.0f32);
        rows.spans_at[v] = (row0 + g + 8 * v) * 2 * max_spans;
    }

    let first_run = tile_offsets[cube.tile] as usize;
    let end_run = tile_offsets[cube.tile + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let q_at = plane * q_size;
    let do_at = plane * do_size;
    if staged {
        stage_plane_rows::<F>(q, &mut q_tile, q_at, first_row, head, head_dim, config);
        stage_plane_rows::<F>(
            dout,
            &mut do_tile,
            do_at,
            first_row,
            head,
            value_dim,
            config,
        );
    }
    stage_spans(spans, &mut tiles.spans, 0usize, first_token, tokens, config);
    if comptime!(config.async_copy) {
        let rows_ready = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        rows_ready.commit_copy_async();
        if total > 0 {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head);
            stage_key_tile::<F>(k, v, &mut tiles.k, &mut tiles.v, &tile, config);
            ready_0.commit_copy_async();
        }
        rows_ready.arrive_and_wait();
        let tc = comptime!(config.tensor_cores);
        load_rows_into::<F>(&q_tile, q_at, &mut rows.q, head_dim, tc);
        load_rows_into::<F>(&do_tile, do_at, &mut rows.dout, value_dim, tc);
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
            dq_tile::<F>(
                k,
                v,
                &mut rows,
                &mut tiles,
                &tile,
                scale,
                &mut scratch,
                config,
            );
            sync_cube();
        }
    } else {
        sync_cube();
        let tc = comptime!(config.tensor_cores);
        load_rows_global_into::<F>(q, first_row, head, &mut rows.q, head_dim, tc);
        load_rows_global_into::<F>(dout, first_row, head, &mut rows.dout, value_dim, tc);
        for _ in 0..total {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head);
            if comptime!(!config.in_turn) {
                stage_key_tile::<F>(k, v, &mut tiles.k, &mut tiles.v, &tile, config);
                sync_cube();
            }
            dq_tile::<F>(
                k,
                v,
                &mut rows,
                &mut tiles,
                &tile,
                scale,
                &mut scratch,
                config,
            );
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    let (exact, tc) = comptime!((config.exact_dims, config.tensor_cores));
    write_rows::<F>(&rows.dq, dq, first_row, head, scale, head_dim, exact, tc);
}
