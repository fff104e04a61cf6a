//! Conversions of the few op types that are generic over the backend (not plain associated types):
//! `ContextParallel<B>` uses `B`'s primitives, so these only re-wrap the same values.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::TensorPrimitive;

use crate::backend::{ContextParallel, CpInner};

type Cp<B> = ContextParallel<B>;

pub fn primitive_in<B: CpInner>(p: TensorPrimitive<Cp<B>>) -> TensorPrimitive<B> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub fn primitive_out<B: CpInner>(p: TensorPrimitive<B>) -> TensorPrimitive<Cp<B>> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub fn qparams_in<B: CpInner>(
    p: QuantizationParametersPrimitive<Cp<B>>,
) -> QuantizationParametersPrimitive<B> {
    QuantizationParametersPrimitive { scales: p.scales }
}

/// The transaction's read order was taken out before `tr_execute` is called
/// (`TransactionPrimitive::execute_async`), so rebuilding it from the lists loses nothing.
pub fn transaction_in<B: CpInner>(t: TransactionPrimitive<Cp<B>>) -> TransactionPrimitive<B> {
    TransactionPrimitive::new(t.read_floats, t.read_qfloats, t.read_ints, t.read_bools)
}

pub fn max_pool1d_with_indices_out<B: CpInner>(
    r: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<Cp<B>> {
    MaxPool1dWithIndices {
        output: r.output,
        indices: r.indices,
    }
}

pub fn max_pool1d_backward_out<B: CpInner>(r: MaxPool1dBackward<B>) -> MaxPool1dBackward<Cp<B>> {
    MaxPool1dBackward { x_grad: r.x_grad }
}

pub fn max_pool2d_with_indices_out<B: CpInner>(
    r: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<Cp<B>> {
    MaxPool2dWithIndices {
        output: r.output,
        indices: r.indices,
    }
}

pub fn max_pool2d_backward_out<B: CpInner>(r: MaxPool2dBackward<B>) -> MaxPool2dBackward<Cp<B>> {
    MaxPool2dBackward { x_grad: r.x_grad }
}

pub fn deform_conv2d_backward_out<B: CpInner>(
    r: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<Cp<B>> {
    DeformConv2dBackward {
        x_grad: r.x_grad,
        offset_grad: r.offset_grad,
        weight_grad: r.weight_grad,
        mask_grad: r.mask_grad,
        bias_grad: r.bias_grad,
    }
}
