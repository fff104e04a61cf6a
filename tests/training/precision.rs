//! Training in bf16 and f16 (`--precision`) on Flex: the f32 master weights are cast to
//! the low precision per micro-batch, so activations, attention inputs and CP messages are bf16,
//! attention accumulates in f32, and the loss's softmax runs in f32.
//!
//! Tolerances: TransformerEngine's CP tests compare bf16 (f16) attention outputs and gradients of
//! CP with one device by `torch.allclose` at atol = rtol = 2.5e-2 (5e-3 for f16): that is
//! `tests/cp_strategies.rs`' bf16 test, on the attention itself. Here, on whole training steps,
//! the loss is held to that tolerance and the parameters' gradients to the precision's own
//! error (see `assert_as_accurate`).

use super::*;
use burn_dcp_suite::train::{DcpSettings, Precision};

/// TransformerEngine's bf16 tolerance (relative to the largest reference magnitude here).
const BF16_TOLERANCE: f64 = 2.5e-2;
/// TransformerEngine's f16 tolerance.
const F16_TOLERANCE: f64 = 5e-3;

fn at(precision: Precision, mut config: TrainConfig) -> TrainConfig {
    config.precision = precision;
    config
}

/// The largest [`max_rel`] over the parameters' gradients (each relative to its own largest
/// magnitude).
fn worst_gradient_err(got: &(f64, Vec<Vec<f32>>, u64), want: &(f64, Vec<Vec<f32>>, u64)) -> f64 {
    assert_eq!(got.1.len(), want.1.len());
    got.1
        .iter()
        .zip(&want.1)
        .map(|(g, w)| {
            assert!(g.iter().all(|x| x.is_finite()), "a non-finite gradient");
            max_rel(g, w)
        })
        .fold(0.0, f64::max)
}

fn loss_err(got: &(f64, Vec<Vec<f32>>, u64), want: &(f64, Vec<Vec<f32>>, u64)) -> f64 {
    assert!(got.0.is_finite(), "a non-finite loss");
    ((got.0 - want.0) / want.0).abs()
}

/// A low-precision CP step against cp 1 in the same precision and in f32: the loss within
/// `tolerance` of cp 1's (TransformerEngine's), and the gradients no further from f32's than
/// twice cp 1's own distance from them (`precision_err`): CP in bf16 is as accurate as one
/// device in bf16. (Gradients of whole-model parameters carry bf16's rounding of every rank's
/// partial sums — burn's matmul and embedding backward return the activations' dtype, so
/// weight gradients are rounded to bf16 before the f32 sum — which is why they are held to
/// the precision's own error, not to a fixed bound.)
fn assert_as_accurate(
    got: &(f64, Vec<Vec<f32>>, u64),
    same_precision: &(f64, Vec<Vec<f32>>, u64),
    f32_reference: &(f64, Vec<Vec<f32>>, u64),
    precision_err: f64,
    tolerance: f64,
    what: &str,
) {
    let loss = loss_err(got, same_precision);
    let grads = worst_gradient_err(got, f32_reference);
    let to_cp1 = worst_gradient_err(got, same_precision);
    eprintln!(
        "{what}: loss rel {loss:.2e} vs cp 1; gradients vs f32 {grads:.2e} (cp 1's {precision_err:.2e}), vs cp 1 {to_cp1:.2e}"
    );
    assert!(loss <= tolerance, "{what}: loss rel {loss:e} > {tolerance}");
    assert!(
        grads <= 2.0 * precision_err,
        "{what}: gradients {grads:e} from f32's, more than twice cp 1's {precision_err:e}"
    );
}

/// Every strategy at cp 4 in bf16: the loss within TransformerEngine's bf16 tolerance of cp 1
/// in bf16, the gradients as close to f32's as cp 1's in bf16 (see [`assert_as_accurate`]);
/// bf16 cp 1 itself within that tolerance of f32 cp 1 for the loss.
#[test]
fn bf16_cp4_matches_bf16_cp1_for_every_strategy() {
    let base = config(1, 1, Strategy::Ring, Layout::Zigzag, "causal");
    let f32_reference = one_step(&base);
    let reference = one_step(&at(Precision::Bf16, base));
    let precision_err = worst_gradient_err(&reference, &f32_reference);
    let loss = loss_err(&reference, &f32_reference);
    eprintln!("bf16 cp 1 vs f32 cp 1: loss rel {loss:.2e}, gradients {precision_err:.2e}");
    assert!(loss <= BF16_TOLERANCE && precision_err <= BF16_TOLERANCE);
    let usp = USP_2X2;
    let mut configs = vec![
        config(4, 1, Strategy::Ulysses, Layout::Zigzag, "causal"),
        config(4, 1, Strategy::Ring, Layout::Zigzag, "causal"),
        config(4, 1, Strategy::Ring, Layout::Stripe, "causal"),
        config(4, 1, Strategy::AllGather, Layout::Contiguous, "causal"),
        config(4, 1, usp, Layout::Zigzag, "causal"),
    ];
    let mut dcp = config(4, 1, Strategy::Dcp, Layout::Zigzag, "causal");
    dcp.mode = TrainMode::Dcp(DcpSettings {
        block: 16,
        stages: 3,
    });
    configs.push(dcp);
    for config in configs {
        let what = format!("bf16 cp 4 {}", config.strategy_name());
        let got = one_step(&at(Precision::Bf16, config));
        assert!(got.2 > 0, "{what}: nothing was communicated");
        let (r, f) = (&reference, &f32_reference);
        assert_as_accurate(&got, r, f, precision_err, BF16_TOLERANCE, &what);
    }
}

/// Dynamic CP pools in bf16 (groups of several sizes inside one step), as the static
/// strategies.
#[test]
fn bf16_dynamic_cp_matches_bf16_cp1() {
    let (base, step) = mixed_lengths_step();
    let flex = burn::backend::flex::FlexDevice;
    let f32_reference = step_on::<burn::backend::Flex>(&base, step, &flex);
    let base = at(Precision::Bf16, base);
    let reference = step_on::<burn::backend::Flex>(&base, step, &flex);
    let precision_err = worst_gradient_err(&reference, &f32_reference);
    let ulysses_cp4 = TrainConfig {
        cp: 4,
        mode: TrainMode::Static {
            strategy: Strategy::Ulysses,
            layout: Layout::Zigzag,
        },
        ..base
    };
    let dynamic = dynamic_pow2(ulysses_cp4, 512);
    let got = step_on::<burn::backend::Flex>(&dynamic, step, &flex);
    let (r, f) = (&reference, &f32_reference);
    assert_as_accurate(
        &got,
        r,
        f,
        precision_err,
        BF16_TOLERANCE,
        "bf16 dynamic pool 4",
    );
}

/// f16 computes too: cp 4 within TransformerEngine's f16 tolerance of f32 cp 1, for the loss
/// and every parameter's gradient (f16's 11-bit mantissa; no loss scaling: the tiny model's
/// gradients stay far above f16's smallest normal).
#[test]
fn f16_cp4_matches_f32_cp1() {
    let f32_reference = one_step(&config(1, 1, Strategy::Ring, Layout::Zigzag, "causal"));
    let got = one_step(&at(
        Precision::F16,
        config(4, 1, Strategy::Ring, Layout::Zigzag, "causal"),
    ));
    let (loss, grads) = (
        loss_err(&got, &f32_reference),
        worst_gradient_err(&got, &f32_reference),
    );
    eprintln!("f16 cp 4 vs f32 cp 1: loss rel {loss:.2e}, gradients {grads:.2e}");
    assert!(loss <= F16_TOLERANCE && grads <= F16_TOLERANCE);
}

/// bf16's CP messages are half of f32's: a ring step's CP bytes are the analytic volume at 2
/// bytes per element (ring sends no LSE), exactly half the f32 step's.
#[test]
fn bf16_cp_bytes_are_half_of_f32() {
    let cp_bytes = |config: &TrainConfig| -> u64 {
        let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
        let data = TrainData::load(config).unwrap();
        for result in world.run(|comm| -> Result<(), String> {
            let groups = RankGroups::new(comm, config).map_err(|e| e.to_string())?;
            let device = burn::backend::flex::FlexDevice;
            let gpt = init_model::<burn::backend::Flex>(config, 0, 0, &device)?;
            step_gradients(&gpt, &groups, config, &data, 1, &device).map_err(|e| e.to_string())?;
            Ok(())
        }) {
            result.unwrap();
        }
        world
            .stats()
            .iter()
            .map(|s| s.bytes_by_label.get("cp").copied().unwrap_or(0))
            .sum()
    };
    let f32_config = config(4, 1, Strategy::Ring, Layout::Zigzag, "causal");
    let f32_bytes = cp_bytes(&f32_config);
    let bf16_bytes = cp_bytes(&at(Precision::Bf16, f32_config));
    assert!(f32_bytes > 0);
    assert_eq!(2 * bf16_bytes, f32_bytes);
}

/// The precision is a run's flag, written to config.json, parsed with a clear error.
#[test]
fn precision_names_parse_and_bad_ones_name_the_choices() {
    for precision in Precision::ALL {
        assert_eq!(Precision::parse(precision.name()).unwrap(), precision);
    }
    let err = Precision::parse("fp8").unwrap_err().to_string();
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    let json = serde_json::to_string(&at(
        Precision::Bf16,
        config(4, 1, Strategy::Ring, Layout::Zigzag, "causal"),
    ))
    .unwrap();
    assert!(json.contains("\"precision\":\"bf16\""), "{json}");
    // A config.json written before the flag existed resumes in f32.
    let old = json.replace(",\"precision\":\"bf16\"", "");
    let parsed: TrainConfig = serde_json::from_str(&old).unwrap();
    assert_eq!(parsed.precision, Precision::F32);
}

/// Ranks without tokens (2 and 3 tokens per micro-batch at cp 4) train in bf16 too: their empty
/// activations keep the precision's dtype.
#[test]
fn bf16_ranks_without_tokens_train() {
    for seq_len in [2, 3] {
        let mut reference = at(
            Precision::Bf16,
            config(1, 1, Strategy::Ring, Layout::Zigzag, "causal"),
        );
        reference.seq_len = seq_len;
        let want = one_step(&reference);
        let usp = USP_2X2;
        for strategy in [Strategy::Ring, Strategy::Ulysses, Strategy::AllGather, usp] {
            let mut cp4 = at(
                Precision::Bf16,
                config(4, 1, strategy, Layout::Zigzag, "causal"),
            );
            cp4.seq_len = seq_len;
            let got = one_step(&cp4);
            let what = format!("bf16 seq_len {seq_len}, {strategy}");
            assert!(loss_err(&got, &want) <= BF16_TOLERANCE, "{what}");
        }
    }
}
