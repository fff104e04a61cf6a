//! Context-parallel attention strategies: how ranks holding shards of a packed micro-batch
//! cooperate to compute exact attention (forward and backward).
//!
//! | strategy   | file            | communication |
//! |------------|-----------------|---------------|
//! | Ulysses    | `ulysses.rs`    | all-to-all sequence ↔ heads |
//! | ring       | `ring.rs`       | P−1 point-to-point KV passes, merged with LSE |
//! | all-gather | `all_gather.rs` | all-gather KV, reduce-scatter dK/dV |
//! | USP        | `usp.rs`        | Ulysses inside, ring outside (2D mesh) |
//!
//! Every strategy works with every [`Placement`] — a static layout's or a planner's: tokens are
//! described by (sequence, position) segments, so the kernels apply masks on global positions
//! whatever the placement. The placement decides balance (zigzag balances causal work), not
//! correctness.

pub(crate) mod agreement;
pub mod all_gather;
pub mod block_plan;
pub mod dcp;
pub mod exchange;
pub mod ring;
pub mod ulysses;
pub mod usp;

use std::fmt;
use std::sync::Arc;

use burn::prelude::Tensor;
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput, MaskSpec, Segment, VarlenAttention};

use crate::comm::Comm;
use crate::error::CpError;
use crate::placement::Placement;
use crate::strategy::agreement::CallConfig;
use crate::strategy::block_plan::BlockSchedule;

/// Which algorithm computes attention across the CP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// All-to-all from sequence shards to head shards; needs `heads % cp == 0`.
    Ulysses,
    /// Key/value blocks travel around a ring of all CP ranks.
    Ring,
    /// Every rank gathers all keys/values (llama3-style).
    AllGather,
    /// Ulysses within groups of `ulysses_degree` ranks, ring across `ring_degree` such groups.
    Usp {
        ulysses_degree: usize,
        ring_degree: usize,
    },
    /// A DCP block plan: tokens live where the plan homes them, blocks move once per (block,
    /// destination) and results come home ([`CpBatch::blocks`] carries the plan).
    Dcp,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Ulysses => f.write_str("ulysses"),
            Strategy::Ring => f.write_str("ring"),
            Strategy::AllGather => f.write_str("all-gather"),
            Strategy::Usp {
                ulysses_degree,
                ring_degree,
            } => write!(f, "usp({ulysses_degree}x{ring_degree})"),
            Strategy::Dcp => f.write_str("dcp"),
        }
    }
}

impl Strategy {
    /// Parses a strategy name for a CP group of `cp` ranks. `usp` needs `ulysses_degree` (the
    /// ring degree is `cp / ulysses_degree`); the other strategies reject it, so a degree is never
    /// silently ignored.
    pub fn parse(name: &str, ulysses_degree: Option<usize>, cp: usize) -> Result<Self, CpError> {
        let strategy = match (name, ulysses_degree) {
            ("ulysses", None) => Strategy::Ulysses,
            ("ring", None) => Strategy::Ring,
            ("all-gather", None) => Strategy::AllGather,
            ("dcp", None) => Strategy::Dcp,
            ("usp", Some(0)) => {
                return Err(CpError::Config(
                    "the ulysses degree must be at least 1, got 0".into(),
                ))
            }
            ("usp", Some(ulysses_degree)) => {
                if !cp.is_multiple_of(ulysses_degree) {
                    return Err(CpError::Config(format!(
                        "cp size {cp} is not divisible by ulysses degree {ulysses_degree}"
                    )));
                }
                Strategy::Usp {
                    ulysses_degree,
                    ring_degree: cp / ulysses_degree,
                }
            }
            ("usp", None) => {
                return Err(CpError::Config(
                    "strategy usp needs the ulysses degree (ulysses_degree × ring_degree = cp); none was given".into(),
                ))
            }
            ("ulysses" | "ring" | "all-gather" | "dcp", Some(degree)) => {
                return Err(CpError::Config(format!(
                    "a ulysses degree ({degree}) only applies to strategy usp, not {name}"
                )))
            }
            (other, _) => {
                return Err(CpError::Config(format!(
                    "unknown strategy '{other}': expected ulysses, ring, all-gather, usp or dcp"
                )))
            }
        };
        strategy.validate_mesh(cp)?;
        Ok(strategy)
    }

    /// Checks the strategy against the CP size.
    pub fn validate_mesh(&self, cp: usize) -> Result<(), CpError> {
        if cp == 0 {
            return Err(CpError::Config("cp size must be at least 1, got 0".into()));
        }
        if let Strategy::Usp {
            ulysses_degree,
            ring_degree,
        } = self
        {
            if ulysses_degree * ring_degree != cp {
                return Err(CpError::Config(format!(
                    "ulysses_degree {ulysses_degree} × ring_degree {ring_degree} = {} does not equal the cp size {cp}",
                    ulysses_degree * ring_degree
                )));
            }
        }
        Ok(())
    }

    /// Checks the head counts against the strategy.
    pub fn validate_heads(&self, heads: usize, kv_heads: usize, cp: usize) -> Result<(), CpError> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(CpError::Config(format!(
                "kv heads {kv_heads} must divide q heads {heads} (grouped-query attention)"
            )));
        }
        let degree = match self {
            Strategy::Ulysses => cp,
            Strategy::Usp { ulysses_degree, .. } => *ulysses_degree,
            Strategy::Ring | Strategy::AllGather | Strategy::Dcp => 1,
        };
        if !heads.is_multiple_of(degree) {
            return Err(CpError::Config(format!(
                "q heads {heads} are not divisible by the ulysses degree {degree} (strategy {self})"
            )));
        }
        Ok(())
    }
}

/// One rank's membership of a CP group, with the sub-groups its strategy needs.
#[derive(Clone, Debug)]
pub struct CpGroup {
    pub comm: Comm,
    pub strategy: Strategy,
    /// USP only: this rank's Ulysses group (ranks `g·U .. g·U+U`) and ring group (ranks `u, u+U, …`).
    pub(crate) usp_groups: Option<(Comm, Comm)>,
}

impl CpGroup {
    /// Builds the group. For USP this is a collective call (it splits `comm`): every rank of
    /// `comm` must call it with the same strategy.
    pub fn new(comm: Comm, strategy: Strategy) -> Result<Self, CpError> {
        strategy.validate_mesh(comm.size())?;
        let usp_groups = match strategy {
            Strategy::Usp { ulysses_degree, .. } => {
                let rank = comm.rank();
                let ulysses = comm.split(rank / ulysses_degree, rank % ulysses_degree)?;
                let ring = comm.split(rank % ulysses_degree, rank / ulysses_degree)?;
                Some((ulysses, ring))
            }
            _ => None,
        };
        Ok(Self {
            comm,
            strategy,
            usp_groups,
        })
    }

    pub fn cp(&self) -> usize {
        self.comm.size()
    }
}

/// What a micro-batch's attention needs besides the tensors: where tokens live, the masks, the
/// scale, and (strategy dcp) the block plan. Identical on every rank of the group.
#[derive(Clone, Debug, PartialEq)]
pub struct CpBatch {
    pub placement: Arc<Placement>,
    /// One mask per sequence, or one for all.
    pub masks: Vec<MaskSpec>,
    /// Softmax scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// Strategy dcp: the executable block plan (its placement must be `placement`).
    pub blocks: Option<Arc<BlockSchedule>>,
}

impl CpBatch {
    pub fn new(placement: Placement, masks: Vec<MaskSpec>) -> Self {
        Self {
            placement: Arc::new(placement),
            masks,
            scale: None,
            blocks: None,
        }
    }

    /// A micro-batch run by a DCP block plan: tokens placed where the plan homes them.
    pub fn from_blocks(schedule: Arc<BlockSchedule>, masks: Vec<MaskSpec>) -> Self {
        Self {
            placement: Arc::new(schedule.placement().clone()),
            masks,
            scale: None,
            blocks: Some(schedule),
        }
    }

    /// The block plan of strategy dcp.
    fn schedule(&self) -> Result<&BlockSchedule, CpError> {
        self.blocks.as_deref().ok_or_else(|| {
            CpError::Config(
                "strategy dcp needs the micro-batch's block plan (CpBatch::from_blocks)".into(),
            )
        })
    }

    /// The mask of sequence `seq` (the single mask when one is given for all).
    pub fn mask(&self, seq: usize) -> &MaskSpec {
        burn_dcp_kernels::mask_of(&self.masks, seq)
    }

    /// The kernel problem: queries `q_segments` against keys `kv_segments`.
    pub(crate) fn problem(
        &self,
        q_segments: Vec<Segment>,
        kv_segments: Vec<Segment>,
    ) -> VarlenAttention {
        VarlenAttention {
            seq_lens: self.placement.seq_lens.clone(),
            masks: self.masks.clone(),
            q_segments,
            kv_segments,
            scale: self.scale,
        }
    }
}

/// Inputs of a backward pass, all local to this rank: `q [T, H, D]`, `k`/`v [T, K, D]`,
/// `out`/`dout [T, H, Dv]`, `lse [H, T]` (the forward's final output and LSE).
#[derive(Clone, Debug)]
pub struct BackwardInputs<B: FlashOps> {
    pub q: Tensor<B, 3>,
    pub k: Tensor<B, 3>,
    pub v: Tensor<B, 3>,
    pub out: Tensor<B, 3>,
    pub lse: Tensor<B, 2>,
    pub dout: Tensor<B, 3>,
}

/// A CP attention algorithm: forward and backward over this rank's shard.
pub trait AttentionStrategy {
    fn forward<B: FlashOps>(
        &self,
        group: &CpGroup,
        batch: &CpBatch,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) -> Result<FlashOutput<B>, CpError>;

    fn backward<B: FlashOps>(
        &self,
        group: &CpGroup,
        batch: &CpBatch,
        inputs: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError>;
}

/// Context-parallel attention forward on this rank's shard: `q [T, H, D]`, `k`/`v [T, K, D]`
/// (this rank's tokens in [`Placement`] order) → `out [T, H, Dv]`, `lse [H, T]`.
///
/// A collective call: every rank of the group calls it with the same configuration. The ranks
/// first agree on the configuration (see `agreement`): invalid inputs on any rank, or ranks that
/// disagree, fail on every rank before data moves. A failure after that marks this rank failed
/// (`Communicator::abort`) so that its peers fail at once, naming it.
pub fn cp_attention_forward<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> Result<FlashOutput<B>, CpError> {
    let local = validate_inputs(group, batch, &q, &k, &v);
    let dims = [q.dims(), k.dims(), v.dims()];
    let config = CallConfig::new("forward", group, batch, dims, q.dtype());
    agreement::agree(group, &config, local)?;
    let result = match group.strategy {
        Strategy::Ulysses => ulysses::Ulysses.forward(group, batch, q, k, v),
        Strategy::Ring => ring::Ring.forward(group, batch, q, k, v),
        Strategy::AllGather => all_gather::AllGatherKv.forward(group, batch, q, k, v),
        Strategy::Usp { .. } => usp::Usp.forward(group, batch, q, k, v),
        Strategy::Dcp => batch
            .schedule()
            .and_then(|plan| dcp::forward(&group.comm, batch, plan, q, k, v)),
    };
    fail_fast(group, result)
}

/// Context-parallel attention backward on this rank's shard (see [`BackwardInputs`]); a
/// collective call like [`cp_attention_forward`].
pub fn cp_attention_backward<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    inputs: BackwardInputs<B>,
) -> Result<FlashGradients<B>, CpError> {
    let local = validate_backward_inputs(group, batch, &inputs);
    let dims = [inputs.q.dims(), inputs.k.dims(), inputs.v.dims()];
    let config = CallConfig::new("backward", group, batch, dims, inputs.q.dtype());
    agreement::agree(group, &config, local)?;
    let result = match group.strategy {
        Strategy::Ulysses => ulysses::Ulysses.backward(group, batch, inputs),
        Strategy::Ring => ring::Ring.backward(group, batch, inputs),
        Strategy::AllGather => all_gather::AllGatherKv.backward(group, batch, inputs),
        Strategy::Usp { .. } => usp::Usp.backward(group, batch, inputs),
        Strategy::Dcp => batch
            .schedule()
            .and_then(|plan| dcp::backward(&group.comm, batch, plan, inputs)),
    };
    fail_fast(group, result)
}

/// Once data moves, an error leaves peers mid-protocol: mark this rank failed (with the error as
/// the reason) so they fail at once, naming it, instead of at the timeout. An error that only
/// reports another rank's failure changes nothing (the root cause is already recorded).
fn fail_fast<T>(group: &CpGroup, result: Result<T, CpError>) -> Result<T, CpError> {
    if let Err(error) = &result {
        if !matches!(error, CpError::Comm(comm) if comm.is_peer_failure()) {
            group.comm.abort(&error.to_string());
        }
    }
    result
}

fn validate_backward_inputs<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    inputs: &BackwardInputs<B>,
) -> Result<(), CpError> {
    validate_inputs(group, batch, &inputs.q, &inputs.k, &inputs.v)?;
    let tokens = inputs.q.dims()[0];
    let [heads, value_dim] = [inputs.q.dims()[1], inputs.v.dims()[2]];
    let expected = [tokens, heads, value_dim];
    if inputs.out.dims() != expected
        || inputs.dout.dims() != expected
        || inputs.lse.dims() != [heads, tokens]
    {
        return Err(CpError::Input(format!(
            "out {:?}, dout {:?} and lse {:?} must be {expected:?}, {expected:?} and {:?}",
            inputs.out.dims(),
            inputs.dout.dims(),
            inputs.lse.dims(),
            [heads, tokens]
        )));
    }
    Ok(())
}

fn validate_inputs<B: FlashOps>(
    group: &CpGroup,
    batch: &CpBatch,
    q: &Tensor<B, 3>,
    k: &Tensor<B, 3>,
    v: &Tensor<B, 3>,
) -> Result<(), CpError> {
    let cp = group.cp();
    if batch.placement.cp() != cp {
        return Err(CpError::Config(format!(
            "the micro-batch is sharded over {} ranks but the CP group has {cp}",
            batch.placement.cp()
        )));
    }
    group.strategy.validate_mesh(cp)?;
    let shape = burn_dcp_kernels::AttentionShape::from_dims(&q.dims(), &k.dims(), &v.dims())?;
    group
        .strategy
        .validate_heads(shape.heads, shape.kv_heads, cp)?;
    burn_dcp_kernels::ops::common_float_dtype(&[
        ("q", q.dtype()),
        ("k", k.dtype()),
        ("v", v.dtype()),
    ])?;
    let rank = group.comm.rank();
    let expected = batch.placement.tokens(rank);
    if shape.q_tokens != expected || shape.kv_tokens != expected {
        return Err(CpError::Input(format!(
            "rank {rank} holds {expected} tokens under the {}, but q has {} and k/v have {} tokens",
            batch.placement.kind, shape.q_tokens, shape.kv_tokens
        )));
    }
    burn_dcp_kernels::validate_masks(&batch.masks, &batch.placement.seq_lens)?;
    if group.strategy == Strategy::Dcp {
        validate_blocks(batch, shape)?;
    }
    if let Some(scale) = batch.scale {
        burn_dcp_kernels::validate_scale(scale)?;
    }
    Ok(())
}

/// Strategy dcp: the block plan covers this group and places the tokens as the batch says.
fn validate_blocks(
    batch: &CpBatch,
    shape: burn_dcp_kernels::AttentionShape,
) -> Result<(), CpError> {
    let schedule = batch.schedule()?;
    if schedule.placement() != &*batch.placement {
        return Err(CpError::Config(format!(
            "the block plan places the tokens differently from the micro-batch's {}",
            batch.placement
        )));
    }
    if shape.value_dim != shape.head_dim {
        return Err(CpError::Config(format!(
            "strategy dcp needs value dim {} = head dim {} (its byte model has one dim)",
            shape.value_dim, shape.head_dim
        )));
    }
    Ok(())
}
