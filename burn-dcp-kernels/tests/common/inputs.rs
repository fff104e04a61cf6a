//! Random inputs of a shape, on the host and on a device.

use burn::prelude::{Backend, Tensor};
use burn::tensor::TensorData;
use burn_dcp_kernels::AttentionShape;
use rand::rngs::SmallRng;
use rand::Rng;

pub fn random(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Random `q`, `k`, `v` and `dout` of a shape, drawn in that order.
#[derive(Debug)]
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dout: Vec<f32>,
}

pub fn inputs(rng: &mut SmallRng, s: &AttentionShape) -> Inputs {
    Inputs {
        q: random(rng, s.q_tokens * s.heads * s.head_dim),
        k: random(rng, s.kv_tokens * s.kv_heads * s.head_dim),
        v: random(rng, s.kv_tokens * s.kv_heads * s.value_dim),
        dout: random(rng, s.q_tokens * s.heads * s.value_dim),
    }
}

/// `values` as an f32 tensor `dims` on `device`.
pub fn upload<B: Backend>(values: &[f32], dims: [usize; 3], device: &B::Device) -> Tensor<B, 3> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

/// A tensor's values, read back as f32.
pub fn read<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}
