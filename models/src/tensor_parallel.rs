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
//! | MLP up / down | column- then row-parallel (`d_ff / tp` each) | `f` before, `g` after |
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
use burn::tensor::activation::gelu;
use burn::tensor::module::embedding;

use crate::gpt::{reshape, self_attention, Gpt, GptConfig, Rope};

/// The TP group's communication, as the model needs it. Every TP rank calls the same ops in the
/// same order (collectives).
pub trait TensorParallel<B: Backend> {
    /// This rank in the TP group.
    fn rank(&self) -> usize;
    /// The TP group's size.
    fn size(&self) -> usize;
    /// `f`: identity forward, all-reduce of the gradient backward.
    fn copy<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, String>;
    /// `g`: all-reduce forward, identity backward.
    fn reduce<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, String>;
    /// Element-wise maximum over the group, without gradient.
    fn max<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, String>;
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
pub fn validate_tp(config: &GptConfig, tp: usize) -> Result<(), String> {
    config.validate()?;
    if tp == 0 || !config.n_heads.is_multiple_of(tp) {
        return Err(format!(
            "--tp {tp} must divide the {} query heads (a TP rank owns whole heads)",
            config.n_heads
        ));
    }
    if !config.n_kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(config.n_kv_heads) {
        return Err(format!(
            "--tp {tp} and the {} kv heads: one must divide the other (kv heads are split, or replicated when tp > kv heads)",
            config.n_kv_heads
        ));
    }
    if !config.d_ff.is_multiple_of(tp) {
        return Err(format!(
            "--tp {tp} must divide the MLP width {} (column-parallel up projection)",
            config.d_ff
        ));
    }
    if config.vocab_size < tp {
        return Err(format!(
            "--tp {tp} exceeds the {} vocabulary rows (vocab-parallel embedding)",
            config.vocab_size
        ));
    }
    Ok(())
}

/// One TP rank's transformer block.
#[derive(Module, Debug)]
pub struct TpBlock<B: Backend> {
    attn_norm: RmsNorm<B>,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    mlp_norm: RmsNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// One TP rank's shard of the GPT.
#[derive(Module, Debug)]
pub struct TpGpt<B: Backend> {
    /// Rows `vocab_start ..` of the embedding (also the LM head when tied). A burn `Embedding`
    /// like the plain GPT's, so that at tp 1 the two save the same record.
    embedding: Embedding<B>,
    blocks: Vec<TpBlock<B>>,
    norm: RmsNorm<B>,
    /// Untied LM head: this rank's vocabulary columns.
    head: Option<Linear<B>>,
    /// Query and kv heads on this rank.
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab_start: usize,
    rope_theta: f64,
}

/// `linear` with only the columns `columns` of its weight (`[d_in, d_out]`).
fn columns<B: Backend>(linear: &Linear<B>, columns: std::ops::Range<usize>) -> Linear<B> {
    let weight = linear.weight.val();
    let rows = weight.dims()[0];
    Linear {
        weight: Param::from_tensor(weight.slice([0..rows, columns]).detach()),
        bias: None,
    }
}

/// `linear` with only the rows `rows` of its weight.
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
    /// TP rank `rank`'s shard of `full` over `tp` ranks (`config` is `full`'s).
    pub fn shard(
        full: &Gpt<B>,
        config: &GptConfig,
        rank: usize,
        tp: usize,
    ) -> Result<Self, String> {
        validate_tp(config, tp)?;
        if rank >= tp {
            return Err(format!("TP rank {rank} is outside a TP group of {tp}"));
        }
        let head_dim = config.head_dim();
        let heads = config.n_heads / tp;
        let (kv_heads, kv_first) = if config.n_kv_heads >= tp {
            let local = config.n_kv_heads / tp;
            (local, rank * local)
        } else {
            // Replicated: this rank's query heads all belong to one kv head.
            let group = config.n_heads / config.n_kv_heads;
            (1, rank * heads / group)
        };
        let q_cols = rank * heads * head_dim..(rank + 1) * heads * head_dim;
        let kv_cols = kv_first * head_dim..(kv_first + kv_heads) * head_dim;
        let ff = config.d_ff / tp;
        let ff_range = rank * ff..(rank + 1) * ff;
        let blocks = full
            .blocks
            .iter()
            .map(|b| TpBlock {
                attn_norm: own_norm(&b.attn_norm),
                q: columns(&b.q, q_cols.clone()),
                k: columns(&b.k, kv_cols.clone()),
                v: columns(&b.v, kv_cols.clone()),
                o: rows(&b.o, q_cols.clone()),
                mlp_norm: own_norm(&b.mlp_norm),
                up: columns(&b.up, ff_range.clone()),
                down: rows(&b.down, ff_range.clone()),
            })
            .collect();
        let vocab = vocab_range(config.vocab_size, rank, tp);
        let weight = full.embedding.weight.val();
        let d_model = weight.dims()[1];
        Ok(Self {
            embedding: Embedding {
                weight: Param::from_tensor(weight.slice([vocab.clone(), 0..d_model]).detach()),
            },
            blocks,
            norm: own_norm(&full.norm),
            head: full.head.as_ref().map(|h| columns(h, vocab.clone())),
            heads,
            kv_heads,
            head_dim,
            vocab_start: vocab.start,
            rope_theta: full.rope_theta,
        })
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

    /// The k and v projection weights of every block: under replicated kv heads (tp > kv heads)
    /// their gradients are partial and are summed over [`Self::kv_replicas`].
    pub fn kv_param_ids(&self) -> Vec<ParamId> {
        self.blocks
            .iter()
            .flat_map(|b| [b.k.weight.id, b.v.weight.id])
            .collect()
    }

    /// This rank's vocabulary-parallel logits `[T, V / tp]` of `tokens [T]` at `positions [T]`.
    pub fn forward_local<T: TensorParallel<B>>(
        &self,
        tokens: Tensor<B, 1, Int>,
        positions: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 2>, String> {
        let count = tokens.dims()[0];
        let rope = Rope::new(&positions, self.head_dim, self.rope_theta);
        let local_vocab = self.embedding.weight.dims()[0];
        // Vocab-parallel lookup: tokens outside this rank's rows contribute zeros.
        let (local, inside) = local_rows(tokens, self.vocab_start, local_vocab);
        let looked_up = embedding(self.embedding.weight.val(), reshape(local, [1, count]));
        let keep = reshape(inside, [1, count, 1]).repeat_dim(2, looked_up.dims()[2]);
        let looked_up = looked_up.zeros_like().mask_where(keep, looked_up);
        let mut x = tp.reduce(looked_up)?;
        for block in &self.blocks {
            x = block.forward(x, &rope, self.heads, self.kv_heads, self.head_dim, tp)?;
        }
        let d_model = x.dims()[2];
        let x = tp.copy(reshape(self.norm.forward(x), [count, d_model]))?;
        Ok(match &self.head {
            Some(head) => head.forward(x),
            None => x.matmul(self.embedding.weight.val().transpose()),
        })
    }

    /// Sum of the next-token cross-entropy over labels `≥ 0`, as [`Gpt::loss_sum`], with the
    /// softmax over the vocabulary split across the TP group (the same `[1]` value on every TP
    /// rank).
    pub fn loss_sum<T: TensorParallel<B>>(
        &self,
        tokens: Tensor<B, 1, Int>,
        positions: Tensor<B, 1, Int>,
        labels: Tensor<B, 1, Int>,
        tp: &T,
    ) -> Result<Tensor<B, 1>, String> {
        let count = tokens.dims()[0];
        let logits = self.forward_local(tokens, positions, tp)?;
        let local_vocab = logits.dims()[1];
        let max = tp.max(logits.clone().detach().max_dim(1))?;
        let sum_exp = tp.reduce((logits.clone() - max.clone()).exp().sum_dim(1))?;
        let lse = reshape(sum_exp.log() + max, [count]);
        let (local, inside) = local_rows(labels.clone(), self.vocab_start, local_vocab);
        let picked = reshape(logits.gather(1, reshape(local, [count, 1])), [count]);
        let target = tp.reduce(picked.zeros_like().mask_where(inside, picked))?;
        let valid = labels.greater_equal_elem(0);
        let losses = lse - target;
        Ok(losses.zeros_like().mask_where(valid, losses).sum())
    }
}

impl<B: Backend> TpBlock<B> {
    fn forward<T: TensorParallel<B>>(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        tp: &T,
    ) -> Result<Tensor<B, 3>, String> {
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
        Ok(x + tp.reduce(self.down.forward(gelu(self.up.forward(h))))?)
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
        assert!(
            tp3.contains("--tp 3 must divide the 8 query heads"),
            "{tp3}"
        );
        let kv = GptConfig::new(61, 24, 4, 12, 3, 64);
        let error = validate_tp(&kv, 4).unwrap_err();
        assert!(
            error.contains("the 3 kv heads: one must divide the other"),
            "{error}"
        );
        assert_eq!(vocab_range(61, 1, 2), 30..61);
    }
}
