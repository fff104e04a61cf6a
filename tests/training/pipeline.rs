//! Pipeline parallelism (1F1B and GPipe) composed with CP, TP, DP and dynamic CP: one step and
//! 8 steps equal cp 1.

use super::*;

/// Pipeline parallelism composed with CP, TP, DP and dynamic CP: one step of `--pp 2 --cp 2`
/// (1F1B and GPipe), `--tp 2 --pp 2 --cp 2`, `--pp 2 --cp 2 --dp 2 --strategy dynamic`, and pp 2
/// under dcp and auto gives cp 1's loss and every parameter's gradient (the stages' gradients
/// put together; the tied embedding's two copies summed).
#[test]
fn pipeline_steps_match_cp1() {
    use burn_dcp_suite::train::{DcpSettings, PpSchedule};
    let base = |cp: usize, dp: usize| {
        let mut config = config(cp, dp, Strategy::Ring, Layout::Zigzag, "mixed");
        config.micro_batches = 4;
        config
    };
    let reference = one_step(&base(1, 1));
    let pp_config = |tp: usize, cp: usize, dp: usize| {
        let mut config = base(cp, dp);
        config.tp = tp;
        config.pp = 2;
        config
    };
    let configs = [
        ("pp 2 cp 2", pp_config(1, 2, 1)),
        ("tp 2 pp 2 cp 2", pp_config(2, 2, 1)),
        (
            "pp 2 cp 2 gpipe",
            TrainConfig {
                pp_schedule: PpSchedule::Gpipe,
                ..pp_config(1, 2, 1)
            },
        ),
        (
            "pp 2 cp 2 dp 2 dynamic",
            dynamic_pow2(pp_config(1, 2, 2), 60),
        ),
        (
            "pp 2 dcp",
            TrainConfig {
                mode: TrainMode::Dcp(DcpSettings {
                    block: 16,
                    stages: 2,
                }),
                ..pp_config(1, 2, 1)
            },
        ),
        (
            "pp 2 auto",
            TrainConfig {
                mode: every_candidate(16, 2),
                ..pp_config(1, 2, 1)
            },
        ),
    ];
    for (what, config) in configs {
        config.validate().unwrap();
        let got = one_step(&config);
        match config.tp {
            1 => assert_same_step(&got, &reference, what),
            _ => assert_same_loss_and_norms(&got, &reference, what),
        }
    }
}

/// Over 8 steps of training (AdamW updates included), the per-step losses of `--pp 2 --cp 2`,
/// `--tp 2 --pp 2 --cp 2` and `--pp 2 --cp 2 --dp 2 --strategy dynamic` equal cp 1's within 1e-4
/// relative.
#[test]
fn pipeline_training_follows_cp1_over_8_steps() {
    let base = |cp: usize, dp: usize| {
        let mut config = config(cp, dp, Strategy::Ring, Layout::Zigzag, "causal");
        config.micro_batches = 4;
        config.steps = 8;
        config
    };
    let reference = train(&base(1, 1), None, None);
    assert_eq!(reference.len(), 8);
    let pp_cp = TrainConfig {
        pp: 2,
        ..base(2, 1)
    };
    for (what, config) in [
        ("pp 2 cp 2", pp_cp.clone()),
        ("tp 2 pp 2 cp 2", TrainConfig { tp: 2, ..pp_cp }),
        (
            "pp 2 cp 2 dp 2 dynamic",
            dynamic_pow2(
                TrainConfig {
                    pp: 2,
                    ..base(2, 2)
                },
                60,
            ),
        ),
    ] {
        assert_losses(&train(&config, None, None), &reference, 1e-4, what);
    }
}
