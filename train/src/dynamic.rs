//! Dynamic CP in training (Megatron-style, `--strategy dynamic`).
//!
//! The `dp × cp` ranks form one pool. Each optimizer step takes the step's global batch (the same
//! packed micro-batches, in the same order, as a static run) as a list of sequences; the scheduler
//! ([`burn_dcp::planner::dynamic`]) gives every sequence a group of the pool and splits the step
//! into sub-steps (`plan::plan_dynamic`). A rank runs, per sub-step, the sub-micro-batch of its
//! group: the group's sequences packed together and placed over the group by the inner strategy's
//! layout, under a CP context with the group's communicator. Groups are created once per rank range
//! (one collective split of the pool per sub-step that needs new ones, `groups.rs`) and cached;
//! the backward of every attention call runs in the group its forward used (the autodiff node
//! keeps its context). Gradients are all-reduced over the whole pool and the loss is the mean over every labelled token of the step,
//! so the step equals cp 1 on the same data.
//!
//! Work estimate of a sequence (what the scheduler balances, per rank `work / group size`):
//! forward FLOPs `4 · d_model · n_layers · pairs(mask)` of attention (`pairs` = allowed
//! query-key pairs of its mask, counted exactly) plus `2 · linear_params · len` of the token-local
//! layers (`linear_params` = the weights of the QKV/output projections and the MLP of every layer,
//! and the LM head). The backward multiplies both by about the same factor, so it is left out.

use burn_dcp::kernels::MaskSpec;
use burn_dcp::planner::dynamic::DynamicCpConfig;
use burn_dcp::{CpError, Strategy};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::model::ModelShape;

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
pub fn strategy_for(inner: Strategy, size: usize) -> Result<Strategy, CpError> {
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

/// Allowed query-key pairs of a sequence's mask (exact).
fn attention_pairs(mask: &MaskSpec, len: usize) -> f64 {
    (0..len)
        .map(|i| mask.key_ranges(i, len).count() as f64)
        .sum()
}

/// Forward FLOPs of a sequence (see the module docs).
pub fn sequence_work(len: usize, mask: &MaskSpec, model: &ModelShape) -> f64 {
    let d = model.d_model as f64;
    let kv_dim = d * model.n_kv_heads as f64 / model.n_heads as f64;
    let per_layer = d * d * 2.0 + 2.0 * d * kv_dim + 2.0 * d * model.d_ff as f64;
    let linear_params = per_layer * model.n_layers as f64 + d * model.vocab_size as f64;
    let attention = 4.0 * d * model.n_layers as f64 * attention_pairs(mask, len);
    attention + 2.0 * linear_params * len as f64
}
