//! The GPT of `burn-dcp-models` as the engine trains it: its [`TrainModel`] and
//! [`PipelineStage`] hooks (a TP shard of a pipeline stage, [`TpGpt::stage`]), its
//! initialisation for a rank ([`init_model`]) and [`train_rank`], the run `gpt_longctx` makes.
//! Nothing of the engine depends on this module: any [`TrainModel`] trains the same way.

use std::path::Path;

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::module::{Module, ParamId};
use burn::prelude::{Backend, Int, Tensor};
use burn_dcp::comm::Comm;
use burn_dcp::kernels::FlashOps;
use burn_dcp_models::{GptConfig, TpGpt};

use crate::config::{Recompute, TrainConfig};
use crate::data::TrainData;
use crate::error::TrainError;
use crate::metrics::StepObserver;
use crate::model::{CpTrain, ModelShape, PipelineStage, ShardInput, TrainModel};
use crate::run::{RankOutcome, Trainer};
use crate::tensor_parallel::TpGroup;

/// The model one rank trains: its TP shard of each of its pipeline chunks of the GPT (one chunk,
/// the whole GPT, at tp 1, pp 1), on [`CpTrain`] with checkpoint strategy `C`.
pub type TrainGpt<B, C = NoCheckpointing> = GptChunks<CpTrain<B, C>>;

/// The chunks of the GPT one pipeline rank holds: `vpp` stages of `TpGpt::stage` over
/// `pp × vpp` virtual stages, chunk `v` of pipeline rank `r` being virtual stage `v · pp + r`
/// (Megatron-LM's interleaved assignment); one chunk without `--vpp`.
#[derive(Module, Debug)]
pub struct GptChunks<B: Backend> {
    pub chunks: Vec<TpGpt<B>>,
}

/// TP rank `tp_rank`'s shard of pipeline stage `pp_rank` of the model at initialisation: every
/// rank cuts its shard from the same full initialisation (seed `config.seed`, or the weights of
/// `--hf-checkpoint`), so any mesh starts from tp 1, pp 1's weights.
pub fn init_model<B: FlashOps>(
    config: &TrainConfig,
    tp_rank: usize,
    pp_rank: usize,
    device: &B::Device,
) -> Result<TrainGpt<B>, TrainError> {
    init_gpt::<B, NoCheckpointing>(config, tp_rank, pp_rank, device)
}

/// [`init_model`] on [`CpTrain`] with checkpoint strategy `C`.
fn init_gpt<B: FlashOps, C: CheckpointStrategy>(
    config: &TrainConfig,
    tp_rank: usize,
    pp_rank: usize,
    device: &B::Device,
) -> Result<TrainGpt<B, C>, TrainError> {
    let model_config = config.model_config()?;
    let full = match &config.hf_checkpoint {
        Some(dir) => {
            crate::hf::load::load_initial::<CpTrain<B, C>>(config, Path::new(dir), device)?
        }
        None => model_config
            .init::<CpTrain<B, C>>(config.seed, device)
            .map_err(TrainError::from)?,
    };
    let stages = config.pp * config.vpp;
    let chunks = (0..config.vpp)
        .map(|v| {
            let stage = v * config.pp + pp_rank;
            TpGpt::stage(&full, &model_config, tp_rank, config.tp, stage, stages)
                .map_err(TrainError::from)
        })
        .collect::<Result<_, _>>()?;
    Ok(GptChunks { chunks })
}

/// Trains the GPT of `config.model_size` on one rank ([`Trainer::train_rank`] with
/// [`init_model`]).
pub fn train_rank<B: FlashOps>(
    world: Comm,
    config: &TrainConfig,
    data: &TrainData,
    resume: Option<&Path>,
    out: Option<&Path>,
    observer: &dyn StepObserver,
    device: &B::Device,
) -> Result<RankOutcome, TrainError> {
    let trainer = Trainer {
        config,
        data,
        resume,
        out,
        observer,
    };
    match config.recompute {
        Recompute::Attention => trainer
            .train_rank_checkpointed::<B, BalancedCheckpointing, TrainGpt<B, BalancedCheckpointing>, _>(
                world,
                device,
                |rank| init_gpt(rank.config, rank.tp_rank, rank.pp_rank, rank.device),
            ),
        Recompute::None | Recompute::Block => {
            trainer.train_rank::<B, TrainGpt<B>, _>(world, device, |rank| {
                init_model::<B>(rank.config, rank.tp_rank, rank.pp_rank, rank.device)
            })
        }
    }
}

impl From<&GptConfig> for ModelShape {
    fn from(config: &GptConfig) -> Self {
        Self {
            vocab_size: config.vocab_size,
            d_model: config.d_model,
            n_layers: config.n_layers,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            d_ff: config.d_ff,
            head_dim: config.head_dim,
            tied_embeddings: config.tied_embeddings,
        }
    }
}

/// `[1, T]` → `[T]` (the GPT takes one packed row).
fn packed<B: Backend, K: burn::tensor::BasicOps<B>>(t: Tensor<B, 2, K>) -> Tensor<B, 1, K> {
    let tokens = t.dims()[1];
    burn_dcp_models::gpt::reshape(t, [tokens])
}

/// The chunks of one pipeline rank: every hook, through its chunks.
impl<B: FlashOps, C: CheckpointStrategy> TrainModel<CpTrain<B, C>> for GptChunks<CpTrain<B, C>> {
    fn loss_sum(
        &self,
        input: ShardInput<CpTrain<B, C>>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 1>, TrainError> {
        match self.chunks.as_slice() {
            [whole] => TrainModel::loss_sum(whole, input, tp),
            chunks => Err(TrainError::Model(format!(
                "a model of {} pipeline chunks runs stage by stage, never whole",
                chunks.len()
            ))),
        }
    }

    fn tensor_parallel(&self) -> bool {
        true
    }

    fn stages(&self) -> Option<&dyn PipelineStage<CpTrain<B, C>>> {
        self.chunk(0)
    }

    fn chunks(&self) -> usize {
        self.chunks.len()
    }

    fn chunk(&self, v: usize) -> Option<&dyn PipelineStage<CpTrain<B, C>>> {
        self.chunks
            .get(v)
            .map(|chunk| chunk as &dyn PipelineStage<CpTrain<B, C>>)
    }

    fn kv_param_ids(&self) -> Vec<ParamId> {
        self.chunks.iter().flat_map(TpGpt::kv_param_ids).collect()
    }

    fn tied_embedding_id(&self) -> Option<ParamId> {
        self.chunks.iter().find_map(TpGpt::tied_embedding_id)
    }

    fn tp_replicated_ids(&self) -> Vec<ParamId> {
        self.chunks
            .iter()
            .flat_map(TpGpt::replicated_param_ids)
            .collect()
    }
}

/// The GPT (a TP shard of a pipeline stage, `TpGpt::stage`): every hook.
impl<B: FlashOps, C: CheckpointStrategy> TrainModel<CpTrain<B, C>> for TpGpt<CpTrain<B, C>> {
    fn loss_sum(
        &self,
        input: ShardInput<CpTrain<B, C>>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 1>, TrainError> {
        if input.tokens.dims()[0] != 1 {
            return Err(TrainError::Model(format!(
                "the GPT takes one packed row of tokens, got {} rows",
                input.tokens.dims()[0]
            )));
        }
        Ok(TpGpt::loss_sum(
            self,
            packed(input.tokens),
            packed(input.positions),
            packed(input.labels),
            tp,
        )?)
    }

    fn tensor_parallel(&self) -> bool {
        true
    }

    fn stages(&self) -> Option<&dyn PipelineStage<CpTrain<B, C>>> {
        Some(self)
    }

    fn kv_param_ids(&self) -> Vec<ParamId> {
        TpGpt::kv_param_ids(self)
    }

    fn tied_embedding_id(&self) -> Option<ParamId> {
        TpGpt::tied_embedding_id(self)
    }

    fn tp_replicated_ids(&self) -> Vec<ParamId> {
        TpGpt::replicated_param_ids(self)
    }
}

impl<B: FlashOps, C: CheckpointStrategy> PipelineStage<CpTrain<B, C>> for TpGpt<CpTrain<B, C>> {
    fn is_first_stage(&self) -> bool {
        TpGpt::is_first_stage(self)
    }

    fn is_last_stage(&self) -> bool {
        TpGpt::is_last_stage(self)
    }

    fn hidden_size(&self) -> usize {
        self.d_model()
    }

    fn embed(
        &self,
        tokens: Tensor<CpTrain<B, C>, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 3>, TrainError> {
        Ok(TpGpt::embed(self, tokens, tp)?)
    }

    fn forward_hidden(
        &self,
        x: Tensor<CpTrain<B, C>, 3>,
        positions: Tensor<CpTrain<B, C>, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 3>, TrainError> {
        Ok(self.blocks_forward(x, positions, tp)?)
    }

    fn layers(&self) -> usize {
        self.block_count()
    }

    fn forward_layer(
        &self,
        layer: usize,
        x: Tensor<CpTrain<B, C>, 3>,
        positions: Tensor<CpTrain<B, C>, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 3>, TrainError> {
        Ok(self.block_forward(layer, x, positions, tp)?)
    }

    fn loss_from_hidden(
        &self,
        x: Tensor<CpTrain<B, C>, 3>,
        labels: Tensor<CpTrain<B, C>, 1, Int>,
        tp: &TpGroup,
    ) -> Result<Tensor<CpTrain<B, C>, 1>, TrainError> {
        Ok(TpGpt::loss_from_hidden(self, x, labels, tp)?)
    }
}
