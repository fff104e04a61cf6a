//! What a step communicates: the CP bytes are the analytic volume with the model's real kv heads,
//! and recomputation communicates exactly one forward more.

use super::*;

/// The GPT passes its real kv heads to the op: a step's CP bytes equal the analytic volume of
/// every micro-batch's attention with the model's `n_kv_heads` (2 of the tiny model's 4 heads),
/// per layer — not with the repeated heads.
#[test]
fn cp_bytes_of_a_step_are_the_analytic_volume_with_the_real_kv_heads() {
    use burn_dcp::diagnostics::volume::{analytic_volume, VolumeShape};
    let config = config(4, 1, Strategy::Ring, Layout::Zigzag, "causal");
    let model = config.model_config().unwrap();
    assert!(
        model.n_kv_heads < model.n_heads,
        "the test needs a GQA model"
    );
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let data = TrainData::load(&config).unwrap();
    for result in world.run(|comm| -> Result<(), String> {
        let groups = RankGroups::new(comm, &config).map_err(|e| e.to_string())?;
        let device = burn::backend::flex::FlexDevice;
        let gpt = init_model::<burn::backend::Flex>(&config, 0, 0, &device)?;
        step_gradients(&gpt, &groups, &config, &data, 1, &device).map_err(|e| e.to_string())?;
        Ok(())
    }) {
        result.unwrap();
    }
    let measured: u64 = world
        .stats()
        .iter()
        .map(|s| s.bytes_by_label.get("cp").copied().unwrap_or(0))
        .sum();
    let shape = |kv_heads| VolumeShape {
        heads: model.n_heads,
        kv_heads,
        head_dim: model.head_dim(),
        value_dim: model.head_dim(),
        element_bytes: 4,
    };
    let analytic = |kv_heads| -> u64 {
        data.step_batches(1, config.micro_batches)
            .unwrap()
            .iter()
            .map(|batch| {
                let placement =
                    burn_dcp::Placement::of_layout(&batch.seq_lens(), 4, Layout::Zigzag).unwrap();
                analytic_volume(Strategy::Ring, &placement, &shape(kv_heads))
                    .iter()
                    .map(|v| v.forward + v.backward)
                    .sum::<u64>()
            })
            .sum::<u64>()
            * model.n_layers as u64
    };
    assert!(measured > 0);
    assert_eq!(measured, analytic(model.n_kv_heads));
    assert_eq!(2 * measured, analytic(model.n_heads));
}

/// Per step: the loss and the bytes sent on the CP axis.
struct LossAndCpBytes(std::sync::Mutex<Vec<(f64, u64)>>);

impl burn_dcp_suite::train::StepObserver for LossAndCpBytes {
    fn on_step(&self, metrics: &burn_dcp_suite::train::StepMetrics) {
        let cp = metrics.bytes_by_axis.get("cp").copied().unwrap_or(0);
        self.0.lock().unwrap().push((metrics.loss, cp));
    }
}

fn train_recording(config: &TrainConfig) -> Vec<(f64, u64)> {
    let observer = LossAndCpBytes(Default::default());
    train_observed(config, None, None, &observer);
    observer.0.into_inner().unwrap()
}

/// `--recompute attention` (burn's BalancedCheckpointing, the CP attention node rerunning its
/// forward in its backward) and `--recompute block` (every layer recomputed from its input) train
/// exactly as keeping everything, and each communicates one more forward per attention call: the
/// CP bytes above `none`'s are the same for both (one forward's; for ring counted exactly).
#[test]
fn recompute_modes_train_exactly_and_communicate_one_forward_more() {
    use burn_dcp_suite::train::Recompute;
    let ring = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    let mut tp_pp = config(2, 1, Strategy::Ring, Layout::Zigzag, "lambda:8,32");
    tp_pp.tp = 2;
    tp_pp.pp = 2;
    tp_pp.micro_batches = 4;
    let mut dcp = config(2, 2, Strategy::Dcp, Layout::Zigzag, "causal");
    dcp.mode = TrainMode::Dcp(burn_dcp_suite::train::DcpSettings {
        block: 32,
        stages: 2,
    });
    let ulysses = config(4, 1, Strategy::Ulysses, Layout::Contiguous, "causal");
    for (name, mut config) in [
        ("ring", ring),
        ("tp2 pp2 ring", tp_pp),
        ("dcp", dcp),
        ("ulysses", ulysses),
    ] {
        config.steps = 2;
        let none = train_recording(&config);
        let mut extra = Vec::new();
        for mode in [Recompute::Attention, Recompute::Block] {
            config.recompute = mode;
            let got = train_recording(&config);
            assert_eq!(got.len(), none.len());
            for (step, ((loss, bytes), (reference, reference_bytes))) in
                got.iter().zip(&none).enumerate()
            {
                let error = (loss - reference).abs() / reference.abs();
                assert!(
                    error <= 1e-6,
                    "{name}, recompute {mode}: step {} loss {loss} vs {reference} with none",
                    step + 1
                );
                assert!(
                    bytes > reference_bytes,
                    "{name}, recompute {mode}: no recompute communication"
                );
                extra.push((mode, step, bytes - reference_bytes));
            }
            eprintln!("{name}, recompute {mode}: losses {got:?} (none: {none:?})");
        }
        let (attention, block) = extra.split_at(extra.len() / 2);
        for (a, b) in attention.iter().zip(block) {
            assert_eq!(
                a.2, b.2,
                "{name}: step {}: attention recomputes {} bytes, block {}",
                a.1, a.2, b.2
            );
        }
        if name == "ring" {
            // Ring over P ranks: the forward rotates K/V P − 1 times, the backward K/V P − 1
            // times and the dK/dV accumulators P times (home again): none = (3P − 2)·S, one
            // forward (P − 1)·S.
            let p = config.cp as u64;
            for (_, step, bytes) in attention {
                assert_eq!(
                    (3 * p - 2) * bytes,
                    (p - 1) * none[*step].1,
                    "{name}: ring's recompute is one forward"
                );
            }
        }
    }
}
