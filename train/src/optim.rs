//! The optimizer and the learning-rate schedule of a run ([`OptimizerSettings`],
//! [`LrScheduleSettings`]: `--optimizer`, `--weight-decay`, `--adam-beta1/2`, `--adam-eps`,
//! `--sgd-momentum`, `--lr`, `--lr-schedule`, `--warmup-steps`, `--min-lr`), and what a user of
//! the engine passes instead: any burn `Optimizer` and any [`LrSchedule`] (burn's
//! `LrScheduler`s through [`SteppedLr`]).
//!
//! A schedule is a function of the step ([`LrSchedule::lr`]), so a resumed run continues it
//! exactly without saving its state.

use std::sync::Mutex;

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::prelude::{Backend, Tensor};
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// The one of `all` that `name` names, or an error naming `flag` and every name.
fn parse_named<T: Copy>(
    flag: &str,
    name: &str,
    all: &[T],
    name_of: fn(T) -> &'static str,
) -> Result<T, TrainError> {
    all.iter()
        .copied()
        .find(|kind| name_of(*kind) == name)
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|kind| name_of(*kind)).collect();
            TrainError::Config(format!(
                "unknown {flag} '{name}': expected {}",
                names.join(", ")
            ))
        })
}

/// Which optimizer updates the weights (`--optimizer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// burn's `AdamW` (decoupled weight decay).
    #[default]
    AdamW,
    /// burn's `Adam` (weight decay as an L2 term of the gradient).
    Adam,
    /// burn's `Sgd` with momentum (no dampening, as PyTorch's and Megatron-LM's SGD).
    Sgd,
}

impl OptimizerKind {
    pub const ALL: [Self; 3] = [Self::AdamW, Self::Adam, Self::Sgd];

    pub fn name(self) -> &'static str {
        match self {
            Self::AdamW => "adamw",
            Self::Adam => "adam",
            Self::Sgd => "sgd",
        }
    }

    pub fn parse(name: &str) -> Result<Self, TrainError> {
        parse_named("--optimizer", name, &Self::ALL, Self::name)
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The optimizer and its hyper-parameters (`config.json`'s `optimizer`). The default is what
/// every earlier run trained with: burn's `AdamWConfig::new()`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSettings {
    pub kind: OptimizerKind,
    /// `--weight-decay` (default 1e-4 for adamw, burn's; 0 for adam and sgd).
    pub weight_decay: f64,
    /// Adam(W)'s `--adam-beta1` (0.9), `--adam-beta2` (0.999), `--adam-eps` (1e-5).
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    /// SGD's `--sgd-momentum` (0.9; 0: none).
    pub momentum: f64,
}

impl Default for OptimizerSettings {
    fn default() -> Self {
        Self::of(OptimizerKind::AdamW)
    }
}

impl OptimizerSettings {
    /// `kind` with its default hyper-parameters.
    pub fn of(kind: OptimizerKind) -> Self {
        Self {
            kind,
            weight_decay: match kind {
                OptimizerKind::AdamW => 1e-4,
                OptimizerKind::Adam | OptimizerKind::Sgd => 0.0,
            },
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-5,
            momentum: 0.9,
        }
    }

    /// The rules, naming the flag and the value.
    pub fn validate(&self) -> Result<(), TrainError> {
        let rule = |flag: &str, value: f64, ok: bool, range: &str| {
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(TrainError::Config(format!(
                    "{flag} {value} must be a finite number in {range}"
                )))
            }
        };
        let wd = self.weight_decay;
        rule("--weight-decay", wd, (0.0..1.0).contains(&wd), "[0, 1)")?;
        if self.kind == OptimizerKind::Sgd {
            let m = self.momentum;
            return rule("--sgd-momentum", m, (0.0..1.0).contains(&m), "[0, 1)");
        }
        rule(
            "--adam-beta1",
            self.beta1,
            (0.0..1.0).contains(&self.beta1),
            "[0, 1)",
        )?;
        rule(
            "--adam-beta2",
            self.beta2,
            (0.0..1.0).contains(&self.beta2),
            "[0, 1)",
        )?;
        rule("--adam-eps", self.epsilon, self.epsilon > 0.0, "(0, ∞)")
    }

    /// The run's optimizer over `M` with weight decay on matrices only ([`MatrixDecay`]).
    pub(crate) fn adamw_matrices<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>(
        &self,
    ) -> OptimizerAdaptor<MatrixDecay<burn::optim::AdamW>, M, B> {
        OptimizerAdaptor::from(MatrixDecay {
            matrices: self.adamw().build(),
            vectors: self.adamw().with_weight_decay(0.0).build(),
        })
    }

    /// Adam (L2 decay) with decay on matrices only.
    pub(crate) fn adam_matrices<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>(
        &self,
    ) -> OptimizerAdaptor<MatrixDecay<burn::optim::Adam>, M, B> {
        OptimizerAdaptor::from(MatrixDecay {
            matrices: self.adam().build(),
            vectors: self.adam().with_weight_decay(None).build(),
        })
    }

    /// SGD (L2 decay) with decay on matrices only.
    pub(crate) fn sgd_matrices<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>(
        &self,
    ) -> OptimizerAdaptor<MatrixDecay<burn::optim::Sgd<B::InnerBackend>>, M, B> {
        OptimizerAdaptor::from(MatrixDecay {
            matrices: self.sgd().build(),
            vectors: self.sgd().with_weight_decay(None).build(),
        })
    }

    pub(crate) fn adamw(&self) -> AdamWConfig {
        AdamWConfig::new()
            .with_beta_1(self.beta1 as f32)
            .with_beta_2(self.beta2 as f32)
            .with_epsilon(self.epsilon as f32)
            .with_weight_decay(self.weight_decay as f32)
    }

    pub(crate) fn adam(&self) -> AdamConfig {
        AdamConfig::new()
            .with_beta_1(self.beta1 as f32)
            .with_beta_2(self.beta2 as f32)
            .with_epsilon(self.epsilon as f32)
            .with_weight_decay(self.decay())
    }

    pub(crate) fn sgd(&self) -> SgdConfig {
        let momentum = (self.momentum > 0.0).then_some(MomentumConfig {
            momentum: self.momentum,
            dampening: 0.0,
            nesterov: false,
        });
        SgdConfig::new()
            .with_weight_decay(self.decay())
            .with_momentum(momentum)
    }

    fn decay(&self) -> Option<WeightDecayConfig> {
        (self.weight_decay > 0.0).then(|| WeightDecayConfig::new(self.weight_decay as f32))
    }
}

/// A burn optimizer whose weight decay applies to matrices only: every parameter of two or more
/// dimensions (projections, the embedding, the LM head) is updated by `matrices`, every vector
/// (norm gains, biases) by `vectors`, the same optimizer without decay — as Megatron-LM
/// (`no_weight_decay_cond`: biases and norms), nanoGPT (`p.dim() >= 2`) and transformers'
/// `Trainer` (no decay for biases and norm weights) do. The state is the inner optimizer's, so
/// a checkpoint's optimizer record is unchanged.
#[derive(Clone)]
pub struct MatrixDecay<O> {
    pub matrices: O,
    pub vectors: O,
}

impl<B: Backend, O: SimpleOptimizer<B>> SimpleOptimizer<B> for MatrixDecay<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: burn::optim::LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        match D {
            0 | 1 => self.vectors.step(lr, tensor, grad, state),
            _ => self.matrices.step(lr, tensor, grad, state),
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}

/// The shape of the learning rate over the run (`--lr-schedule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    /// The peak rate after the warm-up.
    #[default]
    Constant,
    /// Half a cosine from the peak down to `--min-lr` at the last step.
    Cosine,
    /// A straight line from the peak down to `--min-lr` at the last step.
    Linear,
}

impl LrScheduleKind {
    pub const ALL: [Self; 3] = [Self::Constant, Self::Cosine, Self::Linear];

    pub fn name(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Cosine => "cosine",
            Self::Linear => "linear",
        }
    }

    pub fn parse(name: &str) -> Result<Self, TrainError> {
        parse_named("--lr-schedule", name, &Self::ALL, Self::name)
    }
}

/// The learning rate of each optimizer step (1-based): a function of the step alone, so a
/// resumed run continues it exactly.
pub trait LrSchedule: Send + Sync {
    fn lr(&self, step: usize) -> f64;
}

/// The built-in schedules (`config.json`'s `lr_schedule`), Megatron-LM's rule: a linear warm-up
/// from `peak / warmup_steps` at step 1 to `peak` at step `warmup_steps`, then `kind`'s decay
/// from `peak` to `min_lr`, reached at step `decay_steps` (default: the run's last step) and
/// kept after it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LrScheduleSettings {
    pub kind: LrScheduleKind,
    /// `--warmup-steps` (default 0).
    pub warmup_steps: usize,
    /// `--min-lr` (default 0): where cosine and linear end.
    pub min_lr: f64,
    /// `--lr-decay-steps`: the step at which the decay reaches `min_lr` (default: the run's
    /// `steps`). Give it when a run is continued past its first `--steps`, so the schedule does
    /// not change under the resumed run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_steps: Option<usize>,
}

impl LrScheduleSettings {
    /// The rules for a run of `steps` steps at peak rate `peak`.
    pub fn validate(&self, peak: f64, steps: usize) -> Result<(), TrainError> {
        if !(self.min_lr.is_finite() && (0.0..=peak).contains(&self.min_lr)) {
            return Err(TrainError::Config(format!(
                "--min-lr {} must be between 0 and --lr {peak}",
                self.min_lr
            )));
        }
        let end = self.decay_steps.unwrap_or(steps);
        if self.warmup_steps > end {
            return Err(TrainError::Config(format!(
                "--warmup-steps {} exceeds the {end} steps of the schedule (--steps, or --lr-decay-steps)",
                self.warmup_steps
            )));
        }
        Ok(())
    }

    /// The schedule of a run of `steps` steps peaking at `peak`.
    pub fn schedule(&self, peak: f64, steps: usize) -> WarmupDecay {
        WarmupDecay {
            settings: self.clone(),
            peak,
            steps,
        }
    }
}

/// [`LrScheduleSettings`] on a run: its peak and its length.
#[derive(Clone, Debug)]
pub struct WarmupDecay {
    settings: LrScheduleSettings,
    peak: f64,
    steps: usize,
}

impl LrSchedule for WarmupDecay {
    fn lr(&self, step: usize) -> f64 {
        let LrScheduleSettings {
            kind,
            warmup_steps: warmup,
            min_lr,
            decay_steps,
        } = self.settings;
        let step = step.max(1);
        if step <= warmup {
            return self.peak * step as f64 / warmup as f64;
        }
        let decay_steps = decay_steps.unwrap_or(self.steps).saturating_sub(warmup);
        if kind == LrScheduleKind::Constant || decay_steps == 0 {
            return self.peak;
        }
        // 0 just after the warm-up, 1 at the last step.
        let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
        let fraction = match kind {
            LrScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            _ => 1.0 - progress,
        };
        min_lr + (self.peak - min_lr) * fraction
    }
}

/// A burn `LrScheduler` as an [`LrSchedule`]: step `s` gets what its `s`-th `step()` returns
/// (from a fresh copy on a resume that starts later, stepped to it).
pub struct SteppedLr<S: LrScheduler> {
    initial: S,
    /// The scheduler after `.0` steps.
    current: Mutex<(usize, S)>,
}

impl<S: LrScheduler> SteppedLr<S> {
    pub fn new(scheduler: S) -> Self {
        Self {
            current: Mutex::new((0, scheduler.clone())),
            initial: scheduler,
        }
    }
}

impl<S: LrScheduler> LrSchedule for SteppedLr<S> {
    fn lr(&self, step: usize) -> f64 {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if current.0 >= step {
            *current = (0, self.initial.clone());
        }
        let mut lr = 0.0;
        while current.0 < step {
            lr = current.1.step();
            current.0 += 1;
        }
        lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: LrScheduleKind, warmup_steps: usize) -> WarmupDecay {
        LrScheduleSettings {
            kind,
            warmup_steps,
            min_lr: 1e-4,
            decay_steps: None,
        }
        .schedule(1e-3, 10)
    }

    #[test]
    fn warmup_then_decay_reaches_min_lr_at_the_last_step() {
        let cosine = schedule(LrScheduleKind::Cosine, 2);
        assert_eq!(cosine.lr(1), 5e-4);
        assert_eq!(cosine.lr(2), 1e-3);
        assert!((cosine.lr(6) - 5.5e-4).abs() < 1e-12, "{}", cosine.lr(6));
        assert!((cosine.lr(10) - 1e-4).abs() < 1e-12);
        let linear = schedule(LrScheduleKind::Linear, 0);
        assert!((linear.lr(5) - (1e-4 + 9e-4 * 0.5)).abs() < 1e-12);
        assert!((linear.lr(10) - 1e-4).abs() < 1e-12);
        let constant = schedule(LrScheduleKind::Constant, 4);
        assert_eq!(constant.lr(2), 5e-4);
        assert_eq!(constant.lr(9), 1e-3);
        // A decay that ends before the run stays at its minimum.
        let early = LrScheduleSettings {
            kind: LrScheduleKind::Linear,
            warmup_steps: 0,
            min_lr: 1e-4,
            decay_steps: Some(4),
        }
        .schedule(1e-3, 10);
        assert!((early.lr(4) - 1e-4).abs() < 1e-12);
        assert_eq!(early.lr(8), early.lr(4));
    }

    #[test]
    fn a_burn_scheduler_gives_each_step_its_rate_in_any_order() {
        let burn = burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig::new(1e-3, 1e-4, 9)
            .init()
            .unwrap();
        let stepped = SteppedLr::new(burn);
        let mut fresh = burn;
        let expected: Vec<f64> = (0..10).map(|_| fresh.step()).collect();
        // In order, then again from a later step (a resume).
        for step in 1..=10 {
            assert_eq!(stepped.lr(step), expected[step - 1]);
        }
        assert_eq!(stepped.lr(4), expected[3]);
    }

    #[test]
    fn bad_hyper_parameters_name_their_flag() {
        let mut sgd = OptimizerSettings::of(OptimizerKind::Sgd);
        sgd.momentum = 1.5;
        let err = sgd.validate().unwrap_err().to_string();
        assert!(err.contains("--sgd-momentum 1.5"), "{err}");
        let err = LrScheduleSettings {
            min_lr: 2e-3,
            ..Default::default()
        }
        .validate(1e-3, 10)
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--min-lr 0.002 must be between 0 and --lr 0.001"),
            "{err}"
        );
        assert!(OptimizerKind::parse("lion").is_err());
    }
}
