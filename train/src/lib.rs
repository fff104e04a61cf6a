//! Context-parallel training for burn: any model ([`TrainModel`]) on
//! `ContextParallel<Autodiff<B>>`, trained by [`Trainer::train_rank`] on every rank (threads, MPI
//! or TCP processes; [`launch`]). The engine of `gpt_longctx` and `custom_model`.
//!
//! World: `tp × cp × dp × pp` ranks (threads; `burn_dcp::mesh`). Each optimizer step processes
//! `micro_batches` packed micro-batches of `seq_len` tokens (the global batch). Every (TP rank,
//! stage) position plans the same step over its DP × CP pool; TP shards the model inside each
//! rank's work (`TpGpt`), PP runs the plan's sub-steps through the stages ([`pipeline`]). One path
//! for every strategy:
//!
//! ```text
//! TrainData ──step_batches──▶ the step's MicroBatches ──plan_step──▶ StepPlan (plan.rs)
//!   (datasets' packing)        (same data for any cp/dp)   static: replica d runs micro-batches
//!                                                           d, d+dp, … on ranks d·cp..(d+1)·cp;
//!                                                           dynamic: the scheduler's groups;
//!                                                           dcp: block plans; auto: per
//!                                                           micro-batch the fastest estimate
//! StepPlan ──per planned batch this rank is in──▶ gather its sequences (one MicroBatch)
//!          ──RankShard::of(placement, rank)──▶ tokens, global positions, labels
//!          ──set_context(group, placement, masks)──▶ GPT on ContextParallel<Autodiff<B>>
//!          ──ModuleOps::attention──▶ the group's strategy (burn-dcp) ──▶ kernels
//! ```
//!
//! The loss of a planned batch is the *sum* of its tokens' cross-entropy divided by the step's
//! global label count, so gradients summed over all ranks (the all-reduce) are exactly the
//! gradients of the global mean loss, whatever the plan.

mod block_plans;
mod checkpoint;
mod config;
mod data;
pub mod dynamic;
pub mod error;
pub mod flags;
mod gradients;
pub mod groups;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod plan;
mod run;
mod step;
pub mod tensor_parallel;

use burn_dcp::backend::ContextParallel;
use burn_dcp_models::TpGpt;

pub use checkpoint::{
    check_resume, checkpoint_dir, read_json, saved_checkpoint, write_atomically, write_json,
    TrainState,
};
pub(crate) use checkpoint::{load_model, save_checkpoint, Checkpoint, CheckpointFiles, Recorder_};
pub use config::{
    static_strategy_name, AutoSettings, DcpSettings, TrainConfig, DEFAULT_PLAN_AHEAD,
    MAX_MICRO_BATCHES, MAX_PLAN_AHEAD, MAX_SEQ_LEN,
};
pub use data::{builtin_documents, TrainData};
pub use dynamic::{sequence_work, CpSizes, DynamicSettings};
pub use error::TrainError;
pub use flags::TrainFlags;
pub use gradients::gradient_values;
pub(crate) use gradients::reduce_step;
pub use groups::RankGroups;
pub use metrics::{Progress, StepMetrics, StepObserver};
pub use model::{InputRows, ModelShape, PipelineStage, ShardInput, TrainModel};
pub use pipeline::PpSchedule;
pub use plan::{
    plan_step, AutoRecord, PlannedBatch, RankWork, ScheduleStats, StepPlan, StepSequences,
};
pub use run::{init_model, train_rank, ModelInit, RankOutcome, Trainer};
pub(crate) use step::{int_tensor, StepBytes};
pub use step::{step_gradients, step_gradients_planned, StepResult, AXES};
pub use tensor_parallel::TpGroup;

/// The training backend over an inner backend `B` (burn Flex on the CPU, or a cubecl backend with
/// the kernels): the decorator over autodiff over `B`.
pub type CpTrain<B> = ContextParallel<burn::backend::Autodiff<B>>;

/// The model one rank trains: its TP shard of the GPT (the whole GPT at tp 1).
pub type TrainGpt<B> = TpGpt<CpTrain<B>>;

/// The default training backend: [`CpTrain`] over burn Flex (CPU).
pub type TrainBackend = CpTrain<burn::backend::Flex>;
