//! The whole model out of its pieces: the inverse of [`TpGpt::stage`], for exporting what a
//! run of any TP × PP (× VPP) mesh trained as one checkpoint.
//!
//! Column-parallel projections (q, k, v with their biases, gate, up, the untied LM head) are
//! concatenated along their output columns in TP rank order, row-parallel ones (o, down) and the
//! vocab-parallel embedding along their rows; norm gains come from TP rank 0 (every rank holds
//! them whole). Where kv heads are replicated over TP ranks (tp > kv heads), each kv head is
//! taken once, from the first rank of its replicas.

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::{Backend, Tensor};

use crate::error::ModelError;
use crate::gpt::{Block, Gpt, GptConfig};
use crate::tensor_parallel::TpGpt;

fn cat_weights<B: Backend>(parts: &[&Linear<B>], dim: usize) -> Linear<B> {
    // Leaves of their own (`detach`): on an autodiff backend a parameter must not be the output
    // of an operation.
    let weight = Tensor::cat(parts.iter().map(|l| l.weight.val()).collect(), dim).detach();
    // Only column-parallel projections have biases: their biases follow their columns.
    let bias = match (dim, parts.first().and_then(|l| l.bias.as_ref())) {
        (1, Some(_)) => Some(Param::from_tensor(
            Tensor::cat(
                parts
                    .iter()
                    .filter_map(|l| l.bias.as_ref().map(|b| b.val()))
                    .collect(),
                0,
            )
            .detach(),
        )),
        _ => None,
    };
    Linear {
        weight: Param::from_tensor(weight),
        bias,
    }
}

fn norm_of<B: Backend>(norm: &RmsNorm<B>) -> RmsNorm<B> {
    RmsNorm {
        gamma: Param::from_tensor(norm.gamma.val().detach()),
        epsilon: norm.epsilon,
    }
}

/// The block of `ranks` (one per TP rank, in order): the whole block of the plain model.
fn whole_block<B: Backend>(ranks: &[&Block<B>], kv_ranks: &[usize]) -> Block<B> {
    let columns = |pick: fn(&Block<B>) -> &Linear<B>| {
        cat_weights(&ranks.iter().map(|b| pick(b)).collect::<Vec<_>>(), 1)
    };
    let kv = |pick: fn(&Block<B>) -> &Linear<B>| {
        cat_weights(
            &kv_ranks.iter().map(|&r| pick(ranks[r])).collect::<Vec<_>>(),
            1,
        )
    };
    let rows = |pick: fn(&Block<B>) -> &Linear<B>| {
        cat_weights(&ranks.iter().map(|b| pick(b)).collect::<Vec<_>>(), 0)
    };
    let gates: Option<Vec<&Linear<B>>> = ranks.iter().map(|b| b.gate.as_ref()).collect();
    Block {
        attn_norm: norm_of(&ranks[0].attn_norm),
        q: columns(|b| &b.q),
        k: kv(|b| &b.k),
        v: kv(|b| &b.v),
        o: rows(|b| &b.o),
        mlp_norm: norm_of(&ranks[0].mlp_norm),
        gate: gates.map(|gates| cat_weights(&gates, 1)),
        up: columns(|b| &b.up),
        down: rows(|b| &b.down),
    }
}

impl<B: Backend> Gpt<B> {
    /// The model of `config` whose pieces are `stages[s][r]`: virtual pipeline stage `s` (in
    /// model order) of TP rank `r`, as [`TpGpt::stage`] cut them.
    pub fn from_shards(config: &GptConfig, stages: &[Vec<TpGpt<B>>]) -> Result<Self, ModelError> {
        let tp = stages.first().map_or(0, Vec::len);
        if tp == 0 || stages.iter().any(|s| s.len() != tp) {
            return Err(ModelError::Config(format!(
                "gathering a model needs every stage's shards of the same TP ranks, not {:?}",
                stages.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let (first, last) = (&stages[0], &stages[stages.len() - 1]);
        // One rank per kv head: the first of each group of replicas.
        let replicas = match config.n_kv_heads >= tp {
            true => 1,
            false => tp / config.n_kv_heads,
        };
        let kv_ranks: Vec<usize> = (0..tp).step_by(replicas).collect();
        let mut blocks = Vec::with_capacity(config.n_layers);
        for stage in stages {
            for index in 0..stage[0].blocks.len() {
                let ranks: Vec<&Block<B>> = stage.iter().map(|s| &s.blocks[index]).collect();
                blocks.push(whole_block(&ranks, &kv_ranks));
            }
        }
        if blocks.len() != config.n_layers {
            return Err(ModelError::Config(format!(
                "the shards hold {} layers, the configuration {}",
                blocks.len(),
                config.n_layers
            )));
        }
        let missing = |what: &str| ModelError::Stage(format!("no shard holds the {what}"));
        let tables: Option<Vec<Tensor<B, 2>>> = first
            .iter()
            .map(|s| s.embedding.as_ref().map(|e| e.weight.val()))
            .collect();
        let embedding = Embedding {
            weight: Param::from_tensor(
                Tensor::cat(tables.ok_or_else(|| missing("embedding"))?, 0).detach(),
            ),
        };
        let norm = norm_of(last[0].norm.as_ref().ok_or_else(|| missing("final norm"))?);
        let head = match config.tied_embeddings {
            true => None,
            false => {
                let heads: Option<Vec<&Linear<B>>> = last.iter().map(|s| s.head.as_ref()).collect();
                Some(cat_weights(&heads.ok_or_else(|| missing("LM head"))?, 1))
            }
        };
        Ok(Gpt {
            embedding,
            blocks,
            norm,
            head,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim(),
            rope_theta: config.rope_theta,
            rope_scaling: config.rope_scaling.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::prelude::TensorData;

    fn values<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    /// Every parameter of the model gathered from its shards equals the model's, over TP × PP
    /// meshes with split and replicated kv heads, tied and untied, biased (Qwen2) and SwiGLU.
    #[test]
    fn shards_gather_back_to_the_model() {
        let device = Default::default();
        let configs = [
            GptConfig::new(61, 32, 4, 8, 2, 64),
            GptConfig::new(61, 32, 4, 8, 4, 64)
                .with_mlp(crate::Mlp::Swiglu)
                .with_attention_bias(true)
                .with_tied_embeddings(false),
        ];
        for config in &configs {
            let full = config.init::<Flex>(7, &device).unwrap();
            for (tp, stages) in [(1, 1), (2, 2), (4, 1), (4, 4)] {
                let shards: Vec<Vec<TpGpt<Flex>>> = (0..stages)
                    .map(|stage| {
                        (0..tp)
                            .map(|r| TpGpt::stage(&full, config, r, tp, stage, stages).unwrap())
                            .collect()
                    })
                    .collect();
                let gathered = Gpt::from_shards(config, &shards).unwrap();
                let (a, b) = (&full.blocks[3], &gathered.blocks[3]);
                for (x, y) in [(&a.q, &b.q), (&a.k, &b.k), (&a.v, &b.v), (&a.o, &b.o)]
                    .into_iter()
                    .chain([(&a.up, &b.up), (&a.down, &b.down)])
                {
                    assert_eq!(
                        values(x.weight.val()),
                        values(y.weight.val()),
                        "tp {tp} pp {stages}"
                    );
                    let bias = |l: &Linear<Flex>| l.bias.as_ref().map(|b| values(b.val()));
                    assert_eq!(bias(x), bias(y));
                }
                let gate = |b: &Block<Flex>| b.gate.as_ref().map(|g| values(g.weight.val()));
                assert_eq!(gate(a), gate(b));
                assert_eq!(
                    values(full.embedding.weight.val()),
                    values(gathered.embedding.weight.val())
                );
                let head = |g: &Gpt<Flex>| g.head.as_ref().map(|h| values(h.weight.val()));
                assert_eq!(head(&full), head(&gathered));
                let tokens = Tensor::from_data(TensorData::from([1i64, 5, 9, 3]), &device);
                let positions = Tensor::from_data(TensorData::from([0i64, 1, 2, 3]), &device);
                assert_eq!(
                    values(full.forward(tokens.clone(), positions.clone())),
                    values(gathered.forward(tokens, positions))
                );
            }
        }
    }
}
