//! Host side of the matrix-tile kernels ([`super::matrix`]): which kernels run, whether the device
//! can run them, and their launches.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::features::MmaConfig;
use cubecl::ir::{DeviceProperties, ElemType, FloatKind};
use cubecl::{CubeCount, CubeDim};

use super::flash::FlashPlan;
use super::matrix::{self, TILE};
use super::{empty, storage, upload_u32, QueryTables};
use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::tiling::{DenseSpans, TileIntervals};

/// Which kernels [`super::forward_with`] and [`super::backward_with`] run; [`super::forward`]
/// and [`super::backward`] (every `FlashOps` call, hence `ContextParallel`) take it from
/// [`KERNEL_ENV`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The vector kernels ([`super::kernels`]), on every device.
    Vector,
    /// The fastest kernels the device and the problem allow: the flash kernels
    /// ([`super::flash`]: f16/bf16 on CUDA sm_80+, head and value dims multiples of 16 up to
    /// 128), else matrix tiles on tensor cores (f16/bf16 on devices with `cmma`, tiles within
    /// shared memory), else the vector kernels (f32, lavapipe). The default.
    #[default]
    Auto,
    /// The flash kernels ([`super::flash`]), or an error naming what the device or the problem
    /// lacks. With `tensor_cores: false` their products, loads and reductions run on plain
    /// units, on any device and for f32 too: the path CI tests on lavapipe.
    Flash { tensor_cores: bool },
    /// The matrix-tile kernels ([`super::matrix`]), or an error naming what the device lacks.
    /// With `tensor_cores: false` their tile products run on ordinary units, on any device and
    /// for f32 too: the path CI tests on lavapipe.
    MatrixTiles { tensor_cores: bool },
}

/// The environment variable [`super::forward`] and [`super::backward`] read their
/// [`AttentionKernel`] from (once per process): `vector`, `auto` (also when unset), `tiles` (matrix tiles without
/// tensor cores), `tensor-cores`, `flash` or `flash-plain` (the flash kernels without tensor cores).
pub const KERNEL_ENV: &str = "BURN_DCP_ATTENTION_KERNEL";

impl AttentionKernel {
    /// The kernel [`KERNEL_ENV`] names ([`AttentionKernel::Auto`] when it is unset), read
    /// once per process (at the first kernel call), so every call of the process agrees.
    pub fn from_env() -> Result<Self, KernelError> {
        static CHOICE: std::sync::OnceLock<Result<AttentionKernel, KernelError>> =
            std::sync::OnceLock::new();
        CHOICE.get_or_init(Self::read_env).clone()
    }

    fn read_env() -> Result<Self, KernelError> {
        match std::env::var(KERNEL_ENV) {
            Ok(value) => value.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(value)) => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={value:?} is not Unicode"
            ))),
        }
    }
}

impl std::str::FromStr for AttentionKernel {
    type Err = KernelError;

    fn from_str(value: &str) -> Result<Self, KernelError> {
        match value {
            "vector" => Ok(Self::Vector),
            "auto" => Ok(Self::Auto),
            "tiles" => Ok(Self::MatrixTiles {
                tensor_cores: false,
            }),
            "tensor-cores" => Ok(Self::MatrixTiles { tensor_cores: true }),
            "flash" => Ok(Self::Flash { tensor_cores: true }),
            "flash-plain" => Ok(Self::Flash {
                tensor_cores: false,
            }),
            other => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={other:?}: expected one of vector, auto, tiles, tensor-cores, \
                 flash, flash-plain"
            ))),
        }
    }
}

/// Units per plane of the matrix-tile kernel: a CUDA warp (the `cmma` fragments are per warp).
const PLANE_DIM: usize = 32;

/// The launch geometry of one matrix-tile kernel on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MatrixTiles {
    /// Planes per cube, each owning 16 rows (queries, or keys in the dk/dv kernel).
    planes: usize,
    head_pad: usize,
    value_pad: usize,
    tensor_cores: bool,
}

/// The matrix-tile kernels, each with its shared memory per cube.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TilesKernel {
    Forward,
    Dq,
    DkDv,
}

impl TilesKernel {
    /// The kernels of one pass: the forward, or the backward's dq and dk/dv (in this order,
    /// as [`backward_on_tiles`] takes their geometries).
    pub(super) fn of_pass(backward: bool) -> &'static [TilesKernel] {
        if backward {
            &[Self::Dq, Self::DkDv]
        } else {
            &[Self::Forward]
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Dq => "dq",
            Self::DkDv => "dk/dv",
        }
    }

    /// Bytes of shared memory of one cube of `planes` planes: the input-dtype tiles, the f32
    /// tiles and row values, the u32 spans and flags, and up to 31 bytes of alignment per array.
    fn shared_bytes(
        self,
        planes: usize,
        head_pad: usize,
        value_pad: usize,
        max_spans: usize,
        element: usize,
    ) -> usize {
        let rows = TILE * planes;
        let (hp, vp) = (head_pad, value_pad);
        let (inputs, f32s, u32s, arrays) = match self {
            // Q rows, K, V, P; S, O, max/sum/alpha; seen, spans.
            Self::Forward => (
                rows * hp + TILE * hp + TILE * vp + rows * TILE,
                rows * TILE + rows * vp + 3 * rows,
                rows + rows * 2 * max_spans,
                9,
            ),
            // Q, dO rows, K, V, dS; S, dP, dQ, lse, delta; spans.
            Self::Dq => (
                rows * hp + rows * vp + TILE * hp + TILE * vp + rows * TILE,
                2 * rows * TILE + rows * hp + 2 * rows,
                rows * 2 * max_spans,
                11,
            ),
            // K, V rows, Q, dO, P, dS; S, dP, dK, dV, lse, delta; spans.
            Self::DkDv => (
                rows * hp + rows * vp + TILE * hp + TILE * vp + 2 * rows * TILE,
                2 * rows * TILE + rows * hp + rows * vp + 2 * TILE,
                TILE * 2 * max_spans,
                13,
            ),
        };
        element * inputs + 4 * (f32s + u32s) + arrays * 32
    }
}

impl MatrixTiles {
    /// The most planes per cube (4, 2 or 1) with which `kernel` fits the device's shared memory,
    /// or why the device cannot run it.
    pub(super) fn fit(
        kernel: TilesKernel,
        properties: &DeviceProperties,
        dtype: DType,
        shape: &AttentionShape,
        max_spans: usize,
        tensor_cores: bool,
    ) -> Result<Self, KernelError> {
        if tensor_cores {
            check_tensor_cores(properties, dtype)?;
        }
        let head_pad = shape.head_dim.div_ceil(TILE) * TILE;
        let value_pad = shape.value_dim.div_ceil(TILE) * TILE;
        let limit = properties.hardware.max_shared_memory_size;
        let units_limit = properties.hardware.max_units_per_cube as usize;
        let bytes = |planes: usize| {
            kernel.shared_bytes(planes, head_pad, value_pad, max_spans, dtype.size())
        };
        let planes = [4, 2, 1]
            .into_iter()
            .find(|&planes| bytes(planes) <= limit && planes * PLANE_DIM <= units_limit)
            .ok_or_else(|| {
                KernelError::Unsupported(format!(
                    "the matrix-tile {} kernel at head dim {} and value dim {} ({:?}, \
                     {max_spans} span slots) needs {} bytes of shared memory per cube of \
                     {PLANE_DIM} units; this device has {limit} bytes and {units_limit} units \
                     per cube",
                    kernel.name(),
                    shape.head_dim,
                    shape.value_dim,
                    dtype,
                    bytes(1)
                ))
            })?;
        Ok(Self {
            planes,
            head_pad,
            value_pad,
            tensor_cores,
        })
    }

    /// Rows (queries or keys) per cube.
    pub(super) fn rows(&self) -> usize {
        TILE * self.planes
    }

    /// The kernel's comptime configuration for `shape`, `max_spans` span slots per row.
    fn config(&self, shape: &AttentionShape, max_spans: usize) -> matrix::TileConfig {
        matrix::TileConfig {
            head_dim: shape.head_dim,
            value_dim: shape.value_dim,
            head_pad: self.head_pad,
            value_pad: self.value_pad,
            planes: self.planes,
            plane_dim: PLANE_DIM,
            max_spans,
            tensor_cores: self.tensor_cores,
        }
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(PLANE_DIM as u32, self.planes as u32)
    }
}

/// The flash kernels' plan for `kernel`, or `None` for the others: `Auto` takes them where
/// they fit, a forced choice errors where they do not.
pub(super) fn choose_flash(
    kernel: AttentionKernel,
    properties: &DeviceProperties,
    dtype: DType,
    shape: &AttentionShape,
    max_spans: usize,
) -> Result<Option<FlashPlan>, KernelError> {
    match kernel {
        AttentionKernel::Auto => Ok(FlashPlan::new(properties, dtype, shape, max_spans, true).ok()),
        AttentionKernel::Flash { tensor_cores } => {
            FlashPlan::new(properties, dtype, shape, max_spans, tensor_cores).map(Some)
        }
        _ => Ok(None),
    }
}

/// The geometries of the three kernels for `kernel`, or `None` for the vector kernels: `Auto`
/// takes tensor cores only where all three fit, a forced choice errors where one does not.
pub(super) fn choose(
    kernel: AttentionKernel,
    properties: &DeviceProperties,
    dtype: DType,
    shape: &AttentionShape,
    max_spans: usize,
    kernels: &[TilesKernel],
) -> Result<Option<Vec<MatrixTiles>>, KernelError> {
    let fit_all = |tensor_cores: bool| {
        kernels
            .iter()
            .map(|&k| MatrixTiles::fit(k, properties, dtype, shape, max_spans, tensor_cores))
            .collect::<Result<Vec<_>, _>>()
    };
    match kernel {
        AttentionKernel::Vector | AttentionKernel::Flash { .. } => Ok(None),
        AttentionKernel::Auto => Ok(fit_all(true).ok()),
        AttentionKernel::MatrixTiles { tensor_cores } => fit_all(tensor_cores).map(Some),
    }
}

/// Errors unless the device multiplies 16 × 16 × 16 tiles of `dtype` into f32 on planes of
/// [`PLANE_DIM`] units.
fn check_tensor_cores(properties: &DeviceProperties, dtype: DType) -> Result<(), KernelError> {
    let kind = match dtype {
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        other => {
            return Err(KernelError::Unsupported(format!(
                "tensor cores take f16 or bf16 inputs, not {other:?} (f32 runs on the vector \
                 kernel or on matrix tiles without tensor cores)"
            )))
        }
    };
    let config = MmaConfig {
        a_type: ElemType::Float(kind).into(),
        b_type: ElemType::Float(kind).into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: TILE as u32,
        n: TILE as u32,
        k: TILE as u32,
    };
    if !properties.features.matmul.cmma.contains(&config) {
        return Err(KernelError::Unsupported(format!(
            "no tensor-core (cmma) product of 16 x 16 x 16 {dtype:?} tiles into f32 on this device"
        )));
    }
    let (min, max) = (
        properties.hardware.plane_size_min,
        properties.hardware.plane_size_max,
    );
    if min != PLANE_DIM as u32 || max != PLANE_DIM as u32 {
        return Err(KernelError::Unsupported(format!(
            "the tensor-core kernel runs on planes of {PLANE_DIM} units; this device's planes \
             have {min} to {max}"
        )));
    }
    Ok(())
}

/// Launches the matrix-tile forward: `(out, lse)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_on_tiles<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    problem: &VarlenAttention,
    s: &AttentionShape,
    dtype: DType,
    dense: DenseSpans,
    tiles: MatrixTiles,
) -> Result<(CubeTensor<R>, CubeTensor<R>), KernelError> {
    let rows = tiles.rows();
    let tables = QueryTables::build(&q, dense, rows, TILE);
    let out = empty(&q, vec![s.q_tokens, s.heads, s.value_dim], dtype);
    let lse = empty(&q, vec![s.heads, s.q_tokens], DType::F32);
    let client = q.client.clone();
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked
    // by the caller; shared memory was sized by `MatrixTiles::fit`.
    unsafe {
        matrix::forward_tiles_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(s.q_tokens.div_ceil(rows) as u32, s.heads as u32, 1),
            tiles.cube_dim(),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            tables.spans.into_tensor_arg(),
            tables.offsets.into_tensor_arg(),
            tables.runs.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            problem.softmax_scale(s.head_dim) as f32,
            f32::NEG_INFINITY,
            tiles.config(s, tables.max_spans),
            storage(dtype),
        );
    }
    Ok((out, lse))
}

/// Launches the matrix-tile backward (`delta` already computed): `(dq, dk, dv)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_on_tiles<R: CubeRuntime>(
    [q, k, v, dout, lse, delta]: [CubeTensor<R>; 6],
    problem: &VarlenAttention,
    s: &AttentionShape,
    dtype: DType,
    dense: DenseSpans,
    [dq_tiles, dkdv_tiles]: [MatrixTiles; 2],
) -> super::Gradients<R> {
    let client = q.client.clone();
    let scale = problem.softmax_scale(s.head_dim) as f32;
    let dq = empty(&q, vec![s.q_tokens, s.heads, s.head_dim], dtype);
    let dk = empty(&q, vec![s.kv_tokens, s.kv_heads, s.head_dim], dtype);
    let dv = empty(&q, vec![s.kv_tokens, s.kv_heads, s.value_dim], dtype);
    let key_rows = dkdv_tiles.rows();
    let key_tiles = s.kv_tokens.div_ceil(key_rows);
    let by_key = TileIntervals::by_query_tile(&dense, TILE, key_rows).transpose(key_tiles);
    let tables = QueryTables::build(&q, dense, dq_tiles.rows(), TILE);
    // SAFETY: every index the kernel reads or writes is bounded by the shapes and tables checked
    // by the caller; shared memory was sized by `MatrixTiles::fit`.
    unsafe {
        matrix::dkdv_tiles_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(key_tiles as u32, s.kv_heads as u32, 1),
            dkdv_tiles.cube_dim(),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            tables.spans.clone().into_tensor_arg(),
            upload_u32(&client, &q.device, &by_key.offsets).into_tensor_arg(),
            upload_u32(&client, &q.device, &by_key.intervals).into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            dkdv_tiles.config(s, tables.max_spans),
            storage(dtype),
        );
    }
    // SAFETY: as above.
    unsafe {
        matrix::dq_tiles_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(
                s.q_tokens.div_ceil(dq_tiles.rows()) as u32,
                s.heads as u32,
                1,
            ),
            dq_tiles.cube_dim(),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            tables.spans.into_tensor_arg(),
            tables.offsets.into_tensor_arg(),
            tables.runs.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            dq_tiles.config(s, tables.max_spans),
            storage(dtype),
        );
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_parse_and_bad_ones_name_the_choices() {
        assert_eq!("vector".parse(), Ok(AttentionKernel::Vector));
        assert_eq!("auto".parse(), Ok(AttentionKernel::Auto));
        assert_eq!(
            "tiles".parse(),
            Ok(AttentionKernel::MatrixTiles {
                tensor_cores: false
            })
        );
        assert_eq!(
            "tensor-cores".parse(),
            Ok(AttentionKernel::MatrixTiles { tensor_cores: true })
        );
        assert_eq!(
            "flash".parse(),
            Ok(AttentionKernel::Flash { tensor_cores: true })
        );
        assert_eq!(
            "flash-plain".parse(),
            Ok(AttentionKernel::Flash {
                tensor_cores: false
            })
        );
        let err = "cmma".parse::<AttentionKernel>().unwrap_err().to_string();
        assert!(
            err.contains("BURN_DCP_ATTENTION_KERNEL=\"cmma\"") && err.contains("tensor-cores"),
            "{err}"
        );
    }

    #[test]
    fn shared_memory_of_each_kernel() {
        // f16, D = Dv = 128, one span slot, 4 planes (64 rows): Q 64·128 + K 16·128 + V 16·128
        // + P 64·16 halves (26 624 B); S 64·16 + O 64·128 + stats 3·64 floats and seen 64 +
        // spans 64·2 words (38 400 B); 9 · 32 B of alignment: 65 312 B. 2 planes: 36 896 B
        // (over lavapipe's 32 KiB); 1 plane: 22 688 B.
        let forward = |planes| TilesKernel::Forward.shared_bytes(planes, 128, 128, 1, 2);
        assert_eq!(forward(4), 65_312);
        assert_eq!(forward(2), 36_896);
        assert_eq!(forward(1), 22_688);
        // dk/dv, 1 plane: K, V rows, Q, dO 16·128 each + P, dS 16·16 halves (17 408 B); S, dP
        // 16·16 + dK, dV 16·128 + lse, delta 16 floats (18 560 B); spans 32 words; 13 · 32 B.
        assert_eq!(TilesKernel::DkDv.shared_bytes(1, 128, 128, 1, 2), 36_512);
    }
}
