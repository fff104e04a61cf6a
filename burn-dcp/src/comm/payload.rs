//! What a message carries: a tensor on its device, or bytes on the host.
//!
//! Strategies send their blocks as [`Payload::device`] — the backend's own tensor, moved, not
//! copied. A communicator that can hand a tensor to its peer as it is (the in-process world:
//! every rank is a thread of one process) does so, and the receiver only copies it when the
//! tensor lives on another device than its own ([`Payload::into_float`]). A communicator that
//! needs bytes (MPI) reads the tensor back once, at the boundary ([`Payload::into_host`]).
//! Reductions of device payloads are taken on the device in rank order, with the host's
//! arithmetic (f32 accumulation for f16/bf16, one rounding at the end), so both give the same
//! bits.

use std::any::Any;
use std::fmt;

use burn::prelude::{Backend, Tensor};
use burn::tensor::{
    try_read_sync, DType, FloatDType, Shape, Slice, TensorCreationOptions, TensorData,
    TensorPrimitive,
};
use burn_backend::{Scalar, TensorMetadata};

use crate::comm::PayloadError;

/// A message body.
#[derive(Clone, Debug)]
pub enum Payload {
    /// Bytes on the host (control messages, data received over MPI, checkpoint shards).
    Host(TensorData),
    /// A backend's float tensor, on its device.
    Device(DeviceTensor),
}

impl From<TensorData> for Payload {
    fn from(data: TensorData) -> Self {
        Payload::Host(data)
    }
}

impl Payload {
    /// A burn float tensor as a payload, kept on its device.
    pub fn device<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self {
        Self::from_float::<B>(tensor.into_primitive().tensor())
    }

    /// A backend float primitive as a payload, kept on its device.
    pub fn from_float<B: Backend>(tensor: B::FloatTensorPrimitive) -> Self {
        Payload::Device(DeviceTensor(Box::new(Float::<B>(tensor))))
    }

    /// The payload's dims.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Payload::Host(data) => data.shape.as_slice().to_vec(),
            Payload::Device(tensor) => tensor.0.shape().as_slice().to_vec(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Payload::Host(data) => data.dtype,
            Payload::Device(tensor) => tensor.0.dtype(),
        }
    }

    pub fn num_elements(&self) -> usize {
        self.shape().iter().product()
    }

    /// Bytes on the wire (what [`CommStats`](crate::comm::CommStats) counts).
    pub fn num_bytes(&self) -> u64 {
        match self {
            Payload::Host(data) => data.bytes.len() as u64,
            Payload::Device(_) => (self.num_elements() * self.dtype().size()) as u64,
        }
    }

    /// Whether the payload is a device tensor.
    pub fn is_device(&self) -> bool {
        matches!(self, Payload::Device(_))
    }

    /// The backend primitive of a device payload, for communicators that need its type.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn device_any(&self) -> Option<&dyn Any> {
        match self {
            Payload::Host(_) => None,
            Payload::Device(tensor) => Some(tensor.0.as_any()),
        }
    }

    /// The payload's bytes on the host (reads a device tensor back).
    pub fn into_host(self) -> Result<TensorData, PayloadError> {
        match self {
            Payload::Host(data) => Ok(data),
            Payload::Device(tensor) => tensor.0.into_host(),
        }
    }

    /// Waits until this thread's queue has written a device tensor (host payloads: at once),
    /// so that another thread may read it: the sender's half of [`Payload::adopt`].
    ///
    /// Why: the receiver's copy runs on the receiver's stream, which does not wait for the
    /// sender's. On wgpu every stream submits to one device queue in order, so the sender's
    /// writes come first; on CUDA the streams run concurrently, and ring's backward, which sends
    /// dk/dv right after computing them, read them half-written (seen on an H100: dk and dv
    /// 35 % off; out, lse and dq exact).
    pub(crate) fn finish_writes(&self) -> Result<(), PayloadError> {
        match self {
            Payload::Host(_) => Ok(()),
            Payload::Device(tensor) => tensor.0.finish_writes(),
        }
    }

    /// Makes a device tensor that another thread produced safe to read and drop on this one: a
    /// copy in this thread's own memory, with this thread's queue drained before the sender's
    /// buffer is let go. Host payloads are returned as they are.
    ///
    /// Why: cubecl gives each thread its own stream and memory pool. A kernel queued on the
    /// receiver's stream that reads the sender's buffer is not yet submitted when the receiver
    /// drops its handle; the sender's pool then hands the buffer out again, and the sender's next
    /// write can reach the device first (seen on wgpu as wrong gradients on some ranks). Reading
    /// the buffer once, into our own memory, and waiting for that read closes the window.
    pub(crate) fn adopt(self) -> Result<Payload, PayloadError> {
        match self {
            Payload::Host(data) => Ok(Payload::Host(data)),
            Payload::Device(tensor) => tensor.0.adopt().map(Payload::Device),
        }
    }

    /// The payload as a float primitive of `B` on `device`: a device tensor of `B` is moved (and
    /// copied only when it lives on another device); host bytes are uploaded, keeping their dtype.
    pub fn into_float<B: Backend>(
        self,
        device: &B::Device,
    ) -> Result<B::FloatTensorPrimitive, PayloadError> {
        let data = match self {
            Payload::Device(tensor) if tensor.0.as_any().is::<B::FloatTensorPrimitive>() => {
                let tensor = *tensor
                    .0
                    .into_any()
                    .downcast::<B::FloatTensorPrimitive>()
                    .expect("the type was just checked");
                return Ok(match &B::float_device(&tensor) == device {
                    true => tensor,
                    false => B::float_to_device(tensor, device),
                });
            }
            // A tensor of another backend (a world mixing backends): through the host.
            other => other.into_host()?,
        };
        let dtype = data.dtype;
        let tensor: Tensor<B, 1> = Tensor::<B, 1>::from_data(
            TensorData::from_bytes(data.bytes, [data.shape.num_elements()], dtype),
            TensorCreationOptions::new(device.clone()).with_dtype(dtype),
        );
        Ok(B::float_reshape(
            tensor.into_primitive().tensor(),
            data.shape,
        ))
    }

    /// The payload as a `D`-dimensional burn tensor on `device` (see [`Payload::into_float`]).
    pub fn into_tensor<B: Backend, const D: usize>(
        self,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, PayloadError> {
        let dims = self.shape();
        if dims.len() != D {
            return Err(PayloadError::Dims { dims, expected: D });
        }
        Ok(Tensor::from_primitive(TensorPrimitive::Float(
            self.into_float::<B>(device)?,
        )))
    }
}

/// A backend's float tensor behind a type-erased handle, so that one communicator serves every
/// backend. Cloning clones the handle (backends share the buffer).
pub struct DeviceTensor(Box<dyn DeviceOps>);

impl Clone for DeviceTensor {
    fn clone(&self) -> Self {
        DeviceTensor(self.0.clone_box())
    }
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceTensor({:?} {:?} of {})",
            self.0.shape().as_slice(),
            self.0.dtype(),
            self.0.backend()
        )
    }
}

/// What communicators need of a device tensor, implemented for every backend's float primitive.
trait DeviceOps: Send + Sync {
    fn shape(&self) -> Shape;
    fn dtype(&self) -> DType;
    fn backend(&self) -> &'static str;
    fn clone_box(&self) -> Box<dyn DeviceOps>;
    fn as_any(&self) -> &dyn Any;
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
    fn into_host(self: Box<Self>) -> Result<TensorData, PayloadError>;
    /// A copy in the calling thread's memory, its queue drained (see [`Payload::adopt`]).
    fn adopt(&self) -> Result<DeviceTensor, PayloadError>;
    /// Drains the calling thread's queue (see [`Payload::finish_writes`]).
    fn finish_writes(&self) -> Result<(), PayloadError>;
    /// The elementwise sum of `self` and `others`, in that order, with the host's arithmetic;
    /// `None` when some part is not a tensor of the same backend.
    fn sum(&self, others: &[&DeviceTensor]) -> Option<DeviceTensor>;
    /// The tensor as one dimension of its elements.
    fn flatten(&self) -> DeviceTensor;
    /// Elements `start..end` of a flat tensor.
    fn slice_flat(&self, start: usize, end: usize) -> DeviceTensor;
    /// `self` then `others` (flat tensors of the same backend) as one flat tensor; `None` when
    /// some part is not a tensor of the same backend.
    fn concat_flat(&self, others: &[&DeviceTensor]) -> Option<DeviceTensor>;
    /// The tensor with new dims (same number of elements).
    fn reshape(&self, dims: &[usize]) -> DeviceTensor;
}

struct Float<B: Backend>(B::FloatTensorPrimitive);

impl<B: Backend> Float<B> {
    fn wrap(tensor: B::FloatTensorPrimitive) -> DeviceTensor {
        DeviceTensor(Box::new(Float::<B>(tensor)))
    }

    fn downcast<'a>(others: &[&'a DeviceTensor]) -> Option<Vec<&'a B::FloatTensorPrimitive>> {
        others
            .iter()
            .map(|other| other.0.as_any().downcast_ref::<B::FloatTensorPrimitive>())
            .collect()
    }
}

impl<B: Backend> DeviceOps for Float<B> {
    fn shape(&self) -> Shape {
        self.0.shape()
    }

    fn dtype(&self) -> DType {
        self.0.dtype()
    }

    fn backend(&self) -> &'static str {
        std::any::type_name::<B>()
    }

    fn clone_box(&self) -> Box<dyn DeviceOps> {
        Box::new(Float::<B>(self.0.clone()))
    }

    fn as_any(&self) -> &dyn Any {
        &self.0
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        Box::new(self.0)
    }

    fn into_host(self: Box<Self>) -> Result<TensorData, PayloadError> {
        try_read_sync(B::float_into_data(self.0))
            .ok_or(PayloadError::NoSyncRead)?
            .map_err(|e| PayloadError::ReadBack(format!("{e:?}")))
    }

    fn adopt(&self) -> Result<DeviceTensor, PayloadError> {
        // `self` keeps its handle alive during the multiply, so the backend cannot reuse the
        // sender's buffer in place: the result is a new buffer of this thread. Multiplying by
        // one is exact for every value (±0, ±∞ and subnormals included).
        let copy = B::float_mul_scalar(self.0.clone(), Scalar::Float(1.0));
        B::sync(&B::float_device(&copy)).map_err(|e| PayloadError::Copy(format!("{e:?}")))?;
        Ok(Self::wrap(copy))
    }

    fn finish_writes(&self) -> Result<(), PayloadError> {
        B::sync(&B::float_device(&self.0)).map_err(|e| PayloadError::Copy(format!("{e:?}")))
    }

    fn sum(&self, others: &[&DeviceTensor]) -> Option<DeviceTensor> {
        let others = Self::downcast(others)?;
        let dtype = self.0.dtype();
        // The host sums f64 in f64 and every other float type in f32 (`sum_tensor_data`).
        let (wide, narrow) = match dtype {
            DType::F64 => (FloatDType::F64, None),
            DType::F32 => (FloatDType::F32, None),
            DType::Flex32 => (FloatDType::F32, Some(FloatDType::Flex32)),
            DType::F16 => (FloatDType::F32, Some(FloatDType::F16)),
            DType::BF16 => (FloatDType::F32, Some(FloatDType::BF16)),
            _ => return None,
        };
        let widen = |t: &B::FloatTensorPrimitive| match narrow {
            Some(_) => B::float_cast(t.clone(), wide),
            None => t.clone(),
        };
        let total = others
            .into_iter()
            .fold(widen(&self.0), |acc, t| B::float_add(acc, widen(t)));
        Some(Self::wrap(match narrow {
            Some(narrow) => B::float_cast(total, narrow),
            None => total,
        }))
    }

    fn flatten(&self) -> DeviceTensor {
        let count = self.0.shape().num_elements();
        Self::wrap(B::float_reshape(self.0.clone(), Shape::new([count])))
    }

    fn slice_flat(&self, start: usize, end: usize) -> DeviceTensor {
        Self::wrap(B::float_slice(
            self.0.clone(),
            &[Slice::new(start as isize, Some(end as isize), 1)],
        ))
    }

    fn concat_flat(&self, others: &[&DeviceTensor]) -> Option<DeviceTensor> {
        let others = Self::downcast(others)?;
        let parts: Vec<_> = std::iter::once(&self.0)
            .chain(others)
            .filter(|t| t.shape().num_elements() > 0)
            .cloned()
            .collect();
        Some(match parts.len() {
            0 => DeviceTensor(self.clone_box()),
            _ => Self::wrap(B::float_cat(parts, 0)),
        })
    }

    fn reshape(&self, dims: &[usize]) -> DeviceTensor {
        Self::wrap(B::float_reshape(self.0.clone(), Shape::from(dims.to_vec())))
    }
}

/// The elementwise sum of payloads of one shape and dtype, in the given order (deterministic):
/// on the device when every part is a device tensor of one backend, else on the host. Both give
/// the same bits.
pub(crate) fn sum_payloads(parts: Vec<Payload>) -> Result<Payload, PayloadError> {
    let first = parts.first().ok_or(PayloadError::NothingToSum)?;
    let (shape, dtype) = (first.shape(), first.dtype());
    for part in &parts[1..] {
        if part.shape() != shape || part.dtype() != dtype {
            return Err(PayloadError::Mismatch {
                shape: part.shape(),
                dtype: part.dtype(),
                expected_shape: shape,
                expected_dtype: dtype,
            });
        }
    }
    if let Some((first, rest)) = device_parts(&parts) {
        if let Some(sum) = first.0.sum(&rest) {
            return Ok(Payload::Device(sum));
        }
    }
    let host = parts
        .into_iter()
        .map(Payload::into_host)
        .collect::<Result<Vec<_>, _>>()?;
    crate::comm::sum_tensor_data(host).map(Payload::Host)
}

/// The first part and the others, when every part is a device tensor.
fn device_parts(parts: &[Payload]) -> Option<(&DeviceTensor, Vec<&DeviceTensor>)> {
    let mut tensors = parts.iter().map(|part| match part {
        Payload::Device(tensor) => Some(tensor),
        Payload::Host(_) => None,
    });
    let first = tensors.next()??;
    let rest = tensors.collect::<Option<Vec<_>>>()?;
    Some((first, rest))
}

/// A payload as one dimension of its elements.
pub(crate) fn flatten(payload: Payload) -> Payload {
    match payload {
        Payload::Host(data) => {
            let count = data.num_elements();
            Payload::Host(TensorData::from_bytes(data.bytes, [count], data.dtype))
        }
        Payload::Device(tensor) => Payload::Device(tensor.0.flatten()),
    }
}

/// Splits a flat payload into `parts` contiguous chunks (sizes differ by at most one element).
pub(crate) fn split_flat(flat: &Payload, parts: usize) -> Vec<Payload> {
    let count = flat.num_elements();
    let bounds = (0..parts).map(|p| (p * count / parts, (p + 1) * count / parts));
    match flat {
        Payload::Host(data) => {
            let width = data.dtype.size();
            let bytes = data.as_bytes();
            bounds
                .map(|(start, end)| {
                    Payload::Host(TensorData::from_bytes_vec(
                        bytes[start * width..end * width].to_vec(),
                        [end - start],
                        data.dtype,
                    ))
                })
                .collect()
        }
        Payload::Device(tensor) => bounds
            .map(|(start, end)| Payload::Device(tensor.0.slice_flat(start, end)))
            .collect(),
    }
}

/// Flat chunks joined and given `shape` back; fails when they do not add up to it.
pub(crate) fn concat_flat(
    chunks: Vec<Payload>,
    shape: &[usize],
    dtype: DType,
) -> Result<Payload, PayloadError> {
    if let Some(chunk) = chunks.iter().find(|chunk| chunk.dtype() != dtype) {
        return Err(PayloadError::ChunkDtype {
            dtype: chunk.dtype(),
            expected: dtype,
        });
    }
    let count: usize = chunks.iter().map(Payload::num_elements).sum();
    let expected: usize = shape.iter().product();
    if count != expected {
        return Err(PayloadError::ChunkSizes {
            bytes: count * dtype.size(),
            shape: shape.to_vec(),
            dtype,
            expected: expected * dtype.size(),
        });
    }
    if let Some((first, rest)) = device_parts(&chunks) {
        if let Some(joined) = first.0.concat_flat(&rest) {
            return Ok(Payload::Device(joined.0.reshape(shape)));
        }
    }
    let mut bytes = Vec::with_capacity(expected * dtype.size());
    for chunk in chunks {
        bytes.extend_from_slice(chunk.into_host()?.as_bytes());
    }
    Ok(Payload::Host(TensorData::from_bytes_vec(
        bytes,
        shape.to_vec(),
        dtype,
    )))
}
