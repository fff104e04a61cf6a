//! Where a rank's local rows sit in their sequences: the lengths a burn-nn padding mask describes
//! and the global positions of the rows under the CP context.

use burn::prelude::{Backend, Bool, Tensor};

use crate::backend::current_context;
use crate::error::CpError;
use crate::tensors::bool_values;

/// Sequence lengths of a burn-nn padding mask (`[B, S]`, `true` at padding): the real tokens of
/// each row. Padding must come after a row's tokens (right padding, as burn-nn's
/// `generate_padding_mask` makes).
pub fn lengths_from_mask_pad<B: Backend>(
    mask_pad: Tensor<B, 2, Bool>,
) -> Result<Vec<usize>, CpError> {
    let [rows, width] = mask_pad.dims();
    let values = bool_values(mask_pad);
    (0..rows)
        .map(|row| {
            let row_values = &values[row * width..(row + 1) * width];
            let len = row_values.iter().take_while(|&&padded| !padded).count();
            match row_values[len..].iter().position(|&padded| !padded) {
                Some(offset) => Err(CpError::Input(format!(
                    "row {row} of mask_pad has a real token at column {} after padding at column {len}; padding must come after a row's tokens",
                    len + offset
                ))),
                None => Ok(len),
            }
        })
        .collect()
}

/// Global positions of the local `[batch, width]` rows under this thread's CP context (row-major,
/// 0 at padding), or `None` without a context.
///
/// # Panics
/// When the context's rows do not fit `[batch, width]`.
pub(crate) fn context_positions(batch: usize, width: usize) -> Option<Vec<i64>> {
    let context = current_context()?;
    let rank = context.group.comm.rank();
    let positions = context
        .batch
        .local_rows(rank)
        .and_then(|rows| {
            if rows.rows() != batch {
                return Err(CpError::Input(format!(
                    "the input has {batch} rows but the CP context describes {} (CpBatch::with_rows)",
                    rows.rows()
                )));
            }
            rows.positions(width)
        })
        .unwrap_or_else(|e| panic!("position encoding under the CP context of rank {rank}: {e}"));
    Some(positions)
}
