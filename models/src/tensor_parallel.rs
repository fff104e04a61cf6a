//! The GPT split over `tp` tensor-parallel ranks, Megatron-LM style: [`TpGpt`] is one TP rank's
//! shard of a [`Gpt`], cut from the full model ([`TpGpt::shard`]) so that tp N starts from the
//! same weights as tp 1, and it runs the same math (RoPE, attention, MLP) with the plain model's
//! own pieces.
//!
//! | layer | split | communication |
//! |---|---|---|
//! | token embedding | vocab-parallel: rank `r` owns rows `⌊rV/tp⌋ .. ⌊(r+1)V/tp⌋` | `g` (sum of the looked-up rows) |
//! | Q / K / V | column-parallel: whole query heads; kv heads split, or replicated when tp > kv heads | `f` before |
//! | attention output | row-parallel | `g` after |
//! | MLP gate, up / down | column- then row-parallel (`d_ff / tp` each; SwiGLU's gate as its up) | `f` before, `g` after |
//! | LM head (tied or not) | vocab-parallel columns | `f` before |
//! | cross-entropy | vocab-parallel: max and Σexp and the target logit all-reduced | `max` (no gradient), `g` |
//!
//! `f` and `g` are [`TensorParallel::copy`] and [`TensorParallel::reduce`] (identity forward /
//! all-reduce backward, and the reverse): the model has no communication code of its own, the
//! trainer passes the TP group's ops. Norm weights are replicated and get the same gradient on
//! every TP rank; replicated kv projections (tp > kv heads) get partial gradients that the
//! trainer sums over [`TpGpt::kv_replicas`].

use burn::module::{Module, Param, ParamId};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::{Backend, Bool, Int, Tensor};
use burn::tensor::module::embedding;
use burn::tensor::FloatDType;
use burn_dcp::heads::{HeadParts, Heads};

use crate::error::ModelError;
use crate::gpt::{mlp, reshape, self_attention, Block, Gpt, GptConfig};
use crate::rope::{Rope, RopeSettings};

/// The TP group's communication, as the model needs it. Every TP rank calls the same ops in the
/// same order (collectives).
pub trait TensorParallel<B: Backend> {
    /// This rank in the TP group.
    fn rank(&self) -> usize;
    /// The TP group's size.
    fn size(&self) -> usize;
    /// `f`: identity forward, all-reduce of the gradient backward.
    fn copy<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, ModelError>;
    /// `g`: all-reduce forward, identity backward.
    fn reduce<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, ModelError>;
    /// Element-wise maximum over the group, without gradient.
    fn all_reduce_max<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, ModelError>;
}

/// The vocabulary rows TP rank `rank` of `tp` owns (an uneven split when `tp` does not divide).
pub fn vocab_range(vocab: usize, rank: usize, tp: usize) -> std::ops::Range<usize> {
    rank * vocab / tp..(rank + 1) * vocab / tp
}

/// `ids [T]` relative to the vocabulary rows `start .. start + rows` of this rank: the local
/// row of each id (clamped into range, so a lookup is always valid) and whether it is one of
/// this rank's rows.
fn local_rows<B: Backend>(
    ids: Tensor<B, 1, Int>,
    start: usize,
    rows: usize,
) -> (Tensor<B, 1, Int>, Tensor<B, 1, Bool>) {
    let local = ids.sub_scalar(start as i64);
    let inside = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(rows as i64));
    (local.clamp(0, rows as i64 - 1), inside)
}

/// Checks the config for `tp` ranks, naming the rule.
pub fn validate_tp(config: &GptConfig, tp: usize) -> Result<(), ModelError> {
    config.validate()?;
    rank_heads(config, tp)?;
    if !config.d_ff.is_multiple_of(tp) {
        return Err(ModelError::Config(format!(
            "tensor parallelism over {tp} ranks must divide the MLP width {} (column-parallel up projection)",
            config.d_ff
        )));
    }
    if config.vocab_size < tp {
        return Err(ModelError::Config(format!(
            "tensor parallelism over {tp} ranks exceeds the {} vocabulary rows (vocab-parallel embedding)",
            config.vocab_size
        )));
    }
    Ok(())
}

/// One of `tp` ranks' query and kv heads.
fn rank_heads(config: &GptConfig, tp: usize) -> Result<Heads, ModelError> {
    config
        .heads()?
        .split(HeadParts::TensorParallel(tp))
        .map_err(|e| ModelError::Config(e.to_string()))
}

/// Checks that `stages` pipeline stages can split the config's layers evenly.
pub fn validate_stages(config: &GptConfig, stages: usize) -> Result<(), ModelError> {
    burn_dcp::mesh::check_stage_layers(stages, config.n_layers)
        .map_err(|e| ModelError::Config(e.to_string()))
}

/// One TP rank's shard of one pipeline stage of the GPT (the whole depth when there is one
/// stage): the first stage holds the embedding, the last the final norm and the LM head (with a
/// copy of the embedding when tied, like Megatron-LM's last stage), every stage `layers / pp`
/// blocks.
#[derive(Module, Debug)]
pub struct TpGpt<B: Backend> {
    /// Rows `vocab_start ..` of the embedding: the lookup on the first stage, the tied LM head on
    /// the last. A burn `Embedding` like the plain GPT's, so that at tp 1, pp 1 the two save the
    /// same record (an `Option` that is `Some` records as its value).
    pub(crate) embedding: Option<Embedding<B>>,
    /// Blocks with this rank's columns of q/k/v, gate and up and rows of o and down.
    pub(crate) blocks: Vec<Block<B>>,
    /// Final norm (last stage).
    pub(crate) norm: Option<RmsNorm<B>>,
    /// Untied LM head: this rank's vocabulary columns (last stage).
    pub(crate) head: Option<Linear<B>>,
    /// Query and kv heads on this rank.
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) d_model: usize,
    pub(crate) vocab_start: usize,
    pub(crate) rope_theta: f64,
    pub(crate) rope_scaling: Option<crate::rope::RopeScaling>,
    /// Whether this is the first / last pipeline stage, and how many there are.
    pub(crate) first_stage: bool,
    pub(crate) last_stage: bool,
    pub(crate) stages: usize,
}

/// `linear` with only the columns `columns` of its weight (`[d_in, d_out]`) and of its bias.
fn columns<B: Backend>(linear: &Linear<B>, columns: std::ops::Range<usize>) -> Linear<B> {
    let weight = linear.weight.val();
    let rows = weight.dims()[0];
    Linear {
        weight: Param::from_tensor(weight.slice([0..rows, columns.clone()]).detach()),
        bias: linear
            .bias
            .as_ref()
            .map(|bias| Param::from_tensor(bias.val().slice([columns]).detach())),
    }
}

/// `linear` with only the rows `rows` of its weight (a row-parallel projection: its bias, if
/// any, would be added after the sum, and no model here has one).
fn rows<B: Backend>(linear: &Linear<B>, rows: std::ops::Range<usize>) -> Linear<B> {
    let weight = linear.weight.val();
    let columns = weight.dims()[1];
    Linear {
        weight: Param::from_tensor(weight.slice([rows, 0..columns]).detach()),
        bias: None,
    }
}

/// A copy of `norm` with a parameter of its own (a shard never shares a tensor with the full
/// model it was cut from).
fn own_norm<B: Backend>(norm: &RmsNorm<B>) -> RmsNorm<B> {
    RmsNorm {
        gamma: Param::from_tensor(norm.gamma.val().detach()),
        epsilon: norm.epsilon,
    }
}

impl<B: Backend> TpGpt<B> {
    /// TP rank `rank`'s shard of `full` over `tp` ranks (`config` is `full`'s), one stage.
    pub fn shard(
        full: &Gpt<B>,
        config: &GptConfig,
        rank: usize,
        tp: usize,
    ) -> Result<Self, ModelError> {
        Self::stage(full, config, rank, tp, 0, 1)
    }

    /// TP rank `rank`'s shard over `tp` ranks of pipeline stage `stage` of `stages` (blocks
    /// `stage·L/stages .. (stage+1)·L/stages`) of `full`.
    pub fn stage(
        full: &Gpt<B>,
        config: &GptConfig,
        rank: usize,
        tp: usize,
        stage: usize,
        stages: usize,
    ) -> Result<Self, ModelError> {
        validate_tp(config, tp)?;
        if rank >= tp {
            return Err(ModelError::Config(format!(
                "TP rank {rank} is outside a TP group of {tp}"
            )));
        }
        validate_stages(config, stages)?;
        if stage >= stages {
            return Err(ModelError::Config(format!(
                "pipeline stage {stage} is outside a pipeline of {stages} stages"
            )));
        }
        let head_dim = config.head_dim();
        let unit = rank_heads(config, tp)?;
        let (heads, kv_heads) = (unit.heads(), unit.kv_heads());
        // Replicated past their count: ranks whose query heads share one kv head all read it.
        let kv_first = config
            .heads()?
            .first_kv_head(rank, HeadParts::TensorParallel(tp));
        let q_cols = rank * heads * head_dim..(rank + 1) * heads * head_dim;
        let kv_cols = kv_first * head_dim..(kv_first + kv_heads) * head_dim;
        let ff = config.d_ff / tp;
        let ff_range = rank * ff..(rank + 1) * ff;
        let per_stage = config.n_layers / stages;
        let blocks = full.blocks[stage * per_stage..(stage + 1) * per_stage]
            .iter()
            .map(|b| Block {
                attn_norm: own_norm(&b.attn_norm),
                q: columns(&b.q, q_cols.clone()),
                k: columns(&b.k, kv_cols.clone()),
                v: columns(&b.v, kv_cols.clone()),
                o: rows(&b.o, q_cols.clone()),
                mlp_norm: own_norm(&b.mlp_norm),
                gate: b.gate.as_ref().map(|gate| columns(gate, ff_range.clone())),
                up: columns(&b.up, ff_range.clone()),
                down: rows(&b.down, ff_range.clone()),
            })
            .collect();
        let (first, last) = (stage == 0, stage + 1 == stages);
        let vocab = vocab_range(config.vocab_size, rank, tp);
        let weight = full.embedding.weight.val();
        let d_model = weight.dims()[1];
        let needs_embedding = first || (last && full.head.is_none());
        Ok(Self {
            embedding: needs_embedding.then(|| Embedding {
                weight: Param::from_tensor(weight.slice([vocab.clone(), 0..d_model]).detach()),
            }),
            blocks,
            norm: last.then(|| own_norm(&full.norm)),
            head: if last {
                full.head.as_ref().map(|h| columns(h, vocab.clone()))
            } else {
                None
            },
            heads,
            kv_heads,
            head_dim,
            d_model,
            vocab_start: vocab.start,
            rope_theta: full.rope_theta,
            rope_scaling: full.rope_scaling.clone(),
            first_stage: first,
            last_stage: last,
            stages,
        })
    }

    fn rope(&self) -> RopeSettings {
        RopeSettings {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
        }
    }

    /// The model width (of the hidden states that cross pipeline stages).
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    /// Whether this shard is of the first pipeline stage (it embeds the tokens).
    pub fn is_first_stage(&self) -> bool {
        self.first_stage
    }

    /// Whether this shard is of the last pipeline stage (it computes the loss).
    pub fn is_last_stage(&self) -> bool {
        self.last_stage
    }

    /// The embedding shared by the first and the last stage when the LM head is tied and there
    /// is more than one stage: each stage's copy gets part of the gradient (the lookup's, the
    /// head's), which the trainer sums over the two (Megatron-LM's embedding group).
    pub fn tied_embedding_id(&self) -> Option<ParamId> {
        match (&self.embedding, &self.head) {
            (Some(embedding), None) if self.stages > 1 && (self.first_stage || self.last_stage) => {
                Some(embedding.weight.id)
            }
            _ => None,
        }
    }

    /// The parameters every TP rank holds whole: the norms (RMSNorm scales of every block and
    /// the final norm). Every other parameter is this rank's shard.
    pub fn replicated_param_ids(&self) -> Vec<ParamId> {
        let blocks = self
            .blocks
            .iter()
            .flat_map(|b| [b.attn_norm.gamma.id, b.mlp_norm.gamma.id]);
        blocks
            .chain(self.norm.iter().map(|norm| norm.gamma.id))
            .collect()
    }

    /// The TP ranks that hold the same kv projection as `rank` (more than one only when tp >
    /// kv heads): the trainer sums the k/v weight gradients over them.
    pub fn kv_replicas(config: &GptConfig, rank: usize, tp: usize) -> Vec<usize> {
        if config.n_kv_heads >= tp {
            return vec![rank];
        }
        let replicas = tp / config.n_kv_heads;
        let first = rank / replicas * replicas;
        (first..first + replicas).collect()
    }

    /// The k and v projection weights (and biases) of every block: under replicated kv heads (tp > kv heads)
    /// their gradients are partial and are summed over [`Self::kv_replicas`].
    pub fn kv_param_ids(&self) -> Vec<ParamId> {
        let bias_ids = |linear: &Linear<B>| linear.bias.as_ref().map(|bias| bias.id);
        self.blocks
            .iter()
            .flat_map(|b| {
                [b.k.weight.id, b.v.weight.id]
                    .into_iter()
                    .chain(bias_ids(&b.k))
                    .chain(bias_ids(&b.v))
            })
            .collect()
    }

    /// The embedding's `[1, T, d]` rows of `tokens [T]` (first stage): a vocab-parallel lookup,
    /// tokens outside this rank's rows contribute zeros to the sum over the TP group.
    pub fn embed<T: TensorParallel<B>>(
        &self,
        tokens: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let table = match (&self.embedding, self.first_stage) {
            (Some(table), true) => table.weight.val(),
            _ => {
                return Err(ModelError::Stage(
                    "only the first pipeline stage embeds tokens".into(),
                ))
            }
        };
        let count = tokens.dims()[0];
        let local_vocab = table.dims()[0];
        let (local, inside) = local_rows(tokens, self.vocab_start, local_vocab);
        let looked_up = embedding(table, reshape(local, [1, count]));
        let keep = reshape(inside, [1, count, 1]).repeat_dim(2, looked_up.dims()[2]);
        let looked_up = looked_up.zeros_like().mask_where(keep, looked_up);
        tp.reduce(looked_up)
    }

    /// This stage's blocks on the hidden states `x [1, T, d]` of tokens at `positions [T]`.
    pub fn blocks_forward<T: TensorParallel<B>>(
        &self,
        mut x: Tensor<B, 3>,
        positions: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let rope = Rope::new(&positions, self.head_dim, &self.rope());
        for block in &self.blocks {
            x = block.forward_tp(x, &rope, self.heads, self.kv_heads, self.head_dim, tp)?;
        }
        Ok(x)
    }

    /// The blocks of this stage.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Block `index` of this stage alone (what [`Self::blocks_forward`] runs as its `index`-th).
    pub fn block_forward<T: TensorParallel<B>>(
        &self,
        index: usize,
        x: Tensor<B, 3>,
        positions: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let Some(block) = self.blocks.get(index) else {
            return Err(ModelError::Config(format!(
                "block {index} of a stage of {} blocks",
                self.blocks.len()
            )));
        };
        let rope = Rope::new(&positions, self.head_dim, &self.rope());
        block.forward_tp(x, &rope, self.heads, self.kv_heads, self.head_dim, tp)
    }

    /// The vocabulary-parallel logits `[T, V / tp]` of the last stage's output `x [1, T, d]`.
    pub fn logits<T: TensorParallel<B>>(
        &self,
        x: Tensor<B, 3>,
        tp: &T,
    ) -> Result<Tensor<B, 2>, ModelError> {
        let Some(norm) = self.norm.as_ref().filter(|_| self.last_stage) else {
            return Err(ModelError::Stage(
                "only the last pipeline stage computes logits".into(),
            ));
        };
        let [_, count, d_model] = x.dims();
        let x = tp.copy(reshape(norm.forward(x), [count, d_model]))?;
        match (&self.head, &self.embedding) {
            (Some(head), _) => Ok(head.forward(x)),
            (None, Some(embedding)) => Ok(x.matmul(embedding.weight.val().transpose())),
            (None, None) => Err(ModelError::Stage("the last stage holds no LM head".into())),
        }
    }

    /// Sum of the next-token cross-entropy over labels `≥ 0` of the last stage's output
    /// `x [1, T, d]`, with the softmax over the vocabulary split across the TP group (the same
    /// `[1]` value on every TP rank).
    pub fn loss_from_hidden<T: TensorParallel<B>>(
        &self,
        x: Tensor<B, 3>,
        labels: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 1>, ModelError> {
        let count = x.dims()[1];
        // The softmax and the loss in f32, whatever the model computes in.
        let logits = self.logits(x, tp)?.cast(FloatDType::F32);
        let local_vocab = logits.dims()[1];
        let max = tp.all_reduce_max(logits.clone().detach().max_dim(1))?;
        let sum_exp = tp.reduce((logits.clone() - max.clone()).exp().sum_dim(1))?;
        let lse = reshape(sum_exp.log() + max, [count]);
        let (local, inside) = local_rows(labels.clone(), self.vocab_start, local_vocab);
        let picked = reshape(logits.gather(1, reshape(local, [count, 1])), [count]);
        let target = tp.reduce(picked.zeros_like().mask_where(inside, picked))?;
        let valid = labels.greater_equal_elem(0);
        let losses = lse - target;
        Ok(losses.zeros_like().mask_where(valid, losses).sum())
    }

    /// Sum of the next-token cross-entropy over labels `≥ 0`, as [`Gpt::loss_sum`], with the
    /// softmax over the vocabulary split across the TP group (the same `[1]` value on every TP
    /// rank; a model of one stage).
    pub fn loss_sum<T: TensorParallel<B>>(
        &self,
        tokens: Tensor<B, 1, Int>,
        positions: Tensor<B, 1, Int>,
        labels: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 1>, ModelError> {
        let x = self.embed(tokens, tp)?;
        let x = self.blocks_forward(x, positions, tp)?;
        self.loss_from_hidden(x, labels, tp)
    }
}

impl<B: Backend> Block<B> {
    /// The block on one TP rank's shard: the norms' outputs copied into the column-parallel
    /// projections, the row-parallel ones' outputs reduced.
    fn forward_tp<T: TensorParallel<B>>(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        tp: &T,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let h = tp.copy(self.attn_norm.forward(x.clone()))?;
        let merged = self_attention(
            [&self.q, &self.k, &self.v],
            h,
            rope,
            heads,
            kv_heads,
            head_dim,
        );
        let x = x + tp.reduce(self.o.forward(merged))?;
        let h = tp.copy(self.mlp_norm.forward(x.clone()))?;
        Ok(x + tp.reduce(mlp(self.gate.as_ref(), &self.up, &self.down, h))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_rules_name_the_values() {
        let config = GptConfig::new(61, 32, 4, 8, 2, 64);
        assert!(validate_tp(&config, 4).is_ok());
        let tp3 = validate_tp(&config, 3).unwrap_err();
        assert!(matches!(tp3, ModelError::Config(_)), "{tp3:?}");
        let tp3 = tp3.to_string();
        assert!(
            tp3.contains("tensor parallelism over 3 ranks must divide the 8 query heads"),
            "{tp3}"
        );
        let kv = GptConfig::new(61, 24, 4, 12, 3, 64);
        let error = validate_tp(&kv, 4).unwrap_err().to_string();
        assert!(
            error.contains("the 3 kv heads: one must divide the other"),
            "{error}"
        );
        assert_eq!(vocab_range(61, 1, 2), 30..61);
    }
}
