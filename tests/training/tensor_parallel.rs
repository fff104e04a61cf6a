//! Tensor parallelism at the model level and composed with CP: the shards give the full model's
//! loss and gradients, steps equal cp 1, and a plain GPT checkpoint loads into the tp 1 shard.

use super::*;

/// Tensor parallelism at the model level: tp 2 (kv heads split) and tp 4 (kv heads replicated)
/// shards of one full initialisation give the full model's loss, and every shard's gradient is
/// the matching slice of the full gradient (replicated kv projections: summed over replicas).
#[test]
fn tensor_parallel_gpt_matches_the_full_model() {
    use burn::prelude::{Tensor, ToElement};
    use burn::tensor::TensorData;
    use burn_dcp_models::tensor_parallel::vocab_range;
    use burn_dcp_models::{GptConfig, TpGpt};
    use burn_dcp_suite::train::TpGroup;
    type B = CpTrain<burn::backend::Flex>;
    let device = burn::backend::flex::FlexDevice;
    let config = GptConfig::new(61, 32, 2, 4, 2, 64);
    let full: Gpt<B> = config.init(3, &device).unwrap();
    let tokens: Vec<i64> = (0..24).map(|i| (i * 7 + 3) % 61).collect();
    let positions: Vec<i64> = (0..24).map(|i| i % 13).collect();
    let labels: Vec<i64> = (0..24)
        .map(|i| if i % 13 == 12 { -1 } else { (i * 5 + 1) % 61 })
        .collect();
    let int = |v: &Vec<i64>| {
        Tensor::<B, 1, burn::prelude::Int>::from_data(
            TensorData::new(v.clone(), [v.len()]),
            &device,
        )
    };
    let loss = full.loss_sum(int(&tokens), int(&positions), int(&labels));
    let full_loss = loss.clone().into_scalar().to_f64();
    let full_grads = burn::optim::GradientsParams::from_grads(loss.backward(), &full);
    let full_values = gradient_values(&full, &full_grads);
    for tp in [2usize, 4] {
        let world = InProcessWorld::new(tp, WorldConfig::default()).unwrap();
        let results = world.run(|comm| -> Result<_, String> {
            let rank = comm.rank();
            let shard = TpGpt::shard(&full, &config, rank, tp)?;
            let group = TpGroup { comm };
            let loss = shard.loss_sum(int(&tokens), int(&positions), int(&labels), &group)?;
            let value = loss.clone().into_scalar().to_f64();
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &shard);
            Ok((value, gradient_values(&shard, &grads)))
        });
        let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        for (rank, (value, _)) in results.iter().enumerate() {
            let err = ((value - full_loss) / full_loss).abs();
            assert!(
                err < 1e-5,
                "tp {tp} rank {rank}: loss {value} vs {full_loss}"
            );
        }
        // Parameter order (both models): embedding; per block attn_norm, q, k, v, o, mlp_norm,
        // up, down; norm. Check the embedding rows and the first block's projections.
        let d = 32;
        let head_dim = 8;
        for (rank, (_, grads)) in results.iter().enumerate() {
            let vocab = vocab_range(61, rank, tp);
            let want: Vec<f32> = full_values[0][vocab.start * d..vocab.end * d].to_vec();
            let err = max_rel(&grads[0], &want);
            assert!(
                err < 1e-4,
                "tp {tp} rank {rank}: embedding gradient {err:e}"
            );
            // q: columns of this rank's heads.
            let heads = 4 / tp;
            let cols = rank * heads * head_dim..(rank + 1) * heads * head_dim;
            let want: Vec<f32> = (0..d)
                .flat_map(|row| cols.clone().map(move |c| (row, c)))
                .map(|(row, c)| full_values[2][row * d + c])
                .collect();
            assert!(
                want.iter().any(|x| *x != 0.0),
                "tp {tp}: all-zero q gradient"
            );
            let err = max_rel(&grads[2], &want);
            assert!(err < 1e-4, "tp {tp} rank {rank}: q gradient {err:e}");
            // k: this rank's kv head columns; replicated heads sum over their replicas.
            let kv_dim = 2 * head_dim;
            let replicas = TpGpt::<B>::kv_replicas(&config, rank, tp);
            let mut got = vec![0.0f32; grads[3].len()];
            for &replica in &replicas {
                for (g, x) in got.iter_mut().zip(&results[replica].1[3]) {
                    *g += x;
                }
            }
            let kv_cols = grads[3].len() / d;
            let first = if tp <= 2 {
                rank * kv_cols
            } else {
                rank * heads / 2 * head_dim
            };
            let want: Vec<f32> = (0..d)
                .flat_map(|row| (first..first + kv_cols).map(move |c| (row, c)))
                .map(|(row, c)| full_values[3][row * kv_dim + c])
                .collect();
            assert!(
                want.iter().any(|x| *x != 0.0),
                "tp {tp}: all-zero k gradient"
            );
            let err = max_rel(&got, &want);
            assert!(err < 1e-4, "tp {tp} rank {rank}: k gradient {err:e}");
            // The replicated norm weight gets the full gradient on every rank.
            let err = max_rel(&grads[1], &full_values[1]);
            assert!(err < 1e-4, "tp {tp} rank {rank}: norm gradient {err:e}");
        }
    }
}

/// Tensor parallelism composed with CP and DP in the training step: tp 2 × cp 2, tp 2 × cp 2 ×
/// dp 2, tp 4 (kv heads replicated) and tp 2 under dynamic CP and under auto give cp 1's loss,
/// and TP rank 0's gradients of the replicated parameters (norms) equal cp 1's.
#[test]
fn tensor_parallel_steps_match_cp1() {
    let flex = burn::backend::flex::FlexDevice;
    let reference = one_step(&config(1, 1, Strategy::Ring, Layout::Zigzag, "mixed"));
    let tp_config = |tp: usize, cp: usize, dp: usize| {
        let mut config = config(cp, dp, Strategy::Ring, Layout::Zigzag, "mixed");
        config.tp = tp;
        config
    };
    for (what, config) in [
        ("tp 2 cp 2", tp_config(2, 2, 1)),
        ("tp 2 cp 2 dp 2", tp_config(2, 2, 2)),
        ("tp 4", tp_config(4, 1, 1)),
        ("tp 2 dynamic pool 2", dynamic_pow2(tp_config(2, 2, 1), 100)),
        (
            "tp 2 auto",
            TrainConfig {
                mode: every_candidate(16, 2),
                ..tp_config(2, 2, 1)
            },
        ),
    ] {
        config.validate().unwrap();
        let got = step_on::<burn::backend::Flex>(&config, 1, &flex);
        assert_same_loss_and_norms(&got, &reference, what);
    }
}

/// At tp 1 the trained model (`TpGpt`) saves the same record as the plain GPT, so checkpoints
/// written before training switched to `TpGpt` still load.
#[test]
fn a_plain_gpt_checkpoint_loads_into_the_tp1_shard() {
    use burn::module::Module;
    use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
    use burn_dcp_models::TpGpt;
    type B = burn::backend::Flex;
    let device = burn::backend::flex::FlexDevice;
    let config = burn_dcp_models::GptConfig::new(61, 32, 2, 4, 2, 64);
    let plain: Gpt<B> = config.init(9, &device).unwrap();
    let path = std::env::temp_dir().join(format!("bdcp-plain-gpt-{}", std::process::id()));
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    plain.clone().save_file(&path, &recorder).unwrap();
    let other: Gpt<B> = config.init(1, &device).unwrap();
    let shard = TpGpt::shard(&other, &config, 0, 1).unwrap();
    let loaded = shard
        .load_file(&path, &recorder, &device)
        .expect("a plain GPT record loads into the tp 1 shard");
    let _ = std::fs::remove_file(path.with_extension("mpk"));
    let want = TpGpt::shard(&plain, &config, 0, 1).unwrap();
    let values = |m: &TpGpt<B>| {
        struct Collect(Vec<Vec<f32>>);
        impl burn::module::ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(
                &mut self,
                param: &burn::module::Param<burn::prelude::Tensor<B, D>>,
            ) {
                self.0
                    .push(param.val().into_data().to_vec::<f32>().unwrap());
            }
        }
        let mut collect = Collect(Vec::new());
        m.visit(&mut collect);
        collect.0
    };
    assert_eq!(values(&loaded), values(&want));
}
