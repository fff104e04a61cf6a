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

// ---------------------------------------------------------------- records

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

// ---------------------------------------------------------------- equal to burn-nn without CP

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let err = max_rel_err(got, want);
    assert!(err <= TOLERANCE, "{what}: max_rel_err {err:e}");
}

/// burn-nn's and the drop-in's outputs of one case.
type Pair<B> = Box<dyn Fn() -> (Tensor<B, 3>, Tensor<B, 3>)>;

fn mha_equals_burn_nn<B: Backend>(backend: &str) {
    let device = Default::default();
    B::seed(&device, 5);
    let config = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4).with_dropout(0.0);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: MultiHeadAttention<B> = load(
        MultiHeadAttentionConfig::new(16, 4)
            .with_dropout(0.0)
            .init(&device),
        &bytes,
    );
    let lens = [7, 4, 6];
    let x = input::<B>(3, 7, 16, 1);
    let pad = padding_mask::<B>(&lens, 7);
    let causal = generate_autoregressive_mask::<B>(3, 7, &device);
    let cases: Vec<(&str, Pair<B>)> = vec![
        ("no mask", {
            let (theirs, ours, x) = (theirs.clone(), ours.clone(), x.clone());
            Box::new(move || {
                (
                    theirs
                        .forward(burn::nn::attention::MhaInput::self_attn(x.clone()))
                        .context,
                    ours.forward(MhaInput::self_attn(x.clone())).context,
                )
            })
        }),
        ("mask_pad", {
            let (theirs, ours, x, pad) = (theirs.clone(), ours.clone(), x.clone(), pad.clone());
            Box::new(move || {
                (
                    theirs
                        .forward(
                            burn::nn::attention::MhaInput::self_attn(x.clone())
                                .mask_pad(pad.clone()),
                        )
                        .context,
                    ours.forward(MhaInput::self_attn(x.clone()).mask_pad(pad.clone()))
                        .context,
                )
            })
        }),
        ("mask_pad + causal mask_attn", {
            let (theirs, ours, x, pad, causal) = (
                theirs.clone(),
                ours.clone(),
                x.clone(),
                pad.clone(),
                causal.clone(),
            );
            Box::new(move || {
                (
                    theirs
                        .forward(
                            burn::nn::attention::MhaInput::self_attn(x.clone())
                                .mask_pad(pad.clone())
                                .mask_attn(causal.clone()),
                        )
                        .context,
                    ours.forward(
                        MhaInput::self_attn(x.clone())
                            .mask_pad(pad.clone())
                            .mask_attn(causal.clone()),
                    )
                    .context,
                )
            })
        }),
        ("causal() extension", {
            let (theirs, ours, x, causal) =
                (theirs.clone(), ours.clone(), x.clone(), causal.clone());
            Box::new(move || {
                (
                    theirs
                        .forward(
                            burn::nn::attention::MhaInput::self_attn(x.clone())
                                .mask_attn(causal.clone()),
                        )
                        .context,
                    ours.forward(MhaInput::self_attn(x.clone()).causal())
                        .context,
                )
            })
        }),
        ("a non-causal mask_attn (sliding window of 2)", {
            let window: Vec<bool> = (0..3 * 7 * 7)
                .map(|i| {
                    let (q, k) = ((i / 7) % 7, i % 7);
                    k > q || q - k >= 2
                })
                .collect();
            let window =
                Tensor::<B, 3, Bool>::from_data(TensorData::new(window, [3, 7, 7]), &device);
            let (theirs, ours, x, pad) = (theirs.clone(), ours.clone(), x.clone(), pad.clone());
            Box::new(move || {
                (
                    theirs
                        .forward(
                            burn::nn::attention::MhaInput::self_attn(x.clone())
                                .mask_pad(pad.clone())
                                .mask_attn(window.clone()),
                        )
                        .context,
                    ours.forward(
                        MhaInput::self_attn(x.clone())
                            .mask_pad(pad.clone())
                            .mask_attn(window.clone()),
                    )
                    .context,
                )
            })
        }),
        ("cross-attention of 7 queries on 5 keys", {
            let memory = input::<B>(3, 5, 16, 9);
            let (theirs, ours, x) = (theirs.clone(), ours.clone(), x.clone());
            Box::new(move || {
                (
                    theirs
                        .forward(burn::nn::attention::MhaInput::new(
                            x.clone(),
                            memory.clone(),
                            memory.clone(),
                        ))
                        .context,
                    ours.forward(MhaInput::new(x.clone(), memory.clone(), memory.clone()))
                        .context,
                )
            })
        }),
    ];
    for (what, run) in cases {
        let (want, got) = run();
        assert_close(
            &values(got),
            &values(want),
            &format!("{backend}: MHA {what}"),
        );
    }
    // Quiet softmax takes burn-nn's matmul path (and returns the weights).
    let config = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4)
        .with_dropout(0.0)
        .with_quiet_softmax(true);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: MultiHeadAttention<B> = load(
        MultiHeadAttentionConfig::new(16, 4)
            .with_dropout(0.0)
            .with_quiet_softmax(true)
            .init(&device),
        &bytes,
    );
    let want =
        theirs.forward(burn::nn::attention::MhaInput::self_attn(x.clone()).mask_pad(pad.clone()));
    let got = ours.forward(MhaInput::self_attn(x.clone()).mask_pad(pad.clone()));
    assert_close(&values(got.context), &values(want.context), "quiet softmax");
    assert_close(
        &values(got.weights.expect("the matmul path returns the weights")),
        &values(want.weights),
        "quiet softmax weights",
    );
}

#[test]
fn mha_without_a_context_equals_burn_nn() {
    mha_equals_burn_nn::<Plain>("Autodiff<Flex>");
    mha_equals_burn_nn::<Cp>("ContextParallel<Autodiff<Flex>>");
    mha_equals_burn_nn::<Flex>("Flex");
}

fn encoder_equals_burn_nn<B: Backend>(norm_first: bool) {
    let device = Default::default();
    B::seed(&device, 8);
    let config = burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(norm_first);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: TransformerEncoder<B> = load(
        TransformerEncoderConfig::new(16, 32, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first)
            .init(&device),
        &bytes,
    );
    let lens = [6, 3];
    let x = input::<B>(2, 6, 16, 4);
    let pad = padding_mask::<B>(&lens, 6);
    let causal = generate_autoregressive_mask::<B>(2, 6, &device);
    let want = theirs.forward(
        burn::nn::transformer::TransformerEncoderInput::new(x.clone())
            .mask_pad(pad.clone())
            .mask_attn(causal.clone()),
    );
    let got = ours.forward(
        TransformerEncoderInput::new(x.clone())
            .mask_pad(pad)
            .mask_attn(causal),
    );
    assert_close(
        &values(got),
        &values(want),
        &format!("encoder norm_first {norm_first}"),
    );
}

#[test]
fn encoder_and_position_modules_without_a_context_equal_burn_nn() {
    encoder_equals_burn_nn::<Plain>(false);
    encoder_equals_burn_nn::<Plain>(true);
    encoder_equals_burn_nn::<Cp>(true);
    let device = Default::default();
    // RoPE on 3D and 4D inputs, with a start offset, and after shifts.
    let mut theirs = burn::nn::RotaryEncodingConfig::new(16, 8).init::<Plain>(&device);
    let mut ours = RotaryEncodingConfig::new(16, 8).init::<Plain>(&device);
    let x3 = input::<Plain>(2, 5, 8, 2);
    let x4: Tensor<Plain, 4> = Tensor::from_data(
        TensorData::new(random(2 * 3 * 5 * 8, 6), [2, 3, 5, 8]),
        &device,
    );
    assert_close(
        &values(ours.forward(x3.clone())),
        &values(theirs.forward(x3.clone())),
        "rope 3d",
    );
    assert_close(
        &values(ours.forward(x4.clone())),
        &values(theirs.forward(x4.clone())),
        "rope 4d",
    );
    assert_close(
        &values(ours.apply(x3.clone(), 4)),
        &values(theirs.apply(x3.clone(), 4)),
        "rope start 4",
    );
    for shift in [3, 20] {
        theirs.shift(shift);
        ours.shift(shift);
        assert_close(
            &values(ours.freq_complex.clone()),
            &values(theirs.freq_complex.clone()),
            &format!("rope shift {shift}"),
        );
    }
    let theirs = burn::nn::PositionalEncodingConfig::new(8).init::<Plain>(&device);
    let ours = PositionalEncodingConfig::new(8).init::<Plain>(&device);
    assert_close(
        &values(ours.forward(x3.clone())),
        &values(theirs.forward(x3)),
        "sinusoids",
    );
}

// ---------------------------------------------------------------- under CP: equal to cp 1

/// A user's model built only from the drop-ins: RoPE and sinusoids on the input, then a causal
/// GQA encoder stack (4 query heads, 2 kv heads).
#[derive(Module, Debug)]
struct UserModel<B: Backend> {
    rope: RotaryEncoding<B>,
    sinusoids: PositionalEncoding<B>,
    encoder: TransformerEncoder<B>,
}

const D_MODEL: usize = 16;

impl<B: Backend> UserModel<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            rope: RotaryEncodingConfig::new(64, D_MODEL).init(device),
            sinusoids: PositionalEncodingConfig::new(D_MODEL)
                .with_max_sequence_size(64)
                .init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 32, 4, 2)
                .with_n_kv_heads(Some(2))
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
        }
    }

    /// `x [B, S, d]` with right padding `mask_pad [B, S]`; `dense_causal` passes burn-nn's
    /// autoregressive mask, else the `causal()` extension.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_pad: Tensor<B, 2, Bool>,
        dense_causal: bool,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let device = x.device();
        let x = self.sinusoids.forward(self.rope.forward(x));
        let input = TransformerEncoderInput::new(x)
            .mask_pad(mask_pad)
            .rotary(10_000.0);
        let input = if dense_causal {
            input.mask_attn(generate_autoregressive_mask(batch, seq, &device))
        } else {
            input.causal()
        };
        self.encoder.forward(input)
    }

    /// The gradients of the attention's and feed-forward's weights, flattened in a fixed order.
    fn grads<A: AutodiffBackend>(model: &UserModel<A>, grads: &A::Gradients) -> Vec<f32> {
        let mut all = Vec::new();
        for layer in &model.encoder.layers {
            for linear in [
                &layer.mha.query,
                &layer.mha.key,
                &layer.mha.value,
                &layer.mha.output,
            ] {
                all.extend(values(
                    linear.weight.val().grad(grads).expect("weight grad"),
                ));
                all.extend(values(
                    linear
                        .bias
                        .as_ref()
                        .unwrap()
                        .val()
                        .grad(grads)
                        .expect("bias grad"),
                ));
            }
            all.extend(values(
                layer
                    .pwff
                    .linear_inner
                    .weight
                    .val()
                    .grad(grads)
                    .expect("pwff grad"),
            ));
            all.extend(values(
                layer.norm_2.gamma.val().grad(grads).expect("norm grad"),
            ));
        }
        all
    }
}

/// Outputs, input gradients (both `[Σ len, d]`, sequence after sequence) and summed weight
/// gradients.
struct Run {
    out: Vec<f32>,
    dx: Vec<f32>,
    dweights: Vec<f32>,
}

/// One rank's run: the full-batch token index at each local slot (`usize::MAX` at padding), its
/// outputs and input gradients there, its share of the weight gradients.
struct RankRun {
    tokens: Vec<usize>,
    out: Vec<f32>,
    dx: Vec<f32>,
    dweights: Vec<f32>,
}

/// Full-batch data: sequence `s`'s `x` and upstream gradient rows.
struct Data {
    lens: Vec<usize>,
    x: Vec<Vec<f32>>,
    g: Vec<Vec<f32>>,
}

impl Data {
    fn new(lens: &[usize], seed: u64) -> Self {
        Self {
            lens: lens.to_vec(),
            x: lens
                .iter()
                .enumerate()
                .map(|(s, &l)| random(l * D_MODEL, seed + s as u64))
                .collect(),
            g: lens
                .iter()
                .enumerate()
                .map(|(s, &l)| random(l * D_MODEL, seed + 100 + s as u64))
                .collect(),
        }
    }
}

fn model_bytes() -> Vec<u8> {
    let device = Default::default();
    Flex::seed(&device, 21);
    record_bytes::<Flex, _>(UserModel::<Flex>::new(&device))
}

/// The reference: every sequence alone, on one device, without a CP context (Autodiff<Flex>).
fn per_sequence(data: &Data, bytes: &[u8]) -> Run {
    let device = Default::default();
    let model: UserModel<Plain> = load(UserModel::new(&device), bytes);
    let mut run = Run {
        out: vec![],
        dx: vec![],
        dweights: vec![],
    };
    for (s, &len) in data.lens.iter().enumerate() {
        let x = Tensor::<Plain, 3>::from_data(
            TensorData::new(data.x[s].clone(), [1, len, D_MODEL]),
            &device,
        )
        .require_grad();
        let g = Tensor::<Plain, 3>::from_data(
            TensorData::new(data.g[s].clone(), [1, len, D_MODEL]),
            &device,
        );
        let out = model.forward(x.clone(), padding_mask(&[len], len), true);
        let grads = (out.clone() * g).sum().backward();
        run.out.extend(values(out));
        run.dx.extend(values(x.grad(&grads).unwrap()));
        let dweights = UserModel::<Plain>::grads(&model, &grads);
        if run.dweights.is_empty() {
            run.dweights = dweights;
        } else {
            run.dweights
                .iter_mut()
                .zip(dweights)
                .for_each(|(a, b)| *a += b);
        }
    }
    run
}

/// Rows `rows` (sequences per row) of `data` at `cp`, as each rank's `[B, W, d]` local batch under
/// a CP context with `strategy`; outputs and gradients put back in sequence order.
fn context_parallel(
    data: &Data,
    bytes: &[u8],
    rows: Option<BatchRows>,
    cp: usize,
    strategy: Strategy,
    layout: Layout,
    dense_causal: bool,
) -> Run {
    let batch_of = |placement: Placement| {
        let batch = CpBatch::new(placement, vec![MaskSpec::Causal]);
        match rows.clone() {
            Some(rows) => batch.with_rows(rows).unwrap(),
            None => batch,
        }
    };
    let batch = if strategy == Strategy::Dcp {
        let schedule = Arc::new(dcp_schedule(&data.lens, cp));
        let mut batch = batch_of(schedule.placement().clone());
        batch.blocks = Some(schedule);
        batch
    } else {
        batch_of(Placement::of_layout(&data.lens, cp, layout).unwrap())
    };
    // Token t of sequence s: its rows of x and g.
    let offsets: Vec<usize> = data
        .lens
        .iter()
        .scan(0, |acc, &l| {
            let o = *acc;
            *acc += l;
            Some(o)
        })
        .collect();
    let total: usize = data.lens.iter().sum();
    let world = InProcessWorld::new(cp, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<RankRun, burn_dcp::CpError> {
        let device = Default::default();
        let rank = comm.rank();
        let model: UserModel<Cp> = load(UserModel::new(&device), bytes);
        let local = batch.local_rows(rank)?;
        let width = local.width();
        // Which (sequence, position) sits at each local [row, column]: gather a full index table.
        let seqs_per_row: Vec<usize> = match &rows {
            Some(rows) => rows.seqs_per_row().to_vec(),
            None => vec![data.lens.len()],
        };
        let full_width = local.full_width();
        let mut table = vec![usize::MAX; seqs_per_row.len() * full_width];
        let mut seq = 0;
        for (row, &count) in seqs_per_row.iter().enumerate() {
            let mut column = 0;
            for _ in 0..count {
                for t in 0..data.lens[seq] {
                    table[row * full_width + column + t] = offsets[seq] + t;
                }
                column += data.lens[seq];
                seq += 1;
            }
        }
        let tokens = local.gather(&table, full_width, width, usize::MAX)?;
        let row_of = |data_rows: &Vec<Vec<f32>>| -> Vec<f32> {
            tokens
                .iter()
                .flat_map(|&index| {
                    if index == usize::MAX {
                        vec![0.0; D_MODEL]
                    } else {
                        let seq = offsets.partition_point(|&o| o <= index) - 1;
                        let t = index - offsets[seq];
                        data_rows[seq][t * D_MODEL..(t + 1) * D_MODEL].to_vec()
                    }
                })
                .collect()
        };
        let b = local.rows();
        let x = Tensor::<Cp, 3>::from_data(
            TensorData::new(row_of(&data.x), [b, width, D_MODEL]),
            &device,
        )
        .require_grad();
        let g = Tensor::<Cp, 3>::from_data(
            TensorData::new(row_of(&data.g), [b, width, D_MODEL]),
            &device,
        );
        let mask_pad = local.mask_pad_tensor::<Cp>(width, &device)?;
        let group = CpGroup::new(comm.clone(), strategy)?;
        let context = set_context(CpContext {
            group,
            batch: batch.clone(),
        });
        let out = model.forward(x.clone(), mask_pad, dense_causal);
        let calls = context.finish()?;
        assert_eq!(calls, 2, "one intercepted call per encoder layer");
        let grads = (out.clone() * g).sum().backward();
        Ok(RankRun {
            tokens,
            out: values(out),
            dx: values(x.grad(&grads).unwrap()),
            dweights: UserModel::<Cp>::grads(&model, &grads),
        })
    });
    let mut run = Run {
        out: vec![0.0; total * D_MODEL],
        dx: vec![0.0; total * D_MODEL],
        dweights: vec![],
    };
    for result in results {
        let RankRun {
            tokens: placed,
            out,
            dx,
            dweights,
        } = result.unwrap();
        for (slot, &index) in placed.iter().enumerate() {
            if index == usize::MAX {
                continue;
            }
            let (to, from) = (index * D_MODEL, slot * D_MODEL);
            run.out[to..to + D_MODEL].copy_from_slice(&out[from..from + D_MODEL]);
            run.dx[to..to + D_MODEL].copy_from_slice(&dx[from..from + D_MODEL]);
        }
        if run.dweights.is_empty() {
            run.dweights = dweights;
        } else {
            run.dweights
                .iter_mut()
                .zip(dweights)
                .for_each(|(a, b)| *a += b);
        }
    }
    run
}

fn dcp_schedule(seq_lens: &[usize], cp: usize) -> BlockSchedule {
    let problem = BlockProblem {
        seq_lens: seq_lens.to_vec(),
        masks: vec![MaskSpec::Causal],
        head_groups: 1,
        block: 4,
    };
    let dims = AttentionDims {
        heads: 4,
        kv_heads: 2,
        head_dim: D_MODEL / 4,
        element_bytes: 4,
    };
    let topology = Topology {
        devices_per_node: cp,
        ..Topology::a100_p4d(1)
    };
    let routed = dcp_plan(
        &problem,
        tile_grids(&problem),
        &dims,
        &topology,
        &DcpConfig::default(),
    )
    .unwrap();
    BlockSchedule::new(&routed.plan, &problem, &topology).unwrap()
}

fn strategies() -> Vec<(Strategy, usize, Layout)> {
    vec![
        (Strategy::Ring, 2, Layout::Zigzag),
        (Strategy::Ring, 4, Layout::Zigzag),
        (Strategy::Ulysses, 4, Layout::Contiguous),
        (
            Strategy::Usp {
                ulysses_degree: 2,
                ring_degree: 2,
            },
            4,
            Layout::Zigzag,
        ),
        (Strategy::AllGather, 2, Layout::Stripe),
        (Strategy::Dcp, 4, Layout::Contiguous),
    ]
}

fn check_against_reference(data: &Data, rows: Option<BatchRows>, what: &str) {
    let bytes = model_bytes();
    let want = per_sequence(data, &bytes);
    let mut cases = vec![(Strategy::Ring, 1, Layout::Contiguous)];
    cases.extend(strategies());
    for (i, (strategy, cp, layout)) in cases.into_iter().enumerate() {
        let dense = i % 2 == 0;
        let got = context_parallel(data, &bytes, rows.clone(), cp, strategy, layout, dense);
        let case = format!("{what}: {strategy} cp {cp} {layout} (dense causal mask {dense})");
        assert_close(&got.out, &want.out, &format!("{case}: out"));
        assert_close(&got.dx, &want.dx, &format!("{case}: dx"));
        assert_close(
            &got.dweights,
            &want.dweights,
            &format!("{case}: weight gradients"),
        );
    }
}

#[test]
fn drop_ins_under_cp_equal_one_device_with_three_padded_rows() {
    let data = Data::new(&[13, 6, 9], 40);
    check_against_reference(&data, Some(BatchRows::one_per_row(3)), "B = 3 padded");
}

#[test]
fn drop_ins_under_cp_equal_one_device_with_one_packed_row() {
    let data = Data::new(&[11, 7], 50);
    check_against_reference(&data, None, "B = 1 packed");
    check_against_reference(
        &data,
        Some(BatchRows::packed(vec![2])),
        "B = 1 packed (BatchRows)",
    );
}

// ---------------------------------------------------------------- never silent

/// Runs `task` on every rank of a cp-2 world under a ring context of two sequences (one per
/// row); returns each rank's result.
fn under_context<T: Send>(
    task: impl Fn(usize, burn_dcp::CpContextGuard) -> Result<T, String> + Sync,
) -> Vec<Result<T, RankFailure>> {
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    world.run(|comm| -> Result<T, String> {
        let placement =
            Placement::of_layout(&[6, 4], 2, Layout::Zigzag).map_err(|e| e.to_string())?;
        let batch = CpBatch::new(placement, vec![MaskSpec::Causal])
            .with_rows(BatchRows::one_per_row(2))
            .map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let group = CpGroup::new(comm, Strategy::Ring).map_err(|e| e.to_string())?;
        task(rank, set_context(CpContext { group, batch }))
    })
}

#[test]
fn burn_nns_attention_under_a_context_fails_finish() {
    let results = under_context(|_, guard| {
        let device = Default::default();
        let mha = burn::nn::attention::MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&device);
        let x = input::<Cp>(2, 3, 8, 1);
        let _ = mha.forward(burn::nn::attention::MhaInput::self_attn(x));
        Ok(guard.finish().map_err(|e| e.to_string()))
    });
    for result in results {
        let error = result.unwrap().unwrap_err();
        for needle in [
            "no attention call was intercepted",
            "MultiHeadAttention",
            "burn_dcp::nn",
            "CP size 2",
        ] {
            assert!(error.contains(needle), "{needle:?} missing from: {error}");
        }
    }
    // The drop-in under the same context: intercepted, finish() counts the call.
    let results = under_context(|_rank, guard| {
        let device = Default::default();
        let mha = MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&device);
        let width = 3;
        let out = mha.forward(MhaInput::self_attn(input::<Cp>(2, width, 8, 1)).causal());
        assert!(out.weights.is_none(), "no weights under CP");
        guard.finish().map_err(|e| e.to_string())
    });
    for result in results {
        assert_eq!(result.unwrap(), 1);
    }
}

/// A model only partly ported — a drop-in layer beside attention computed on the shard — is
/// refused by `finish()` in three shapes (burn-nn's `MultiHeadAttention`, a burn-nn
/// `TransformerEncoder`, a hand-written `[B, H, L, d]` softmax(QKᵀ)V), naming what it saw; an MLP
/// whose width equals the local length (burn-nn `Linear`, a hand-written rank-3 matmul, a weight
/// broadcast over a rank-4 input) is not.
#[test]
fn a_partly_ported_model_is_refused_and_an_mlp_of_the_local_width_is_not() {
    let width = 3; // every rank's local row width under `under_context`
    let drop_in = |x: Tensor<Cp, 3>| {
        let mha = MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&Default::default());
        mha.forward(MhaInput::self_attn(x).causal()).context
    };
    let cases: Vec<(&str, RankCall, bool)> = vec![
        (
            "burn-nn MultiHeadAttention beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let mha = burn::nn::attention::MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let _ = mha.forward(burn::nn::attention::MhaInput::self_attn(x));
            }),
            true,
        ),
        (
            "a burn-nn TransformerEncoder beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let encoder = burn::nn::transformer::TransformerEncoderConfig::new(8, 16, 2, 1)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let _ = encoder.forward(burn::nn::transformer::TransformerEncoderInput::new(x));
            }),
            true,
        ),
        (
            "a hand-written attention beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let heads = x.reshape([2, width, 2, 4]).swap_dims(1, 2);
                let scores = heads
                    .clone()
                    .matmul(heads.clone().transpose())
                    .div_scalar(2.0);
                let _ = burn::tensor::activation::softmax(scores, 3).matmul(heads);
            }),
            true,
        ),
        (
            "an MLP of the local width (Linear, rank-3 matmul, broadcast weight)",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let linear = burn::nn::LinearConfig::new(8, width).init::<Cp>(&Default::default());
                let _ = linear.forward(x.clone());
                let weight = input::<Cp>(1, 8, width, 2);
                let _ = x.clone().matmul(weight.clone());
                let _ = x.unsqueeze_dim::<4>(1).matmul(weight.unsqueeze_dim::<4>(0));
            }),
            false,
        ),
    ];
    for (what, case, refused) in &cases {
        let results = under_context(|rank, guard| {
            case(rank);
            Ok(guard.finish().map_err(|e| e.to_string()))
        });
        for result in results {
            match (result.unwrap(), refused) {
                (Err(error), true) => {
                    for needle in [
                        "computed attention scores over its own shard",
                        "beside 1 intercepted attention call",
                        "burn_dcp::nn",
                        ", 3, 3]",
                    ] {
                        assert!(
                            error.contains(needle),
                            "{what}: {needle:?} missing from: {error}"
                        );
                    }
                }
                (Ok(calls), false) => assert_eq!(calls, 1, "{what}"),
                (other, _) => panic!("{what}: {other:?}"),
            }
        }
    }
}

/// One rank's call of a module under the context.
type RankCall = Box<dyn Fn(usize) + Sync>;

#[test]
fn what_cp_cannot_compute_is_an_error_at_the_call() {
    let cases: Vec<(&str, RankCall)> = vec![
        (
            "dropout 0.1",
            Box::new(|_rank| {
                // burn-nn's default configuration: dropout 0.1.
                let mha = MultiHeadAttentionConfig::new(8, 2).init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)).causal());
            }),
        ),
        (
            "quiet_softmax",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .with_quiet_softmax(true)
                    .init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)).causal());
            }),
        ),
        (
            "MaskSpec",
            Box::new(|_rank| {
                let width = 3;
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                // Some key masked for the first query: neither causal nor none.
                let mut values = vec![false; 2 * width * width];
                values[0] = true;
                let odd = Tensor::<Cp, 3, Bool>::from_data(
                    TensorData::new(values, [2, width, width]),
                    &Default::default(),
                );
                mha.forward(MhaInput::self_attn(input::<Cp>(2, width, 8, 1)).mask_attn(odd));
            }),
        ),
        (
            "mask_pad differs",
            Box::new(|_rank| {
                let width = 3;
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let wider = input::<Cp>(2, width + 1, 8, 1);
                let pad = Tensor::<Cp, 2, Bool>::from_data(
                    TensorData::new(vec![false; 2 * (width + 1)], [2, width + 1]),
                    &Default::default(),
                );
                mha.forward(MhaInput::self_attn(wider).mask_pad(pad).causal());
            }),
        ),
        (
            "causal-family but the input has no causal mask",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)));
            }),
        ),
        (
            "is not ContextParallel",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Plain>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Plain>(2, 3, 8, 1)).causal());
            }),
        ),
    ];
    for (needle, case) in &cases {
        let results = under_context(|rank, _guard| {
            case(rank);
            Ok(())
        });
        for result in results {
            let error = result.unwrap_err();
            assert!(error.contains(needle), "{needle:?} missing from: {error}");
        }
    }
}

#[test]
fn lengths_from_mask_pad_read_right_padding() {
    let pad = padding_mask::<Flex>(&[3, 1, 4], 4);
    assert_eq!(
        burn_dcp::nn::lengths_from_mask_pad(pad).unwrap(),
        vec![3, 1, 4]
    );
    let left = Tensor::<Flex, 2, Bool>::from_data(
        TensorData::new(vec![true, false, false], [1, 3]),
        &Default::default(),
    );
    let error = burn_dcp::nn::lengths_from_mask_pad(left)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("column 1 after padding at column 0"),
        "{error}"
    );
}

#[test]
fn rows_that_do_not_fit_the_context_are_refused() {
    let results = under_context(|_, _guard| {
        // Three rows under a context of two.
        let x = Tensor::<Cp, 4>::zeros([3, 2, 3, 4], &Default::default());
        let options = burn::tensor::ops::AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        burn::tensor::module::attention(x.clone(), x.clone(), x, None, None, options);
        Ok(())
    });
    for result in results {
        let error = result.unwrap_err();
        assert!(
            error.contains("batch has 3 rows") && error.contains("describe 2"),
            "{error}"
        );
    }
    // Without BatchRows, B > 1 names the fix.
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<(), String> {
        let placement = Placement::of_layout(&[6, 4], 2, Layout::Zigzag).unwrap();
        let group = CpGroup::new(comm, Strategy::Ring).unwrap();
        let _context = set_context(CpContext {
            group,
            batch: CpBatch::new(placement, vec![MaskSpec::Causal]),
        });
        let x = Tensor::<Cp, 4>::zeros([2, 2, 3, 4], &Default::default());
        let options = burn::tensor::ops::AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        burn::tensor::module::attention(x.clone(), x.clone(), x, None, None, options);
        Ok(())
    });
    for result in results {
        let error = result.unwrap_err();
        assert!(error.contains("BatchRows::one_per_row(2)"), "{error}");
    }
}
