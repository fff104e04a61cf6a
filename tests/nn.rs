//! `burn_dcp::nn`: burn-nn 0.21's attention and position modules as drop-ins. A burn-nn record
//! loads into them and back; without a CP context they equal burn-nn; under a CP context (cp 2
//! and 4; ring, Ulysses, USP, all-gather, dcp; B = 1 packed and B = 3 padded) they equal the
//! per-sequence single-device result, forward and gradients; what CP cannot compute is an error,
//! and burn-nn's own attention under a context fails `finish()`.

use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::prelude::{Backend, Bool, Tensor, TensorData};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::backend::{set_context, ContextParallel, CpContext};
use burn_dcp::comm::{InProcessWorld, RankFailure, WorldConfig};
use burn_dcp::diagnostics::harness::max_rel_err;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::nn::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, PositionalEncoding,
    PositionalEncodingConfig, RotaryEncoding, RotaryEncodingConfig, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn_dcp::planner::cost::AttentionDims;
use burn_dcp::planner::dcp::{dcp_plan, DcpConfig};
use burn_dcp::planner::plan::{tile_grids, BlockProblem};
use burn_dcp::planner::topology::Topology;
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{BatchRows, CpBatch, CpGroup, Layout, Placement, Strategy};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::common::USP_2X2;

type Plain = Autodiff<Flex>;
type Cp = ContextParallel<Autodiff<Flex>>;
type Bytes = BinBytesRecorder<FullPrecisionSettings>;

const TOLERANCE: f64 = 1e-5;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn record_bytes<B: Backend, M: Module<B>>(module: M) -> Vec<u8> {
    Recorder::<B>::record(&Bytes::default(), module.into_record(), ()).unwrap()
}

fn load<B: Backend, M: Module<B>>(module: M, bytes: &[u8]) -> M {
    let record = Recorder::<B>::load(&Bytes::default(), bytes.to_vec(), &Default::default())
        .expect("the record loads");
    module.load_record(record)
}

fn padding_mask<B: Backend>(lens: &[usize], width: usize) -> Tensor<B, 2, Bool> {
    let values: Vec<bool> = lens
        .iter()
        .flat_map(|&len| (0..width).map(move |c| c >= len))
        .collect();
    Tensor::from_data(
        TensorData::new(values, [lens.len(), width]),
        &Default::default(),
    )
}

fn input<B: Backend>(batch: usize, seq: usize, d: usize, seed: u64) -> Tensor<B, 3> {
    Tensor::from_data(
        TensorData::new(random(batch * seq * d, seed), [batch, seq, d]),
        &Default::default(),
    )
}

#[test]
fn burn_nn_records_load_into_the_drop_ins_and_back() {
    let device = Default::default();
    Flex::seed(&device, 3);
    // burn's parameters are initialised lazily (a clone draws its own values): compare modules
    // loaded from the same bytes.
    let bytes = record_bytes::<Flex, _>(
        burn::nn::attention::MultiHeadAttentionConfig::new(16, 4).init::<Flex>(&device),
    );
    let theirs = load(
        burn::nn::attention::MultiHeadAttentionConfig::new(16, 4).init::<Flex>(&device),
        &bytes,
    );
    let ours = load(
        MultiHeadAttentionConfig::new(16, 4).init::<Flex>(&device),
        &bytes,
    );
    for (a, b) in [
        (&theirs.query, &ours.query),
        (&theirs.key, &ours.key),
        (&theirs.value, &ours.value),
        (&theirs.output, &ours.output),
    ] {
        assert_eq!(values(a.weight.val()), values(b.weight.val()));
        assert_eq!(
            values(a.bias.as_ref().unwrap().val()),
            values(b.bias.as_ref().unwrap().val())
        );
    }
    // …and back: a drop-in checkpoint loads into burn-nn's module.
    let back = load(
        burn::nn::attention::MultiHeadAttentionConfig::new(16, 4).init::<Flex>(&device),
        &record_bytes::<Flex, _>(ours.clone()),
    );
    assert_eq!(
        values(back.query.weight.val()),
        values(ours.query.weight.val())
    );
    assert_eq!(
        values(back.output.weight.val()),
        values(ours.output.weight.val())
    );

    // The encoder stack: every layer's attention, feed-forward and norms.
    let config = burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2);
    let bytes = record_bytes::<Flex, _>(config.init::<Flex>(&device));
    let theirs = load(config.init::<Flex>(&device), &bytes);
    let ours = load(
        TransformerEncoderConfig::new(16, 32, 4, 2).init::<Flex>(&device),
        &bytes,
    );
    for (a, b) in theirs.layers.iter().zip(&ours.layers) {
        assert_eq!(
            values(a.mha.value.weight.val()),
            values(b.mha.value.weight.val())
        );
        assert_eq!(
            values(a.pwff.linear_inner.weight.val()),
            values(b.pwff.linear_inner.weight.val())
        );
        assert_eq!(values(a.norm_2.gamma.val()), values(b.norm_2.gamma.val()));
    }
    let back = load(
        config.init::<Flex>(&device),
        &record_bytes::<Flex, _>(ours.clone()),
    );
    assert_eq!(
        values(back.layers[1].mha.key.weight.val()),
        values(ours.layers[1].mha.key.weight.val())
    );

    // The position modules (constants only: the records are empty, the layouts equal).
    let rope = burn::nn::RotaryEncodingConfig::new(32, 8).init::<Flex>(&device);
    let ours = load(
        RotaryEncodingConfig::new(32, 8).init::<Flex>(&device),
        &record_bytes::<Flex, _>(rope),
    );
    load(
        burn::nn::RotaryEncodingConfig::new(32, 8).init::<Flex>(&device),
        &record_bytes::<Flex, _>(ours),
    );
    let sinusoids = burn::nn::PositionalEncodingConfig::new(8).init::<Flex>(&device);
    let ours = load(
        PositionalEncodingConfig::new(8).init::<Flex>(&device),
        &record_bytes::<Flex, _>(sinusoids),
    );
    load(
        burn::nn::PositionalEncodingConfig::new(8).init::<Flex>(&device),
        &record_bytes::<Flex, _>(ours),
    );
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let err = max_rel_err(got, want);
    assert!(err <= TOLERANCE, "{what}: max_rel_err {err:e}");
}

#[path = "nn/plain.rs"]
mod plain;

#[path = "nn/under_cp.rs"]
mod under_cp;

#[path = "nn/refusals.rs"]
mod refusals;
