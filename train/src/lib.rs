//! Context-parallel training for burn: any model ([`TrainModel`]) on
//! `ContextParallel<Autodiff<B>>`, trained by [`Trainer::train_rank`] on every rank (threads, MPI
//! or TCP processes; [`launch`]). The engine of `gpt_longctx` and `custom_model`.
//!
//! World: `tp × cp × dp × pp` ranks (threads; `burn_dcp::mesh`). Each optimizer step processes
//! `micro_batches` packed micro-batches of `seq_len` tokens (the global batch). Every (TP rank,
//! stage) position plans the same step over its DP × CP pool; TP shards the model inside each
//! rank's work (`TpGpt`), PP runs the plan's sub-steps through the stages (`pipeline.rs`). One path
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

mod checkpoint;
mod config;
mod data;
mod error;
mod files;
mod flags;
mod gpt;
mod gradients;
mod groups;
mod heartbeat;
pub mod hf;
pub mod host_memory;
pub mod launch;
pub mod links;
pub mod metrics;
mod mode;
mod model;
mod optim;
mod pipeline;
mod plan;
mod planning;
mod predict;
mod run;
mod settings;
mod step;
mod summary;
mod tensor_parallel;

// What users of the engine use; everything else is the engine's own (`pub(crate)`).
pub use checkpoint::{check_resume, saved_checkpoint, TrainState};
pub use config::{
    AutoSettings, CpSizes, DcpSettings, DynamicSettings, EmulatedLinks, GroupStrategy, PpSchedule,
    Precision, Recompute, TrainConfig, TrainMode, DEFAULT_PLAN_AHEAD, MAX_CHUNK_BYTES,
    MAX_MICRO_BATCHES, MAX_PLAN_AHEAD, MAX_SEQ_LEN,
};
pub use data::TrainData;
pub use error::TrainError;
pub use files::{refuse_overwrite, same_dir, write_json};
pub use flags::TrainFlags;
pub use gpt::{init_model, train_rank, TrainGpt};
pub use gradients::{all_reduce_grads, gradient_values, GRADIENT_BUCKET_BYTES};
pub use groups::RankGroups;
pub use metrics::{Progress, StepMetrics, StepObserver};
pub use model::{
    cast_model, cross_entropy_sum, CpTrain, InputRows, ModelShape, PipelineStage, ShardInput,
    TrainModel,
};
pub use optim::{
    LrSchedule, LrScheduleKind, LrScheduleSettings, OptimizerKind, OptimizerSettings, SteppedLr,
    WarmupDecay,
};
pub use plan::{AutoRecord, PlannedBatch, StepPlan};
pub use planning::plan_step;
pub use run::{ModelInit, RankOutcome, TrainBackend, Trainer};
pub use step::{rank_peak_gpu_memory_mb, rank_peak_memory_mb, step_gradients, AXES};
pub use summary::run_summary;
pub use tensor_parallel::TpGroup;
