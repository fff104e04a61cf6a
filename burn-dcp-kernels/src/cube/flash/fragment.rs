//! Register fragments of the `m16n8k16` product and the pieces that move them: loads from shared
//! memory, the product, and the row reductions across the four lanes that share a row.
//!
//! A plane (warp) holds a `16 × 16` A tile, a `16 × 8` B tile and a `16 × 8` f32 accumulator in
//! registers, spread over its 32 lanes as PTX's `mma.m16n8k16` defines them (PTX ISA, "Matrix
//! Fragments for mma.m16n8k16 with floating point type"). With `g = lane / 4`, `t = lane % 4`,
//! each fragment is an array of pairs of adjacent elements:
//!
//! | fragment | pairs | pair `v` holds |
//! |---|---|---|
//! | A (row m, col k) | 4 | row `g + 8·(v % 2)`, cols `2t + 8·(v / 2)` and the next |
//! | B (row k, col n) | 2 | rows `2t + 8v` and the next, col `g` |
//! | C (row m, col n) | 2 | row `g + 8v`, cols `2t` and the next |
//!
//! The C layout of two adjacent `n = 8` tiles is the A layout of one `k = 16` tile, so scores
//! become the next product's A operand in registers ([`accumulators_as_a()`]).
//!
//! Every piece has its bodies chosen at compile time. With `tensor_cores` (CUDA, sm_80+):
//! `ldmatrix` loads and `mma.sync`. Without, the same fragments loaded element by element by the
//! table above and the product computed by the plane's units, in one of two ways:
//! - `shuffles` (devices whose planes shuffle within groups of four lanes, lavapipe among them):
//!   each lane gathers its two rows of A from the three other lanes of its row (`t ^ 1`,
//!   `t ^ 2`, `t ^ 3`) and reads its four columns of B from the staged tile ([`load_b_pair()`]
//!   loads them in that order). No barrier: lavapipe compiles every `sync_cube` as a coroutine
//!   suspend point, and the shared-memory form below takes it about 3.5 times longer to compile;
//! - otherwise, through a shared scratch tile with two barriers per product, on any device.
//!
//! So everything but the two instructions and their lane layout is tested without a GPU. The
//! row reductions likewise: plane shuffles (`shuffles`) or shared memory.

use cubecl::prelude::*;

use super::stage::padded;
use super::FlashConfig;

/// Pairs of adjacent elements: one 32-bit register of f16/bf16, two of f32. Fragments live in
/// flat arrays of pairs: A fragment `j` is pairs `4j..4j + 4`, accumulator fragment `n` pairs
/// `2n..2n + 2`, so that loops over them may stay rolled on devices without tensor cores
/// (lavapipe compiles every unrolled load separately) and unroll into registers on CUDA.
pub type Pair<T> = Vector<T, Const<2>>;

/// Elements of the scratch tile one plane's products use without tensor cores: A (16 × 16)
/// then both B fragments (16 × 16).
pub const PRODUCT_SCRATCH: usize = 16 * 16 + 16 * 16;
/// Elements of the scratch one plane's reductions use without shuffles.
pub const REDUCE_SCRATCH: usize = 32;

/// A plane's part of a cube's scratch tile: `tile` from element `at` (the plain bodies'
/// products through shared memory, [`PRODUCT_SCRATCH`], and their row reductions,
/// [`REDUCE_SCRATCH`]; a one-element stand-in where the body needs none).
#[derive(CubeType)]
pub struct Scratch<E: CubePrimitive> {
    pub tile: SharedMemory<E>,
    pub at: usize,
}

#[cube]
impl<E: CubePrimitive> Scratch<E> {
    /// The plane's [`PRODUCT_SCRATCH`] elements (one element on tensor cores).
    pub fn products(#[comptime] config: FlashConfig) -> Scratch<E> {
        let len = comptime!(if config.tensor_cores {
            1
        } else {
            config.planes * PRODUCT_SCRATCH
        });
        let tile = SharedMemory::<E>::new(len);
        Scratch::<E> {
            tile,
            at: UNIT_POS_Y as usize * PRODUCT_SCRATCH,
        }
    }

    /// The plane's [`REDUCE_SCRATCH`] elements (one element with shuffles).
    pub fn reductions(#[comptime] config: FlashConfig) -> Scratch<E> {
        let len = comptime!(if config.shuffles {
            1
        } else {
            config.planes * REDUCE_SCRATCH
        });
        let tile = SharedMemory::<E>::new(len);
        Scratch::<E> {
            tile,
            at: UNIT_POS_Y as usize * REDUCE_SCRATCH,
        }
    }
}

/// The lane and its `(g, t)` of the table above.
#[cube]
pub fn lane_coords() -> (usize, usize, usize) {
    let lane = UNIT_POS_X as usize;
    (lane, lane / 4, lane % 4)
}

/// Loads the A fragment of rows `row0..row0 + 16`, cols `col0..col0 + 16` of a row-major
/// `tile` with `stride` elements per row (16-byte aligned rows: `stride` and `col0` multiples of
/// 8) into pairs `at..at + 4` of `a`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_a<F: Float>(
    tile: &SharedMemory<F>,
    row0: usize,
    col0: usize,
    a: &mut Array<Pair<F>>,
    at: usize,
    #[comptime] stride: usize,
    #[comptime] tensor_cores: bool,
) {
    let (lane, g, t) = lane_coords();
    if tensor_cores {
        // ldmatrix x4: lanes 8j..8j+7 give the rows of 8 × 8 matrix j, which is register j:
        // (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
        let from = (row0 + lane % 16) * stride + col0 + (lane / 16) * 8;
        let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        let rows = def.load_matrix::<F, Const<2>>(
            &tile.slice(from, from + 8),
            cmma::MatrixIdent::A,
            4usize,
            false,
        );
        #[unroll]
        for v in 0..4usize {
            a[at + v] = rows[v];
        }
    } else {
        #[unroll]
        for v in 0..4usize {
            let from = (row0 + g + 8 * (v % 2)) * stride + col0 + 2 * t + 8 * (v / 2);
            let mut pair = Pair::<F>::empty();
            pair[0] = tile[from];
            pair[1] = tile[from + 1];
            a[at + v] = pair;
        }
    }
}

/// Two B fragments, for the `n` tiles `n0..n0 + 8` (pairs 0, 1) and `n0 + 8..n0 + 16` (pairs 2,
/// 3), over `k0..k0 + 16`. `transposed = false`: `tile` is row-major in `n` (row `n`, col `k`:
/// a K tile for `Q·Kᵀ`); `true`: row-major in `k` (row `k`, col `n`: a V tile for `P·V`).
/// With `shuffles` (and no tensor cores), the lane's four columns whole instead (32 pairs, the
/// order [`mma_pair()`]'s shuffles deliver A in).
#[cube]
pub fn load_b_pair<F: Float>(
    tile: &SharedMemory<F>,
    n0: usize,
    k0: usize,
    #[comptime] stride: usize,
    #[comptime] transposed: bool,
    #[comptime] config: FlashConfig,
) -> Array<Pair<F>> {
    let (lane, g, t) = lane_coords();
    if comptime!(config.tensor_cores) {
        let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        // Matrix j = lane / 8 is register j: (n tile 0, k 0-7), (n tile 0, k 8-15), (n tile
        // 1, k 0-7), (n tile 1, k 8-15); `.trans` reads the k-major tile as its transpose.
        let k = k0 + ((lane / 8) % 2) * 8;
        let n = n0 + (lane / 16) * 8;
        let at = if transposed {
            (k + lane % 8) * stride + n
        } else {
            (n + lane % 8) * stride + k
        };
        def.load_matrix::<F, Const<2>>(
            &tile.slice(at, at + 8),
            cmma::MatrixIdent::B,
            4usize,
            transposed,
        )
    } else if comptime!(config.shuffles) {
        load_b_columns::<F>(tile, n0, k0, stride, transposed)
    } else {
        let mut b = Array::<Pair<F>>::new(4usize);
        #[unroll]
        for h in 0..2usize {
            #[unroll]
            for v in 0..2usize {
                let n = n0 + 8 * h + g;
                let k = k0 + 2 * t + 8 * v;
                b[2 * h + v] = b_pair::<F>(tile, k, n, stride, transposed);
            }
        }
        b
    }
}

/// B's elements `(k, n)` and `(k + 1, n)` of a staged tile, row-major in `n` (`transposed =
/// false`: row `n`, col `k`) or in `k`.
#[cube]
fn b_pair<F: Float>(
    tile: &SharedMemory<F>,
    k: usize,
    n: usize,
    #[comptime] stride: usize,
    #[comptime] transposed: bool,
) -> Pair<F> {
    let mut pair = Pair::<F>::empty();
    if transposed {
        pair[0] = tile[k * stride + n];
        pair[1] = tile[(k + 1) * stride + n];
    } else {
        pair[0] = tile[n * stride + k];
        pair[1] = tile[n * stride + k + 1];
    }
    pair
}

/// The lane's columns `8·(c / 2) + 2t + c % 2` (`c` = 0..3) of B over all 16 `k`, as pairs of
/// adjacent `k` in the order the quad's shuffles deliver A: pair `8c + m` holds `k = 2·(t ^ m)`
/// and the next, pair `8c + 4 + m` holds `k = 8 + 2·(t ^ m)` and the next.
#[cube]
fn load_b_columns<F: Float>(
    tile: &SharedMemory<F>,
    n0: usize,
    k0: usize,
    #[comptime] stride: usize,
    #[comptime] transposed: bool,
) -> Array<Pair<F>> {
    let (_lane, _g, t) = lane_coords();
    let mut b = Array::<Pair<F>>::new(32usize);
    #[unroll]
    for c in 0..4usize {
        let n = n0 + 8 * (c / 2) + 2 * t + c % 2;
        #[unroll]
        for m in 0..4usize {
            #[unroll]
            for half in 0..2usize {
                let k = k0 + 8 * half + 2 * (t ^ m);
                b[8 * c + 4 * half + m] = b_pair::<F>(tile, k, n, stride, transposed);
            }
        }
    }
    b
}

/// `len` accumulator fragments of zeros (`2 · len` pairs).
#[cube]
pub fn zero_accumulators(#[comptime] len: usize) -> Array<Pair<f32>> {
    let mut c = Array::<Pair<f32>>::new(2 * len);
    #[unroll]
    for i in 0..2 * len {
        c[i] = Pair::<f32>::new(0.0);
    }
    c
}

/// `C_h += A · B_h` for both B fragments `h` of a [`load_b_pair()`] result: `A` is pairs
/// `a_at..a_at + 4` of `a`, `C_0` pairs `c_at..c_at + 2` of `c` and `C_1` the next two.
/// `scratch`: the plane's [`PRODUCT_SCRATCH`] elements (used by the shared-memory form only).
/// Every unit of the cube calls it together (the shuffles exchange within the plane; the
/// scratch form synchronises the cube).
#[cube]
pub fn mma_pair<F: Float>(
    a: &Array<Pair<F>>,
    a_at: usize,
    b: &Array<Pair<F>>,
    c: &mut Array<Pair<f32>>,
    c_at: usize,
    scratch: &mut Scratch<F>,
    #[comptime] config: FlashConfig,
) {
    if comptime!(config.tensor_cores) {
        let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        let mut a_frag = Array::<Pair<F>>::new(4usize);
        #[unroll]
        for v in 0..4usize {
            a_frag[v] = a[a_at + v];
        }
        #[unroll]
        for h in 0..2usize {
            let mut b_frag = Array::<Pair<F>>::new(2usize);
            let mut c_frag = Array::<Pair<f32>>::new(2usize);
            #[unroll]
            for v in 0..2usize {
                b_frag[v] = b[2 * h + v];
                c_frag[v] = c[c_at + 2 * h + v];
            }
            def.execute_inplace(&a_frag, &b_frag, &mut c_frag);
            #[unroll]
            for v in 0..2usize {
                c[c_at + 2 * h + v] = c_frag[v];
            }
        }
    } else if comptime!(config.shuffles) {
        mma_by_shuffles::<F>(a, a_at, b, c, c_at);
    } else {
        let (_lane, g, t) = lane_coords();
        let a_base = scratch.at;
        let b_base = scratch.at + 16 * 16;
        #[unroll]
        for v in 0..4usize {
            let at = a_base + (g + 8 * (v % 2)) * 16 + 2 * t + 8 * (v / 2);
            let pair = a[a_at + v];
            scratch.tile[at] = pair[0];
            scratch.tile[at + 1] = pair[1];
        }
        // B as 16 rows (k) of 16 columns (n: both fragments).
        #[unroll]
        for i in 0..4usize {
            let k = 2 * t + 8 * (i % 2);
            let n = 8 * (i / 2) + g;
            let pair = b[i];
            scratch.tile[b_base + k * 16 + n] = pair[0];
            scratch.tile[b_base + (k + 1) * 16 + n] = pair[1];
        }
        sync_cube();
        for i in 0..4usize {
            // Pair `i` of C: fragment `i / 2`, row `g + 8·(i % 2)`, cols `2t`, `2t + 1`.
            let row = g + 8 * (i % 2);
            let col = 8 * (i / 2) + 2 * t;
            let mut pair = c[c_at + i];
            let mut first = pair[0];
            let mut second = pair[1];
            #[unroll]
            for k in 0..16usize {
                let x = f32::cast_from(scratch.tile[a_base + row * 16 + k]);
                first += x * f32::cast_from(scratch.tile[b_base + k * 16 + col]);
                second += x * f32::cast_from(scratch.tile[b_base + k * 16 + col + 1]);
            }
            pair[0] = first;
            pair[1] = second;
            c[c_at + i] = pair;
        }
        sync_cube();
    }
}

/// [`mma_pair()`] on plain units without barriers: A's rows `g` and `g + 8` over all 16 `k`
/// from the quad (lane `t ^ m` gives `k = 2·(t ^ m)`, `8 + 2·(t ^ m)` and the next of each),
/// B's columns from [`load_b_columns()`].
#[cube]
fn mma_by_shuffles<F: Float>(
    a: &Array<Pair<F>>,
    a_at: usize,
    b: &Array<Pair<F>>,
    c: &mut Array<Pair<f32>>,
    c_at: usize,
) {
    #[unroll]
    for m in 0..4usize {
        #[unroll]
        for r in 0..2usize {
            // Pair `r` of A: row `g + 8r`, k from `2t`; pair `2 + r`: the same row, k from 8 + 2t.
            let mut low = Pair::<f32>::cast_from(a[a_at + r]);
            let mut high = Pair::<f32>::cast_from(a[a_at + 2 + r]);
            if m > 0 {
                low = plane_shuffle_xor(low, m as u32);
                high = plane_shuffle_xor(high, m as u32);
            }
            #[unroll]
            for h in 0..2usize {
                // Pair `2h + r` of C: fragment `h`, row `g + 8r`, columns `8h + 2t + e`.
                let mut pair = c[c_at + 2 * h + r];
                #[unroll]
                for e in 0..2usize {
                    let low_b = Pair::<f32>::cast_from(b[8 * (2 * h + e) + m]);
                    let high_b = Pair::<f32>::cast_from(b[8 * (2 * h + e) + 4 + m]);
                    pair[e] += low[0] * low_b[0]
                        + low[1] * low_b[1]
                        + high[0] * high_b[0]
                        + high[1] * high_b[1];
                }
                c[c_at + 2 * h + r] = pair;
            }
        }
    }
}

/// Pairs `at..at + 4` of an A fragment (input dtype) of the `k` columns `16j..16j + 16` made of
/// accumulator fragments `2j` and `2j + 1` of `p` (pairs `4j..4j + 4`): scores or probabilities
/// become the next product's left operand without leaving registers.
#[cube]
pub fn accumulators_as_a<F: Float>(p: &Array<Pair<f32>>, j: usize) -> Array<Pair<F>> {
    let mut a = Array::<Pair<F>>::new(4usize);
    // C pairs of fragment 2j: rows g, g+8 (cols 2t..); of 2j + 1: the same 8 columns on.
    // A pairs: (g, k 2t..), (g + 8, k 2t..), (g, k 2t + 8..), (g + 8, k 2t + 8..).
    #[unroll]
    for v in 0..4usize {
        a[v] = Pair::<F>::cast_from(p[4 * j + v]);
    }
    a
}

/// The maximum of `value` over the four lanes of the row (`t = 0..3` of one `g`). `scratch`:
/// the plane's [`REDUCE_SCRATCH`] f32 (unused with `shuffles`). Every unit of
/// the cube calls it together.
#[cube]
pub fn row_max(value: f32, scratch: &mut Scratch<f32>, #[comptime] shuffles: bool) -> f32 {
    if shuffles {
        let value = max(value, plane_shuffle_xor(value, 1));
        max(value, plane_shuffle_xor(value, 2))
    } else {
        let (lane, g, _t) = lane_coords();
        scratch.tile[scratch.at + lane] = value;
        sync_cube();
        let base = scratch.at + 4 * g;
        let first = max(scratch.tile[base], scratch.tile[base + 1]);
        let result = max(first, max(scratch.tile[base + 2], scratch.tile[base + 3]));
        sync_cube();
        result
    }
}

/// The sum of `value` over the four lanes of the row; as [`row_max()`].
#[cube]
pub fn row_sum(value: f32, scratch: &mut Scratch<f32>, #[comptime] shuffles: bool) -> f32 {
    if shuffles {
        let value = value + plane_shuffle_xor(value, 1);
        value + plane_shuffle_xor(value, 2)
    } else {
        let (lane, g, _t) = lane_coords();
        scratch.tile[scratch.at + lane] = value;
        sync_cube();
        let base = scratch.at + 4 * g;
        let first = scratch.tile[base] + scratch.tile[base + 1];
        let result = first + (scratch.tile[base + 2] + scratch.tile[base + 3]);
        sync_cube();
        result
    }
}

/// The plane's 16 staged rows at `at` of `tile` (`padded(dim)` columns) as `dim / 16` A
/// fragments, into `frags`.
#[cube]
pub fn load_rows_into<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    frags: &mut Array<Pair<F>>,
    #[comptime] dim: usize,
    #[comptime] tensor_cores: bool,
) {
    let stride = comptime!(padded(dim));
    #[unroll(tensor_cores)]
    for kk in 0..dim / 16 {
        load_a::<F>(
            tile,
            at / stride,
            16 * kk,
            frags,
            4 * kk,
            stride,
            tensor_cores,
        );
    }
}

/// The plane's 16 staged rows at `at` of `tile` as `dim / 16` A fragments.
#[cube]
pub fn load_rows_as_a<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] dim: usize,
    #[comptime] tensor_cores: bool,
) -> Array<Pair<F>> {
    let mut frags = Array::<Pair<F>>::new(dim / 4);
    load_rows_into::<F>(tile, at, &mut frags, dim, tensor_cores);
    frags
}

/// The plane's 16 rows `first_row..first_row + 16` of head `head` of `source` (`[tokens, heads,
/// dim]`) as `dim / 16` A fragments into `frags`, read from global memory by the table's layout
/// (the one `ldmatrix` gives): rows past the source's end repeat its last row (their pairs are
/// masked), columns past its dim are zeros. For kernels that hold their own rows in registers
/// without staging them (plain loads: no `cp.async` to overlap), which saves their shared memory.
#[cube]
pub fn load_rows_global_into<F: Float>(
    source: &Tensor<F>,
    first_row: usize,
    head: usize,
    frags: &mut Array<Pair<F>>,
    #[comptime] dim: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, g, t) = lane_coords();
    let (tokens, real) = (source.shape(0), source.shape(2));
    #[unroll(unrolled)]
    for kk in 0..dim / 16 {
        #[unroll]
        for v in 0..4usize {
            let token = min(first_row + g + 8 * (v % 2), tokens - 1);
            let base = token * source.stride(0) + head * source.stride(1);
            let col = 16 * kk + 2 * t + 8 * (v / 2);
            let mut pair = Pair::<F>::empty();
            #[unroll]
            for e in 0..2usize {
                let mut value = F::new(0.0);
                if col + e < real {
                    value = source[base + (col + e) * source.stride(2)];
                }
                pair[e] = value;
            }
            frags[4 * kk + v] = pair;
        }
    }
}
