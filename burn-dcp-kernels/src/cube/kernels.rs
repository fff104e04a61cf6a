//! The `#[cube]` kernels: flash attention tiled like FlashAttention-2, on vectors.
//!
//! - **Rows per unit.** One unit owns `rows` rows (queries in the forward and dq kernels, keys in
//!   the dk/dv kernel), strided by the cube's unit count so neighbouring units own neighbouring
//!   rows. Its accumulators live in registers in f32, whatever the input dtype. Every value a
//!   unit loads from the other side (a key, value, query or gradient row) is used for all of its
//!   rows, so a unit issues `1/rows` of the loads of the one-row-per-unit form.
//! - **Staged tiles.** The cube walks the other side tile by tile, visiting only the tiles of the
//!   launch tables ([`crate::tiling`]). Each tile is loaded once per cube, cooperatively, into
//!   shared memory (and, for the key side, the per-query `lse`, `delta` and spans with it), then
//!   every unit reads it from there; `sync_cube` fences the tile before and after use.
//! - **Vectors.** Rows are read and written as vectors of `N` elements (`N = 4` when the last dim
//!   is contiguous and every stride, dim and offset allows it; else 2 or 1), and the dot products
//!   and axpys run on vectors.
//! - Inside a tile, only the (row, column) pairs the query's spans allow are accumulated: a
//!   masked key never contributes, not even as `0 · value` (a non-finite value must not reach a
//!   query that does not attend it).
//!
//! Inputs are read through their strides, so burn's strided views (`swap_dims`, `narrow`) need
//! no copy. No infinity is ever written as a literal (WGSL forbids it): "no key yet" is the finite
//! sentinel `NONE`, and the `-inf` of fully masked rows comes in as a runtime scalar. Every loop
//! over a head dim, a value dim, the rows of a unit or a staging pass is unrolled (see
//! below for why lavapipe needs it).
//!
//!
//! Why several rows per unit: on lavapipe (the CI device) every load from a storage buffer or
//! shared memory is a loop over the SIMD lanes with a branch per lane (Mesa 22.3's gallivm has no
//! uniform-address fast path), so a kernel that loads one key element per multiply-add is bound
//! by loads. A unit owning four rows issues a quarter of the loads per pair, and vector loads
//! share one lane loop between four elements; together with staging, this took the forward from
//! 0.43× to 3.3× burn's attention on the dense shape (benches/RESULTS.md). On GPUs the same
//! structure is the classic register tiling; shared memory serves the reuse across units.
//!
//! **Every loop over a head or value dim is unrolled** (and the row, span-slot and staging
//! loops). Besides the usual register benefits, this is needed for correctness on Mesa's
//! lavapipe (llvmpipe), which CI runs: gallivm caps the *total* number of loop iterations of one
//! shader invocation at 65 535 (`LP_MAX_TGSI_LOOP_ITERATIONS`, one limiter shared by every loop
//! of the function) and then silently leaves every loop after one iteration. With rolled `for d
//! in 0..head_dim` loops a query attending 512 keys at head dim 64 crossed it and returned
//! garbage. What remains rolled are the loops over tiles, tile runs and the keys (queries) of a
//! tile, so on lavapipe a query may attend about 60 000 keys (and a key be attended by that many
//! queries per GQA group); real GPUs have no such cap.
//!
//! The forward updates its online softmax one key at a time (rescaling only when the running
//! max grows) rather than per tile with a score array: the per-tile form took lavapipe's LLVM
//! minutes to compile at head dim 128. The whole kernel test suite (dims 3 to 136, f32 and f16,
//! both backends) runs in about 40 s with a cold Mesa shader cache, 10 s with a warm one.
//!

// `!(lse < NONE_LIMIT)` is deliberate: it is true for a NaN lse, so NaN inputs reach the outputs.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

use cubecl::prelude::*;

mod backward;

pub use backward::{dkdv_kernel, dq_kernel};

use super::elementwise::{NONE, NONE_LIMIT};

/// Index (in vectors of `N`) of element `col·N` of row `row`, head `head` of a
/// `[tokens, heads, dim]` tensor read as vectors. With `N > 1` the host guarantees a contiguous
/// last dim and strides that are multiples of `N`; with `N = 1` any strides work.
#[cube]
fn vector_at<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    row: usize,
    head: usize,
    col: usize,
) -> usize {
    (row * source.stride(0) + head * source.stride(1) + col * N::value() * source.stride(2))
        / N::value()
}

/// The `max_spans` spans of `query`, appended at slot `slot` of `into` (empty when `present` is
/// false, so that no key is allowed).
#[cube]
fn read_spans(
    spans: &Tensor<u32>,
    query: usize,
    present: bool,
    into: &mut Array<u32>,
    slot: usize,
    #[comptime] max_spans: usize,
) {
    #[unroll]
    for s in 0..2 * max_spans {
        let mut value = 0u32;
        if present {
            value = spans[query * 2 * max_spans + s];
        }
        into[slot * 2 * max_spans + s] = value;
    }
}

/// Whether packed key `key` lies in one of the spans stored at slot `slot` of `spans`.
#[cube]
fn allowed(spans: &Array<u32>, slot: usize, key: usize, #[comptime] max_spans: usize) -> bool {
    let mut allowed = false;
    #[unroll]
    for s in 0..max_spans {
        let at = slot * 2 * max_spans + 2 * s;
        if key >= spans[at] as usize && key < spans[at + 1] as usize {
            allowed = true;
        }
    }
    allowed
}

/// Zeroed f32 vectors.
#[cube]
fn zero_vectors<N: Size>(#[comptime] len: usize) -> Array<Vector<f32, N>> {
    let mut values = Array::<Vector<f32, N>>::new(len);
    #[unroll]
    for i in 0..len {
        values[i] = Vector::new(0.0f32);
    }
    values
}

/// Reads row `row` of head `head` into slot `slot` of `into` (f32 vectors; `vecs` vectors per
/// row). The caller clamps `row` into range.
#[cube]
fn load_row<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    row: usize,
    head: usize,
    into: &mut Array<Vector<f32, N>>,
    slot: usize,
    #[comptime] vecs: usize,
) {
    #[unroll]
    for i in 0..vecs {
        into[slot * vecs + i] = Vector::cast_from(source[vector_at(source, row, head, i)]);
    }
}

/// Writes slot `slot` of `values`, times `factor`, to row `row` of head `head`.
#[cube]
fn store_row<F: Float, N: Size>(
    target: &mut Tensor<Vector<F, N>>,
    row: usize,
    head: usize,
    values: &Array<Vector<f32, N>>,
    slot: usize,
    factor: f32,
    #[comptime] vecs: usize,
) {
    let base = (row * target.stride(0) + head * target.stride(1)) / N::value();
    #[unroll]
    for i in 0..vecs {
        target[base + i] = Vector::cast_from(values[slot * vecs + i] * Vector::new(factor));
    }
}

/// Stages rows `first_row..first_row + block` of head `head` (`vecs` vectors each) into `tile`,
/// all `units` units of the cube together; rows past `rows_total` are zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    first_row: usize,
    head: usize,
    rows_total: usize,
    #[comptime] block: usize,
    #[comptime] vecs: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS_X as usize;
    #[unroll]
    for pass in 0..(block * vecs).div_ceil(units) {
        let index = pass * units + unit;
        if index < block * vecs {
            let row = first_row + index / vecs;
            let mut value = Vector::new(F::new(0.0));
            if row < rows_total {
                value = source[vector_at(source, row, head, index % vecs)];
            }
            tile[index] = value;
        }
    }
}

/// Stages one tile of the other side: rows `first_row..first_row + block` of head `head` of
/// `first` (`first_vecs` vectors each) and of `second` (`second_vecs`), e.g. K and V.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_tile<F: Float, N: Size>(
    first: &Tensor<Vector<F, N>>,
    second: &Tensor<Vector<F, N>>,
    first_tile: &mut SharedMemory<Vector<F, N>>,
    second_tile: &mut SharedMemory<Vector<F, N>>,
    first_row: usize,
    head: usize,
    rows_total: usize,
    #[comptime] block: usize,
    #[comptime] first_vecs: usize,
    #[comptime] second_vecs: usize,
    #[comptime] units: usize,
) {
    stage_rows::<F, N>(
        first, first_tile, first_row, head, rows_total, block, first_vecs, units,
    );
    stage_rows::<F, N>(
        second,
        second_tile,
        first_row,
        head,
        rows_total,
        block,
        second_vecs,
        units,
    );
}

/// Row `at` of a staged tile, as f32 vectors, into `row`.
#[cube]
fn load_tile_row<F: Float, N: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    at: usize,
    row: &mut Array<Vector<f32, N>>,
    #[comptime] vecs: usize,
) {
    #[unroll]
    for i in 0..vecs {
        row[i] = Vector::<f32, N>::cast_from(tile[at * vecs + i]);
    }
}

/// Row `at` of a staged tile into `row` (as [`load_tile_row`]), and its dot product with each
/// of the unit's `rows` rows held in `regs`.
#[cube]
fn dot_tile_row<F: Float, N: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    at: usize,
    regs: &Array<Vector<f32, N>>,
    row: &mut Array<Vector<f32, N>>,
    #[comptime] rows: usize,
    #[comptime] vecs: usize,
) -> Array<f32> {
    load_tile_row::<F, N>(tile, at, row, vecs);
    let mut dots = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        dots[r] = 0.0;
    }
    #[unroll]
    for i in 0..vecs {
        #[unroll]
        for r in 0..rows {
            dots[r] += regs[r * vecs + i].dot(row[i]);
        }
    }
    dots
}

/// `acc[r] += weight[r] · row` for each of the unit's rows `r` with `take[r] == 1` (a row that
/// does not attend the pair gets nothing, not even `0 · row`).
#[cube]
fn add_weighted_row<N: Size>(
    acc: &mut Array<Vector<f32, N>>,
    row: &Array<Vector<f32, N>>,
    weight: &Array<f32>,
    take: &Array<u32>,
    #[comptime] rows: usize,
    #[comptime] vecs: usize,
) {
    #[unroll]
    for i in 0..vecs {
        #[unroll]
        for r in 0..rows {
            if take[r] == 1 {
                acc[r * vecs + i] += row[i] * Vector::new(weight[r]);
            }
        }
    }
}

/// Forward: `out [Tq, H, Dv]` (input dtype) and `lse [H, Tq]` (f32).
///
/// Cube `(x, y)` = (query tile of `units · rows` queries, head). Key tiles of `block_kv` keys
/// come from `tile_offsets`/`tile_runs` (the query tile's runs of key tiles).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn forward_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    spans: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    tile_runs: &Tensor<u32>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    neg_inf: f32,
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

    // The unit's queries: registers, spans; rows past the end read the last row and no spans.
    let mut q_rows = zero_vectors::<N>(rows * vq);
    let mut row_spans = Array::<u32>::new(rows * 2 * max_spans);
    #[unroll]
    for r in 0..rows {
        let query = first_query + r * units;
        let present = query < q_tokens;
        let row = select(present, query, q_tokens - 1);
        load_row::<F, N>(q, row, head, &mut q_rows, r, vq);
        read_spans(spans, row, present, &mut row_spans, r, max_spans);
    }
    let mut acc = zero_vectors::<N>(rows * vv);
    let mut running_max = Array::<f32>::new(rows);
    let mut sum = Array::<f32>::new(rows);
    // Whether the query saw any key: a masked row is one without keys, never one whose sum
    // looks empty (a NaN score makes the sum NaN, and that NaN must reach out and lse).
    let mut seen = Array::<u32>::new(rows);
    #[unroll]
    for r in 0..rows {
        running_max[r] = NONE;
        sum[r] = 0.0;
        seen[r] = 0;
    }
    let mut k_tile = SharedMemory::<Vector<F, N>>::new(block_kv * vq);
    let mut v_tile = SharedMemory::<Vector<F, N>>::new(block_kv * vv);
    let mut key_row = zero_vectors::<N>(vq);
    let mut value_row = zero_vectors::<N>(vv);
    let mut weight = Array::<f32>::new(rows);
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
                // Online softmax one key at a time: rescale only when the max grows.
                #[unroll]
                for r in 0..rows {
                    let score = scores[r] * scale;
                    let mut p = f32::new(0.0);
                    let ok = allowed(&row_spans, r, key, max_spans);
                    if ok {
                        if score > running_max[r] {
                            let correction = (running_max[r] - score).exp();
                            sum[r] *= correction;
                            #[unroll]
                            for i in 0..vv {
                                acc[r * vv + i] *= Vector::new(correction);
                            }
                            running_max[r] = score;
                        }
                        p = (score - running_max[r]).exp();
                        sum[r] += p;
                        seen[r] = 1;
                    }
                    weight[r] = p;
                    take[r] = select(ok, 1u32, 0u32);
                }
                load_tile_row::<F, N>(&v_tile, jj, &mut value_row, vv);
                add_weighted_row::<N>(&mut acc, &value_row, &weight, &take, rows, vv);
            }
            sync_cube();
        }
    }

    #[unroll]
    for r in 0..rows {
        let query = first_query + r * units;
        if query < q_tokens {
            let lse_at = head * lse.stride(0) + query * lse.stride(1);
            // A query without any key has `acc = 0`: a zero factor writes `out = 0`.
            let mut inverse = f32::new(0.0);
            if seen[r] == 1 {
                inverse = 1.0 / sum[r];
                lse[lse_at] = running_max[r] + sum[r].ln();
            } else {
                lse[lse_at] = neg_inf;
            }
            store_row::<F, N>(out, query, head, &acc, r, inverse, vv);
        }
    }
}
