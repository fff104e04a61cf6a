//! The `#[cube]` kernels. One unit owns one row (a query in the forward and dq kernels, a key in
//! the dk/dv kernel) and keeps its accumulators in registers (f32, whatever the input dtype). The
//! cube walks the other side tile by tile, visiting only the tiles listed in the launch tables
//! ([`crate::tiling`]) and, inside a tile, only the keys the query's spans allow. All units of a
//! cube read the same key (or query) row at the same time, so the reads are broadcasts served by
//! the cache; the kernels use no shared memory and no barriers (see the module docs of
//! [`super`] for why).
//!
//! Inputs are read through their strides, so burn's strided views (`swap_dims`, `narrow`) need
//! no copy. No infinity is ever written as a literal (WGSL forbids it): "no key yet" is the finite
//! sentinel [`NONE`], and the `-inf` of fully masked rows comes in as a runtime scalar.

// `!(lse < NONE_LIMIT)` is deliberate: it is true for a NaN lse, so NaN inputs reach the outputs.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

use cubecl::prelude::*;

/// The running maximum before any key: far below any real score, still finite.
const NONE: f32 = -3.0e38;
/// Scores and LSE values below this are "no key" (the sentinel or `-inf`).
const NONE_LIMIT: f32 = -1.0e38;

/// The `max_spans` spans of query `query` as registers (empty spans when `present` is false).
#[cube]
fn read_spans(
    spans: &Tensor<u32>,
    query: usize,
    present: bool,
    #[comptime] max_spans: usize,
) -> Array<u32> {
    let mut row = Array::<u32>::new(2 * max_spans);
    #[unroll]
    for slot in 0..2 * max_spans {
        let mut value = 0u32;
        if present {
            value = spans[query * 2 * max_spans + slot];
        }
        row[slot] = value;
    }
    row
}

/// Whether packed key `key` lies in one of the spans of [`read_spans`].
#[cube]
fn allowed(spans: &Array<u32>, key: usize, #[comptime] max_spans: usize) -> bool {
    let mut allowed = false;
    #[unroll]
    for slot in 0..max_spans {
        if key >= spans[2 * slot] as usize && key < spans[2 * slot + 1] as usize {
            allowed = true;
        }
    }
    allowed
}

/// Reads row `row` of head `head` of `[tokens, heads, dim]` into `values` as f32.
#[cube]
fn read_row<F: Float>(
    source: &Tensor<F>,
    row: usize,
    head: usize,
    values: &mut Array<f32>,
    #[comptime] dim: usize,
) {
    let base = row * source.stride(0) + head * source.stride(1);
    #[unroll]
    for d in 0..dim {
        values[d] = f32::cast_from(source[base + d * source.stride(2)]);
    }
}

/// `values · source[row, head, :]` in f32.
#[cube]
fn dot_row<F: Float>(
    values: &Array<f32>,
    source: &Tensor<F>,
    row: usize,
    head: usize,
    #[comptime] dim: usize,
) -> f32 {
    let base = row * source.stride(0) + head * source.stride(1);
    let mut total = f32::new(0.0);
    #[unroll]
    for d in 0..dim {
        total += values[d] * f32::cast_from(source[base + d * source.stride(2)]);
    }
    total
}

/// `acc += weight · source[row, head, :]`.
#[cube]
fn add_row<F: Float>(
    acc: &mut Array<f32>,
    weight: f32,
    source: &Tensor<F>,
    row: usize,
    head: usize,
    #[comptime] dim: usize,
) {
    let base = row * source.stride(0) + head * source.stride(1);
    #[unroll]
    for d in 0..dim {
        acc[d] += weight * f32::cast_from(source[base + d * source.stride(2)]);
    }
}

/// `target[row, head, :] = factor · values`, in the target's dtype.
#[cube]
fn write_row<F: Float>(
    target: &mut Tensor<F>,
    row: usize,
    head: usize,
    values: &Array<f32>,
    factor: f32,
    #[comptime] dim: usize,
) {
    let base = row * target.stride(0) + head * target.stride(1);
    #[unroll]
    for d in 0..dim {
        target[base + d * target.stride(2)] = F::cast_from(values[d] * factor);
    }
}

/// Zeroed f32 registers.
#[cube]
fn zeros(#[comptime] len: usize) -> Array<f32> {
    let mut values = Array::<f32>::new(len);
    #[unroll]
    for d in 0..len {
        values[d] = f32::new(0.0);
    }
    values
}

/// Forward: `out [Tq, H, Dv]` (input dtype) and `lse [H, Tq]` (f32).
///
/// Cube `(x, y)` = (query tile of `block_q` queries, head); unit = query. Key tiles of
/// `block_kv` keys come from `tile_offsets`/`tile_runs` (the query tile's runs of key tiles).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn forward_kernel<F: Float>(
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
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block_q: usize,
    #[comptime] block_kv: usize,
    #[comptime] max_spans: usize,
    #[define(F)] _dtype: StorageType,
) {
    let q_tile = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let query = q_tile * block_q + UNIT_POS_X as usize;
    let active = query < q.shape(0);
    let kv_head = head / (q.shape(1) / k.shape(1));

    let mut q_row = zeros(head_dim);
    if active {
        read_row::<F>(q, query, head, &mut q_row, head_dim);
    }
    let row_spans = read_spans(spans, query, active, max_spans);
    let mut acc = zeros(value_dim);
    let mut running_max = f32::new(NONE);
    let mut sum = f32::new(0.0);
    // Whether the query saw any key: a masked row is one without keys, never one whose sum
    // looks empty (a NaN score makes the sum NaN, and that NaN must reach out and lse).
    let mut any_key = false;

    let first_run = tile_offsets[q_tile] as usize;
    let end_run = tile_offsets[q_tile + 1] as usize;
    for run in first_run..end_run {
        let first_tile = tile_runs[2 * run] as usize;
        let end_tile = tile_runs[2 * run + 1] as usize;
        for kv_tile in first_tile..end_tile {
            let first_key = kv_tile * block_kv;
            if active {
                for jj in 0..block_kv {
                    let key = first_key + jj;
                    if allowed(&row_spans, key, max_spans) {
                        let score = dot_row::<F>(&q_row, k, key, kv_head, head_dim) * scale;
                        // Online softmax one key at a time: rescale only when the max grows.
                        if score > running_max {
                            let correction = (running_max - score).exp();
                            sum *= correction;
                            #[unroll]
                            for d in 0..value_dim {
                                acc[d] *= correction;
                            }
                            running_max = score;
                        }
                        let p = (score - running_max).exp();
                        sum += p;
                        any_key = true;
                        add_row::<F>(&mut acc, p, v, key, kv_head, value_dim);
                    }
                }
            }
        }
    }

    if active {
        let lse_at = head * lse.stride(0) + query * lse.stride(1);
        // A query without any key has `acc = 0`: a zero factor writes `out = 0`.
        let mut inverse = f32::new(0.0);
        if any_key {
            inverse = f32::new(1.0) / sum;
            lse[lse_at] = running_max + sum.ln();
        } else {
            lse[lse_at] = neg_inf;
        }
        write_row::<F>(out, query, head, &acc, inverse, value_dim);
    }
}

/// Backward preprocess: `delta [H, Tq] = rowsum(dout ∘ out)` in f32. One unit per (head, query).
#[cube(launch_unchecked)]
pub fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    dout: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let tokens = out.shape(0);
    let index = ABSOLUTE_POS;
    if index >= tokens * out.shape(1) {
        terminate!();
    }
    let head = index / tokens;
    let query = index % tokens;
    let out_base = query * out.stride(0) + head * out.stride(1);
    let dout_base = query * dout.stride(0) + head * dout.stride(1);
    let mut total = f32::new(0.0);
    #[unroll]
    for d in 0..value_dim {
        total += f32::cast_from(out[out_base + d * out.stride(2)])
            * f32::cast_from(dout[dout_base + d * dout.stride(2)]);
    }
    delta[head * delta.stride(0) + query * delta.stride(1)] = total;
}

/// Backward, query side: `dq [Tq, H, D]`. Same geometry and tile lists as the forward.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dq_kernel<F: Float>(
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
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block_q: usize,
    #[comptime] block_kv: usize,
    #[comptime] max_spans: usize,
    #[define(F)] _dtype: StorageType,
) {
    let q_tile = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let query = q_tile * block_q + UNIT_POS_X as usize;
    let in_range = query < q.shape(0);
    let kv_head = head / (q.shape(1) / k.shape(1));

    let mut q_row = zeros(head_dim);
    let mut dout_row = zeros(value_dim);
    let row_spans = read_spans(spans, query, in_range, max_spans);
    let mut row_lse = f32::new(NONE);
    let mut row_delta = f32::new(0.0);
    if in_range {
        read_row::<F>(q, query, head, &mut q_row, head_dim);
        read_row::<F>(dout, query, head, &mut dout_row, value_dim);
        row_lse = lse[head * lse.stride(0) + query * lse.stride(1)];
        row_delta = delta[head * delta.stride(0) + query * delta.stride(1)];
    }
    // A row without any key (lse −∞) has no gradient; a NaN lse (non-finite inputs) is not
    // below the limit, so its NaN reaches the gradients.
    let active = in_range && !(row_lse < NONE_LIMIT);
    let mut dq_acc = zeros(head_dim);

    let first_run = tile_offsets[q_tile] as usize;
    let end_run = tile_offsets[q_tile + 1] as usize;
    for run in first_run..end_run {
        let first_tile = tile_runs[2 * run] as usize;
        let end_tile = tile_runs[2 * run + 1] as usize;
        for kv_tile in first_tile..end_tile {
            let first_key = kv_tile * block_kv;
            if active {
                for jj in 0..block_kv {
                    let key = first_key + jj;
                    if allowed(&row_spans, key, max_spans) {
                        let score = dot_row::<F>(&q_row, k, key, kv_head, head_dim) * scale;
                        let p = (score - row_lse).exp();
                        let dp = dot_row::<F>(&dout_row, v, key, kv_head, value_dim);
                        let ds = p * (dp - row_delta);
                        add_row::<F>(&mut dq_acc, ds, k, key, kv_head, head_dim);
                    }
                }
            }
        }
    }

    if in_range {
        write_row::<F>(dq, query, head, &dq_acc, scale, head_dim);
    }
}

/// Backward, key side: `dk [Tk, K, D]`, `dv [Tk, K, Dv]`.
///
/// Cube `(x, y)` = (key tile of `block_kv` keys, kv head); unit = key. It loops over the query
/// heads of its group and the query tiles (of `block_q` queries) listed for its key tile, so the
/// grouped-query reduction happens in registers: no atomics, deterministic results.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dkdv_kernel<F: Float>(
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
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block_q: usize,
    #[comptime] block_kv: usize,
    #[comptime] max_spans: usize,
    #[define(F)] _dtype: StorageType,
) {
    let kv_tile = CUBE_POS_X as usize;
    let kv_head = CUBE_POS_Y as usize;
    let key = kv_tile * block_kv + UNIT_POS_X as usize;
    let active = key < k.shape(0);
    let q_tokens = q.shape(0);
    let group = q.shape(1) / k.shape(1);

    let mut k_row = zeros(head_dim);
    let mut v_row = zeros(value_dim);
    if active {
        read_row::<F>(k, key, kv_head, &mut k_row, head_dim);
        read_row::<F>(v, key, kv_head, &mut v_row, value_dim);
    }
    let mut dk_acc = zeros(head_dim);
    let mut dv_acc = zeros(value_dim);
    let first_run = tile_offsets[kv_tile] as usize;
    let end_run = tile_offsets[kv_tile + 1] as usize;
    for member in 0..group {
        let head = kv_head * group + member;
        for run in first_run..end_run {
            let first_tile = tile_runs[2 * run] as usize;
            let end_tile = tile_runs[2 * run + 1] as usize;
            for tile in first_tile..end_tile {
                let first_query = tile * block_q;
                if active {
                    for ii in 0..block_q {
                        let query = first_query + ii;
                        // Rows past the end have no spans in the table: read nothing for them.
                        if query < q_tokens {
                            let row_lse = lse[head * lse.stride(0) + query * lse.stride(1)];
                            let row_spans = read_spans(spans, query, true, max_spans);
                            if !(row_lse < NONE_LIMIT) && allowed(&row_spans, key, max_spans) {
                                let score = dot_row::<F>(&k_row, q, query, head, head_dim) * scale;
                                let p = (score - row_lse).exp();
                                let dout_base = query * dout.stride(0) + head * dout.stride(1);
                                let mut dp = f32::new(0.0);
                                #[unroll]
                                for d in 0..value_dim {
                                    let g = f32::cast_from(dout[dout_base + d * dout.stride(2)]);
                                    dv_acc[d] += p * g;
                                    dp += g * v_row[d];
                                }
                                let row_delta =
                                    delta[head * delta.stride(0) + query * delta.stride(1)];
                                add_row::<F>(
                                    &mut dk_acc,
                                    p * (dp - row_delta),
                                    q,
                                    query,
                                    head,
                                    head_dim,
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    if active {
        write_row::<F>(dk, key, kv_head, &dk_acc, scale, head_dim);
        write_row::<F>(dv, key, kv_head, &dv_acc, f32::new(1.0), value_dim);
    }
}

/// The merge weights of two partial results: `(w_a, w_b, lse)` with `w_a + w_b = 1`, or zeros
/// and the (−∞) input when neither part saw a key.
#[cube]
fn merge_weights(lse_a: f32, lse_b: f32) -> (f32, f32, f32) {
    let high = max(lse_a, lse_b);
    let mut weight_a = f32::new(0.0);
    let mut weight_b = f32::new(0.0);
    let mut merged = high;
    // A NaN part poisons the merge (NaN out and lse) instead of being weighted away.
    let poisoned = lse_a.is_nan() || lse_b.is_nan();
    if poisoned {
        merged = lse_a + lse_b;
        weight_a = merged;
        weight_b = merged;
    } else if high > NONE_LIMIT {
        if lse_a > NONE_LIMIT {
            weight_a = (lse_a - high).exp();
        }
        if lse_b > NONE_LIMIT {
            weight_b = (lse_b - high).exp();
        }
        let total = weight_a + weight_b;
        merged = high + total.ln();
        weight_a /= total;
        weight_b /= total;
    }
    (weight_a, weight_b, merged)
}

/// Merge into fresh outputs: `out`, `lse` ← merge of `(out_a, lse_a)` and `(out_b, lse_b)`.
/// One unit per (head, query).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn merge_kernel<F: Float>(
    out_a: &Tensor<F>,
    lse_a: &Tensor<f32>,
    out_b: &Tensor<F>,
    lse_b: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let tokens = out_a.shape(0);
    let index = ABSOLUTE_POS;
    if index >= tokens * out_a.shape(1) {
        terminate!();
    }
    let head = index / tokens;
    let query = index % tokens;
    let a = lse_a[head * lse_a.stride(0) + query * lse_a.stride(1)];
    let b = lse_b[head * lse_b.stride(0) + query * lse_b.stride(1)];
    let (weight_a, weight_b, merged) = merge_weights(a, b);
    let base_a = query * out_a.stride(0) + head * out_a.stride(1);
    let base_b = query * out_b.stride(0) + head * out_b.stride(1);
    let base = query * out.stride(0) + head * out.stride(1);
    #[unroll]
    for d in 0..value_dim {
        let value = weight_a * f32::cast_from(out_a[base_a + d * out_a.stride(2)])
            + weight_b * f32::cast_from(out_b[base_b + d * out_b.stride(2)]);
        out[base + d * out.stride(2)] = F::cast_from(value);
    }
    lse[head * lse.stride(0) + query * lse.stride(1)] = merged;
}

/// Merge in place: `(out, lse)` ← merge of `(out, lse)` and `(out_b, lse_b)`.
#[cube(launch_unchecked)]
pub fn merge_in_place_kernel<F: Float>(
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    out_b: &Tensor<F>,
    lse_b: &Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let tokens = out.shape(0);
    let index = ABSOLUTE_POS;
    if index >= tokens * out.shape(1) {
        terminate!();
    }
    let head = index / tokens;
    let query = index % tokens;
    let lse_at = head * lse.stride(0) + query * lse.stride(1);
    let a = lse[lse_at];
    let b = lse_b[head * lse_b.stride(0) + query * lse_b.stride(1)];
    let (weight_a, weight_b, merged) = merge_weights(a, b);
    let base = query * out.stride(0) + head * out.stride(1);
    let base_b = query * out_b.stride(0) + head * out_b.stride(1);
    #[unroll]
    for d in 0..value_dim {
        let at = base + d * out.stride(2);
        let value = weight_a * f32::cast_from(out[at])
            + weight_b * f32::cast_from(out_b[base_b + d * out_b.stride(2)]);
        out[at] = F::cast_from(value);
    }
    lse[lse_at] = merged;
}
