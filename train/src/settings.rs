//! The settings of the strategies and schedules a [`TrainConfig`](crate::config::TrainConfig)
//! names: `auto`'s candidates, DCP's blocks and stages, dynamic CP's scheduler, the pipeline
//! schedule.

use burn_dcp::planner::dynamic::DynamicCpConfig;
use burn_dcp::{CpError, Strategy, StrategyKind};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// Settings of `--strategy auto`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AutoSettings {
    /// The strategies it may choose (`--auto-candidates`; default all).
    pub candidates: Vec<StrategyKind>,
}

/// Settings of `--strategy dcp`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DcpSettings {
    /// Tokens per block (`--block`).
    pub block: usize,
    /// Communication stages of each plan (`--stages`).
    pub stages: usize,
}

/// Group sizes the scheduler may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpSizes {
    /// Powers of two (Megatron), plus the whole pool.
    Pow2,
    /// Any size.
    Any,
}

impl std::str::FromStr for CpSizes {
    type Err = TrainError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "pow2" => Ok(Self::Pow2),
            "any" => Ok(Self::Any),
            other => Err(TrainError::Config(format!(
                "unknown --cp-sizes '{other}': expected pow2 or any"
            ))),
        }
    }
}

/// Settings of `--strategy dynamic`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicSettings {
    /// The scheduler's per-rank token budget (`--max-tokens-per-rank`).
    pub max_tokens_per_rank: usize,
    /// Smallest group size (`--min-cp-size`).
    pub min_cp_size: usize,
    /// Group sizes (`--cp-sizes`).
    pub cp_sizes: CpSizes,
}

impl DynamicSettings {
    /// The scheduler's configuration for a pool of `pool` ranks.
    pub fn scheduler(&self, pool: usize) -> DynamicCpConfig {
        DynamicCpConfig {
            world: pool,
            max_seq_len_per_rank: self.max_tokens_per_rank,
            min_cp_size: self.min_cp_size,
            power_of_two: self.cp_sizes == CpSizes::Pow2,
        }
    }

    /// Checks the settings for a pool of `pool` ranks, an inner strategy and the model's heads.
    pub fn validate(
        &self,
        pool: usize,
        inner: Strategy,
        heads: usize,
        kv_heads: usize,
    ) -> Result<(), TrainError> {
        let scheduler = self.scheduler(pool);
        scheduler.validate()?;
        for size in scheduler.sizes() {
            let strategy = strategy_for(inner, size)?;
            strategy
                .validate_heads(heads, kv_heads, size)
                .map_err(|e| {
                    TrainError::Config(format!("dynamic CP may use groups of {size} ranks: {e}"))
                })?;
        }
        Ok(())
    }
}

/// The inner strategy on a group of `size` ranks (USP keeps its Ulysses degree; the ring degree
/// is what remains).
pub(crate) fn strategy_for(inner: Strategy, size: usize) -> Result<Strategy, CpError> {
    match inner {
        Strategy::Usp { ulysses_degree, .. } => {
            if !size.is_multiple_of(ulysses_degree) {
                return Err(CpError::Config(format!(
                    "inner strategy usp with ulysses degree {ulysses_degree} needs every group size to be a multiple of it; dynamic CP may use a group of {size} (raise --min-cp-size or use --cp-sizes pow2)"
                )));
            }
            Ok(Strategy::Usp {
                ulysses_degree,
                ring_degree: size / ulysses_degree,
            })
        }
        other => Ok(other),
    }
}

/// The order of a stage's forward and backward passes (`--pp-schedule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PpSchedule {
    /// One forward, one backward (PipeDream-Flush, Megatron's default): stage `s` of `p` runs
    /// `p − s − 1` warm-up forwards, then alternates, then drains; at most `p − s` micro-batches'
    /// activations are alive at a time.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// GPipe: every forward, then every backward (all micro-batches' activations alive at once).
    #[serde(rename = "gpipe")]
    Gpipe,
}

impl PpSchedule {
    pub fn parse(name: &str) -> Result<Self, TrainError> {
        match name {
            "1f1b" => Ok(Self::OneFOneB),
            "gpipe" => Ok(Self::Gpipe),
            other => Err(TrainError::Config(format!(
                "unknown pipeline schedule '{other}': expected 1f1b or gpipe"
            ))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::OneFOneB => "1f1b",
            Self::Gpipe => "gpipe",
        }
    }
}

impl std::fmt::Display for PpSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the backward recomputes instead of keeping it from the forward (`--recompute`): less
/// memory per rank for more compute. Every mode computes the same values: losses and gradients
/// equal `None`'s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation the backward needs (burn's `NoCheckpointing`).
    #[default]
    None,
    /// burn's `Autodiff<B, BalancedCheckpointing>`: memory-bound activations (norms, RoPE,
    /// activation functions, residual sums) are recomputed in the backward from the kept outputs
    /// of compute-bound ops (matmuls), and the CP attention node keeps only its inputs: its
    /// backward reruns its forward (`out`, LSE) once, communicating once more per backward.
    Attention,
    /// Every layer (transformer block) recomputed whole: the forward keeps only each block's
    /// input; the backward reruns the block's forward with autodiff (CP attention communicating
    /// once more) and backpropagates through it, one block at a time.
    Block,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Attention, Recompute::Block];

    pub fn name(&self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Attention => "attention",
            Self::Block => "block",
        }
    }

    pub fn parse(name: &str) -> Result<Self, TrainError> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.name() == name)
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "unknown recompute mode '{name}': expected none, attention or block"
                ))
            })
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtype a run computes in (`--precision`). Whatever it is, the parameters, their
/// gradients, the optimizer's moments and the checkpoints stay f32 (master weights); with `bf16`
/// or `f16` every micro-batch's forward runs on a copy of the model cast to that dtype (one
/// differentiable cast per parameter: its gradient comes back to the f32 parameter in f32), so
/// activations, attention inputs and CP messages are in the low precision, while attention
/// accumulates in f32 (LSE, softmax, partial results), and the loss's softmax runs in f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    pub fn name(&self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    pub fn parse(name: &str) -> Result<Self, TrainError> {
        Self::ALL
            .into_iter()
            .find(|precision| precision.name() == name)
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "unknown precision '{name}': expected f32, bf16 or f16"
                ))
            })
    }

    /// The dtype of the forward's copy of the model: `None` for f32 (the master weights run as
    /// they are).
    pub fn compute_dtype(&self) -> Option<burn::tensor::FloatDType> {
        match self {
            Self::F32 => None,
            Self::Bf16 => Some(burn::tensor::FloatDType::BF16),
            Self::F16 => Some(burn::tensor::FloatDType::F16),
        }
    }

    /// The element dtype of the activations and messages.
    pub fn dtype(&self) -> burn::tensor::DType {
        match self {
            Self::F32 => burn::tensor::DType::F32,
            Self::Bf16 => burn::tensor::DType::BF16,
            Self::F16 => burn::tensor::DType::F16,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `--emulate-links` settings (the run's `config.json` keeps them).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmulatedLinks {
    /// The links' time scale (`--link-scale`); `None`: measured at start.
    pub scale: Option<f64>,
}
