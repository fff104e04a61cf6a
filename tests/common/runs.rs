//! What a test runs: meshes, masks, layouts, random packed inputs and a run's specification.

use std::time::Duration;

use burn_dcp::comm::{InProcessWorld, WorldConfig};
use burn_dcp::diagnostics::harness::{PackedInputs, RunSpec};
use burn_dcp::diagnostics::volume::VolumeShape;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::{Layout, Strategy};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The byte model's shape of f32 attention inputs with `head_dim` values per query, key and
/// value head.
pub fn f32_volume_shape(heads: usize, kv_heads: usize, head_dim: usize) -> VolumeShape {
    VolumeShape {
        heads,
        kv_heads,
        head_dim,
        value_dim: head_dim,
        element_bytes: 4,
    }
}

/// An in-process world of `size` ranks whose waits fail after `timeout`.
pub fn world_with_timeout(size: usize, timeout: Duration) -> InProcessWorld {
    InProcessWorld::new(
        size,
        WorldConfig {
            timeout,
            ..WorldConfig::default()
        },
    )
    .unwrap()
}

pub fn masks() -> Vec<MaskSpec> {
    [
        "full",
        "causal",
        "sliding:5",
        "lambda:2,4",
        "blockwise:3,2",
        "shared-question:0.2,4",
        "shared-question:0.5,2",
    ]
    .iter()
    .map(|m| m.parse().unwrap())
    .collect()
}

pub fn layouts() -> [Layout; 3] {
    [Layout::Contiguous, Layout::Zigzag, Layout::Stripe]
}

pub fn random_inputs(
    seq_lens: &[usize],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seed: u64,
) -> PackedInputs {
    let mut rng = SmallRng::seed_from_u64(seed);
    let t: usize = seq_lens.iter().sum();
    let mut values = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    PackedInputs {
        seq_lens: seq_lens.to_vec(),
        heads,
        kv_heads,
        head_dim,
        value_dim: head_dim,
        q: values(t * heads * head_dim),
        k: values(t * kv_heads * head_dim),
        v: values(t * kv_heads * head_dim),
        dout: values(t * heads * head_dim),
    }
}

pub fn spec(cp: usize, strategy: Strategy, layout: Layout, mask: &MaskSpec) -> RunSpec {
    RunSpec {
        cp,
        strategy,
        layout,
        masks: vec![mask.clone()],
        scale: None,
        timeout: Duration::from_secs(60),
        blocks: None,
        nodes: 1,
        dtype: burn::tensor::DType::F32,
    }
}

/// Rows `indices` of a token-major `[T, H, D]` buffer as an `[n, H, D]` tensor (a rank's tokens).
pub fn token_rows<Bk: burn::tensor::backend::Backend>(
    data: &[f32],
    heads: usize,
    dim: usize,
    indices: &[usize],
) -> burn::tensor::Tensor<Bk, 3> {
    let rows: Vec<f32> = indices
        .iter()
        .flat_map(|&i| data[i * heads * dim..(i + 1) * heads * dim].to_vec())
        .collect();
    burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(rows, [indices.len(), heads, dim]),
        &Default::default(),
    )
}
