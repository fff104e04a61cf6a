//! burn-nn 0.21's `PositionalEncoding`, at the CP context's global positions.

use burn::config::Config;
use burn::module::Module;
use burn::prelude::{Backend, Int, Tensor, TensorData};

use super::context_positions;
use crate::tensors::exact_reshape;

/// Configuration of a [`PositionalEncoding`]: burn-nn 0.21's `PositionalEncodingConfig` (same
/// fields, defaults and builders).
#[derive(Config, Debug)]
pub struct PositionalEncodingConfig {
    /// Maximum sequence size to use.
    #[config(default = "5_000")]
    pub max_sequence_size: usize,

    /// The size of each vector.
    pub d_model: usize,

    /// Max time scale to use.
    #[config(default = "10_000")]
    pub max_timescale: usize,
}

impl PositionalEncodingConfig {
    /// Initialize a new [PositionalEncoding] module (burn-nn's sinusoids).
    pub fn init<B: Backend>(&self, device: &B::Device) -> PositionalEncoding<B> {
        let sinusoids = burn::nn::generate_sinusoids::<B>(
            self.max_sequence_size,
            self.d_model,
            self.max_timescale,
            device,
        )
        .unsqueeze::<3>();
        PositionalEncoding {
            sinusoids,
            max_sequence_size: self.max_sequence_size,
            max_timescale: self.max_timescale,
        }
    }
}

/// Sinusoidal positional encoding with burn-nn 0.21's public API and record layout.
///
/// Without a CP context it equals burn-nn's module (token `t` of each row at position `t`).
/// Under a CP context each of this rank's tokens gets the sinusoid of its **global** position in
/// its sequence (see [`crate::batch::rows`]).
#[derive(Module, Debug)]
pub struct PositionalEncoding<B: Backend> {
    /// The sinusoids used to add positional information to the input embeddings.
    pub sinusoids: Tensor<B, 3>,
    /// The maximum sequence size to use.
    pub max_sequence_size: usize,
    /// Max time scale to use.
    pub max_timescale: usize,
}

impl<B: Backend> PositionalEncoding<B> {
    /// Adds the sinusoids to `input [batch_size, seq_length, d_model]`.
    ///
    /// # Panics
    ///
    /// * If a position is past the maximum sequence size.
    /// * If the input d_model is not equal to the d_model of the sinusoids.
    pub fn forward(&self, input: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq_length, d_model_input] = input.dims();
        let [_, max_sequence_size, d_model] = self.sinusoids.dims();
        assert!(
            d_model_input == d_model,
            "d_model({d_model_input}) of the input must be equal to d_model of encoding({d_model})"
        );
        let Some(positions) = context_positions(batch, seq_length) else {
            assert!(
                max_sequence_size >= seq_length,
                "max_sequence_size({max_sequence_size}) must be greater or equal than length({seq_length})"
            );
            let dtype = input.dtype();
            return input.add(
                self.sinusoids
                    .clone()
                    .slice([0..1, 0..seq_length, 0..d_model])
                    .cast(dtype),
            );
        };
        if let Some(&last) = positions.iter().max() {
            assert!(
                (last as usize) < max_sequence_size,
                "PositionalEncoding: global position {last} is past max_sequence_size {max_sequence_size}"
            );
        }
        let device = input.device();
        let positions = Tensor::<B, 1, Int>::from_data(
            TensorData::new(positions, [batch * seq_length]),
            &device,
        );
        let table = exact_reshape(self.sinusoids.clone(), [max_sequence_size, d_model]);
        let picked = exact_reshape(table.select(0, positions), [batch, seq_length, d_model]);
        // The table in the input's dtype (bf16 training adds it to bf16 embeddings).
        let dtype = input.dtype();
        input.add(picked.cast(dtype))
    }
}
