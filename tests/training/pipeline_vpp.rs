//! The interleaved pipeline (`--vpp`): pp 2 × vpp 2, alone and with cp 2 (ring, dynamic, dcp,
//! auto), tp 2, recompute and a resumed checkpoint, trains the same losses as pp 1 (≤ 1e-5
//! relative), and the configurations it cannot run are refused naming the rule.

use super::*;
use burn_dcp_suite::train::{DcpSettings, Recompute};

/// The 4-layer GPT (`small`: 4 layers split into pp 2 × vpp 2 chunks of one), 4 micro-batches.
fn small(cp: usize, dp: usize) -> TrainConfig {
    let mut config = config(cp, dp, Strategy::Ring, Layout::Zigzag, "causal");
    config.model_size = "small".into();
    config.micro_batches = 4;
    config.steps = 3;
    config
}

fn interleaved(mut config: TrainConfig) -> TrainConfig {
    config.pp = 2;
    config.vpp = 2;
    config
}

#[test]
fn interleaved_pipelines_train_as_pp1() {
    let reference = train(&small(1, 1), None, None);
    let cp2 = || interleaved(small(2, 1));
    for (what, config) in [
        ("pp 2 vpp 2", interleaved(small(1, 1))),
        ("pp 2 vpp 2 cp 2 ring", cp2()),
        (
            "pp 2 vpp 2 cp 2 dp 2 dynamic",
            dynamic_pow2(interleaved(small(2, 2)), 60),
        ),
        (
            "tp 2 pp 2 vpp 2",
            TrainConfig {
                tp: 2,
                ..interleaved(small(1, 1))
            },
        ),
        (
            "pp 2 vpp 2 cp 2 recompute attention",
            TrainConfig {
                recompute: Recompute::Attention,
                ..cp2()
            },
        ),
        (
            "pp 2 vpp 2 cp 2 recompute block",
            TrainConfig {
                recompute: Recompute::Block,
                ..cp2()
            },
        ),
        (
            "pp 2 vpp 2 cp 2 dcp",
            TrainConfig {
                mode: TrainMode::Dcp(DcpSettings {
                    block: 16,
                    stages: 2,
                }),
                ..cp2()
            },
        ),
        (
            "pp 2 vpp 2 cp 2 auto",
            TrainConfig {
                mode: every_candidate(16, 2),
                ..cp2()
            },
        ),
    ] {
        config.validate().unwrap();
        assert_losses(&train(&config, None, None), &reference, 1e-5, what);
    }
}

#[test]
fn an_interleaved_run_resumes_exactly() {
    resume_exactly(interleaved(small(2, 1)), "vpp");
}

#[test]
fn what_the_interleaved_schedule_cannot_run_is_refused() {
    let refused = |config: TrainConfig, expected: &str| {
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(expected), "{expected}: {err}");
    };
    let mut tiny = interleaved(small(1, 1));
    tiny.model_size = "tiny".into();
    refused(
        tiny,
        "--vpp 2 splits the 2 layers into --pp 2 × --vpp 2 = 4 chunks",
    );
    let mut odd = interleaved(small(1, 1));
    odd.micro_batches = 3;
    refused(odd, "must be a multiple of it (Megatron-LM's rule)");
    let mut gpipe = interleaved(small(1, 1));
    gpipe.pp_schedule = burn_dcp_suite::train::PpSchedule::Gpipe;
    refused(gpipe, "--pp-schedule gpipe has no virtual stages");
    let mut one = small(1, 1);
    one.vpp = 2;
    refused(one, "it needs --pp 2 or more");
}
