//! Host side of the matrix-tile forward ([`super::matrix`]): which kernel runs, whether the device
//! can run it, and its launch.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::features::MmaConfig;
use cubecl::ir::{DeviceProperties, ElemType, FloatKind};
use cubecl::{CubeCount, CubeDim};

use super::matrix::{self, TILE};
use super::{empty, storage, QueryTables};
use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::tiling::DenseSpans;

/// Which forward kernel [`super::forward_with`] runs; [`super::forward`] (every `FlashOps`
/// call, hence `ContextParallel`) takes it from [`FORWARD_KERNEL_ENV`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForwardKernel {
    /// The vector kernel ([`super::kernels::forward_kernel`]), on every device. The default:
    /// the tensor-core path has not yet run on a GPU (none was available to this project), so
    /// it is opt-in until `tests/cube_cuda.rs` has passed on one.
    #[default]
    Vector,
    /// Matrix tiles on tensor cores where the device has them for the inputs (f16/bf16 in, f32
    /// accumulation, 16 × 16 × 16, planes of 32 units) and the tiles fit its shared memory; the
    /// vector kernel otherwise.
    Auto,
    /// The matrix-tile kernel ([`super::matrix::forward_tiles_kernel`]), or an error naming
    /// what the device lacks. With `tensor_cores: false` its tile products run on ordinary
    /// units, on any device and for f32 too: the path CI tests on lavapipe.
    MatrixTiles { tensor_cores: bool },
}

/// The environment variable [`super::forward`] reads its [`ForwardKernel`] from: `vector`
/// (also when unset), `auto`, `tiles` (matrix tiles without tensor cores) or `tensor-cores`.
pub const FORWARD_KERNEL_ENV: &str = "BURN_DCP_FORWARD_KERNEL";

impl ForwardKernel {
    /// The kernel [`FORWARD_KERNEL_ENV`] names ([`ForwardKernel::Vector`] when it is unset).
    pub fn from_env() -> Result<Self, KernelError> {
        match std::env::var(FORWARD_KERNEL_ENV) {
            Ok(value) => value.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(value)) => Err(KernelError::InvalidValue(format!(
                "{FORWARD_KERNEL_ENV}={value:?} is not Unicode"
            ))),
        }
    }
}

impl std::str::FromStr for ForwardKernel {
    type Err = KernelError;

    fn from_str(value: &str) -> Result<Self, KernelError> {
        match value {
            "vector" => Ok(Self::Vector),
            "auto" => Ok(Self::Auto),
            "tiles" => Ok(Self::MatrixTiles {
                tensor_cores: false,
            }),
            "tensor-cores" => Ok(Self::MatrixTiles { tensor_cores: true }),
            other => Err(KernelError::InvalidValue(format!(
                "{FORWARD_KERNEL_ENV}={other:?}: expected one of vector, auto, tiles, tensor-cores"
            ))),
        }
    }
}

/// Units per plane of the matrix-tile kernel: a CUDA warp (the `cmma` fragments are per warp).
const PLANE_DIM: usize = 32;

/// The launch geometry of the matrix-tile kernel on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MatrixTiles {
    /// Planes per cube, each owning 16 queries.
    planes: usize,
    head_pad: usize,
    value_pad: usize,
    tensor_cores: bool,
}

impl MatrixTiles {
    /// The most planes per cube (4, 2 or 1) whose tiles fit the device's shared memory, or why
    /// the device cannot run the kernel.
    pub(super) fn fit(
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
        let bytes =
            |planes: usize| shared_bytes(planes, head_pad, value_pad, max_spans, dtype.size());
        let planes = [4, 2, 1]
            .into_iter()
            .find(|&planes| bytes(planes) <= limit && planes * PLANE_DIM <= units_limit)
            .ok_or_else(|| {
                KernelError::Unsupported(format!(
                    "the matrix-tile forward at head dim {} and value dim {} ({:?}, {max_spans} \
                     span slots) needs {} bytes of shared memory per cube of {PLANE_DIM} units; \
                     this device has {limit} bytes and {units_limit} units per cube",
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
}

/// Shared memory of one cube of the matrix-tile kernel: Q rows, K and V tiles, P (input dtype);
/// S, O, the row statistics (f32) and the spans (u32).
fn shared_bytes(
    planes: usize,
    head_pad: usize,
    value_pad: usize,
    max_spans: usize,
    element: usize,
) -> usize {
    let rows = TILE * planes;
    let inputs = rows * head_pad + TILE * head_pad + TILE * value_pad + rows * TILE;
    let f32s = rows * TILE + rows * value_pad + 3 * rows;
    let u32s = rows + rows * 2 * max_spans;
    // Each of the nine arrays may start up to 31 bytes later for its 32-byte alignment.
    element * inputs + 4 * (f32s + u32s) + 9 * 32
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
    let rows = TILE * tiles.planes;
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
            CubeDim::new_2d(PLANE_DIM as u32, tiles.planes as u32),
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
            s.head_dim,
            s.value_dim,
            tiles.head_pad,
            tiles.value_pad,
            tiles.planes,
            PLANE_DIM,
            tables.max_spans,
            tiles.tensor_cores,
            storage(dtype),
        );
    }
    Ok((out, lse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_parse_and_bad_ones_name_the_choices() {
        assert_eq!("vector".parse(), Ok(ForwardKernel::Vector));
        assert_eq!("auto".parse(), Ok(ForwardKernel::Auto));
        assert_eq!(
            "tiles".parse(),
            Ok(ForwardKernel::MatrixTiles {
                tensor_cores: false
            })
        );
        assert_eq!(
            "tensor-cores".parse(),
            Ok(ForwardKernel::MatrixTiles { tensor_cores: true })
        );
        let err = "cmma".parse::<ForwardKernel>().unwrap_err().to_string();
        assert!(
            err.contains("BURN_DCP_FORWARD_KERNEL=\"cmma\"") && err.contains("tensor-cores"),
            "{err}"
        );
    }

    #[test]
    fn shared_memory_decides_the_planes_per_cube() {
        // f16, D = Dv = 128, one span slot, 4 planes (64 rows): Q 64·128 + K 16·128 + V 16·128
        // + P 64·16 halves (26 624 B); S 64·16 + O 64·128 + stats 3·64 floats and seen 64 +
        // spans 64·2 words (38 400 B); 9 · 32 B of alignment: 65 312 B. 2 planes: 36 896 B
        // (over lavapipe's 32 KiB); 1 plane: 22 688 B.
        assert_eq!(shared_bytes(4, 128, 128, 1, 2), 65_312);
        assert_eq!(shared_bytes(2, 128, 128, 1, 2), 36_896);
        assert_eq!(shared_bytes(1, 128, 128, 1, 2), 22_688);
    }
}
