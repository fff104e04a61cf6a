//! Whether a device and a problem can run the flash kernels, and their comptime shapes: planes
//! and row tiles per cube (the environment's pins, `BURN_DCP_FLASH_PLANES` and
//! `BURN_DCP_FLASH_ROW_TILES`, checked), shared-memory budgets.

use burn::tensor::DType;
use cubecl::features::{MmaConfig, Plane};
use cubecl::ir::{DeviceProperties, ElemType, FloatKind, StorageType};

use cubecl::prelude::CubeType;

use super::stage::padded;
use crate::definition::{AttentionShape, KernelError};

/// The comptime shape of one launch.
#[derive(CubeType, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashConfig {
    /// Head dim of q and k, rounded up to a multiple of 16 (the loads fill the padding with
    /// zeros, the writes skip it).
    pub head_dim: usize,
    /// Head dim of v, rounded up to a multiple of 16.
    pub value_dim: usize,
    /// Whether both dims are multiples of 16 (no padding: no bounds on the columns).
    pub exact_dims: bool,
    /// Planes (warps of 32 units) per cube, each owning `16 · row_tiles` rows.
    pub planes: usize,
    /// Row tiles of 16 per plane (forward: 1 or 2; the backward kernels: 1). Two halve the
    /// shared-memory reads per product (each K and V fragment serves both) at the price of
    /// reading Q from shared memory per tile.
    pub row_tiles: usize,
    /// Query heads of one kv head per cube (forward and dq): the planes split over them, and
    /// the cube's key and value tiles serve all of them.
    pub heads_per_cube: usize,
    /// Rows of the other side per staged tile (keys, or queries in the dk/dv kernel): a
    /// multiple of 16.
    pub block: usize,
    /// Span slots per query of the launch tables.
    pub max_spans: usize,
    /// `ldmatrix` and `mma.sync` (CUDA, sm_80+), or the plain bodies.
    pub tensor_cores: bool,
    /// Double-buffered `cp.async` copies (CUDA, sm_80+, dims multiples of 16), or plain loads.
    pub async_copy: bool,
    /// Products (without tensor cores) and row reductions by plane shuffles, or through
    /// shared memory ([`FlashBody`]).
    pub shuffles: bool,
    /// The other side's two tiles (K and V; dk/dv: Q and dO) staged one after the other in
    /// one buffer, each when its product needs it, instead of side by side: plain loads only,
    /// where both at once do not fit the device's shared memory (f32 at dims above ~220 on
    /// 32 KiB devices). One more `sync_cube` per tile (dk/dv: one more staging of Q).
    pub in_turn: bool,
}

impl FlashConfig {
    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes
    }

    /// Tokens per cube on the 16-row side (each of its `heads_per_cube` heads has them all).
    pub fn tokens_per_cube(&self) -> usize {
        16 * self.row_tiles * self.planes / self.heads_per_cube
    }

    /// Whether a cube stages its planes' own rows (the forward's Q, dq's Q and dO, dk/dv's K
    /// and V) in shared memory: for the copies, and for the forward's two row tiles (read per
    /// tile). Otherwise each plane reads them from global memory into registers once.
    pub fn stages_own_rows(&self) -> bool {
        self.async_copy || self.row_tiles > 1
    }

    /// Elements of the staged key and value tiles, all buffers (dk/dv: query and dO tiles): side
    /// by side, or, staged in turn, one as wide as the wider tile and a one-element stand-in.
    pub fn key_tile_sizes(&self) -> (usize, usize) {
        let k = self.block * padded(self.head_dim);
        let v = self.block * padded(self.value_dim);
        let (k, v) = if self.in_turn { (k.max(v), 1) } else { (k, v) };
        (self.buffers() * k, self.buffers() * v)
    }

    /// Columns of the staged tiles of `block` rows: both tiles' side by side, or the wider
    /// one's when they are staged in turn.
    pub fn staged_columns(&self) -> usize {
        if self.in_turn {
            padded(self.head_dim).max(padded(self.value_dim))
        } else {
            padded(self.head_dim) + padded(self.value_dim)
        }
    }

    /// Buffers per staged tile: two when copies overlap the products.
    pub fn buffers(&self) -> usize {
        if self.async_copy {
            2
        } else {
            1
        }
    }
}

/// Largest head or value dim of these kernels (their accumulators live in registers).
pub const FLASH_MAX_DIM: usize = 256;
/// Planes per cube (each owns 16 rows) of the backward kernels and of the plain bodies unless
/// [`PLANES_ENV`] says otherwise.
const PLANES: usize = 4;
/// Planes per cube of the forward on tensor cores unless [`PLANES_ENV`] says otherwise: on an
/// H200 (bf16, dim 128, `docs/gpu-runs/2026-11-27-h200-tuned.json`) 8 planes ran 8192 causal
/// tokens × 32 heads 17 % faster than 4 and the other shapes within the runs' noise; the
/// backward kernels ran slower on 8.
const FORWARD_PLANES: usize = 8;
/// A tuning knob, read once per process: the planes per cube of all three flash kernels (1, 2,
/// 4 or 8; default 8 for the forward on tensor cores, 4 otherwise).
pub const PLANES_ENV: &str = "BURN_DCP_FLASH_PLANES";

/// Row tiles per plane of the forward unless [`ROW_TILES_ENV`] says otherwise.
const ROW_TILES: usize = 2;
/// A tuning knob, read once per process: the forward's row tiles of 16 per plane (1 or 2;
/// default 2; always 1 above dim 128).
pub const ROW_TILES_ENV: &str = "BURN_DCP_FLASH_ROW_TILES";

type Knob = std::sync::OnceLock<Result<usize, KernelError>>;

/// A tuning knob read once per process into `cell`: the value of the variable `name`, one of
/// `allowed`, or `default` when unset.
fn knob(
    cell: &'static Knob,
    name: &str,
    default: usize,
    allowed: &[usize],
) -> Result<usize, KernelError> {
    cell.get_or_init(|| match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => value
            .parse::<usize>()
            .ok()
            .filter(|v| allowed.contains(v))
            .ok_or_else(|| {
                KernelError::InvalidValue(format!("{name}={value:?}: expected one of {allowed:?}"))
            }),
    })
    .clone()
}

fn row_tiles() -> Result<usize, KernelError> {
    static CELL: Knob = Knob::new();
    knob(&CELL, ROW_TILES_ENV, ROW_TILES, &[1, 2])
}

/// The planes per cube [`PLANES_ENV`] pins for every kernel, if set.
fn pinned_planes() -> Result<Option<usize>, KernelError> {
    static PINNED: std::sync::OnceLock<Result<Option<usize>, KernelError>> =
        std::sync::OnceLock::new();
    PINNED
        .get_or_init(|| match std::env::var_os(PLANES_ENV) {
            None => Ok(None),
            Some(_) => {
                static CELL: Knob = Knob::new();
                knob(&CELL, PLANES_ENV, PLANES, &[1, 2, 4, 8]).map(Some)
            }
        })
        .clone()
}

/// How the flash kernels' planes compute their products and row reductions (comptime: each
/// body is its own kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashBody {
    /// `ldmatrix`, `mma.sync`, `cp.async` copies and plane shuffles: f16/bf16 on CUDA sm_80+.
    TensorCores,
    /// Plain units whose rows of four lanes exchange values by plane shuffles, without a
    /// barrier: devices with plane (subgroup) shuffles, lavapipe among them
    /// ([`plain_body`](super::plain_body)).
    Shuffles,
    /// Plain units exchanging through shared memory (two barriers per product and per row
    /// reduction): any device.
    Shared,
}

impl FlashBody {
    /// Whether this body runs on tensor cores.
    pub fn tensor_cores(self) -> bool {
        self == Self::TensorCores
    }

    /// Whether this body's rows exchange values by plane shuffles.
    pub fn shuffles(self) -> bool {
        self != Self::Shared
    }
}

/// The most planes per cube of the forward and of the backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planes {
    pub forward: usize,
    pub backward: usize,
}

impl Planes {
    /// [`PLANES_ENV`]'s for both, or the defaults: 8 for the forward on tensor cores, 4
    /// otherwise.
    pub fn from_env(tensor_cores: bool) -> Result<Self, KernelError> {
        Ok(match pinned_planes()? {
            Some(planes) => Self::both(planes),
            None => Self {
                forward: if tensor_cores { FORWARD_PLANES } else { PLANES },
                backward: PLANES,
            },
        })
    }

    /// `planes` for all three kernels.
    pub fn both(planes: usize) -> Self {
        Self {
            forward: planes,
            backward: planes,
        }
    }
}

/// The three kernels' comptime shapes for one problem on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashPlan {
    pub forward: FlashConfig,
    pub dq: FlashConfig,
    pub dkdv: FlashConfig,
}

impl FlashPlan {
    /// The plan for `shape` in `dtype` with `max_spans` span slots in `body`: on tensor cores
    /// (`ldmatrix`, `mma.sync`, `cp.async`, plane shuffles: CUDA sm_80+) or on plain units.
    /// Errors name what is missing.
    pub fn new(
        properties: &DeviceProperties,
        dtype: DType,
        shape: &AttentionShape,
        max_spans: usize,
        body: FlashBody,
    ) -> Result<Self, KernelError> {
        flash_fits(properties, dtype, shape, body.tensor_cores())?;
        let limit = properties.hardware.max_shared_memory_size;
        Self::sized(limit, dtype, shape, max_spans, body)
    }

    /// The plan for a device with `limit` bytes of shared memory per cube (the features
    /// unchecked: [`flash_fits`] checks them). Errors when even the smallest cubes do not fit.
    pub fn sized(
        limit: usize,
        dtype: DType,
        shape: &AttentionShape,
        max_spans: usize,
        body: FlashBody,
    ) -> Result<Self, KernelError> {
        let planes = Planes::from_env(body.tensor_cores())?;
        Self::sized_with_planes(limit, dtype, shape, max_spans, body, planes)
    }

    /// [`Self::sized`] with at most `planes` planes per cube (1, 2, 4 or 8) instead of
    /// [`PLANES_ENV`]'s or the defaults. The forward's cube size changes its speed, never its
    /// result: every row sees the same key tiles in the same order.
    pub fn sized_with_planes(
        limit: usize,
        dtype: DType,
        shape: &AttentionShape,
        max_spans: usize,
        body: FlashBody,
        planes: Planes,
    ) -> Result<Self, KernelError> {
        let tensor_cores = body.tensor_cores();
        for most in [planes.forward, planes.backward] {
            if ![1, 2, 4, 8].contains(&most) {
                return Err(KernelError::InvalidValue(format!(
                    "{most} planes per flash cube: expected 1, 2, 4 or 8"
                )));
            }
        }
        let (head_dim, value_dim) = (shape.head_dim, shape.value_dim);
        let exact_dims = head_dim.is_multiple_of(16) && value_dim.is_multiple_of(16);
        // `cp.async` copies on tensor cores at dims that are multiples of 16; plain loads else.
        let async_copy = tensor_cores && exact_dims;
        let group = shape.heads / shape.kv_heads;
        // Query heads of one kv head share a cube's key and value tiles.
        let heads_per_cube = |most: usize| {
            [4, 2, 1]
                .into_iter()
                .find(|&h| h <= most && group.is_multiple_of(h) && most.is_multiple_of(h))
                .unwrap_or(1)
        };
        let widest = head_dim.max(value_dim);
        let config = |(planes, row_tiles, block): (usize, usize, usize),
                      heads: usize,
                      in_turn: bool| FlashConfig {
            head_dim: head_dim.next_multiple_of(16),
            value_dim: value_dim.next_multiple_of(16),
            exact_dims,
            planes,
            row_tiles,
            heads_per_cube: heads.min(planes),
            block,
            max_spans,
            tensor_cores,
            async_copy,
            shuffles: body.shuffles(),
            in_turn,
        };
        // Planes, row tiles and tiles, largest first, until the cube fits the device's shared
        // memory: key tiles of 64 in the forward; 32 in dq above dim 64 (its S, dP and dQ share
        // the registers); query tiles of 32 in dk/dv (its dK and dV take the registers). Only
        // the forward takes two row tiles per plane.
        let dq_block = if widest > 64 { 32 } else { 64 };
        let shapes = |most: usize, block: usize, tiles: usize| {
            [
                (most, tiles, block),
                ((most / 2).max(1), tiles, block),
                (most, 1, block),
                (most, 1, 32),
                (2, 1, 32),
                (2, 1, 16),
                (1, 1, 16),
            ]
        };
        let pick = |name: &str,
                    most: usize,
                    block: usize,
                    tiles: usize,
                    heads: usize,
                    bytes: fn(&FlashConfig, DType) -> usize| {
            let fitting = shapes(most, block, tiles)
                .into_iter()
                .filter(|&(planes, _, b)| planes <= most && b <= block);
            // The tiles in turn only where no shape fits them side by side (plain loads).
            let turns: &[bool] = if async_copy { &[false] } else { &[false, true] };
            turns
                .iter()
                .flat_map(|&turn| fitting.clone().map(move |shape| config(shape, heads, turn)))
                .find(|c| bytes(c, dtype) <= limit)
                .ok_or_else(|| {
                    let smallest = config((1, 1, 16), 1, !async_copy);
                    KernelError::Unsupported(format!(
                        "the flash {name} kernel at head dim {head_dim} and value dim \
                         {value_dim} ({dtype:?}, {max_spans} span slots) needs {} bytes of \
                         shared memory per cube at least; this device has {limit}",
                        bytes(&smallest, dtype)
                    ))
                })
        };
        // Two row tiles per plane above dim 64 hold twice the accumulators: key tiles of 32;
        // above dim 128 one row tile (the registers of two would spill).
        let tiles = if widest > 128 { 1 } else { row_tiles()? };
        let forward_block = if tiles > 1 && widest > 64 { 32 } else { 64 };
        Ok(Self {
            forward: pick(
                "forward",
                planes.forward,
                forward_block,
                tiles,
                heads_per_cube(planes.forward),
                forward_bytes,
            )?,
            dq: pick(
                "dq",
                planes.backward,
                dq_block,
                1,
                heads_per_cube(planes.backward),
                dq_bytes,
            )?,
            dkdv: pick("dk/dv", planes.backward, 32, 1, 1, dkdv_bytes)?,
        })
    }
}

/// `rows` where a cube of `c` stages its own rows ([`FlashConfig::stages_own_rows`]), else 0.
fn staged_rows(c: &FlashConfig, rows: usize) -> usize {
    if c.stages_own_rows() {
        rows
    } else {
        0
    }
}

/// Bytes of shared memory of one forward cube.
fn forward_bytes(c: &FlashConfig, dtype: DType) -> usize {
    let rows = staged_rows(c, 16 * c.row_tiles * c.planes);
    let inputs = rows * padded(c.head_dim) + c.buffers() * c.block * c.staged_columns();
    dtype.size() * inputs + 4 * (c.tokens_per_cube() * 2 * c.max_spans) + scratch(c, dtype)
}

/// Bytes of shared memory of one dq cube.
fn dq_bytes(c: &FlashConfig, dtype: DType) -> usize {
    let rows = staged_rows(c, 16 * c.planes);
    let inputs = rows * (padded(c.head_dim) + padded(c.value_dim))
        + c.buffers() * c.block * c.staged_columns();
    dtype.size() * inputs + 4 * (c.tokens_per_cube() * 2 * c.max_spans) + scratch(c, dtype)
}

/// Bytes of shared memory of one dk/dv cube.
fn dkdv_bytes(c: &FlashConfig, dtype: DType) -> usize {
    let rows = staged_rows(c, 16 * c.planes);
    let per_row = padded(c.head_dim) + padded(c.value_dim);
    let inputs = rows * per_row + c.buffers() * c.block * c.staged_columns();
    let values = c.buffers() * c.block * (2 + 2 * c.max_spans);
    dtype.size() * inputs + 4 * values + scratch(c, dtype)
}
/// Bytes of the plain bodies' scratch, the barriers and alignment.
fn scratch(config: &FlashConfig, dtype: DType) -> usize {
    let product = if config.shuffles {
        0
    } else {
        config.planes * super::fragment::PRODUCT_SCRATCH * dtype.size()
    };
    let reduce = if config.shuffles {
        0
    } else {
        config.planes * super::fragment::REDUCE_SCRATCH * 4
    };
    product + reduce + 8 * 64
}

/// Whether the flash kernels take `shape` in `dtype` on this device: head and value dims
/// up to [`FLASH_MAX_DIM`] (padded inside to multiples of 16); with tensor cores f16/bf16 on a device with the
/// `m16n8k16` product into f32, `ldmatrix`, `cp.async` and plane shuffles on planes of 32.
pub fn flash_fits(
    properties: &DeviceProperties,
    dtype: DType,
    shape: &AttentionShape,
    tensor_cores: bool,
) -> Result<(), KernelError> {
    for (name, dim) in [("head", shape.head_dim), ("value", shape.value_dim)] {
        if dim == 0 || dim > FLASH_MAX_DIM {
            return Err(KernelError::Unsupported(format!(
                "the flash kernels take {name} dims from 1 to {FLASH_MAX_DIM}, not {dim}"
            )));
        }
    }
    if !tensor_cores {
        return Ok(());
    }
    let kind = match dtype {
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        other => {
            return Err(KernelError::Unsupported(format!(
                "the flash kernels' tensor cores take f16 or bf16 inputs, not {other:?}"
            )))
        }
    };
    let input: StorageType = ElemType::Float(kind).into();
    let features = &properties.features;
    let mma = MmaConfig {
        a_type: input,
        b_type: input,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 16,
    };
    let plane = (
        properties.hardware.plane_size_min,
        properties.hardware.plane_size_max,
    );
    let missing = [
        (
            !features.matmul.mma.contains(&mma),
            "the m16n8k16 mma.sync product into f32",
        ),
        (!features.matmul.ldmatrix.contains(&input), "ldmatrix"),
        (!features.copy_async, "cp.async copies"),
        (!features.plane.contains(Plane::Ops), "plane shuffles"),
        (plane != (32, 32), "planes of 32 units"),
    ];
    match missing.iter().find(|(lacks, _)| *lacks) {
        Some((_, what)) => Err(KernelError::Unsupported(format!(
            "the flash kernels need {what} for {dtype:?} on this device (CUDA, sm_80 or newer)"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
