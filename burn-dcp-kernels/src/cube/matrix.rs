//! The forward on 16 × 16 matrix tiles: tensor cores (`cmma`) where the device has them.
//!
//! Layout of one cube (FlashAttention-2's, with one plane per 16 queries):
//!
//! - The cube owns `16 · planes` queries of one head; plane `p` owns queries `16p..16p + 16`.
//!   Its Q rows are staged once in shared memory, zero-padded to a multiple of 16 columns.
//! - Per listed key tile (16 keys, from the same launch tables as the vector kernels) the cube
//!   stages K and V (zero-padded), then each plane computes its 16 × 16 score tile
//!   `S = Q · Kᵀ` on matrix tiles (one 16 × 16 × 16 product per 16 head-dim columns, f32
//!   accumulator), writes it to shared memory, runs the online softmax on it (one unit per
//!   query row: masks from the spans, running max and sum in f32, `P` stored in the input
//!   dtype as FlashAttention does for its second product), rescales its output rows, and
//!   accumulates `O += P · V` on matrix tiles (`O` is an f32 accumulator in shared memory).
//! - The end divides by the sum and writes `out` and the f32 LSE, as the vector kernel does.
//!
//! Both products go through [`scores`] and [`add_probabilities_times_values`], which have two
//! bodies chosen at compile time: `cmma` fragments (`tensor_cores = true`), or the same products
//! computed by the plane's units element by element from the same shared-memory operands, in the
//! same layouts. The second body runs everywhere (lavapipe in CI), so the staging, padding,
//! masks, online softmax and write-back of this kernel are tested without a GPU; what only a GPU
//! tests is the fragment load/execute/store of the first body.
//!
//! Semantics differ from the vector kernels in one place: a masked key inside a listed tile is
//! multiplied by a zero probability instead of being skipped, so a non-finite value (`inf`,
//! `NaN`) in V at a masked key reaches the queries of the same cube tile as `NaN` (`0 · inf`).
//! Finite inputs give the same results up to rounding; fully masked rows still give `out = 0`
//! and `lse = -inf`, and a NaN score still propagates to its query's `out` and `lse`.

use cubecl::prelude::*;

use super::kernels::{allowed_in, NONE};

/// Rows, columns and depth of one matrix tile product.
pub const TILE: usize = 16;
/// Alignment in bytes of the shared-memory tiles (256 bits, `wmma::load_matrix_sync`'s rule).
const ALIGN: usize = 32;

/// `S [16 × 16] = Q [16 × dim] · K [16 × dim]ᵀ` for the plane's rows: `q_tile` holds the
/// plane's 16 query rows at `q_at` (row-major, `dim` columns), `k_tile` the 16 keys (row-major,
/// so Kᵀ is column-major), `s_tile` receives S at `s_at` (row-major, 16 columns).
/// `dim` is a multiple of 16 (zero-padded).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores<F: Float>(
    q_tile: &SharedMemory<F>,
    q_at: usize,
    k_tile: &SharedMemory<F>,
    s_tile: &mut SharedMemory<f32>,
    s_at: usize,
    #[comptime] dim: usize,
    #[comptime] plane_dim: usize,
    #[comptime] tensor_cores: bool,
) {
    if tensor_cores {
        let stride = comptime!(dim as u32);
        let a = unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::A,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::RowMajor,
            )
        };
        let b = unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::B,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::ColMajor,
            )
        };
        let c = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            TILE,
            TILE,
            TILE,
            cmma::MatrixLayout::Undefined,
            0.0,
        );
        for chunk in 0..dim / TILE {
            let q_from = q_at + chunk * TILE;
            let k_from = chunk * TILE;
            cmma::load(
                &a,
                &q_tile.slice(q_from, q_from + (TILE - 1) * dim + TILE),
                stride,
            );
            cmma::load(
                &b,
                &k_tile.slice(k_from, k_from + (TILE - 1) * dim + TILE),
                stride,
            );
            cmma::execute::<F, F, f32, f32>(&a, &b, &c, &c);
        }
        cmma::store(
            &mut s_tile.slice_mut(s_at, s_at + TILE * TILE),
            &c,
            comptime!(TILE as u32),
            cmma::MatrixLayout::RowMajor,
        );
    } else {
        let lane = UNIT_POS_X as usize;
        let per_lane = comptime!(TILE * TILE / plane_dim);
        let mut acc = Array::<f32>::new(per_lane);
        #[unroll]
        for i in 0..per_lane {
            acc[i] = 0.0;
        }
        // The lane's outputs share one column (`plane_dim` is a multiple of 16): its key row
        // is loaded once per chunk.
        let col = lane % TILE;
        let mut key = Array::<f32>::new(TILE);
        for chunk in 0..dim / TILE {
            #[unroll]
            for d in 0..TILE {
                key[d] = f32::cast_from(k_tile[col * dim + chunk * TILE + d]);
            }
            #[unroll]
            for i in 0..per_lane {
                let row = (lane + i * plane_dim) / TILE;
                #[unroll]
                for d in 0..TILE {
                    acc[i] += f32::cast_from(q_tile[q_at + row * dim + chunk * TILE + d]) * key[d];
                }
            }
        }
        #[unroll]
        for i in 0..per_lane {
            s_tile[s_at + lane + i * plane_dim] = acc[i];
        }
    }
}

/// `O [16 × dim] += P [16 × 16] · V [16 × dim]` for the plane's rows: `p_tile` holds P at
/// `p_at` (row-major, 16 columns), `v_tile` the 16 value rows (row-major, `dim` columns), and
/// `o_tile` the f32 accumulator at `o_at` (row-major, `dim` columns). `dim` is a multiple of 16.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_probabilities_times_values<F: Float>(
    p_tile: &SharedMemory<F>,
    p_at: usize,
    v_tile: &SharedMemory<F>,
    o_tile: &mut SharedMemory<f32>,
    o_at: usize,
    #[comptime] dim: usize,
    #[comptime] plane_dim: usize,
    #[comptime] tensor_cores: bool,
) {
    if tensor_cores {
        let stride = comptime!(dim as u32);
        let a = cmma::Matrix::<F>::from_slice(
            cmma::MatrixIdent::A,
            TILE,
            TILE,
            TILE,
            cmma::MatrixLayout::RowMajor,
            &p_tile.slice(p_at, p_at + TILE * TILE),
            comptime!(TILE as u32),
        );
        let b = unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::B,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::RowMajor,
            )
        };
        let c = unsafe {
            cmma::Matrix::<f32>::uninitialized(
                cmma::MatrixIdent::Accumulator,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::Undefined,
            )
        };
        for chunk in 0..dim / TILE {
            let o_from = o_at + chunk * TILE;
            let v_from = chunk * TILE;
            let o_to = o_from + (TILE - 1) * dim + TILE;
            cmma::load_with_layout(
                &c,
                &o_tile.slice(o_from, o_to),
                stride,
                cmma::MatrixLayout::RowMajor,
            );
            cmma::load(
                &b,
                &v_tile.slice(v_from, v_from + (TILE - 1) * dim + TILE),
                stride,
            );
            cmma::execute::<F, F, f32, f32>(&a, &b, &c, &c);
            cmma::store(
                &mut o_tile.slice_mut(o_from, o_to),
                &c,
                stride,
                cmma::MatrixLayout::RowMajor,
            );
        }
    } else {
        let lane = UNIT_POS_X as usize;
        let per_lane = comptime!(TILE * TILE / plane_dim);
        // As in [`scores`]: the lane's outputs share one column, whose 16 values are loaded once.
        let mut value = Array::<f32>::new(TILE);
        for chunk in 0..dim / TILE {
            let col = chunk * TILE + lane % TILE;
            #[unroll]
            for key in 0..TILE {
                value[key] = f32::cast_from(v_tile[key * dim + col]);
            }
            #[unroll]
            for i in 0..per_lane {
                let row = (lane + i * plane_dim) / TILE;
                let at = o_at + row * dim + col;
                let mut total = o_tile[at];
                #[unroll]
                for key in 0..TILE {
                    total += f32::cast_from(p_tile[p_at + row * TILE + key]) * value[key];
                }
                o_tile[at] = total;
            }
        }
    }
}

/// Stages rows `first_row..first_row + rows` of head `head` of `source` (`[tokens, heads, dim]`,
/// any strides) into `tile`, row-major with `padded` columns: columns past `dim` and rows past
/// `rows_total` are zeros. All `units` units of the cube take part.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_padded<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<F>,
    first_row: usize,
    head: usize,
    rows_total: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] padded: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    #[unroll]
    for pass in 0..(rows * padded).div_ceil(units) {
        let index = pass * units + unit;
        if index < rows * padded {
            let row = first_row + index / padded;
            let col = index % padded;
            let mut value = F::new(0.0);
            if row < rows_total && col < dim {
                value = source
                    [row * source.stride(0) + head * source.stride(1) + col * source.stride(2)];
            }
            tile[index] = value;
        }
    }
}

/// The online-softmax step of one query row (`row` of the cube) over one 16-key tile: reads its
/// scores from `s_tile`, writes its probabilities to `p_tile` (input dtype) and its rescale
/// factor to `alpha`, and updates its running max, sum and "saw a key" flag.
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_row<F: Float>(
    row: usize,
    first_key: usize,
    s_tile: &SharedMemory<f32>,
    p_tile: &mut SharedMemory<F>,
    spans: &SharedMemory<u32>,
    stats: &mut SharedMemory<f32>,
    seen: &mut SharedMemory<u32>,
    scale: f32,
    #[comptime] rows: usize,
    #[comptime] max_spans: usize,
) {
    let at = row * TILE;
    let old_max = stats[row];
    let mut tile_max = old_max;
    #[unroll]
    for j in 0..TILE {
        let score = s_tile[at + j] * scale;
        if allowed_in(spans, row, first_key + j, max_spans) && score > tile_max {
            tile_max = score;
        }
    }
    // `exp(NONE - x)` is 0 for any real x; equal maxima give 1.
    let alpha = (old_max - tile_max).exp();
    let mut total = f32::new(0.0);
    #[unroll]
    for j in 0..TILE {
        let mut p = f32::new(0.0);
        if allowed_in(spans, row, first_key + j, max_spans) {
            // A NaN score gives a NaN p: it reaches the sum, hence `out` and `lse`.
            p = (s_tile[at + j] * scale - tile_max).exp();
            seen[row] = 1;
        }
        total += p;
        p_tile[at + j] = F::cast_from(p);
    }
    stats[row] = tile_max;
    stats[rows + row] = stats[rows + row] * alpha + total;
    stats[2 * rows + row] = alpha;
}

/// Forward on matrix tiles: `out [Tq, H, Dv]` (input dtype) and `lse [H, Tq]` (f32).
///
/// Cube `(x, y)` = (tile of `16 · planes` queries, head), `plane_dim × planes` units. Key tiles
/// of 16 keys come from `tile_offsets`/`tile_runs`, as for [`super::kernels::forward_kernel`].
/// `head_pad` and `value_pad` are the dims rounded up to 16.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn forward_tiles_kernel<F: Float>(
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
    #[comptime] head_pad: usize,
    #[comptime] value_pad: usize,
    #[comptime] planes: usize,
    #[comptime] plane_dim: usize,
    #[comptime] max_spans: usize,
    #[comptime] tensor_cores: bool,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime!(TILE * planes);
    let units = comptime!(plane_dim * planes);
    let unit = UNIT_POS as usize;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let q_tile_index = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let q_tokens = q.shape(0);
    let kv_tokens = k.shape(0);
    let kv_head = head / (q.shape(1) / k.shape(1));
    let first_query = q_tile_index * rows;

    // The tiles the products read and write start on 32-byte boundaries (as `wmma` loads and
    // stores require); every 16-column chunk inside them does too.
    let mut q_tile = SharedMemory::<F>::new_aligned(rows * head_pad, ALIGN);
    let mut k_tile = SharedMemory::<F>::new_aligned(TILE * head_pad, ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(TILE * value_pad, ALIGN);
    let mut s_tile = SharedMemory::<f32>::new_aligned(rows * TILE, ALIGN);
    let mut p_tile = SharedMemory::<F>::new_aligned(rows * TILE, ALIGN);
    let mut o_tile = SharedMemory::<f32>::new_aligned(rows * value_pad, ALIGN);
    // Per row: running max, running sum, last rescale factor.
    let mut stats = SharedMemory::<f32>::new(3 * rows);
    let mut seen = SharedMemory::<u32>::new(rows);
    let mut row_spans = SharedMemory::<u32>::new(rows * 2 * max_spans);

    stage_padded::<F>(
        q,
        &mut q_tile,
        first_query,
        head,
        q_tokens,
        rows,
        head_dim,
        head_pad,
        units,
    );
    #[unroll]
    for pass in 0..(rows * value_pad).div_ceil(units) {
        let index = pass * units + unit;
        if index < rows * value_pad {
            o_tile[index] = 0.0;
        }
    }
    #[unroll]
    for pass in 0..(rows * 2 * max_spans).div_ceil(units) {
        let index = pass * units + unit;
        if index < rows * 2 * max_spans {
            let query = first_query + index / (2 * max_spans);
            let mut value = 0u32;
            if query < q_tokens {
                value = spans[query * 2 * max_spans + index % (2 * max_spans)];
            }
            row_spans[index] = value;
        }
    }
    if unit < rows {
        stats[unit] = NONE;
        stats[rows + unit] = 0.0;
        stats[2 * rows + unit] = 1.0;
        seen[unit] = 0;
    }
    sync_cube();

    let q_at = plane * TILE * head_pad;
    let s_at = plane * TILE * TILE;
    let o_at = plane * TILE * value_pad;
    let first_run = tile_offsets[q_tile_index] as usize;
    let end_run = tile_offsets[q_tile_index + 1] as usize;
    for run in first_run..end_run {
        let first_tile = tile_runs[2 * run] as usize;
        let end_tile = tile_runs[2 * run + 1] as usize;
        for kv_tile in first_tile..end_tile {
            let first_key = kv_tile * TILE;
            stage_padded::<F>(
                k,
                &mut k_tile,
                first_key,
                kv_head,
                kv_tokens,
                TILE,
                head_dim,
                head_pad,
                units,
            );
            stage_padded::<F>(
                v,
                &mut v_tile,
                first_key,
                kv_head,
                kv_tokens,
                TILE,
                value_dim,
                value_pad,
                units,
            );
            sync_cube();
            scores::<F>(
                &q_tile,
                q_at,
                &k_tile,
                &mut s_tile,
                s_at,
                head_pad,
                plane_dim,
                tensor_cores,
            );
            sync_cube();
            if lane < TILE {
                softmax_row::<F>(
                    plane * TILE + lane,
                    first_key,
                    &s_tile,
                    &mut p_tile,
                    &row_spans,
                    &mut stats,
                    &mut seen,
                    scale,
                    rows,
                    max_spans,
                );
            }
            sync_cube();
            #[unroll]
            for i in 0..TILE * value_pad / plane_dim {
                let element = lane + i * plane_dim;
                o_tile[o_at + element] *= stats[2 * rows + plane * TILE + element / value_pad];
            }
            sync_cube();
            add_probabilities_times_values::<F>(
                &p_tile,
                s_at,
                &v_tile,
                &mut o_tile,
                o_at,
                value_pad,
                plane_dim,
                tensor_cores,
            );
            sync_cube();
        }
    }

    #[unroll]
    for i in 0..TILE * value_pad / plane_dim {
        let element = lane + i * plane_dim;
        let row = plane * TILE + element / value_pad;
        let col = element % value_pad;
        let query = first_query + row;
        if query < q_tokens && col < value_dim {
            // A query without any key writes 0 (its accumulator may hold `0 · value` terms).
            let mut value = f32::new(0.0);
            if seen[row] == 1 {
                value = o_tile[o_at + element] / stats[rows + row];
            }
            out[query * out.stride(0) + head * out.stride(1) + col * out.stride(2)] =
                F::cast_from(value);
        }
    }
    if lane < TILE {
        let row = plane * TILE + lane;
        let query = first_query + row;
        if query < q_tokens {
            let mut value = neg_inf;
            if seen[row] == 1 {
                value = stats[row] + stats[rows + row].ln();
            }
            lse[head * lse.stride(0) + query * lse.stride(1)] = value;
        }
    }
}
