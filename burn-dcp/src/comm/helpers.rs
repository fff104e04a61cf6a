//! Small helpers of the communicators: panic messages, the deterministic sum of tensors.

use burn::tensor::{DType, TensorData};

use super::PayloadError;

/// The message of a panic payload (`&str` or `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}

/// Elementwise sum of tensors of one shape and dtype, in the given order (deterministic).
pub fn sum_tensor_data(parts: Vec<TensorData>) -> Result<TensorData, PayloadError> {
    let mut iter = parts.into_iter();
    let first = iter.next().ok_or(PayloadError::NothingToSum)?;
    let (shape, dtype) = (first.shape.clone(), first.dtype);
    if dtype == DType::F64 {
        let mut acc = first.into_vec::<f64>().map_err(data_error)?;
        for part in iter {
            check_same(&shape, dtype, &part)?;
            let values = part.into_vec::<f64>().map_err(data_error)?;
            acc.iter_mut().zip(values).for_each(|(a, b)| *a += b);
        }
        return Ok(TensorData::new(acc, shape));
    }
    let mut acc = first
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(data_error)?;
    for part in iter {
        check_same(&shape, dtype, &part)?;
        let values = part
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(data_error)?;
        acc.iter_mut().zip(values).for_each(|(a, b)| *a += b);
    }
    Ok(TensorData::new(acc, shape).convert_dtype(dtype))
}

fn check_same(
    shape: &burn::tensor::Shape,
    dtype: DType,
    part: &TensorData,
) -> Result<(), PayloadError> {
    if &part.shape != shape || part.dtype != dtype {
        return Err(PayloadError::Mismatch {
            shape: part.shape.as_slice().to_vec(),
            dtype: part.dtype,
            expected_shape: shape.as_slice().to_vec(),
            expected_dtype: dtype,
        });
    }
    Ok(())
}

fn data_error(error: burn::tensor::DataError) -> PayloadError {
    PayloadError::Data(format!("{error:?}"))
}
