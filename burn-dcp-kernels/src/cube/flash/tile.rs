//! One tile's products and score fix-ups, shared by the three flash kernels: `S = A·Bᵀ`
//! against a staged tile ([`scores()`], [`scores_in_registers()`]), `acc += P·B`
//! ([`add_product()`]), the softmax scale
//! ([`scale_scores()`]) and the row-side mask ([`mask_rows()`]).

use cubecl::prelude::*;

use super::fragment::*;
use super::stage::*;
use super::FlashConfig;
use crate::cube::elementwise::NONE;

/// `S = A·Bᵀ` for the plane's `16 · row_tiles` rows against `block` rows of `tile` from row
/// `base` (row-major, `padded(dim)` columns): `row_tiles · block / 8` accumulator fragments, row
/// tile by row tile. The A fragments are `a` (one row tile: `dim / 16` fragments held in
/// registers) or are loaded per use from rows `a_row0..` of `a_tile` — each B fragment loaded
/// from `tile` then serves every row tile, which is what more rows per plane buy.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores<F: Float>(
    a: &Array<Pair<F>>,
    a_tile: &SharedMemory<F>,
    a_row0: usize,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut Scratch<F>,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    let (block, row_tiles, tc) = comptime!((config.block, config.row_tiles, config.tensor_cores));
    let mut s = zero_accumulators(row_tiles * block / 8);
    let stride = comptime!(padded(dim));
    #[unroll(tc)]
    for kk in 0..dim / 16 {
        let mut a_kk = Array::<Pair<F>>::new(4 * row_tiles);
        if comptime!(row_tiles > 1) {
            #[unroll]
            for mi in 0..row_tiles {
                load_a::<F>(
                    a_tile,
                    a_row0 + 16 * mi,
                    16 * kk,
                    &mut a_kk,
                    4 * mi,
                    stride,
                    tc,
                );
            }
        }
        #[unroll(tc)]
        for np in 0..block / 16 {
            let b = load_b_pair::<F>(tile, base + 16 * np, 16 * kk, stride, false, config);
            #[unroll]
            for mi in 0..row_tiles {
                let at = mi * (block / 4) + 4 * np;
                if comptime!(row_tiles == 1) {
                    mma_pair::<F>(a, 4 * kk, &b, &mut s, at, scratch, config);
                } else {
                    mma_pair::<F>(&a_kk, 4 * mi, &b, &mut s, at, scratch, config);
                }
            }
        }
    }
    s
}

/// [`scores()`] of one row tile whose A fragments are in registers.
#[cube]
pub fn scores_in_registers<F: Float>(
    a: &Array<Pair<F>>,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut Scratch<F>,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    scores::<F>(a, tile, 0usize, tile, base, scratch, dim, config)
}

/// `acc += P·B` for the plane's `16 · row_tiles` rows: `p` holds `P` as accumulator fragments
/// (`block / 8` per row tile, `block` columns), `tile` the `block` rows of B from row `base`
/// (row-major, `dim` columns, `padded(dim)` stride); `acc` has `dim / 8` fragments per row tile.
#[cube]
pub fn add_product<F: Float>(
    p: &Array<Pair<f32>>,
    tile: &SharedMemory<F>,
    base: usize,
    acc: &mut Array<Pair<f32>>,
    scratch: &mut Scratch<F>,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) {
    let (block, row_tiles, tc) = comptime!((config.block, config.row_tiles, config.tensor_cores));
    #[unroll(tc)]
    for kk in 0..block / 16 {
        let mut a = Array::<Pair<F>>::new(4 * row_tiles);
        #[unroll]
        for mi in 0..row_tiles {
            let part = accumulators_as_a::<F>(p, mi * (block / 16) + kk);
            #[unroll]
            for v in 0..4usize {
                a[4 * mi + v] = part[v];
            }
        }
        #[unroll(tc)]
        for np in 0..dim / 16 {
            let stride = comptime!(padded(dim));
            let b = load_b_pair::<F>(tile, 16 * np, base + 16 * kk, stride, true, config);
            #[unroll]
            for mi in 0..row_tiles {
                mma_pair::<F>(
                    &a,
                    4 * mi,
                    &b,
                    acc,
                    mi * (dim / 4) + 4 * np,
                    scratch,
                    config,
                );
            }
        }
    }
}

/// Multiplies the first `pairs` pairs of `s` by `scale`.
#[cube]
pub fn scale_scores(
    s: &mut Array<Pair<f32>>,
    scale: f32,
    #[comptime] pairs: usize,
    #[comptime] unrolled: bool,
) {
    #[unroll(unrolled)]
    for i in 0..pairs {
        s[i] = s[i] * Pair::<f32>::new(scale);
    }
}

/// Sets the scores of the pairs the spans do not allow to `NONE`. The lane's rows are
/// queries whose spans start at `spans_at[r]` of `spans` (`r = 2i + v` for row `16i + g + 8v`);
/// its columns are keys `first_key + 8n + 2t + e`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn mask_rows(
    s: &mut Array<Pair<f32>>,
    spans: &SharedMemory<u32>,
    spans_at: &Array<usize>,
    first_key: usize,
    #[comptime] block: usize,
    #[comptime] row_tiles: usize,
    #[comptime] max_spans: usize,
    #[comptime] unrolled: bool,
) {
    let (_lane, _g, t) = lane_coords();
    #[unroll]
    for mi in 0..row_tiles {
        #[unroll(unrolled)]
        for i in 0..block / 4 {
            // Pair `i` of the row tile: fragment `i / 2`, row `v = i % 2`.
            let at = mi * (block / 4) + i;
            let mut pair = s[at];
            #[unroll]
            for e in 0..2usize {
                let key = first_key + 8 * (i / 2) + 2 * t + e;
                if !allowed(spans, spans_at[2 * mi + i % 2], key, max_spans) {
                    pair[e] = NONE;
                }
            }
            s[at] = pair;
        }
    }
}
