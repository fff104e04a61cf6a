//! The dk/dv kernel: cube = `16 · planes` keys of one kv head, plane `p` owns 16 of them; per
//! query tile (`block` queries, double-buffered with their lse, delta and spans) of every query
//! head of the GQA group each plane computes `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, then `Pᵀ`, `dSᵀ`,
//! and adds `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::backward::{mask_columns, probabilities_and_ds, write_rows};
use super::fragment::*;
use super::stage::*;
use super::tile::{add_product, scale_scores, scores_in_registers};
use super::{fast_exp, FlashConfig};

/// Stages query tile `tile` into its buffer: Q and dO rows (copies; Q alone when staged in
/// turn, [`FlashConfig::in_turn`]), and their lse, delta and spans (plain stores, visible after
/// the buffer's barrier or sync).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_tile<F: Float>(
    q: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    spans: &Tensor<u32>,
    tiles: &mut QueryTiles<F>,
    tile: &Listed,
    #[comptime] config: FlashConfig,
) {
    let (block, max_spans) = comptime!((config.block, config.max_spans));
    let (hd, vd) = comptime!((config.head_dim, config.value_dim));
    stage_tile::<F>(q, &mut tiles.q, tile, hd, config);
    if comptime!(!config.in_turn) {
        stage_tile::<F>(dout, &mut tiles.dout, tile, vd, config);
    }
    let at = tile.buffer * block;
    let first = tile.index * block;
    stage_row_values(lse, &mut tiles.lse, at, tile.head, first, block, config);
    stage_row_values(delta, &mut tiles.delta, at, tile.head, first, block, config);
    stage_spans(
        spans,
        &mut tiles.spans,
        at * 2 * max_spans,
        first,
        block,
        config,
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
    scratch: &mut Scratch<F>,
    #[comptime] dim: usize,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    if comptime!(config.stages_own_rows()) {
        let frags = load_rows_as_a::<F>(rows, at, dim, config.tensor_cores);
        scores_in_registers::<F>(&frags, tile, base, scratch, dim, config)
    } else {
        scores_in_registers::<F>(held, tile, base, scratch, dim, config)
    }
}

/// The plane's key and value rows: staged in shared memory for the copies (`k`, `v`: the
/// cube's), or held in registers (`k_held`, `v_held`: the plane's) with plain loads; the
/// plane's first key, and its `dK`, `dV` accumulators.
#[derive(CubeType)]
struct KeyRows<F: Float> {
    k: SharedMemory<F>,
    v: SharedMemory<F>,
    k_held: Array<Pair<F>>,
    v_held: Array<Pair<F>>,
    first: usize,
    dk: Array<Pair<f32>>,
    dv: Array<Pair<f32>>,
}

#[cube]
impl<F: Float> KeyRows<F> {
    /// The rows of the cube's `16 · planes` keys from `first_key` of kv head `kv_head`: staged
    /// by the cube's copies (when `any` query tile will read them), or each plane's 16 read
    /// from global memory into registers.
    fn load(
        k: &Tensor<F>,
        v: &Tensor<F>,
        first_key: usize,
        kv_head: usize,
        any: bool,
        #[comptime] config: FlashConfig,
    ) -> KeyRows<F> {
        let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
        let (staged, rows) = comptime!((config.stages_own_rows(), 16 * config.planes));
        let (k_size, v_size, held_k, held_v) = comptime!(if staged {
            (rows * padded(head_dim), rows * padded(value_dim), 1, 1)
        } else {
            (1, 1, head_dim / 4, value_dim / 4)
        });
        let mut keys = KeyRows::<F> {
            k: SharedMemory::<F>::new_aligned(k_size, 16usize),
            v: SharedMemory::<F>::new_aligned(v_size, 16usize),
            k_held: Array::<Pair<F>>::new(held_k),
            v_held: Array::<Pair<F>>::new(held_v),
            first: first_key + UNIT_POS_Y as usize * 16,
            dk: zero_accumulators(head_dim / 8),
            dv: zero_accumulators(value_dim / 8),
        };
        if staged {
            if any {
                stage_rows::<F>(
                    k,
                    &mut keys.k,
                    0usize,
                    first_key,
                    kv_head,
                    rows,
                    head_dim,
                    config,
                );
                stage_rows::<F>(
                    v,
                    &mut keys.v,
                    0usize,
                    first_key,
                    kv_head,
                    rows,
                    value_dim,
                    config,
                );
            }
        } else {
            let first = keys.first;
            let tc = comptime!(config.tensor_cores);
            load_rows_global_into::<F>(k, first, kv_head, &mut keys.k_held, head_dim, tc);
            load_rows_global_into::<F>(v, first, kv_head, &mut keys.v_held, value_dim, tc);
        }
        keys
    }
}

/// `Sᵀ = K·Qᵀ` of the plane's 16 keys against the staged Q tile, scaled and masked (partial
/// tiles). Staged key rows are reloaded per tile (registers go to
/// the accumulators).
#[cube]
fn key_scores<F: Float>(
    kv: &QueryTiles<F>,
    keys: &KeyRows<F>,
    tile: &Listed,
    scale: f32,
    scratch: &mut Scratch<F>,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    let (head_dim, block, tc) = comptime!((config.head_dim, config.block, config.tensor_cores));
    let base = tile.buffer * block;
    let at = UNIT_POS_Y as usize * comptime!(16 * padded(head_dim));
    let mut s = scores_of_rows::<F>(
        &keys.k_held,
        &keys.k,
        at,
        &kv.q,
        base,
        scratch,
        head_dim,
        config,
    );
    scale_scores(&mut s, scale, comptime!(block / 4), tc);
    if !tile.full {
        let max_spans = comptime!(config.max_spans);
        let spans_at = base * 2 * max_spans;
        mask_columns(
            &mut s, &kv.spans, spans_at, keys.first, block, max_spans, tc,
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
    scratch: &mut Scratch<F>,
    #[comptime] config: FlashConfig,
) -> Array<Pair<f32>> {
    let value_dim = comptime!(config.value_dim);
    let at = UNIT_POS_Y as usize * comptime!(16 * padded(value_dim));
    scores_of_rows::<F>(
        &keys.v_held,
        &keys.v,
        at,
        tile,
        base,
        scratch,
        value_dim,
        config,
    )
}

/// One query tile of the dk/dv kernel for the plane's 16 keys: [`key_scores`],
/// [`value_scores`], `Pᵀ` and `dSᵀ`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`. Staged in turn
/// ([`FlashConfig::in_turn`], after [`stage_query_tile`] staged Q into buffer 0): `Sᵀ`; dO over
/// Q for `dPᵀ` and `dV`; Q again for `dK`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_tile<F: Float>(
    q: &Tensor<F>,
    dout: &Tensor<F>,
    kv: &mut QueryTiles<F>,
    keys: &mut KeyRows<F>,
    tile: &Listed,
    scale: f32,
    scratch: &mut Scratch<F>,
    #[comptime] config: FlashConfig,
) {
    let (head_dim, value_dim) = comptime!((config.head_dim, config.value_dim));
    let (block, tc, in_turn) = comptime!((config.block, config.tensor_cores, config.in_turn));
    let base = tile.buffer * block;
    let mut s = key_scores::<F>(kv, keys, tile, scale, scratch, config);
    let mut dp = if in_turn {
        sync_cube();
        stage_tile::<F>(dout, &mut kv.q, tile, value_dim, config);
        sync_cube();
        value_scores::<F>(keys, &kv.q, base, scratch, config)
    } else {
        value_scores::<F>(keys, &kv.dout, base, scratch, config)
    };
    let none = Array::<f32>::new(2usize);
    probabilities_and_ds(
        &mut s, &mut dp, &none, &none, &kv.lse, &kv.delta, base, block, false, tc,
    );
    if in_turn {
        add_product::<F>(&s, &kv.q, base, &mut keys.dv, scratch, value_dim, config);
        sync_cube();
        stage_tile::<F>(q, &mut kv.q, tile, head_dim, config);
        sync_cube();
    } else {
        add_product::<F>(&s, &kv.dout, base, &mut keys.dv, scratch, value_dim, config);
    }
    add_product::<F>(&dp, &kv.q, base, &mut keys.dk, scratch, head_dim, config);
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
    let (block, max_spans) = comptime!((config.block, config.max_spans));
    let buffers = comptime!(config.buffers());
    let slot = launch_slot();
    let groups = k.shape(1);
    if slot >= order.len() * groups {
        terminate!();
    }
    let key_tile = order[slot / groups] as usize;
    let kv_head = slot % groups;
    let group = q.shape(1) / k.shape(1);
    let first_key = key_tile * comptime!(16 * config.planes);
    let first_run = tile_offsets[key_tile] as usize;
    let end_run = tile_offsets[key_tile + 1] as usize;
    let total = count_tiles(tile_runs, first_run, end_run) * group;

    // Staged rows are copies, waited for only when there is a tile.
    let mut keys = KeyRows::<F>::load(k, v, first_key, kv_head, total > 0, config);
    // Staged in turn, dO takes Q's buffer.
    let (q_size, do_size) = comptime!(config.key_tile_sizes());
    let mut tiles = QueryTiles::<F> {
        q: SharedMemory::<F>::new_aligned(q_size, 16usize),
        dout: SharedMemory::<F>::new_aligned(do_size, 16usize),
        lse: SharedMemory::<f32>::new(buffers * block),
        delta: SharedMemory::<f32>::new(buffers * block),
        spans: SharedMemory::<u32>::new(buffers * block * 2 * max_spans),
    };
    let mut scratch = Scratch::<F>::products(config);
    let mut cursor = Cursor::start(tile_runs, first_run, end_run);

    if comptime!(config.async_copy) {
        let ready_0 = Barrier::shared(units as u32, UNIT_POS == 0);
        let ready_1 = Barrier::shared(units as u32, UNIT_POS == 0);
        // The key rows travel with the first query tile.
        if total > 0 {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head * group);
            stage_query_tile::<F>(q, dout, lse, delta, spans, &mut tiles, &tile, config);
            ready_0.commit_copy_async();
        }
        for i in 0..total {
            let buffer = i % 2;
            let tile = Listed::at(&cursor, tile_runs, buffer, kv_head * group);
            if i + 1 < total {
                cursor.advance(tile_runs, first_run, end_run);
                let next = Listed::at(&cursor, tile_runs, 1 - buffer, kv_head * group);
                stage_query_tile::<F>(q, dout, lse, delta, spans, &mut tiles, &next, config);
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
                q,
                dout,
                &mut tiles,
                &mut keys,
                &tile,
                scale,
                &mut scratch,
                config,
            );
            sync_cube();
        }
    } else {
        for _ in 0..total {
            let tile = Listed::at(&cursor, tile_runs, 0usize, kv_head * group);
            stage_query_tile::<F>(q, dout, lse, delta, spans, &mut tiles, &tile, config);
            sync_cube();
            dkdv_tile::<F>(
                q,
                dout,
                &mut tiles,
                &mut keys,
                &tile,
                scale,
                &mut scratch,
                config,
            );
            sync_cube();
            cursor.advance(tile_runs, first_run, end_run);
        }
    }
    let (tc, exact) = comptime!((config.tensor_cores, config.exact_dims));
    write_rows::<F>(
        &keys.dk, dk, keys.first, kv_head, scale, head_dim, exact, tc,
    );
    write_rows::<F>(&keys.dv, dv, keys.first, kv_head, 1.0, value_dim, exact, tc);
}
