//! What follows from a [`TrainConfig`]: its model, data, tokenizer, mesh and topologies.

use burn_dcp::heads::Heads;
use burn_dcp::mesh::MeshShape;
use burn_dcp::CpError;
use burn_dcp_datasets::{DataError, LengthMix, LengthSampler, MaskPolicy, Tokenizer};
use burn_dcp_models::GptConfig;

use super::run::TrainConfig;
use crate::error::TrainError;
use crate::model::ModelShape;

impl TrainConfig {
    /// The strategy as `--strategy` names it ([`TrainMode::name`](crate::TrainMode::name)).
    pub fn strategy_name(&self) -> String {
        self.mode.name()
    }

    /// The model trained: the architecture of `--model-config` / `--hf-checkpoint`, or the
    /// preset `model_size` (the GPT's with the tokenizer's vocabulary), with `--rope-theta` and
    /// `--rope-scaling` over it.
    pub fn model_config(&self) -> Result<GptConfig, TrainError> {
        crate::hf::load::model_config(self)
    }

    /// The shape of the model trained: `model_shape`, or the GPT's of `model_size`.
    pub fn model_shape(&self) -> Result<ModelShape, TrainError> {
        match &self.model_shape {
            Some(shape) => {
                shape.validate()?;
                Ok(shape.clone())
            }
            None => Ok(ModelShape::from(&self.model_config()?)),
        }
    }

    /// What a checkpoint records of the model (and a resume compares): the GPT's configuration,
    /// or the custom model's shape, as JSON.
    pub fn model_identity(&self) -> Result<serde_json::Value, TrainError> {
        let value = match &self.model_shape {
            Some(shape) => serde_json::to_value(shape),
            None => serde_json::to_value(self.model_config()?),
        };
        value.map_err(|e| TrainError::Malformed(format!("the model's configuration: {e}")))
    }

    pub fn mask_policy(&self) -> Result<MaskPolicy, TrainError> {
        MaskPolicy::parse(&self.mask).map_err(|e| TrainError::Config(e.to_string()))
    }

    /// `--lengths-from`'s sampler, fitted to `seq_len` (`None` without the flag).
    pub fn length_sampler(&self) -> Result<Option<LengthSampler>, TrainError> {
        let Some(name) = &self.lengths_from else {
            return Ok(None);
        };
        let mix: LengthMix = name
            .parse()
            .map_err(|e: DataError| TrainError::Config(format!("--lengths-from: {e}")))?;
        LengthSampler::fitted(mix, self.seq_len)
            .map(Some)
            .map_err(|e| TrainError::Config(e.to_string()))
    }

    /// `tokenizer_file`'s tokenizer, else `tokenizer`'s.
    pub fn tokenizer(&self) -> Result<Tokenizer, TrainError> {
        match &self.tokenizer_file {
            Some(path) => Tokenizer::from_file(std::path::Path::new(path)),
            None => Tokenizer::from_name(&self.tokenizer),
        }
        .map_err(|e| TrainError::Config(e.to_string()))
    }

    /// The ids the model embeds: `model_shape`'s vocabulary, else the trained model's.
    pub fn vocab_size(&self) -> Result<usize, TrainError> {
        match &self.model_shape {
            Some(shape) => Ok(shape.vocab_size),
            None => Ok(self.model_config()?.vocab_size),
        }
    }

    /// What the training data are called in messages: `--data-path`'s words or the corpus.
    pub fn data_name(&self) -> String {
        match self.data_path.is_empty() {
            true => format!("corpus {}", self.corpus),
            false => format!("--data-path {}", self.data_path.join(" ")),
        }
    }

    /// tp × cp × dp × pp ranks.
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// The DP × CP ranks of one (TP, PP) position: the pool plans (and dynamic CP) schedule over.
    pub fn pool_size(&self) -> usize {
        self.cp * self.dp
    }

    /// The mesh of the world (`burn_dcp::mesh`).
    pub fn mesh_shape(&self) -> MeshShape {
        MeshShape {
            tp: self.tp,
            cp: self.cp,
            dp: self.dp,
            pp: self.pp,
        }
    }

    /// The query and kv heads one TP rank holds (kv heads replicated when tp > kv heads): what
    /// its CP attention runs on.
    pub fn rank_heads(&self, model: &ModelShape) -> Result<Heads, TrainError> {
        let heads = model.heads()?;
        self.mesh_shape()
            .heads_per_tp_rank(heads)
            .map_err(|e| TrainError::Config(e.naming_parts(&format!("--tp {}", self.tp))))
    }

    /// World ranks per virtual node (`--nodes` must divide the world).
    pub fn ranks_per_node(&self) -> Result<usize, CpError> {
        let world = self.world_size();
        match burn_dcp::comm::nodes::NodeMap::new(world, self.nodes) {
            Ok(map) => Ok(map.ranks_per_node()),
            // The rule is NodeMap's; the message names the flag and what the world is.
            Err(_) => Err(CpError::Config(format!(
                "--nodes {} must divide the {world} ranks (tp × cp × dp × pp)",
                self.nodes
            ))),
        }
    }

    /// The topology of one static CP group (ranks `d·cp .. (d+1)·cp`) as its ranks sit on the
    /// world's nodes: a group must fill whole nodes or sit inside one.
    pub fn group_topology(&self) -> Result<burn_dcp::planner::topology::Topology, CpError> {
        let world_per_node = self.ranks_per_node()?;
        // TP is the innermost axis: a node holds whole TP groups, and world_per_node / tp ranks
        // of each CP group.
        if !world_per_node.is_multiple_of(self.tp) {
            return Err(CpError::Config(format!(
                "a node of {world_per_node} ranks (--nodes {}) must hold whole TP groups of {}",
                self.nodes, self.tp
            )));
        }
        let per_node = world_per_node / self.tp;
        let nodes = if self.cp.is_multiple_of(per_node) {
            self.cp / per_node
        } else if per_node.is_multiple_of(self.cp) {
            1
        } else {
            return Err(CpError::Config(format!(
                "a CP group of {} ranks neither fills whole nodes of {per_node} ranks nor fits in one (--nodes {})",
                self.cp, self.nodes
            )));
        };
        burn_dcp::planner::topology::Topology::for_ranks(&self.topology, nodes, self.cp)
            .map_err(|e| CpError::Config(format!("--topology {}: {e}", self.topology)))
    }

    /// The topology of the CP group of pool ranks `ranks` (a dynamic CP group or a replica) as
    /// they sit on the run's nodes: the nodes it touches, holding equal shares of it.
    pub fn ranks_topology(
        &self,
        ranks: &std::ops::Range<usize>,
    ) -> Result<burn_dcp::planner::topology::Topology, CpError> {
        let per_node = (self.ranks_per_node()? / self.tp).max(1);
        let size = ranks.len();
        let first = ranks.start / per_node;
        let last = ranks.end.saturating_sub(1) / per_node;
        let nodes = last - first + 1;
        if !size.is_multiple_of(nodes) {
            return Err(CpError::Config(format!(
                "a CP group of {size} ranks ({ranks:?}) spreads unevenly over {nodes} nodes of {per_node}"
            )));
        }
        burn_dcp::planner::topology::Topology::for_ranks(&self.topology, nodes, size)
            .map_err(|e| CpError::Config(format!("--topology {}: {e}", self.topology)))
    }
}

/// The GPT of a shape (the TP rules of `burn_dcp_models` are stated on it).
pub(crate) fn gpt_of_shape(shape: &ModelShape) -> GptConfig {
    GptConfig::new(
        shape.vocab_size,
        shape.d_model,
        shape.n_layers,
        shape.n_heads,
        shape.n_kv_heads,
        shape.d_ff,
    )
    .with_tied_embeddings(shape.tied_embeddings)
    .with_head_dim(shape.head_dim)
}
