//! The vector kernels' backward (after the delta prepass, `super::super::elementwise`): dq
//! (query side) and dk/dv (key side), without atomics.

// `!(lse < NONE_LIMIT)` is deliberate: it is true for a NaN lse, so NaN inputs reach the outputs.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

use cubecl::prelude::*;

use super::*;

/// Backward, query side: `dq [Tq, H, D]`. Same geometry and tile lists as the forward.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dq_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    dq: &mut Tensor<Vector<F, N>>,
    scale: f32,
    #[comptime] vq: usize,
    #[comptime] vv: usize,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] block_kv: usize,
    #[comptime] max_spans: usize,
    #[define(F)] _dtype: StorageType,
) {
    let q_tile = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let q_tokens = q.shape(0);
    let kv_tokens = k.shape(0);
    let kv_head = head / (q.shape(1) / k.shape(1));
    let first_query = q_tile * rows * units + unit;

    let mut q_rows = zero_vectors::<N>(rows * vq);
    let mut dout_rows = zero_vectors::<N>(rows * vv);
    let mut row_spans = Array::<u32>::new(rows * 2 * max_spans);
    let mut row_lse = Array::<f32>::new(rows);
    let mut row_delta = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        let query = first_query + r * units;
        let present = query < q_tokens;
        let row = select(present, query, q_tokens - 1);
        load_row::<F, N>(q, row, head, &mut q_rows, r, vq);
        load_row::<F, N>(dout, row, head, &mut dout_rows, r, vv);
        // A row without any key (lse −∞) has no gradient; a NaN lse (non-finite inputs) is not
        // below the limit, so its NaN reaches the gradients. Rows past the end have no spans.
        read_spans(spans, row, present, &mut row_spans, r, max_spans);
        row_lse[r] = lse[head * lse.stride(0) + row * lse.stride(1)];
        row_delta[r] = delta[head * delta.stride(0) + row * delta.stride(1)];
    }
    let mut dq_acc = zero_vectors::<N>(rows * vq);
    let mut k_tile = SharedMemory::<Vector<F, N>>::new(block_kv * vq);
    let mut v_tile = SharedMemory::<Vector<F, N>>::new(block_kv * vv);
    let mut key_row = zero_vectors::<N>(vq);
    let mut value_row = zero_vectors::<N>(vv);
    let mut ds = Array::<f32>::new(rows);
    let mut take = Array::<u32>::new(rows);

    let first_run = tile_offsets[q_tile] as usize;
    let end_run = tile_offsets[q_tile + 1] as usize;
    for run in first_run..end_run {
        let first_tile = tile_runs[2 * run] as usize;
        let end_tile = tile_runs[2 * run + 1] as usize;
        for kv_tile in first_tile..end_tile {
            let first_key = kv_tile * block_kv;
            stage_tile::<F, N>(
                k,
                v,
                &mut k_tile,
                &mut v_tile,
                first_key,
                kv_head,
                kv_tokens,
                block_kv,
                vq,
                vv,
                units,
            );
            sync_cube();
            for jj in 0..block_kv {
                let key = first_key + jj;
                let scores = dot_tile_row::<F, N>(&k_tile, jj, &q_rows, &mut key_row, rows, vq);
                let dp = dot_tile_row::<F, N>(&v_tile, jj, &dout_rows, &mut value_row, rows, vv);
                #[unroll]
                for r in 0..rows {
                    let ok = !(row_lse[r] < NONE_LIMIT) && allowed(&row_spans, r, key, max_spans);
                    let p = (scores[r] * scale - row_lse[r]).exp();
                    ds[r] = p * (dp[r] - row_delta[r]);
                    take[r] = select(ok, 1u32, 0u32);
                }
                add_weighted_row::<N>(&mut dq_acc, &key_row, &ds, &take, rows, vq);
            }
            sync_cube();
        }
    }

    #[unroll]
    for r in 0..rows {
        let query = first_query + r * units;
        if query < q_tokens {
            store_row::<F, N>(dq, query, head, &dq_acc, r, scale, vq);
        }
    }
}

/// Backward, key side: `dk [Tk, K, D]`, `dv [Tk, K, Dv]`.
///
/// Cube `(x, y)` = (key tile of `units · rows` keys, kv head); a unit owns `rows` keys. It loops
/// over the query heads of its group and the query tiles (of `block_q` queries) listed for its
/// key tile, staging each query tile (rows of `q` and `dout`, `lse`, `delta`, spans) in shared
/// memory, so the grouped-query reduction happens in registers: no atomics, deterministic.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dkdv_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    scale: f32,
    #[comptime] vq: usize,
    #[comptime] vv: usize,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] block_q: usize,
    #[comptime] max_spans: usize,
    #[define(F)] _dtype: StorageType,
) {
    let kv_tile = CUBE_POS_X as usize;
    let kv_head = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let q_tokens = q.shape(0);
    let kv_tokens = k.shape(0);
    let group = q.shape(1) / k.shape(1);
    let first_key = kv_tile * rows * units + unit;

    let mut k_rows = zero_vectors::<N>(rows * vq);
    let mut v_rows = zero_vectors::<N>(rows * vv);
    #[unroll]
    for r in 0..rows {
        let key = first_key + r * units;
        let row = select(key < kv_tokens, key, kv_tokens - 1);
        load_row::<F, N>(k, row, kv_head, &mut k_rows, r, vq);
        load_row::<F, N>(v, row, kv_head, &mut v_rows, r, vv);
    }
    let mut dk_acc = zero_vectors::<N>(rows * vq);
    let mut dv_acc = zero_vectors::<N>(rows * vv);
    let mut q_tile = SharedMemory::<Vector<F, N>>::new(block_q * vq);
    let mut dout_tile = SharedMemory::<Vector<F, N>>::new(block_q * vv);
    let mut lse_tile = SharedMemory::<f32>::new(block_q);
    let mut delta_tile = SharedMemory::<f32>::new(block_q);
    let mut spans_tile = SharedMemory::<u32>::new(block_q * 2 * max_spans);
    let mut query_spans = Array::<u32>::new(2 * max_spans);
    let mut query_row = zero_vectors::<N>(vq);
    let mut dout_row = zero_vectors::<N>(vv);
    let mut weight = Array::<f32>::new(rows);
    let mut ds = Array::<f32>::new(rows);
    let mut take = Array::<u32>::new(rows);

    let first_run = tile_offsets[kv_tile] as usize;
    let end_run = tile_offsets[kv_tile + 1] as usize;
    for member in 0..group {
        let head = kv_head * group + member;
        for run in first_run..end_run {
            let first_tile = tile_runs[2 * run] as usize;
            let end_tile = tile_runs[2 * run + 1] as usize;
            for tile in first_tile..end_tile {
                let first_query = tile * block_q;
                stage_tile::<F, N>(
                    q,
                    dout,
                    &mut q_tile,
                    &mut dout_tile,
                    first_query,
                    head,
                    q_tokens,
                    block_q,
                    vq,
                    vv,
                    units,
                );
                // Per query: lse (the sentinel past the end: no gradient), delta, spans.
                #[unroll]
                for pass in 0..(block_q * (2 + 2 * max_spans)).div_ceil(units) {
                    let index = pass * units + unit;
                    if index < block_q {
                        let query = first_query + index;
                        let mut value = f32::new(NONE);
                        if query < q_tokens {
                            value = lse[head * lse.stride(0) + query * lse.stride(1)];
                        }
                        lse_tile[index] = value;
                    } else if index < 2 * block_q {
                        let query = first_query + index - block_q;
                        let mut value = f32::new(0.0);
                        if query < q_tokens {
                            value = delta[head * delta.stride(0) + query * delta.stride(1)];
                        }
                        delta_tile[index - block_q] = value;
                    } else if index < block_q * (2 + 2 * max_spans) {
                        let slot = index - 2 * block_q;
                        let query = first_query + slot / (2 * max_spans);
                        let mut value = 0u32;
                        if query < q_tokens {
                            value = spans[first_query * 2 * max_spans + slot];
                        }
                        spans_tile[slot] = value;
                    }
                }
                sync_cube();
                for ii in 0..block_q {
                    let query = first_query + ii;
                    let row_lse = lse_tile[ii];
                    let row_delta = delta_tile[ii];
                    #[unroll]
                    for s in 0..2 * max_spans {
                        query_spans[s] = spans_tile[ii * 2 * max_spans + s];
                    }
                    let scores =
                        dot_tile_row::<F, N>(&q_tile, ii, &k_rows, &mut query_row, rows, vq);
                    let dp = dot_tile_row::<F, N>(&dout_tile, ii, &v_rows, &mut dout_row, rows, vv);
                    let live = !(row_lse < NONE_LIMIT) && query < q_tokens;
                    #[unroll]
                    for r in 0..rows {
                        let key = first_key + r * units;
                        let ok = live && allowed(&query_spans, 0, key, max_spans);
                        let p = (scores[r] * scale - row_lse).exp();
                        weight[r] = p;
                        ds[r] = p * (dp[r] - row_delta);
                        take[r] = select(ok, 1u32, 0u32);
                    }
                    add_weighted_row::<N>(&mut dv_acc, &dout_row, &weight, &take, rows, vv);
                    add_weighted_row::<N>(&mut dk_acc, &query_row, &ds, &take, rows, vq);
                }
                sync_cube();
            }
        }
    }

    #[unroll]
    for r in 0..rows {
        let key = first_key + r * units;
        if key < kv_tokens {
            store_row::<F, N>(dk, key, kv_head, &dk_acc, r, scale, vq);
            store_row::<F, N>(dv, key, kv_head, &dv_acc, r, 1.0, vv);
        }
    }
}
