//! Rotary position embeddings, "rotate half" (GPT-NeoX's and Hugging Face Llama's convention):
//! the inverse frequencies `θ^(−2i/D)` of `rope_theta`, optionally rescaled as Hugging Face's
//! `rope_scaling` says (`linear`, `llama3`; `transformers.modeling_rope_utils`), and the `cos` /
//! `sin` tables of the tokens' *global* positions (a CP shard holds tokens from anywhere in its
//! sequences).

use std::f64::consts::PI;

use burn::prelude::{Backend, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::ModelError;
use crate::tensors::reshape;

/// How the inverse frequencies are rescaled for a longer context (Hugging Face's
/// `rope_scaling`, of the types this model supports).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend between
    /// (`_compute_llama3_parameters` of transformers).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Checks the factors, naming the value and the rule.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = |name: &str, value: f64| match value.is_finite() && value > 0.0 {
            true => Ok(()),
            false => Err(ModelError::Config(format!(
                "rope_scaling {name} {value} must be a positive number"
            ))),
        };
        match *self {
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(ModelError::Config(format!(
                        "rope_scaling high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor} (llama3)"
                    )));
                }
                if original_max_position_embeddings == 0 {
                    return Err(ModelError::Config(
                        "rope_scaling original_max_position_embeddings must be positive (llama3)"
                            .into(),
                    ));
                }
                Ok(())
            }
        }
    }

    /// `inverse_frequency` rescaled.
    fn apply(&self, inverse_frequency: f64) -> f64 {
        match *self {
            RopeScaling::Linear { factor } => inverse_frequency / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let wavelength = 2.0 * PI / inverse_frequency;
                if wavelength < old / high_freq_factor {
                    inverse_frequency
                } else if wavelength > old / low_freq_factor {
                    inverse_frequency / factor
                } else {
                    let smooth =
                        (old / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inverse_frequency / factor + smooth * inverse_frequency
                }
            }
        }
    }
}

/// The rotary embedding's settings: base and optional rescaling.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSettings {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

impl RopeSettings {
    /// The `head_dim / 2` inverse frequencies, as f32 (what the tables multiply positions by;
    /// transformers computes them in f32 too).
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        (0..head_dim / 2)
            .map(|i| {
                let base = self.theta.powf(-(2.0 * i as f64) / head_dim as f64);
                let scaled = match &self.scaling {
                    Some(scaling) => scaling.apply(base),
                    None => base,
                };
                scaled as f32
            })
            .collect()
    }
}

/// RoPE rotation tables for given positions: `cos`, `sin` of shape `[1, 1, T, head_dim/2]`.
pub(crate) struct Rope<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> Rope<B> {
    pub(crate) fn new(
        positions: &Tensor<B, 1, Int>,
        head_dim: usize,
        settings: &RopeSettings,
    ) -> Self {
        let half = head_dim / 2;
        let device = positions.device();
        let frequencies = Tensor::<B, 1>::from_data(
            TensorData::new(settings.inverse_frequencies(head_dim), [half]),
            &device,
        );
        let tokens = positions.dims()[0];
        // angle[t, i] = position[t] · frequency[i]
        let angles =
            reshape(positions.clone().float(), [tokens, 1]) * frequencies.reshape([1, half]);
        Self {
            cos: reshape(angles.clone().cos(), [1, 1, tokens, half]),
            sin: reshape(angles.sin(), [1, 1, tokens, half]),
        }
    }

    /// Rotates `x [1, heads, T, head_dim]` (half-split convention). The tables are computed in
    /// f32 and rounded to `x`'s dtype (bf16 training rotates bf16 queries and keys).
    pub(crate) fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [_, _, _, dim] = x.dims();
        let half = dim / 2;
        let dtype = x.dtype();
        let (cos, sin) = (self.cos.clone().cast(dtype), self.sin.clone().cast(dtype));
        // Nothing to rotate on a rank without tokens (and burn-flex 0.21 narrows an empty bf16
        // tensor into an empty f32 one).
        if x.shape().num_elements() == 0 {
            return x;
        }
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.narrow(3, half, half);
        let rotated_1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let rotated_2 = x1 * sin + x2 * cos;
        Tensor::cat(vec![rotated_1, rotated_2], 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `_compute_llama3_parameters` for Llama 3.1's settings (factor 8, low 1,
    /// high 4, 8192 positions), head dim 128, θ 500000: frequencies above 2π/2048 kept, below
    /// 2π/8192 divided by 8, between blended (values computed by the formula of
    /// transformers 4.x/5.x, `modeling_rope_utils.py`).
    #[test]
    fn llama3_scaling_keeps_high_divides_low_blends_between() {
        let settings = RopeSettings {
            theta: 500000.0,
            scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
        };
        let plain = RopeSettings {
            theta: 500000.0,
            scaling: None,
        }
        .inverse_frequencies(128);
        let scaled = settings.inverse_frequencies(128);
        for (i, (&p, &s)) in plain.iter().zip(&scaled).enumerate() {
            let wavelength = 2.0 * PI / p as f64;
            if wavelength < 2048.0 {
                assert_eq!(p, s, "frequency {i} (wavelength {wavelength}) is kept");
            } else if wavelength > 8192.0 {
                assert!((p as f64 / 8.0 - s as f64).abs() <= 1e-6 * p as f64, "{i}");
            } else {
                assert!(s < p && s > p / 8.0, "frequency {i} is blended: {s} of {p}");
            }
        }
        let linear = RopeSettings {
            theta: 10000.0,
            scaling: Some(RopeScaling::Linear { factor: 4.0 }),
        };
        assert_eq!(linear.inverse_frequencies(4), vec![0.25, 0.0025]);
    }

    #[test]
    fn bad_factors_are_named() {
        let error = RopeScaling::Linear { factor: 0.0 }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(error.contains("factor 0"), "{error}");
        let error = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position_embeddings: 8192,
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(error.contains("high_freq_factor 1"), "{error}");
    }
}
