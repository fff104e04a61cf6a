//! Hugging Face checkpoints against transformers itself: the fixtures of scripts/hf_fixtures.py
//! (small random Llama with llama3 RoPE scaling and a tied head, Mistral with a sliding window,
//! Qwen2 with q/k/v biases, written by transformers 5.24's `save_pretrained`, and the logits and
//! window losses transformers computed) load and compute what transformers did, under every CP
//! strategy; a trained model exports and reloads with the same loss; bad checkpoints are named.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::prelude::{Int, Tensor, TensorData};
use burn_dcp::backend::{set_context, ContextParallel, CpContext};
use burn_dcp::comm::{InProcessWorld, WorldConfig};
use burn_dcp::kernels::MaskSpec;
use burn_dcp::planner::cost::AttentionDims;
use burn_dcp::planner::dcp::{dcp_plan, DcpConfig};
use burn_dcp::planner::plan::{tile_grids, BlockProblem};
use burn_dcp::planner::topology::Topology;
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpBatch, CpGroup, Layout, Placement, Strategy};
use burn_dcp_models::hf::load_hf;
use burn_dcp_suite::train::hf::{ExportFlags, Exporting};
use burn_dcp_suite::train::{TrainConfig, TrainData, TrainFlags};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::common::USP_2X2;

type Cp = ContextParallel<Autodiff<Flex>>;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
        .unwrap()
}

fn relative(ours: &[f32], theirs: &[f32]) -> f64 {
    let diff: f64 = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let norm: f64 = theirs.iter().map(|b| (*b as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The logits transformers computed on the fixture's two sequences equal the loaded model's
/// (f32, ≤ 1e-4 relative): every position for Llama and Qwen2; for Mistral the positions within
/// its window (beyond it the window is the batch's mask, which the loss tests cover).
#[test]
fn checkpoints_written_by_transformers_give_its_logits() {
    let device = Default::default();
    for model in ["llama", "mistral", "qwen2"] {
        let dir = fixtures().join(model);
        let (gpt, hf) = load_hf::<Flex>(&dir, &device).unwrap();
        let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
        let expected = SafeTensors::deserialize(&bytes).unwrap();
        for i in 0..2 {
            let ids = expected.tensor(&format!("input_ids_{i}")).unwrap();
            let ids: Vec<i64> = ids
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let count = ids.len();
            let logits = expected.tensor(&format!("logits_{i}")).unwrap();
            let theirs: Vec<f32> = logits
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let tokens = Tensor::<Flex, 1, Int>::from_data(TensorData::new(ids, [count]), &device);
            let positions = Tensor::<Flex, 1, Int>::arange(0..count as i64, &device);
            let ours: Vec<f32> = gpt.forward(tokens, positions).into_data().to_vec().unwrap();
            let vocab = hf.model.vocab_size;
            let checked = hf.sliding_window.unwrap_or(count).min(count) * vocab;
            let error = relative(&ours[..checked], &theirs[..checked]);
            assert!(
                error <= 1e-4,
                "{model} sequence {i}: logits differ by {error:.2e}"
            );
        }
    }
}

/// The fixture's sequences (token ids) and transformers' logits of each.
fn expected_logits(model: &str) -> Vec<(Vec<i64>, Vec<f32>)> {
    let bytes = std::fs::read(fixtures().join(model).join("expected.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&bytes).unwrap();
    (0..2)
        .map(|i| {
            let ids = expected.tensor(&format!("input_ids_{i}")).unwrap();
            let logits = expected.tensor(&format!("logits_{i}")).unwrap();
            (
                ids.data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                logits
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
            )
        })
        .collect()
}

/// DCP's block plan of `seq_lens` over `cp` ranks of one node (blocks of 4 tokens).
fn dcp_schedule(seq_lens: &[usize], mask: &MaskSpec, cp: usize) -> BlockSchedule {
    let problem = BlockProblem {
        seq_lens: seq_lens.to_vec(),
        masks: vec![mask.clone()],
        head_groups: 1,
        block: 4,
    };
    let dims = AttentionDims {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        element_bytes: 4,
    };
    let topology = Topology {
        devices_per_node: cp,
        ..Topology::a100_p4d(1)
    };
    let grids = tile_grids(&problem);
    let routed = dcp_plan(&problem, grids, &dims, &topology, &DcpConfig::default()).unwrap();
    BlockSchedule::new(&routed.plan, &problem, &topology).unwrap()
}

/// The logits of the fixture's two sequences packed in one micro-batch, computed by `cp` ranks
/// (threads) of `ContextParallel<Autodiff<Flex>>` under `strategy`, each rank holding its shard
/// of the tokens at their positions; scattered back into the packed order.
fn cp_logits(model: &str, sequences: &[Vec<i64>], strategy: Strategy, cp: usize) -> Vec<f32> {
    let dir = fixtures().join(model);
    let (_, hf) = load_hf::<Flex>(&dir, &Default::default()).unwrap();
    let mask = match hf.sliding_window {
        Some(window) => MaskSpec::Sliding { window },
        None => MaskSpec::Causal,
    };
    let lens: Vec<usize> = sequences.iter().map(Vec::len).collect();
    let ids: Vec<i64> = sequences.concat();
    let positions: Vec<i64> = lens.iter().flat_map(|&l| 0..l as i64).collect();
    let batch = if strategy == Strategy::Dcp {
        let schedule = Arc::new(dcp_schedule(&lens, &mask, cp));
        let mut batch = CpBatch::new(schedule.placement().clone(), vec![mask]);
        batch.blocks = Some(schedule);
        batch
    } else {
        let layout = match strategy {
            Strategy::Ring => Layout::Zigzag,
            _ => Layout::Contiguous,
        };
        CpBatch::new(Placement::of_layout(&lens, cp, layout).unwrap(), vec![mask])
    };
    let vocab = hf.model.vocab_size;
    let world = InProcessWorld::new(cp, WorldConfig::default()).unwrap();
    let ranks = world.run(
        |comm| -> Result<(Vec<usize>, Vec<f32>), burn_dcp::CpError> {
            let device = Default::default();
            let (gpt, _) = load_hf::<Cp>(&dir, &device).unwrap();
            let indices = batch.placement.packed_indices(comm.rank());
            let pick = |values: &[i64]| -> Tensor<Cp, 1, Int> {
                let local: Vec<i64> = indices.iter().map(|&i| values[i]).collect();
                Tensor::from_data(TensorData::new(local, [indices.len()]), &device)
            };
            let context = set_context(CpContext {
                group: CpGroup::new(comm.clone(), strategy)?,
                batch: batch.clone(),
            });
            let logits = gpt.forward(pick(&ids), pick(&positions));
            context.finish()?;
            Ok((indices, logits.into_data().to_vec().unwrap()))
        },
    );
    let mut packed = vec![f32::NAN; ids.len() * vocab];
    for rank in ranks {
        let (indices, logits) = rank.unwrap();
        for (slot, &index) in indices.iter().enumerate() {
            packed[index * vocab..(index + 1) * vocab]
                .copy_from_slice(&logits[slot * vocab..(slot + 1) * vocab]);
        }
    }
    packed
}

/// At cp 4 (ring zigzag, Ulysses, USP, DCP; all-gather at cp 2) the logits of both sequences
/// packed in one micro-batch equal transformers' at every position (f32, ≤ 1e-4 relative),
/// Mistral's beyond its window too (there the batch's mask is the window).
#[test]
fn logits_under_context_parallelism_equal_transformers() {
    for model in ["llama", "mistral", "qwen2"] {
        let expected = expected_logits(model);
        let sequences: Vec<Vec<i64>> = expected.iter().map(|(ids, _)| ids.clone()).collect();
        let theirs: Vec<f32> = expected.iter().flat_map(|(_, l)| l.clone()).collect();
        for (strategy, cp) in [
            (Strategy::Ring, 4),
            (Strategy::Ulysses, 4),
            (USP_2X2, 4),
            (Strategy::AllGather, 2),
            (Strategy::Dcp, 4),
        ] {
            let ours = cp_logits(model, &sequences, strategy, cp);
            let error = relative(&ours, &theirs);
            assert!(
                error <= 1e-4,
                "{model} {strategy:?} cp {cp}: logits differ by {error:.2e}"
            );
        }
    }
}

/// The flags of a run on the fixture's token file (windows of 24 tokens, one document).
fn flags(model: &str, mesh: &[&str]) -> TrainFlags {
    let manifest = expected();
    let mut flags = TrainFlags {
        hf_checkpoint: Some(fixtures().join(model).display().to_string()),
        data_path: Some(vec![fixtures().join("tokens.bin").display().to_string()]),
        eod_token: Some(manifest["eod_token"].as_u64().unwrap() as u32),
        seq_len: Some(manifest["window"].as_u64().unwrap() as usize),
        micro_batches: Some(1),
        cp: Some(1),
        ..TrainFlags::default()
    };
    for pair in mesh.chunks(2) {
        match pair {
            ["cp", n] => flags.cp = n.parse().ok(),
            ["tp", n] => flags.tp = n.parse().ok(),
            ["strategy", s] => flags.strategy = Some(s.to_string()),
            ["block", n] => flags.block = n.parse().ok(),
            ["ulysses-degree", n] => flags.ulysses_degree = n.parse().ok(),
            other => panic!("unknown flag {other:?}"),
        }
    }
    flags
}

/// `--eval-only`'s loss of `config` on threads (Flex).
fn eval_loss(config: &TrainConfig, resume: Option<&Path>) -> f64 {
    let data = TrainData::eval_windows(config).unwrap();
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let observer = burn_dcp_suite::train::Progress::new("hf".to_string(), 0, None, false).unwrap();
    let losses: Vec<f64> = world
        .run(|comm| {
            burn_dcp_suite::train::train_rank::<Flex>(
                comm,
                config,
                &data,
                resume,
                None,
                &observer,
                &Default::default(),
            )
        })
        .into_iter()
        .map(|outcome| outcome.unwrap().eval_loss.unwrap())
        .collect();
    assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
    losses[0]
}

/// `--eval-only` equals transformers' mean loss (`labels=input_ids`) over the token file's
/// windows, at cp 1 and cp 4 (ring, Ulysses, DCP), for each architecture (Mistral's sliding
/// window is its mask).
#[test]
fn eval_only_equals_transformers_loss_under_every_strategy() {
    let manifest = expected();
    for model in ["llama", "mistral", "qwen2"] {
        let theirs = manifest["models"][model]["mean_window_loss"]
            .as_f64()
            .unwrap();
        for mesh in [
            &[][..],
            &["cp", "4", "strategy", "ring-zigzag"][..],
            &["cp", "4", "strategy", "ulysses"][..],
            &["cp", "4", "strategy", "dcp", "block", "8"][..],
        ] {
            let mut flags = flags(model, mesh);
            flags.eval_only = true;
            flags.eval_tokens = Some(72);
            let config = flags.config().unwrap();
            if model == "mistral" {
                assert_eq!(config.mask, "sliding:8");
            }
            let ours = eval_loss(&config, None);
            let error = (ours - theirs).abs() / theirs;
            assert!(
                error <= 1e-4,
                "{model} {mesh:?}: {ours} vs transformers' {theirs} ({error:.2e})"
            );
        }
    }
}

/// Train three steps at tp 2 × cp 2 with `--export-hf`, then the export (TP pieces joined)
/// evaluates as the trained run's own checkpoint does.
#[test]
fn a_trained_model_exports_and_reloads_with_the_same_loss() {
    let scratch = std::env::temp_dir().join(format!("burn-dcp-hf-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (out, export_dir) = (scratch.join("run"), scratch.join("export"));
    let mut run = flags("qwen2", &["cp", "2", "tp", "2", "strategy", "ulysses"]);
    run.steps = Some(3);
    run.lr = Some(1e-2);
    let mut config = run.config().unwrap();
    let export = ExportFlags {
        export_hf: Some(export_dir.display().to_string()),
        export_dtype: Some("f32".into()),
        ..ExportFlags::default()
    }
    .plan(&mut config)
    .unwrap()
    .unwrap();
    let data = TrainData::load(&config).unwrap();
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let progress = burn_dcp_suite::train::Progress::new("hf".to_string(), 3, None, false).unwrap();
    let observer = Exporting {
        inner: &progress,
        export: &export,
    };
    for result in world.run(|comm| {
        burn_dcp_suite::train::train_rank::<Flex>(
            comm,
            &config,
            &data,
            None,
            Some(&out),
            &observer,
            &Default::default(),
        )
    }) {
        result.unwrap();
    }
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(export_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(written["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(written["torch_dtype"], "float32");
    // The trained run, evaluated from its checkpoint…
    let mut trained = config.clone();
    trained.eval_only = true;
    trained.eval_tokens = 72;
    let from_checkpoint = eval_loss(&trained, Some(&out));
    // …and its export, loaded as a checkpoint of its own at cp 1.
    let mut reload = flags("qwen2", &[]);
    reload.hf_checkpoint = Some(export_dir.display().to_string());
    reload.eval_only = true;
    reload.eval_tokens = Some(72);
    let from_export = eval_loss(&reload.config().unwrap(), None);
    let untrained = expected()["models"]["qwen2"]["mean_window_loss"]
        .as_f64()
        .unwrap();
    assert!(from_checkpoint < untrained, "three steps lowered the loss");
    let error = (from_export - from_checkpoint).abs() / from_checkpoint;
    assert!(
        error <= 1e-5,
        "export {from_export} vs checkpoint {from_checkpoint}"
    );
    std::fs::remove_dir_all(&scratch).unwrap();
}

/// A bad checkpoint: its name, how it is spoiled, and what the error must say.
type Case<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);

/// A bad checkpoint is refused before anything is written, naming what is wrong.
#[test]
fn bad_checkpoints_are_named() {
    let scratch = std::env::temp_dir().join(format!("burn-dcp-hf-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let copy = |name: &str, edit: &dyn Fn(&Path)| -> String {
        let dir = scratch.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixtures().join("llama").join(file), dir.join(file)).unwrap();
        }
        edit(&dir);
        dir.display().to_string()
    };
    let replace = |dir: &Path, from: &str, to: &str| {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert!(text.contains(from));
        std::fs::write(dir.join("config.json"), text.replace(from, to)).unwrap();
    };
    let cases: [Case<'_>; 5] = [
        (
            "truncated",
            &|d| {
                let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
                std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
            },
            "truncated",
        ),
        (
            "wider",
            &|d| replace(d, "\"intermediate_size\": 64", "\"intermediate_size\": 72"),
            "tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32], the configuration needs [72, 32]",
        ),
        (
            "untied",
            &|d| replace(d, "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false"),
            "tensor lm_head.weight is missing",
        ),
        (
            "gemma",
            &|d| replace(d, "\"model_type\": \"llama\"", "\"model_type\": \"gemma\""),
            "model_type 'gemma' is not supported",
        ),
        (
            "yarn",
            &|d| replace(d, "\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""),
            "rope_scaling type 'yarn' is not supported",
        ),
    ];
    for (name, edit, wanted) in cases {
        let dir = copy(name, edit);
        let flags = TrainFlags {
            hf_checkpoint: Some(dir),
            ..TrainFlags::default()
        };
        let error = flags.config().unwrap_err().to_string();
        assert!(error.contains(wanted), "{name}: {error}");
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

/// An export loads in transformers (`AutoModelForCausalLM.from_pretrained`, no conversion) with
/// burn-dcp's logits (≤ 1e-4 relative), for each architecture. Runs where python3 has torch and
/// transformers (PyPI's wheels run on the CPU); elsewhere it says it is skipped (CI has neither:
/// the loss tests above check the same weights through the fixtures).
#[test]
fn an_export_loads_in_transformers_with_the_same_logits() {
    let python = std::process::Command::new("python3")
        .args(["-c", "import torch, transformers"])
        .output();
    if !python.is_ok_and(|out| out.status.success()) {
        eprintln!("skipped: python3 with torch and transformers is not installed here");
        return;
    }
    let scratch = std::env::temp_dir().join(format!("burn-dcp-hf-py-{}", std::process::id()));
    let device = Default::default();
    let ids: Vec<i64> = vec![5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 2, 77];
    for model in ["llama", "mistral", "qwen2"] {
        let (gpt, hf) = load_hf::<Flex>(&fixtures().join(model), &device).unwrap();
        let dir = scratch.join(model);
        burn_dcp_models::hf::save_hf(&gpt, &hf, &dir, burn_dcp_models::hf::ExportDtype::F32)
            .unwrap();
        let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_hf_export.py");
        let out = std::process::Command::new("python3")
            .arg(script)
            .arg(&dir)
            .arg(list)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(theirs["class"], hf.architecture.class());
        let theirs: Vec<f32> = theirs["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let (reloaded, _) = load_hf::<Flex>(&dir, &device).unwrap();
        let count = ids.len();
        let tokens =
            Tensor::<Flex, 1, Int>::from_data(TensorData::new(ids.clone(), [count]), &device);
        let positions = Tensor::<Flex, 1, Int>::arange(0..count as i64, &device);
        let ours: Vec<f32> = reloaded
            .forward(tokens, positions)
            .into_data()
            .to_vec()
            .unwrap();
        // Mistral's window (8) is wider than nothing here but shorter than 12 tokens: compare
        // the positions it does not cut.
        let checked = hf.sliding_window.unwrap_or(count).min(count) * hf.model.vocab_size;
        let error = relative(&ours[..checked], &theirs[..checked]);
        assert!(
            error <= 1e-4,
            "{model}: transformers' logits of the export differ by {error:.2e}"
        );
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

/// Three AdamW steps (decay on matrices only) on every window equal transformers' own three
/// steps from the same checkpoint (f32, ≤ 1e-5 relative), at cp 1 and under every CP strategy
/// (ring in its three layouts, Ulysses, all-gather, USP, DCP).
#[test]
fn training_steps_equal_transformers_steps() {
    let manifest = expected();
    let train = &manifest["train"];
    for model in ["llama", "mistral", "qwen2"] {
        let theirs: Vec<f64> = manifest["models"][model]["train_losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        for mesh in [
            &[][..],
            &["cp", "2", "strategy", "ring-zigzag"][..],
            &["cp", "4", "strategy", "ring-contiguous"][..],
            &["cp", "2", "strategy", "ring-stripe"][..],
            &["cp", "2", "strategy", "ulysses"][..],
            &["cp", "2", "strategy", "all-gather"][..],
            &["cp", "4", "strategy", "usp", "ulysses-degree", "2"][..],
            &["cp", "4", "strategy", "dcp", "block", "8"][..],
        ] {
            let mut run = flags(model, mesh);
            run.micro_batches = Some(manifest["windows"].as_u64().unwrap() as usize);
            run.steps = Some(train["steps"].as_u64().unwrap() as usize);
            run.lr = train["lr"].as_f64();
            run.adam_eps = train["eps"].as_f64();
            run.weight_decay = train["weight_decay"].as_f64();
            let config = run.config().unwrap();
            let ours = super::train(&config, None, None);
            for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                let error = (a - b).abs() / b;
                assert!(
                    error <= 1e-5,
                    "{model} {mesh:?} step {}: {a} vs transformers' {b}",
                    step + 1
                );
            }
        }
    }
}
