//! The training loop's optimizers, schedules and global gradient clipping.

use super::*;
use burn_dcp_suite::train::{
    LrSchedule, LrScheduleKind, LrScheduleSettings, OptimizerKind, OptimizerSettings, StepMetrics,
};

/// Every step's metrics, as rank 0 reports them.
struct Recorded(std::sync::Mutex<Vec<StepMetrics>>);

impl burn_dcp_suite::train::StepObserver for Recorded {
    fn on_step(&self, metrics: &StepMetrics) {
        self.0.lock().unwrap().push(metrics.clone());
    }
}

fn recorded(config: &TrainConfig) -> Vec<StepMetrics> {
    let observer = Recorded(Default::default());
    train_observed(config, None, None, &observer);
    observer.0.into_inner().unwrap()
}

/// A run with a warm-up, a cosine decay and clipping to a norm below every step's.
fn clipped(cp: usize) -> TrainConfig {
    let mut config = config(cp, 1, Strategy::Ring, Layout::Zigzag, "causal");
    config.micro_batches = 4;
    config.steps = 3;
    config.learning_rate = 3e-3;
    config.clip_grad_norm = Some(0.5);
    config.lr_schedule = LrScheduleSettings {
        kind: LrScheduleKind::Cosine,
        warmup_steps: 1,
        min_lr: 3e-4,
        decay_steps: None,
    };
    config
}

/// The global gradient norm at dp 2 × cp 2, tp 2 × cp 2 and pp 2 × cp 2 (and cp 4) is cp 1's,
/// step for step, with clipping active (every norm above the limit), and so are the losses; the
/// learning rate each step used is the schedule's.
#[test]
fn clipped_grad_norms_and_losses_match_cp1_across_the_mesh() {
    let reference = recorded(&clipped(1));
    let schedule = clipped(1).lr_schedule.schedule(3e-3, 3);
    for (step, metrics) in reference.iter().enumerate() {
        assert!(
            metrics.grad_norm > 0.5,
            "step {}: norm {} does not exceed the clip",
            step + 1,
            metrics.grad_norm
        );
        assert_eq!(metrics.lr, schedule.lr(step + 1));
    }
    let mut meshes = vec![("cp 4", clipped(4))];
    let mut dp = clipped(2);
    dp.dp = 2;
    meshes.push(("dp 2 × cp 2", dp));
    let mut tp = clipped(2);
    tp.tp = 2;
    meshes.push(("tp 2 × cp 2", tp));
    let mut pp = clipped(2);
    pp.pp = 2;
    meshes.push(("pp 2 × cp 2", pp));
    for (what, config) in meshes {
        config.validate().unwrap();
        let got = recorded(&config);
        assert_eq!(got.len(), reference.len(), "{what}");
        for (g, r) in got.iter().zip(&reference) {
            let norm_err = (g.grad_norm - r.grad_norm).abs() / r.grad_norm;
            let loss_err = (g.loss - r.loss).abs() / r.loss;
            eprintln!(
                "{what} step {}: grad norm {} vs {} ({norm_err:e}), loss {} vs {} ({loss_err:e})",
                g.step, g.grad_norm, r.grad_norm, g.loss, r.loss
            );
            assert!(norm_err <= 1e-4, "{what} step {}: grad norm", g.step);
            assert!(loss_err <= 1e-5, "{what} step {}: loss", g.step);
            assert_eq!(g.lr, r.lr, "{what} step {}", g.step);
        }
    }
}

/// Clipping changes the updates (a run without it trains other losses after the first step),
/// and a limit above every norm changes nothing.
#[test]
fn clipping_scales_only_norms_above_the_limit() {
    let clipped_losses = train(&clipped(1), None, None);
    let mut free = clipped(1);
    free.clip_grad_norm = None;
    let free_losses = train(&free, None, None);
    assert_eq!(clipped_losses[0], free_losses[0]);
    assert_ne!(clipped_losses[1], free_losses[1]);
    let mut loose = clipped(1);
    loose.clip_grad_norm = Some(1e6);
    assert_eq!(train(&loose, None, None), free_losses);
}

/// Adam and SGD (with momentum and weight decay) train, and a run resumed from their
/// checkpoint (model, optimizer state, the schedule's step) continues bit for bit.
#[test]
fn each_optimizer_resumes_exactly() {
    for kind in [
        OptimizerKind::Adam,
        OptimizerKind::Sgd,
        OptimizerKind::AdamW,
    ] {
        let mut config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
        config.optimizer = OptimizerSettings {
            weight_decay: 0.01,
            ..OptimizerSettings::of(kind)
        };
        config.lr_schedule = LrScheduleSettings {
            kind: LrScheduleKind::Linear,
            warmup_steps: 2,
            min_lr: 1e-4,
            decay_steps: Some(6),
        };
        // Plain SGD needs a larger step than Adam's 1e-3 to move the loss in six steps (its
        // update is the raw gradient; the builtin corpus is this crate's own sources, so the
        // data change with them).
        if kind == OptimizerKind::Sgd {
            config.learning_rate = 0.1;
        }
        let losses = train(
            &TrainConfig {
                steps: 6,
                ..config.clone()
            },
            None,
            None,
        );
        assert!(
            losses[5] < losses[0],
            "{kind}: the loss did not fall: {losses:?}"
        );
        resume_exactly(config, &format!("optimizer-{kind}"));
    }
}

/// A user of the engine passes their own optimizer and a burn `LrScheduler`
/// (`Trainer::train_rank_with`): burn's SGD with momentum and its constant scheduler train what
/// `--optimizer sgd` at the same rate trains, bit for bit.
#[test]
fn a_users_optimizer_and_burn_scheduler_train_as_the_flags_do() {
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::SgdConfig;
    use burn_dcp_suite::train::{init_model, SteppedLr, TrainGpt, Trainer};
    let mut config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    config.steps = 3;
    config.optimizer = OptimizerSettings::of(OptimizerKind::Sgd);
    let by_flags = train(&config, None, None);
    let data = TrainData::load(&config).unwrap();
    let observer = Quiet(Default::default());
    let trainer = Trainer {
        config: &config,
        data: &data,
        resume: None,
        out: None,
        observer: &observer,
    };
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let device = burn::backend::flex::FlexDevice;
    for result in world.run(|comm| {
        type B = burn::backend::Flex;
        let optimizer = SgdConfig::new()
            .with_momentum(Some(MomentumConfig {
                momentum: 0.9,
                dampening: 0.0,
                nesterov: false,
            }))
            .init::<CpTrain<B>, TrainGpt<B>>();
        let schedule = SteppedLr::new(config.learning_rate);
        trainer.train_rank_with::<B, _, TrainGpt<B>, _, _>(
            comm,
            &device,
            |rank| init_model::<B>(rank.config, rank.tp_rank, rank.pp_rank, rank.device),
            optimizer,
            &schedule,
        )
    }) {
        result.unwrap();
    }
    assert_eq!(observer.0.into_inner().unwrap(), by_flags);
}

/// `--eval-every`: the validation loss (held-out documents, forward only) at cp 4, dp 2 × cp 2
/// and pp 2 × cp 2 is cp 1's, on every step it runs (every 2nd and the last).
#[test]
fn validation_loss_matches_cp1_across_the_mesh() {
    let with_eval = |cp: usize| {
        let mut config = config(cp, 1, Strategy::Ring, Layout::Zigzag, "causal");
        config.steps = 3;
        config.eval_every = Some(2);
        config.eval_tokens = 700;
        config
    };
    let reference = recorded(&with_eval(1));
    let losses: Vec<Option<f64>> = reference.iter().map(|m| m.val_loss).collect();
    assert!(losses[0].is_none() && losses[1].is_some() && losses[2].is_some());
    let mut dp = with_eval(2);
    dp.dp = 2;
    let mut pp = with_eval(2);
    pp.pp = 2;
    for (what, config) in [
        ("cp 4", with_eval(4)),
        ("dp 2 × cp 2", dp),
        ("pp 2 × cp 2", pp),
    ] {
        config.validate().unwrap();
        for (got, want) in recorded(&config).iter().zip(&reference) {
            match (got.val_loss, want.val_loss) {
                (Some(g), Some(w)) => assert!((g - w).abs() / w <= 1e-5, "{what}: {g} vs {w}"),
                (g, w) => assert_eq!(g, w, "{what} step {}", got.step),
            }
        }
    }
}
