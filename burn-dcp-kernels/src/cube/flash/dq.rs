//! The dq kernel: the forward's cubes and key tiles; per key tile each plane recomputes
//! `S = Q·Kᵀ` and `dP = dO·Vᵀ`, forms `P = exp(scale·S − lse)` and `dS = P ∘ (dP − delta)` in
//! registers and adds `dS·K`; the end writes `scale · dQ`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::backward::{probabilities_and_ds, scores_in_registers, write_rows};
use super::fragment::*;
use super::stage::*;
use super::tile::{add_product, mask_rows, scale_scores};
use super::{fast_exp, FlashConfig};

/// One key tile of the dq kernel for the plane's 16 rows: `dP = dO·Vᵀ`, then
/// [`dq_from_dp`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_tile<F: Float>(
    q_frags: &Array<Pair<F>>,
    do_frags: &Array<Pair<F>>,
    k_tile: &SharedMemory<F>,
    v_tile: &SharedMemory<F>,
    buffer: usize,
    key_tile: usize,
    full: bool,
    rows: &RowValues,
    row_spans: &SharedMemory<u32>,
    dq_acc: &mut Array<Pair<f32>>,
    scale: f32,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] config: FlashConfig,
) {
    let (value_dim, block, tc) = comptime!((config.value_dim, config.block, config.tensor_cores));
    let mut dp = scores_in_registers::<F>(
        do_frags,
        v_tile,
        buffer * block,
        scratch,
        scratch_at,
        value_dim,
        block,
        tc,
        config.shuffles,
    );
    dq_from_dp::<F>(
        q_frags, &mut dp, k_tile, buffer, key_tile, full, rows, row_spans, dq_acc, scale, scratch,
        scratch_at, config,
    );
}

/// The rest of one key tile of the dq kernel, given `dP`: `S` against the staged K tile, mask
/// (partial tiles), `P` and `dS` in registers, `dQ += dS·K`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_from_dp<F: Float>(
    q_frags: &Array<Pair<F>>,
    dp: &mut Array<Pair<f32>>,
    k_tile: &SharedMemory<F>,
    buffer: usize,
    key_tile: usize,
    full: bool,
    rows: &RowValues,
    row_spans: &SharedMemory<u32>,
    dq_acc: &mut Array<Pair<f32>>,
    scale: f32,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] config: FlashConfig,
) {
    let head_dim = comptime!(config.head_dim);
    let block = comptime!(config.block);
    let tc = comptime!(config.tensor_cores);
    let base = buffer * block;
    let mut s = scores_in_registers::<F>(
        q_frags,
        k_tile,
        base,
        scratch,
        scratch_at,
        head_dim,
        block,
        tc,
        config.shuffles,
    );
    scale_scores(&mut s, scale, comptime!(block / 4), tc);
    if !full {
        let first_key = key_tile * block;
        let spans_at = &rows.spans_at;
        mask_rows(
            &mut s,
            row_spans,
            spans_at,
            first_key,
            block,
            1usize,
            config.max_spans,
            tc,
        );
    }
    let unused = SharedMemory::<f32>::new(1usize);
    probabilities_and_ds(
        &mut s,
        dp,
        &rows.lse,
        &rows.delta,
        &unused,
        &unused,
        0usize,
        block,
        true,
        tc,
    );
    add_product::<F>(
        dp,
        k_tile,
        base,
        dq_acc,
        scratch,
        scratch_at,
        head_dim,
        block,
        1usize,
        tc,
        config.shuffles,
    );
}

/// The lse, delta and span offsets of the lane's two rows.
#[derive(CubeType)]
struct RowValues {
    lse: Array<f32>,
    delta: Array<f32>,
    spans_at: Array<usize>,
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
    let planes = comptime!(config.planes);
    let units = comptime!(config.units());
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
    let copy = comptime!(config.async_copy);
    let tokens = comptime!(config.tokens_per_cube());
    let per_head = comptime!(config.planes / config.heads_per_cube);
    let (lane, g, _t) = lane_coords();
    let plane = UNIT_POS_Y as usize;
    let slot = launch_slot();
    let groups = q.shape(1) / config.heads_per_cube;
    if slot >= order.len() * groups {
        terminate!();
    }
    let head = (slot % groups) * config.heads_per_cube + plane / per_head;
    let kv_head = head / (q.shape(1) / k.shape(1));
    let q_tokens = q.shape(0);
    let q_tile_index = order[slot / groups] as usize;
    let first_token = q_tile_index * tokens;
    let row0 = (plane % per_head) * 16;
    let first_row = first_token + row0;

    let q_size = comptime!(16 * padded(config.head_dim));
    let do_size = comptime!(16 * padded(config.value_dim));
    let k_size = comptime!(config.block * padded(config.head_dim));
    let v_size = comptime!(config.block * padded(config.value_dim));
    // The plane's Q and dO rows are staged for the copies; plain loads read their fragments
    // from global memory once.
    let staged = comptime!(config.stages_own_rows());
    let q_rows = comptime!(if staged { planes * q_size } else { 1 });
    let do_rows = comptime!(if staged { planes * do_size } else { 1 });
    let mut q_tile = SharedMemory::<F>::new_aligned(q_rows, 16usize);
    let mut do_tile = SharedMemory::<F>::new_aligned(do_rows, 16usize);
    // Staged in turn, K takes V's buffer.
    let (k_size, v_size) = comptime!(if config.in_turn {
        (k_size.max(v_size), 1)
    } else {
        (k_size, v_size)
    });
    let mut k_tile = SharedMemory::<F>::new_aligned(config.buffers() * k_size, 16usize);
    let mut v_tile = SharedMemory::<F>::new_aligned(config.buffers() * v_size, 16usize);
    let mut row_spans = SharedMemory::<u32>::new(tokens * 2 * max_spans);
    let mut scratch = SharedMemory::<F>::new(comptime!(if config.tensor_cores {
        1
    } else {
        config.planes * PRODUCT_SCRATCH
    }));
    let scratch_at = plane * PRODUCT_SCRATCH;

    let mut rows = RowValues {
        lse: Array::<f32>::new(2usize),
        delta: Array::<f32>::new(2usize),
        spans_at: Array::<usize>::new(2usize),
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

    let first_run = tile_offsets[q_tile_index] as usize;
    let end_run = tile_offsets[q_tile_index + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);
    let mut dq_acc = zero_accumulators(head_dim / 8);
    let q_at = plane * q_size;
    let do_at = plane * do_size;

    if staged {
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
    if copy {
        let rows_ready = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        rows_ready.commit_copy_async();
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
                stage_key_tile::<F>(
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
            dq_tile::<F>(
                &q_frags,
                &do_frags,
                &k_tile,
                &v_tile,
                buffer,
                key_tile,
                full,
                &rows,
                &row_spans,
                &mut dq_acc,
                scale,
                &mut scratch,
                scratch_at,
                config,
            );
            sync_cube();
        }
    } else {
        sync_cube();
        let q_frags = load_rows_global::<F>(q, first_row, head, head_dim, tensor_cores);
        let do_frags = load_rows_global::<F>(dout, first_row, head, value_dim, tensor_cores);
        for _ in 0..total {
            let key_tile = cursor.tile;
            let full = cursor.full(tile_runs);
            if comptime!(config.in_turn) {
                // V first (for dP), then K into the same buffer (for S and dQ).
                let (block, tc) = comptime!((config.block, config.tensor_cores));
                stage_tile::<F>(v, &mut k_tile, 0usize, key_tile, kv_head, value_dim, config);
                sync_cube();
                let mut dp = scores_in_registers::<F>(
                    &do_frags,
                    &k_tile,
                    0usize,
                    &mut scratch,
                    scratch_at,
                    value_dim,
                    block,
                    tc,
                    config.shuffles,
                );
                sync_cube();
                stage_tile::<F>(k, &mut k_tile, 0usize, key_tile, kv_head, head_dim, config);
                sync_cube();
                dq_from_dp::<F>(
                    &q_frags,
                    &mut dp,
                    &k_tile,
                    0usize,
                    key_tile,
                    full,
                    &rows,
                    &row_spans,
                    &mut dq_acc,
                    scale,
                    &mut scratch,
                    scratch_at,
                    config,
                );
            } else {
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
                dq_tile::<F>(
                    &q_frags,
                    &do_frags,
                    &k_tile,
                    &v_tile,
                    0usize,
                    key_tile,
                    full,
                    &rows,
                    &row_spans,
                    &mut dq_acc,
                    scale,
                    &mut scratch,
                    scratch_at,
                    config,
                );
            }
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    write_rows::<F>(
        &dq_acc,
        dq,
        first_row,
        head,
        scale,
        head_dim,
        config.exact_dims,
        tensor_cores,
    );
}
