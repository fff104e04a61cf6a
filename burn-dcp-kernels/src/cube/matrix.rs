//! The kernels on 16 × 16 matrix tiles — forward with LSE, dq, dk/dv — with tensor cores
//! (`cmma`) where the device has them.
//!
//! Layout of one forward cube (FlashAttention-2's, with one plane per 16 queries):
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
//! The backward has the vector kernels' split (no atomics): [`dq_tiles_kernel`](fn@dq_tiles_kernel) walks key tiles
//! per query tile, [`dkdv_tiles_kernel`](fn@dkdv_tiles_kernel) walks the query tiles of every query head of its GQA
//! group per key tile; both recompute `S` and `dP = dO · Vᵀ` on tiles, form `dS` with one unit
//! per row, and accumulate their gradients in f32 in shared memory (the dk/dv kernel works on
//! the transposes: `Sᵀ = K · Qᵀ`, `dV += Pᵀ · dO`, `dK += dSᵀ · Q`, so every product has the
//! forward's two shapes).
//!
//! All products go through [`scores`](fn@scores) (`A · Bᵀ`) and [`add_probabilities_times_values`](fn@add_probabilities_times_values)
//! (`C += A · B`), which have two bodies chosen at compile time: `cmma` fragments
//! (`tensor_cores = true`), or the same products computed by the plane's units element by
//! element from the same shared-memory operands, in the same layouts. The second body runs
//! everywhere (lavapipe in CI), so the staging, padding, masks, softmax, gradients and
//! write-back of these kernels are tested without a GPU; what only a GPU tests is the fragment
//! load/execute/store of the first body (CI compiles it to CUDA C++:
//! `burn-dcp/tests/cuda_codegen.rs`).
//!
//! Semantics differ from the vector kernels in one place: a masked pair inside a listed tile
//! is multiplied by a zero (probability or `dS`) instead of being skipped, so a non-finite
//! value (`inf`, `NaN`) in V, dO, Q or K at a masked pair can reach other rows of the same
//! tiles as `NaN` (`0 · inf`). Finite inputs give the same results up to rounding; fully
//! masked rows still give `out = 0`, `lse = -inf` and zero gradients, and a NaN score still
//! propagates to its query's `out` and `lse`.
//!
//! On lavapipe the staging, zeroing and write-back loops are rolled, and rolled iterations
//! count against gallivm's per-invocation loop cap of 65 535 (see [`super::kernels`]): about 70 to 80
//! per 16-row tile at head dim 64, so there a query may attend about 14 000 keys and a key be
//! attended by about 13 000 queries of its GQA group (the vector kernels: about 60 000). GPUs
//! have no such cap; on lavapipe these kernels are a test vehicle, never the default.
//!
//! **Matrix tiles and tensor cores** (these kernels, [`super::AttentionKernel`]): the same three kernels
//! (forward with LSE, dq, dk/dv) on 16 × 16 tiles, one plane (32 units) per 16 rows: per tile
//! pair each plane computes `S = Q·Kᵀ` (and `dP = dO·Vᵀ`) as 16 × 16 × 16 products with f32
//! accumulators, runs the softmax (or `dS`) with one unit per row, stores `P` (`dS`) in the
//! input dtype and accumulates `O += P·V` (`dQ += dS·K`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`) in f32
//! in shared memory. The products are `cmma` (tensor cores: `wmma` on CUDA) or, with
//! `tensor_cores: false`, the same products on ordinary units; everything else is shared.
//! [`super::KERNEL_ENV`] (`BURN_DCP_ATTENTION_KERNEL`) picks the kernels of every `FlashOps` call:
//! `vector`, `auto` (the default: tensor cores where the device has them for the dtype and
//! the tiles fit its shared memory, else vector), `tiles`, `tensor-cores`.
//!
//! **Run on an H100 (2026-11-26):** `tests/cube_cuda.rs` passed there (tensor cores in f16
//! and bf16 against the f64 oracle for every mask at head dims 40–256, forward and gradients;
//! against the same tiles on ordinary units; the vector kernels on CUDA), so the default is
//! `auto`; the bench group `cuda` timed them (`benches/RESULTS.md`: 3.1× the vector kernels
//! forward, 9.2× forward + backward, ~10 TFLOP/s — far from FlashAttention-3). CI has no GPU:
//! there the matrix-tile kernels are checked on lavapipe with their products on ordinary units
//! (f32 ≤ 1e-5 vs the oracle for every mask, ragged GQA, padded dims, several tiles; f16 within
//! the rounding bounds), and their `cmma` branches are compiled to CUDA C++ by cubecl-cuda's
//! compiler (`burn-dcp/tests/cuda_codegen.rs`: `wmma` loads, products and stores on
//! 32-byte-aligned shared memory).

use cubecl::prelude::*;

use super::kernels::{allowed_in, NONE};

/// Rows, columns and depth of one matrix tile product.
pub const TILE: usize = 16;
/// Alignment in bytes of the shared-memory tiles (256 bits, `wmma::load_matrix_sync`'s rule).
const ALIGN: usize = 32;

/// The comptime shape of one matrix-tile kernel launch, shared by the three kernels: the head
/// and value dims and their zero-padding to a multiple of 16, the planes per cube and units per
/// plane, the span slots per row of the launch tables, and whether the tile products run on
/// tensor cores (`cmma`) or on ordinary units.
#[derive(CubeType, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    pub head_dim: usize,
    pub value_dim: usize,
    /// `head_dim` rounded up to 16.
    pub head_pad: usize,
    /// `value_dim` rounded up to 16.
    pub value_pad: usize,
    /// Planes per cube, each owning 16 rows.
    pub planes: usize,
    /// Units per plane (32: a CUDA warp, as the `cmma` fragments need).
    pub plane_dim: usize,
    /// Span slots per row of the launch tables.
    pub max_spans: usize,
    pub tensor_cores: bool,
}

impl TileConfig {
    /// Rows (queries, or keys in the dk/dv kernel) per cube: 16 per plane.
    pub fn rows(&self) -> usize {
        TILE * self.planes
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        self.plane_dim * self.planes
    }
}

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
        // SAFETY: filled by `cmma::load` before any read.
        let a = unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::A,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::RowMajor,
            )
        };
        // SAFETY: filled by `cmma::load` before any read.
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
        // SAFETY: filled by `cmma::load` before any read.
        let b = unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::B,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::RowMajor,
            )
        };
        // SAFETY: filled by `cmma::load` before any read.
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
        // As in [`scores`](fn@scores): the lane's outputs share one column, whose 16 values are loaded once.
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

/// Stages the spans of queries `first_query..first_query + rows` into `into` (empty spans past
/// `q_tokens`, so that no key is allowed). All `units` units of the cube take part.
#[cube]
fn stage_spans(
    spans: &Tensor<u32>,
    into: &mut SharedMemory<u32>,
    first_query: usize,
    q_tokens: usize,
    #[comptime] rows: usize,
    #[comptime] max_spans: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    #[unroll]
    for pass in 0..(rows * 2 * max_spans).div_ceil(units) {
        let index = pass * units + unit;
        if index < rows * 2 * max_spans {
            let query = first_query + index / (2 * max_spans);
            let mut value = 0u32;
            if query < q_tokens {
                value = spans[query * 2 * max_spans + index % (2 * max_spans)];
            }
            into[index] = value;
        }
    }
}

/// Per-query f32 values `source [H, Tq]` of head `head` for queries `first_query..+rows` into
/// `into` (0 past `q_tokens`), by the first `rows` units.
#[cube]
fn stage_row_values(
    source: &Tensor<f32>,
    into: &mut SharedMemory<f32>,
    head: usize,
    first_query: usize,
    q_tokens: usize,
    #[comptime] rows: usize,
) {
    let unit = UNIT_POS as usize;
    if unit < rows {
        let query = first_query + unit;
        let mut value = f32::new(0.0);
        if query < q_tokens {
            value = source[head * source.stride(0) + query * source.stride(1)];
        }
        into[unit] = value;
    }
}

/// Zeros `len` elements of `tile`, all `units` units of the cube together.
#[cube]
fn zero_tile(tile: &mut SharedMemory<f32>, #[comptime] len: usize, #[comptime] units: usize) {
    let unit = UNIT_POS as usize;
    for pass in 0..len.div_ceil(units) {
        let index = pass * units + unit;
        if index < len {
            tile[index] = 0.0;
        }
    }
}

/// Writes `factor ·` the f32 rows of `tile` (`padded` columns, row `r` of the plane to token
/// `first_row + plane·16 + r`) to `target [tokens, heads, dim]` at head `head`, skipping padding.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_rows<F: Float>(
    tile: &SharedMemory<f32>,
    target: &mut Tensor<F>,
    first_row: usize,
    head: usize,
    factor: f32,
    #[comptime] dim: usize,
    #[comptime] padded: usize,
    #[comptime] plane_dim: usize,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tokens = target.shape(0);
    for i in 0..TILE * padded / plane_dim {
        let element = lane + i * plane_dim;
        let token = first_row + plane * TILE + element / padded;
        let col = element % padded;
        if token < tokens && col < dim {
            let at = token * target.stride(0) + head * target.stride(1) + col * target.stride(2);
            target[at] = F::cast_from(tile[plane * TILE * padded + element] * factor);
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
/// of 16 keys come from `tile_offsets`/`tile_runs`, as for [`forward_kernel`](fn@super::kernels::forward_kernel).
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
    #[comptime] config: TileConfig,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime!(config.rows());
    let units = comptime!(config.units());
    let head_dim = comptime!(config.head_dim);
    let value_dim = comptime!(config.value_dim);
    let head_pad = comptime!(config.head_pad);
    let value_pad = comptime!(config.value_pad);
    let plane_dim = comptime!(config.plane_dim);
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
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
    zero_tile(&mut o_tile, rows * value_pad, units);
    stage_spans(
        spans,
        &mut row_spans,
        first_query,
        q_tokens,
        rows,
        max_spans,
        units,
    );
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

/// Backward, query side, on matrix tiles: `dq [Tq, H, D]`. Same cubes and key-tile lists as
/// [`forward_tiles_kernel`](fn@forward_tiles_kernel). Per key tile each plane recomputes `S = Q·Kᵀ` and `dP = dO·Vᵀ` on
/// matrix tiles, forms `dS = P ∘ (dP − delta)` with `P = exp(scale·S − lse)` on the allowed
/// pairs (one unit per query row; `dS` stored in the input dtype), and accumulates
/// `dQ += dS·K` in f32; the end writes `scale · dQ`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dq_tiles_kernel<F: Float>(
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
    #[comptime] config: TileConfig,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime!(config.rows());
    let units = comptime!(config.units());
    let head_dim = comptime!(config.head_dim);
    let value_dim = comptime!(config.value_dim);
    let head_pad = comptime!(config.head_pad);
    let value_pad = comptime!(config.value_pad);
    let plane_dim = comptime!(config.plane_dim);
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let q_tile_index = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let q_tokens = q.shape(0);
    let kv_tokens = k.shape(0);
    let kv_head = head / (q.shape(1) / k.shape(1));
    let first_query = q_tile_index * rows;

    let mut q_tile = SharedMemory::<F>::new_aligned(rows * head_pad, ALIGN);
    let mut do_tile = SharedMemory::<F>::new_aligned(rows * value_pad, ALIGN);
    let mut k_tile = SharedMemory::<F>::new_aligned(TILE * head_pad, ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(TILE * value_pad, ALIGN);
    let mut s_tile = SharedMemory::<f32>::new_aligned(rows * TILE, ALIGN);
    let mut dp_tile = SharedMemory::<f32>::new_aligned(rows * TILE, ALIGN);
    let mut ds_tile = SharedMemory::<F>::new_aligned(rows * TILE, ALIGN);
    let mut dq_tile = SharedMemory::<f32>::new_aligned(rows * head_pad, ALIGN);
    let mut row_lse = SharedMemory::<f32>::new(rows);
    let mut row_delta = SharedMemory::<f32>::new(rows);
    let mut row_spans = SharedMemory::<u32>::new(rows * 2 * max_spans);

    let h = head;
    let qt = q_tokens;
    stage_padded::<F>(
        q,
        &mut q_tile,
        first_query,
        h,
        qt,
        rows,
        head_dim,
        head_pad,
        units,
    );
    stage_padded::<F>(
        dout,
        &mut do_tile,
        first_query,
        h,
        qt,
        rows,
        value_dim,
        value_pad,
        units,
    );
    zero_tile(&mut dq_tile, rows * head_pad, units);
    stage_spans(
        spans,
        &mut row_spans,
        first_query,
        qt,
        rows,
        max_spans,
        units,
    );
    stage_row_values(lse, &mut row_lse, h, first_query, qt, rows);
    stage_row_values(delta, &mut row_delta, h, first_query, qt, rows);
    sync_cube();

    let q_at = plane * TILE * head_pad;
    let do_at = plane * TILE * value_pad;
    let s_at = plane * TILE * TILE;
    let first_run = tile_offsets[q_tile_index] as usize;
    let end_run = tile_offsets[q_tile_index + 1] as usize;
    for run in first_run..end_run {
        let first_tile = tile_runs[2 * run] as usize;
        let end_tile = tile_runs[2 * run + 1] as usize;
        for kv_tile in first_tile..end_tile {
            let first_key = kv_tile * TILE;
            let kh = kv_head;
            let kt = kv_tokens;
            stage_padded::<F>(
                k,
                &mut k_tile,
                first_key,
                kh,
                kt,
                TILE,
                head_dim,
                head_pad,
                units,
            );
            stage_padded::<F>(
                v,
                &mut v_tile,
                first_key,
                kh,
                kt,
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
            scores::<F>(
                &do_tile,
                do_at,
                &v_tile,
                &mut dp_tile,
                s_at,
                value_pad,
                plane_dim,
                tensor_cores,
            );
            sync_cube();
            if lane < TILE {
                let row = plane * TILE + lane;
                #[unroll]
                for j in 0..TILE {
                    let mut ds = f32::new(0.0);
                    if allowed_in(&row_spans, row, first_key + j, max_spans) {
                        let p = (s_tile[row * TILE + j] * scale - row_lse[row]).exp();
                        ds = p * (dp_tile[row * TILE + j] - row_delta[row]);
                    }
                    ds_tile[row * TILE + j] = F::cast_from(ds);
                }
            }
            sync_cube();
            add_probabilities_times_values::<F>(
                &ds_tile,
                s_at,
                &k_tile,
                &mut dq_tile,
                q_at,
                head_pad,
                plane_dim,
                tensor_cores,
            );
            sync_cube();
        }
    }
    write_rows::<F>(
        &dq_tile,
        dq,
        first_query,
        head,
        scale,
        head_dim,
        head_pad,
        plane_dim,
    );
}

/// Backward, key side, on matrix tiles: `dk [Tk, K, D]`, `dv [Tk, K, Dv]`. Cube `(x, y)` =
/// (tile of `16 · planes` keys, kv head); plane `p` owns keys `16p..16p + 16`, staged once. For
/// each query head of the GQA group and each listed tile of 16 queries (`tile_offsets`/
/// `tile_runs`: per key tile, the runs of query tiles), the cube stages Q, dO, lse, delta and
/// the spans; each plane computes `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` on matrix tiles, forms `Pᵀ`
/// and `dSᵀ` on the allowed pairs (one unit per key row; both stored in the input dtype), and
/// accumulates `dV += Pᵀ·dO`, `dK += dSᵀ·Q` in f32. The end writes `scale · dK` and `dV`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dkdv_tiles_kernel<F: Float>(
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
    #[comptime] config: TileConfig,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime!(config.rows());
    let units = comptime!(config.units());
    let head_dim = comptime!(config.head_dim);
    let value_dim = comptime!(config.value_dim);
    let head_pad = comptime!(config.head_pad);
    let value_pad = comptime!(config.value_pad);
    let plane_dim = comptime!(config.plane_dim);
    let max_spans = comptime!(config.max_spans);
    let tensor_cores = comptime!(config.tensor_cores);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let key_tile_index = CUBE_POS_X as usize;
    let kv_head = CUBE_POS_Y as usize;
    let q_tokens = q.shape(0);
    let kv_tokens = k.shape(0);
    let group = q.shape(1) / k.shape(1);
    let first_key = key_tile_index * rows;

    let mut k_tile = SharedMemory::<F>::new_aligned(rows * head_pad, ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(rows * value_pad, ALIGN);
    let mut q_tile = SharedMemory::<F>::new_aligned(TILE * head_pad, ALIGN);
    let mut do_tile = SharedMemory::<F>::new_aligned(TILE * value_pad, ALIGN);
    let mut s_tile = SharedMemory::<f32>::new_aligned(rows * TILE, ALIGN);
    let mut dp_tile = SharedMemory::<f32>::new_aligned(rows * TILE, ALIGN);
    let mut p_tile = SharedMemory::<F>::new_aligned(rows * TILE, ALIGN);
    let mut ds_tile = SharedMemory::<F>::new_aligned(rows * TILE, ALIGN);
    let mut dk_tile = SharedMemory::<f32>::new_aligned(rows * head_pad, ALIGN);
    let mut dv_tile = SharedMemory::<f32>::new_aligned(rows * value_pad, ALIGN);
    let mut col_lse = SharedMemory::<f32>::new(TILE);
    let mut col_delta = SharedMemory::<f32>::new(TILE);
    let mut col_spans = SharedMemory::<u32>::new(TILE * 2 * max_spans);

    let kh = kv_head;
    let kt = kv_tokens;
    stage_padded::<F>(
        k,
        &mut k_tile,
        first_key,
        kh,
        kt,
        rows,
        head_dim,
        head_pad,
        units,
    );
    stage_padded::<F>(
        v,
        &mut v_tile,
        first_key,
        kh,
        kt,
        rows,
        value_dim,
        value_pad,
        units,
    );
    zero_tile(&mut dk_tile, rows * head_pad, units);
    zero_tile(&mut dv_tile, rows * value_pad, units);

    let k_at = plane * TILE * head_pad;
    let v_at = plane * TILE * value_pad;
    let s_at = plane * TILE * TILE;
    let first_run = tile_offsets[key_tile_index] as usize;
    let end_run = tile_offsets[key_tile_index + 1] as usize;
    for member in 0..group {
        let head = kv_head * group + member;
        for run in first_run..end_run {
            let first_tile = tile_runs[2 * run] as usize;
            let end_tile = tile_runs[2 * run + 1] as usize;
            for query_tile in first_tile..end_tile {
                let first_query = query_tile * TILE;
                let h = head;
                let qt = q_tokens;
                // Nobody still reads the previous tile's Q, dO, lse, delta or spans.
                sync_cube();
                stage_padded::<F>(
                    q,
                    &mut q_tile,
                    first_query,
                    h,
                    qt,
                    TILE,
                    head_dim,
                    head_pad,
                    units,
                );
                stage_padded::<F>(
                    dout,
                    &mut do_tile,
                    first_query,
                    h,
                    qt,
                    TILE,
                    value_dim,
                    value_pad,
                    units,
                );
                stage_spans(
                    spans,
                    &mut col_spans,
                    first_query,
                    qt,
                    TILE,
                    max_spans,
                    units,
                );
                stage_row_values(lse, &mut col_lse, h, first_query, qt, TILE);
                stage_row_values(delta, &mut col_delta, h, first_query, qt, TILE);
                sync_cube();
                scores::<F>(
                    &k_tile,
                    k_at,
                    &q_tile,
                    &mut s_tile,
                    s_at,
                    head_pad,
                    plane_dim,
                    tensor_cores,
                );
                scores::<F>(
                    &v_tile,
                    v_at,
                    &do_tile,
                    &mut dp_tile,
                    s_at,
                    value_pad,
                    plane_dim,
                    tensor_cores,
                );
                sync_cube();
                if lane < TILE {
                    let row = plane * TILE + lane;
                    let key = first_key + row;
                    #[unroll]
                    for j in 0..TILE {
                        let mut p = f32::new(0.0);
                        let mut ds = f32::new(0.0);
                        if allowed_in(&col_spans, j, key, max_spans) {
                            p = (s_tile[row * TILE + j] * scale - col_lse[j]).exp();
                            ds = p * (dp_tile[row * TILE + j] - col_delta[j]);
                        }
                        p_tile[row * TILE + j] = F::cast_from(p);
                        ds_tile[row * TILE + j] = F::cast_from(ds);
                    }
                }
                sync_cube();
                add_probabilities_times_values::<F>(
                    &p_tile,
                    s_at,
                    &do_tile,
                    &mut dv_tile,
                    v_at,
                    value_pad,
                    plane_dim,
                    tensor_cores,
                );
                add_probabilities_times_values::<F>(
                    &ds_tile,
                    s_at,
                    &q_tile,
                    &mut dk_tile,
                    k_at,
                    head_pad,
                    plane_dim,
                    tensor_cores,
                );
            }
        }
    }
    sync_cube();
    write_rows::<F>(
        &dk_tile, dk, first_key, kv_head, scale, head_dim, head_pad, plane_dim,
    );
    write_rows::<F>(
        &dv_tile, dv, first_key, kv_head, 1.0, value_dim, value_pad, plane_dim,
    );
}
