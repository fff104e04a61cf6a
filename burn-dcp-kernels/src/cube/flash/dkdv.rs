//! The dk/dv kernel: cube = `16 · planes` keys of one kv head, plane `p` owns 16 of them; per
//! query tile (`block` queries, double-buffered with their lse, delta and spans) of every query
//! head of the GQA group each plane computes `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, then `Pᵀ`, `dSᵀ`,
//! and adds `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::backward::{mask_columns, probabilities_and_ds, scores_in_registers, write_rows};
use super::fragment::*;
use super::stage::*;
use super::tile::{add_product, scale_scores};
use super::{fast_exp, FlashConfig};

/// Stages query tile `query_tile` of head `head` into buffer `buffer`: Q and dO rows (copies;
/// Q alone when staged in turn, [`FlashConfig::in_turn`]), and their lse, delta and spans
/// (plain stores, visible after the buffer's barrier or sync).
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
    let (block, units) = comptime!((config.block, config.units()));
    let max_spans = comptime!(config.max_spans);
    let first = query_tile * block;
    let q_tokens = q.shape(0);
    let (hd, vd) = comptime!((config.head_dim, config.value_dim));
    stage_tile::<F>(q, &mut tiles.q, buffer, query_tile, head, hd, config);
    if comptime!(!config.in_turn) {
        stage_tile::<F>(dout, &mut tiles.dout, buffer, query_tile, head, vd, config);
    }
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

/// `A·Bᵀ` of the plane's 16 rows against a staged tile: the rows are `held` in registers, or
/// loaded from `rows` at `at` for this product alone (registers go to the accumulators).
#[cube]
#[allow(clippy::too_many_arguments)]
fn scores_of_rows<F: Float>(
    held: &Array<Pair<F>>,
    rows: &SharedMemory<F>,
    at: usize,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] is_held: bool,
    #[comptime] tc: bool,
    #[comptime] shuffles: bool,
) -> Array<Pair<f32>> {
    if is_held {
        scores_in_registers::<F>(
            held, tile, base, scratch, scratch_at, dim, block, tc, shuffles,
        )
    } else {
        let frags = load_rows_as_a::<F>(rows, at, dim, tc);
        scores_in_registers::<F>(
            &frags, tile, base, scratch, scratch_at, dim, block, tc, shuffles,
        )
    }
}

/// The plane's key and value rows: staged in shared memory for the copies (`k`, `v`: the
/// cube's), or held in registers (`k_held`, `v_held`: the plane's) with plain loads.
#[derive(CubeType)]
struct KeyRows<F: Float> {
    k: SharedMemory<F>,
    v: SharedMemory<F>,
    k_held: Array<Pair<F>>,
    v_held: Array<Pair<F>>,
}

/// `Sᵀ = K·Qᵀ` of the plane's 16 keys against the staged Q tile, scaled and masked (partial
/// tiles). Staged key rows are reloaded per tile (registers go to the accumulators).
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_scores<F: Float>(
    kv: &QueryTiles<F>,
    keys: &KeyRows<F>,
    buffer: usize,
    first_key: usize,
    full: bool,
    scale: f32,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    let (head_dim, block, tc) = comptime!((config.head_dim, config.block, config.tensor_cores));
    let base = buffer * block;
    let at = UNIT_POS_Y as usize * comptime!(16 * padded(head_dim));
    let held = comptime!(!config.stages_own_rows());
    let mut s = scores_of_rows::<F>(
        &keys.k_held,
        &keys.k,
        at,
        &kv.q,
        base,
        scratch,
        scratch_at,
        head_dim,
        block,
        held,
        tc,
        config.shuffles,
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
    s
}

/// `dPᵀ = V·dOᵀ` of the plane's 16 values against the dO tile staged in `tile` from row `base`.
#[cube]
fn value_scores<F: Float>(
    keys: &KeyRows<F>,
    tile: &SharedMemory<F>,
    base: usize,
    scratch: &mut SharedMemory<F>,
    scratch_at: usize,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    let (value_dim, block, tc) = comptime!((config.value_dim, config.block, config.tensor_cores));
    let at = UNIT_POS_Y as usize * comptime!(16 * padded(value_dim));
    let held = comptime!(!config.stages_own_rows());
    scores_of_rows::<F>(
        &keys.v_held,
        &keys.v,
        at,
        tile,
        base,
        scratch,
        scratch_at,
        value_dim,
        block,
        held,
        tc,
        config.shuffles,
    )
}

/// One query tile of the dk/dv kernel for the plane's 16 keys: [`key_scores`],
/// [`value_scores`], `Pᵀ` and `dSᵀ`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_tile<F: Float>(
    kv: &QueryTiles<F>,
    keys: &KeyRows<F>,
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
    let (block, tc) = comptime!((config.block, config.tensor_cores));
    let base = buffer * block;
    let mut s = key_scores::<F>(
        kv, keys, buffer, first_key, full, scale, scratch, scratch_at, config,
    );
    let mut dp = value_scores::<F>(keys, &kv.dout, base, scratch, scratch_at, config);
    let none = Array::<f32>::new(2usize);
    probabilities_and_ds(
        &mut s, &mut dp, &none, &none, &kv.lse, &kv.delta, base, block, false, tc,
    );
    add_product::<F>(
        &s,
        &kv.dout,
        base,
        dv_acc,
        scratch,
        scratch_at,
        value_dim,
        block,
        1usize,
        tc,
        config.shuffles,
    );
    add_product::<F>(
        &dp,
        &kv.q,
        base,
        dk_acc,
        scratch,
        scratch_at,
        head_dim,
        block,
        1usize,
        tc,
        config.shuffles,
    );
}

/// [`dkdv_tile`] with Q and dO staged in turn in one buffer ([`FlashConfig::in_turn`]), after
/// [`stage_query_tile`] staged Q: `Sᵀ`; dO over it for `dPᵀ` and `dV`; Q again for `dK`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_tile_in_turn<F: Float>(
    q: &Tensor<F>,
    dout: &Tensor<F>,
    kv: &mut QueryTiles<F>,
    keys: &KeyRows<F>,
    query_tile: usize,
    head: usize,
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
    let (block, tc) = comptime!((config.block, config.tensor_cores));
    let mut s = key_scores::<F>(
        kv, keys, 0usize, first_key, full, scale, scratch, scratch_at, config,
    );
    sync_cube();
    stage_tile::<F>(dout, &mut kv.q, 0usize, query_tile, head, value_dim, config);
    sync_cube();
    let mut dp = value_scores::<F>(keys, &kv.q, 0usize, scratch, scratch_at, config);
    let none = Array::<f32>::new(2usize);
    probabilities_and_ds(
        &mut s, &mut dp, &none, &none, &kv.lse, &kv.delta, 0usize, block, false, tc,
    );
    add_product::<F>(
        &s,
        &kv.q,
        0usize,
        dv_acc,
        scratch,
        scratch_at,
        value_dim,
        block,
        1usize,
        tc,
        config.shuffles,
    );
    sync_cube();
    stage_tile::<F>(q, &mut kv.q, 0usize, query_tile, head, head_dim, config);
    sync_cube();
    add_product::<F>(
        &dp,
        &kv.q,
        0usize,
        dk_acc,
        scratch,
        scratch_at,
        head_dim,
        block,
        1usize,
        tc,
        config.shuffles,
    );
}

/// Backward, key side: `dk [Tk, K, D]`, `dv [Tk, K, Dv]`. A cube: the `16·planes` keys of one
/// key tile of one kv head, the tiles in `order` (heaviest first, [`launch_slot`](fn@launch_slot)); tile lists
/// per key tile (the transpose of query tiles of `block` queries against key tiles of
/// `16 · planes` keys), walked once per query head of the group.
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
    order: &Tensor<u32>,
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
    let slot = launch_slot();
    let groups = k.shape(1);
    if slot >= order.len() * groups {
        terminate!();
    }
    let key_tile = order[slot / groups] as usize;
    let kv_head = slot % groups;
    let group = q.shape(1) / k.shape(1);
    let kv_tokens = k.shape(0);
    let cube_keys = comptime!(16 * config.planes);
    let first_key = key_tile * cube_keys;
    let plane_key = first_key + plane * 16;

    // Key and value rows are staged for the copies; plain loads hold the plane's in registers.
    let staged = comptime!(config.stages_own_rows());
    let k_rows = comptime!(if staged {
        cube_keys * padded(head_dim)
    } else {
        1
    });
    let v_rows = comptime!(if staged {
        cube_keys * padded(value_dim)
    } else {
        1
    });
    let (held_k, held_v) = comptime!(if staged {
        (1, 1)
    } else {
        (head_dim / 4, value_dim / 4)
    });
    let mut keys = KeyRows::<F> {
        k: SharedMemory::<F>::new_aligned(k_rows, 16usize),
        v: SharedMemory::<F>::new_aligned(v_rows, 16usize),
        k_held: Array::<Pair<F>>::new(held_k),
        v_held: Array::<Pair<F>>::new(held_v),
    };
    // Staged in turn, dO takes Q's buffer.
    let (q_size, do_size) = comptime!(if config.in_turn {
        (block * padded(head_dim).max(padded(value_dim)), 1)
    } else {
        (block * padded(head_dim), block * padded(value_dim))
    });
    let mut tiles = QueryTiles::<F> {
        q: SharedMemory::<F>::new_aligned(comptime!(buffers * q_size), 16usize),
        dout: SharedMemory::<F>::new_aligned(comptime!(buffers * do_size), 16usize),
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

    // Staged rows are copies, waited for only when there is a tile.
    if staged {
        if total > 0 {
            let kt = kv_tokens;
            stage_rows::<F>(
                k,
                &mut keys.k,
                0usize,
                first_key,
                kv_head,
                kt,
                unit,
                cube_keys,
                head_dim,
                units,
                copy,
            );
            stage_rows::<F>(
                v,
                &mut keys.v,
                0usize,
                first_key,
                kv_head,
                kt,
                unit,
                cube_keys,
                value_dim,
                units,
                copy,
            );
        }
    } else {
        let tc = comptime!(config.tensor_cores);
        load_rows_global_into::<F>(k, plane_key, kv_head, &mut keys.k_held, head_dim, tc);
        load_rows_global_into::<F>(v, plane_key, kv_head, &mut keys.v_held, value_dim, tc);
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
                &keys,
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
            if comptime!(config.in_turn) {
                dkdv_tile_in_turn::<F>(
                    q,
                    dout,
                    &mut tiles,
                    &keys,
                    cursor.tile,
                    head,
                    plane_key,
                    full,
                    &mut dk_acc,
                    &mut dv_acc,
                    scale,
                    &mut scratch,
                    scratch_at,
                    config,
                );
            } else {
                dkdv_tile::<F>(
                    &tiles,
                    &keys,
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
            }
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    let tc = comptime!(config.tensor_cores);
    let exact = comptime!(config.exact_dims);
    write_rows::<F>(&dk_acc, dk, plane_key, kv_head, scale, head_dim, exact, tc);
    write_rows::<F>(&dv_acc, dv, plane_key, kv_head, 1.0, value_dim, exact, tc);
}
