//! The backend extension trait: attention with LSE, its backward and the merge, on burn tensors.
//!
//! Strategies (Ulysses, ring, all-gather, USP) call only these three operations, so a backend with
//! its own kernels (the cubecl kernels for wgpu/CUDA) slots in by implementing [`FlashOps`], and
//! every strategy runs on it unchanged. The provided methods run the portable host implementation
//! ([`crate::portable`]), which is the implementation for CPU backends such as burn Flex.

use burn::prelude::{Backend, Tensor};
use burn::tensor::{DType, TensorCreationOptions, TensorData};

use crate::definition::{AttentionShape, BackwardTensors, KernelError, VarlenAttention};
use crate::portable;

/// A tensor of `dims` filled with `value`; one with no elements is allocated without a launch
/// (cubecl on CUDA refuses a launch of zero cubes, `CUDA_ERROR_INVALID_VALUE`, seen on an H100
/// from DCP's empty pieces and from a rank with no tokens; wgpu accepts it). The strategies' and
/// the kernels' degenerate outputs are made by it.
pub fn filled<B: Backend, const D: usize>(
    dims: [usize; D],
    value: f32,
    options: TensorCreationOptions<B>,
) -> Tensor<B, D> {
    match dims.contains(&0) {
        true => Tensor::empty(dims, options),
        false => Tensor::full(dims, value, options),
    }
}

/// A device's memory as its allocator sees it, in bytes: what live tensors use, and what the
/// allocator holds from the device (the pools' pages; the analogue of torch's
/// `memory_reserved`). cubecl's pools keep their pages, so `reserved` sampled after a step is the
/// step's high-water mark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    pub in_use: u64,
    pub reserved: u64,
}

/// Forward result: `out [q_tokens, heads, value_dim]` (input dtype), `lse [heads, q_tokens]` (f32).
#[derive(Clone, Debug)]
pub struct FlashOutput<B: Backend> {
    pub out: Tensor<B, 3>,
    pub lse: Tensor<B, 2>,
}

/// Backward result, each in the dtype and shape of its input: `dq [q_tokens, heads, head_dim]`,
/// `dk [kv_tokens, kv_heads, head_dim]`, `dv [kv_tokens, kv_heads, value_dim]`.
#[derive(Clone, Debug)]
pub struct FlashGradients<B: Backend> {
    pub dq: Tensor<B, 3>,
    pub dk: Tensor<B, 3>,
    pub dv: Tensor<B, 3>,
}

/// A backward pass's burn tensors: `lse [heads, q_tokens]`, the others `[tokens, heads, dim]`.
pub type FlashBackward<B> = BackwardTensors<Tensor<B, 3>, Tensor<B, 2>>;

impl<B: Backend> FlashBackward<B> {
    /// The backward of `forward`, the output of `q`, `k`, `v` (after any merge), for `dout`.
    pub fn new(
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        forward: FlashOutput<B>,
        dout: Tensor<B, 3>,
    ) -> Self {
        let FlashOutput { out, lse } = forward;
        Self {
            q,
            k,
            v,
            out,
            lse,
            dout,
        }
    }
}

/// Attention with LSE over packed varlen sequences (see [`VarlenAttention`] for the layout).
pub trait FlashOps: Backend {
    /// What this backend's kernels take beyond the rules every backend shares. [`check_forward`],
    /// [`check_backward`] and [`check_merge`] apply them to shapes and dtypes alone, so a lazy
    /// backend (burn-fusion) can reject a call before it queues it.
    const LIMITS: KernelLimits = KernelLimits::NONE;

    /// Errors when this backend cannot run the kernels it would pick for these inputs: a bad
    /// kernel choice in the environment, a forced kernel the device lacks (`backward`: the
    /// gradient kernels, else the forward). burn-fusion's backends call it before they record
    /// their custom op, which cannot fail once queued. Default: nothing to check.
    fn check_kernels(
        _device: &Self::Device,
        _shape: &AttentionShape,
        _dtype: DType,
        _problem: &VarlenAttention,
        _backward: bool,
    ) -> Result<(), KernelError> {
        Ok(())
    }

    /// This device's memory, where the backend allocates on a device of its own (`None`: host
    /// memory, which `burn_dcp::kernels::memory` accounts for). Reads the allocator's counts;
    /// waits for no kernel.
    fn device_memory(_device: &Self::Device) -> Option<DeviceMemory> {
        None
    }

    /// `softmax(scale·q·kᵀ + mask)·v` and the natural-log LSE of every (head, query).
    /// Queries with no allowed key get `out = 0`, `lse = −∞`.
    fn flash_forward(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        problem: &VarlenAttention,
    ) -> Result<FlashOutput<Self>, KernelError> {
        host_forward(q, k, v, problem)
    }

    /// Gradients of the forward pass given the *final* `out`/`lse` (after any merge) and `dout`.
    /// With a subset of the keys (a ring step) it returns that subset's exact share of the
    /// gradients: `dq` partial sums, `dk`/`dv` for those keys.
    fn flash_backward(
        inputs: FlashBackward<Self>,
        problem: &VarlenAttention,
    ) -> Result<FlashGradients<Self>, KernelError> {
        host_backward(inputs, problem)
    }

    /// Merges two partial results over disjoint key sets of the same queries.
    fn flash_merge(
        a: FlashOutput<Self>,
        b: FlashOutput<Self>,
    ) -> Result<FlashOutput<Self>, KernelError> {
        host_merge(a, b)
    }
}

impl FlashOps for burn::backend::Flex {}

/// What a backend's kernels take, beyond the rules every backend shares (see [`FlashOps::LIMITS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLimits {
    /// The input dtypes taken; `None`: every float dtype.
    pub dtypes: Option<&'static [DType]>,
    /// Head and value dims must lie in `1..=max_dim`; `None`: any dim.
    pub max_dim: Option<usize>,
    /// The most query or key tokens (the width of the kernels' index tables); `None`: no limit.
    pub max_tokens: Option<usize>,
}

impl KernelLimits {
    /// No limit beyond the shared rules (the portable host implementation).
    pub const NONE: Self = Self {
        dtypes: None,
        max_dim: None,
        max_tokens: None,
    };

    fn check_dtype(&self, dtype: DType) -> Result<(), KernelError> {
        match self.dtypes {
            Some(taken) if !taken.contains(&dtype) => Err(KernelError::InvalidDType(format!(
                "these attention kernels take {} inputs, not {dtype:?}",
                taken
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" / ")
            ))),
            _ => Ok(()),
        }
    }

    fn check_dim(&self, name: &str, dim: usize) -> Result<(), KernelError> {
        match self.max_dim {
            Some(max) if dim == 0 || dim > max => Err(KernelError::InvalidShape(format!(
                "{name} {dim}: these attention kernels take dims from 1 to {max}"
            ))),
            _ => Ok(()),
        }
    }

    fn check_shape(&self, shape: &AttentionShape) -> Result<(), KernelError> {
        self.check_dim("head dim", shape.head_dim)?;
        self.check_dim("value dim", shape.value_dim)?;
        match self.max_tokens {
            Some(max) if shape.q_tokens > max || shape.kv_tokens > max => {
                Err(KernelError::InvalidShape(format!(
                    "{} query and {} key tokens: these attention kernels take at most {max} on each side",
                    shape.q_tokens, shape.kv_tokens
                )))
            }
            _ => Ok(()),
        }
    }
}

/// The dims and dtype of one tensor operand: all the checks below read.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    pub dims: &'a [usize],
    pub dtype: DType,
}

impl<'a> Operand<'a> {
    pub fn new(dims: &'a [usize], dtype: DType) -> Self {
        Self { dims, dtype }
    }
}

/// Every check of a forward call, on shapes and dtypes alone: one float dtype, consistent
/// `[tokens, heads, dim]` shapes, a valid problem for them, and `limits`. Returns the shape and
/// the dtype.
pub fn check_forward(
    limits: &KernelLimits,
    q: Operand<'_>,
    k: Operand<'_>,
    v: Operand<'_>,
    problem: &VarlenAttention,
) -> Result<(AttentionShape, DType), KernelError> {
    let dtype = common_float_dtype(&[("q", q.dtype), ("k", k.dtype), ("v", v.dtype)])?;
    limits.check_dtype(dtype)?;
    let shape = AttentionShape::from_dims(q.dims, k.dims, v.dims)?;
    problem.validate(&shape)?;
    limits.check_shape(&shape)?;
    Ok((shape, dtype))
}

/// Every check of a backward call: those of [`check_forward`], `out`/`dout` in the inputs' dtype
/// and `lse` in f32, with the shapes of [`check_backward_shapes`].
pub fn check_backward(
    limits: &KernelLimits,
    inputs: BackwardTensors<Operand<'_>>,
    problem: &VarlenAttention,
) -> Result<(AttentionShape, DType), KernelError> {
    let BackwardTensors {
        q,
        k,
        v,
        out,
        lse,
        dout,
    } = inputs;
    let (shape, dtype) = check_forward(limits, q, k, v, problem)?;
    common_float_dtype(&[("q", dtype), ("out", out.dtype), ("dout", dout.dtype)])?;
    check_lse_dtype("lse", lse.dtype)?;
    check_backward_shapes(&shape, out.dims, dout.dims, lse.dims)?;
    Ok((shape, dtype))
}

/// Every check of a merge: one float dtype for both outputs, f32 LSEs, equal shapes, `limits`
/// on the value dim. Returns the outputs' dtype.
pub fn check_merge(
    limits: &KernelLimits,
    out_a: Operand<'_>,
    lse_a: Operand<'_>,
    out_b: Operand<'_>,
    lse_b: Operand<'_>,
) -> Result<DType, KernelError> {
    let dtype = common_float_dtype(&[("out a", out_a.dtype), ("out b", out_b.dtype)])?;
    limits.check_dtype(dtype)?;
    check_lse_dtype("lse a", lse_a.dtype)?;
    check_lse_dtype("lse b", lse_b.dtype)?;
    check_merge_shapes(out_a.dims, out_b.dims, lse_a.dims, lse_b.dims)?;
    limits.check_dim("value dim", out_a.dims[2])?;
    Ok(dtype)
}

fn check_lse_dtype(name: &str, dtype: DType) -> Result<(), KernelError> {
    if dtype != DType::F32 {
        return Err(KernelError::InvalidDType(format!(
            "{name} has dtype {dtype:?}, expected f32"
        )));
    }
    Ok(())
}

/// Checks that tensors share one float dtype and returns it.
pub fn common_float_dtype(named: &[(&str, DType)]) -> Result<DType, KernelError> {
    let (first_name, first) = named[0];
    if !first.is_float() {
        return Err(KernelError::InvalidDType(format!(
            "{first_name} has dtype {first:?}, expected a float dtype"
        )));
    }
    if let Some((name, dtype)) = named.iter().find(|(_, d)| *d != first) {
        return Err(KernelError::InvalidDType(format!(
            "{name} has dtype {dtype:?} but {first_name} has {first:?}: all attention inputs must share one dtype"
        )));
    }
    Ok(first)
}

/// Checks `out`/`dout [q_tokens, heads, value_dim]` and `lse [heads, q_tokens]` of a backward call.
pub fn check_backward_shapes(
    shape: &AttentionShape,
    out: &[usize],
    dout: &[usize],
    lse: &[usize],
) -> Result<(), KernelError> {
    let expected_out = [shape.q_tokens, shape.heads, shape.value_dim];
    let expected_lse = [shape.heads, shape.q_tokens];
    if out != expected_out || dout != expected_out || lse != expected_lse {
        return Err(KernelError::InvalidShape(format!(
            "out {out:?}, dout {dout:?} and lse {lse:?} must be {expected_out:?}, {expected_out:?} and {expected_lse:?}"
        )));
    }
    Ok(())
}

/// Checks the two partial results of a merge: equal `out [tokens, heads, value_dim]` shapes and
/// `lse [heads, tokens]`.
pub fn check_merge_shapes(
    out_a: &[usize],
    out_b: &[usize],
    lse_a: &[usize],
    lse_b: &[usize],
) -> Result<(), KernelError> {
    let lse_ok = |lse: &[usize]| out_a.len() == 3 && lse == [out_a[1], out_a[0]];
    if out_a.len() != 3 || out_b != out_a || !lse_ok(lse_a) || !lse_ok(lse_b) {
        return Err(KernelError::InvalidShape(format!(
            "merge needs equal shapes: out {out_a:?} / {out_b:?}, lse {lse_a:?} / {lse_b:?} (lse is [heads, tokens])"
        )));
    }
    Ok(())
}

fn host_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("data converted to f32 reads back as f32")
}

fn from_host<B: Backend, const D: usize>(
    values: Vec<f32>,
    dims: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    let data = TensorData::new(values, dims).convert_dtype(dtype);
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

fn shape_of(
    q: &Tensor<impl Backend, 3>,
    k: &Tensor<impl Backend, 3>,
    v: &Tensor<impl Backend, 3>,
) -> Result<AttentionShape, KernelError> {
    AttentionShape::from_dims(&q.dims(), &k.dims(), &v.dims())
}

/// [`FlashOps::flash_forward`] on the host: reads the tensors, runs [`portable::forward`].
pub fn host_forward<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    problem: &VarlenAttention,
) -> Result<FlashOutput<B>, KernelError> {
    let dtype = common_float_dtype(&[("q", q.dtype()), ("k", k.dtype()), ("v", v.dtype())])?;
    let shape = shape_of(&q, &k, &v)?;
    let device = q.device();
    let result = portable::forward(&host_f32(q), &host_f32(k), &host_f32(v), &shape, problem)?;
    Ok(FlashOutput {
        out: from_host(
            result.out,
            [shape.q_tokens, shape.heads, shape.value_dim],
            dtype,
            &device,
        ),
        lse: from_host(
            result.lse,
            [shape.heads, shape.q_tokens],
            DType::F32,
            &device,
        ),
    })
}

/// [`FlashOps::flash_backward`] on the host: reads the tensors, runs [`portable::backward`].
pub fn host_backward<B: Backend>(
    inputs: FlashBackward<B>,
    problem: &VarlenAttention,
) -> Result<FlashGradients<B>, KernelError> {
    let x = &inputs;
    let dtype = common_float_dtype(&[
        ("q", x.q.dtype()),
        ("k", x.k.dtype()),
        ("v", x.v.dtype()),
        ("out", x.out.dtype()),
        ("dout", x.dout.dtype()),
    ])?;
    let shape = shape_of(&x.q, &x.k, &x.v)?;
    check_backward_shapes(&shape, &x.out.dims(), &x.dout.dims(), &x.lse.dims())?;
    let device = x.q.device();
    let h = inputs.map(host_f32, host_f32);
    let grads = portable::backward(&h.q, &h.k, &h.v, &h.out, &h.lse, &h.dout, &shape, problem)?;
    let q_dims = [shape.q_tokens, shape.heads, shape.head_dim];
    Ok(FlashGradients {
        dq: from_host(grads.dq, q_dims, dtype, &device),
        dk: from_host(
            grads.dk,
            [shape.kv_tokens, shape.kv_heads, shape.head_dim],
            dtype,
            &device,
        ),
        dv: from_host(
            grads.dv,
            [shape.kv_tokens, shape.kv_heads, shape.value_dim],
            dtype,
            &device,
        ),
    })
}

/// [`FlashOps::flash_merge`] on the host: runs [`portable::merge`].
pub fn host_merge<B: Backend>(
    a: FlashOutput<B>,
    b: FlashOutput<B>,
) -> Result<FlashOutput<B>, KernelError> {
    let dtype = common_float_dtype(&[("out a", a.out.dtype()), ("out b", b.out.dtype())])?;
    let [tokens, heads, value_dim] = a.out.dims();
    check_merge_shapes(&a.out.dims(), &b.out.dims(), &a.lse.dims(), &b.lse.dims())?;
    let device = a.out.device();
    let (mut out, mut lse) = (host_f32(a.out), host_f32(a.lse));
    portable::merge(
        &mut out,
        &mut lse,
        &host_f32(b.out),
        &host_f32(b.lse),
        heads,
        value_dim,
    )?;
    Ok(FlashOutput {
        out: from_host(out, [tokens, heads, value_dim], dtype, &device),
        lse: from_host(lse, [heads, tokens], DType::F32, &device),
    })
}
