//! burn-nn 0.21's `RotaryEncoding`, at the CP context's global positions.

use burn::config::Config;
use burn::module::Module;
use burn::prelude::{Backend, Int, Tensor};
use std::ops::Range;

use super::context_positions;
use crate::tensors::exact_reshape;

/// Configuration of a [`RotaryEncoding`]: burn-nn 0.21's `RotaryEncodingConfig` (same fields,
/// defaults and builders).
#[derive(Config, Debug)]
pub struct RotaryEncodingConfig {
    /// Maximum sequence length of input
    pub max_sequence_length: usize,

    /// Size of the input embedding or hidden dimension
    pub d_model: usize,

    /// Scaling factor for frequency computation. Defaults to 10000.0
    #[config(default = "10000.0")]
    pub theta: f32,
}

impl RotaryEncodingConfig {
    /// Initialize a new [RotaryEncoding] module (burn-nn's frequencies).
    ///
    /// # Panics
    ///
    /// Panics if the size of input embedding dimension is not even.
    /// Panics if the theta parameter is not positive.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RotaryEncoding<B> {
        self.init_with_frequency_scaling(|x| x, device)
    }

    /// Initialize a new [RotaryEncoding] module with a custom frequency scaling function.
    pub fn init_with_frequency_scaling<B: Backend>(
        &self,
        scaling: impl Fn(Tensor<B, 1>) -> Tensor<B, 1>,
        device: &B::Device,
    ) -> RotaryEncoding<B> {
        // burn-nn's own constructor computes the frequencies (and checks d_model and theta), so
        // the tables are burn-nn's bit for bit.
        let theirs = burn::nn::RotaryEncodingConfig::new(self.max_sequence_length, self.d_model)
            .with_theta(self.theta)
            .init_with_frequency_scaling(scaling, device);
        RotaryEncoding {
            freq_complex: theirs.freq_complex,
            theta: theirs.theta,
            start_offset: 0,
        }
    }
}

/// Rotary positional encoding with burn-nn 0.21's public API and record layout.
///
/// Without a CP context it equals burn-nn's module: the `seq_len` tokens of the input are at
/// positions `start .. start + seq_len`. Under a CP context ([`crate::backend::set_context`]) the
/// input's tokens are this rank's share of the batch (`[B, …, W, d_model]`, see
/// [`crate::batch::rows`]), and each is rotated by its **global** position in its sequence (plus
/// `start`) — what burn-nn's module gets wrong on every rank but the first.
#[derive(Module, Debug)]
pub struct RotaryEncoding<B: Backend> {
    /// Complex frequency tensor of shape (max_sequence_length, d_model, 2) with real and imaginary components
    pub freq_complex: Tensor<B, 3>,
    /// Frequency vector used to compute/apply the complex rotations.
    pub theta: Tensor<B, 1>,
    start_offset: usize,
}

#[allow(clippy::single_range_in_vec_init)]
impl<B: Backend> RotaryEncoding<B> {
    /// Applies rotary positional encoding to a tensor of dimensions (..., seq_len, d_model).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.apply(x, 0)
    }

    /// Applies rotary positional encoding to a tensor of dimensions (..., seq_len, d_model), the
    /// first token at `start` (under a CP context: every token at `start` + its global position).
    ///
    /// # Panics
    /// If the input has fewer than 2 dimensions, or a position is past `max_sequence_length`.
    pub fn apply<const D: usize>(&self, x: Tensor<B, D>, start: usize) -> Tensor<B, D> {
        assert!(
            D >= 2,
            "Input tensor must have at least 2 dimensions for sequence length and hidden dimension"
        );
        let device = x.device();
        let shape = x.dims();
        let (seq_len, d_model) = (shape[D - 2], shape[D - 1]);
        let batch = if D >= 3 { shape[0] } else { 1 };
        let rest = shape[..D - 2].iter().product::<usize>() / batch.max(1);
        let max_len = self.freq_complex.dims()[0];
        let positions: Vec<i64> = match context_positions(batch, seq_len) {
            Some(positions) => positions.iter().map(|p| p + start as i64).collect(),
            None => (0..batch)
                .flat_map(|_| (start..start + seq_len).map(|p| p as i64))
                .collect(),
        };
        if let Some(&last) = positions.iter().max() {
            assert!(
                last < max_len as i64,
                "RotaryEncoding: position {last} is past max_sequence_length {max_len} (under a CP context positions are global)"
            );
        }
        let positions = Tensor::<B, 1, Int>::from_data(
            burn::prelude::TensorData::new(positions, [batch * seq_len]),
            &device,
        );
        // The tables in `x`'s dtype (computed in the module's own, f32 unless cast).
        let dtype = x.dtype();
        let frequencies = self.freq_complex.clone().select(0, positions).cast(dtype);
        let frequencies = exact_reshape(frequencies, [batch, 1, seq_len, d_model, 2]);
        // Each pair (x₂ᵢ, x₂ᵢ₊₁) → (x₂ᵢ·cos − x₂ᵢ₊₁·sin, x₂ᵢ·sin + x₂ᵢ₊₁·cos), as burn-nn lays it out.
        let signs = pair_signs::<B>(&device, dtype);
        let pairs =
            exact_reshape(x, [batch, rest, seq_len, d_model / 2, 2]).matmul(signs.unsqueeze::<5>());
        let rotated = exact_reshape(pairs, [batch, rest, seq_len, d_model, 2]) * frequencies;
        exact_reshape(rotated.sum_dim(4), shape)
    }

    /// Shifts the pre-computed rotary frequency to cover a new range of positions (burn-nn's
    /// `shift`).
    pub fn shift(&mut self, start: usize) {
        let max_seq_len = self.freq_complex.dims()[0];
        assert!(
            start > self.start_offset,
            "Shift start position must be monotonically increasing"
        );
        let current_end = self.start_offset + max_seq_len;
        if start >= current_end {
            let new_freqs = frequencies(start..start + max_seq_len, self.theta.clone());
            self.freq_complex
                .inplace(|freqs| freqs.slice_assign([0..max_seq_len], new_freqs));
        } else {
            let num_keep = current_end - start;
            let start_rel = start - self.start_offset;
            let tail_freqs = self.freq_complex.clone().slice([start_rel..max_seq_len]);
            self.freq_complex
                .inplace(|freqs| freqs.slice_assign([0..num_keep], tail_freqs));
            let new_freqs = frequencies(current_end..start + max_seq_len, self.theta.clone());
            self.freq_complex
                .inplace(|freqs| freqs.slice_assign([num_keep..max_seq_len], new_freqs));
        }
        self.start_offset = start;
    }
}

/// Rotates `x [batch, …, seq, d]` by RoPE at `positions` (`batch · seq` values, row-major) with
/// base `theta`, the tables computed for these positions only (burn-nn's formula and pair layout):
/// the rotary extension of [`super::MultiHeadAttention`].
pub(crate) fn rotate_at<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    positions: Vec<i64>,
    theta: f32,
) -> Tensor<B, D> {
    let shape = x.dims();
    let device = x.device();
    let (seq_len, dim) = (shape[D - 2], shape[D - 1]);
    let batch = shape[0];
    let rest = shape[..D - 2].iter().product::<usize>() / batch.max(1);
    let half = dim / 2;
    let inverse: Vec<f32> = (0..half)
        .map(|i| (-(2.0 * i as f64 / dim as f64) * (theta as f64).ln()).exp() as f32)
        .collect();
    let count = positions.len();
    let positions =
        Tensor::<B, 1, Int>::from_data(burn::prelude::TensorData::new(positions, [count]), &device)
            .float();
    let inverse =
        Tensor::<B, 1>::from_data(burn::prelude::TensorData::new(inverse, [half]), &device);
    let angles = exact_reshape(positions, [count, 1]) * exact_reshape(inverse, [1, half]);
    let cos = exact_reshape(angles.clone().cos(), [count, half, 1, 1]);
    let sin = exact_reshape(angles.sin(), [count, half, 1, 1]);
    // The angles in f32, the tables rounded to `x`'s dtype.
    let dtype = x.dtype();
    let table = exact_reshape(
        Tensor::cat(vec![cos, sin], 3).repeat_dim(2, 2).cast(dtype),
        [batch, 1, seq_len, dim, 2],
    );
    let signs = pair_signs::<B>(&device, dtype);
    let pairs = exact_reshape(x, [batch, rest, seq_len, half, 2]).matmul(signs.unsqueeze::<5>());
    let rotated = exact_reshape(pairs, [batch, rest, seq_len, dim, 2]) * table;
    exact_reshape(rotated.sum_dim(4), shape)
}

/// The `[2, 4]` matrix that turns each pair `(a, b)` into `(a, −b, b, a)` (then multiplied by
/// `(cos, sin, sin, cos)` and summed in pairs), in `dtype` (exact in every float dtype).
fn pair_signs<B: Backend>(device: &B::Device, dtype: burn::tensor::DType) -> Tensor<B, 2> {
    Tensor::<B, 2>::from_floats([[1.0, 0.0, 0.0, 1.0], [0.0, -1.0, 1.0, 0.0]], device).cast(dtype)
}

/// `[cos, sin]` of `position · θᵢ` for the positions of `range`: `[positions, d_model, 2]`, each
/// frequency serving two consecutive dims (burn-nn's layout).
fn frequencies<B: Backend>(range: Range<usize>, theta: Tensor<B, 1>) -> Tensor<B, 3> {
    let half = theta.dims()[0];
    let count = range.len();
    let positions =
        Tensor::<B, 1, Int>::arange(range.start as i64..range.end as i64, &theta.device()).float();
    let angles = exact_reshape(positions, [count, 1]) * exact_reshape(theta, [1, half]);
    let cos = exact_reshape(angles.clone().cos(), [count, half, 1, 1]);
    let sin = exact_reshape(angles.sin(), [count, half, 1, 1]);
    let pair = Tensor::cat(vec![cos, sin], 3).repeat_dim(2, 2);
    exact_reshape(pair, [count, 2 * half, 2])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::prelude::TensorData;

    /// The rotary extension of the attention rotates as burn-nn's RotaryEncoding does.
    #[test]
    fn rotation_at_positions_equals_the_encoding_module() {
        let device = Default::default();
        let (batch, heads, seq, dim) = (2, 3, 5, 8);
        let values: Vec<f32> = (0..batch * heads * seq * dim)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let x = Tensor::<Flex, 4>::from_data(
            TensorData::new(values, [batch, heads, seq, dim]),
            &device,
        );
        let module = RotaryEncodingConfig::new(16, dim).init::<Flex>(&device);
        let want = module
            .apply(x.clone(), 3)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let positions = (0..batch).flat_map(|_| 3..3 + seq as i64).collect();
        let got = rotate_at(x, positions, 10_000.0)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5, "{g} vs {w}");
        }
    }
}
