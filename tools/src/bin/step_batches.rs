//! The micro-batches a `gpt_longctx` run trains on, step by step, and (with `--export-init DIR`)
//! its initial weights as a Hugging Face checkpoint: what another framework needs to train the
//! same model on the same tokens from the same start (`scripts/torch_train.py` reads both).
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin step_batches -- --model-size llama-125m \
//!     --seq-len 8192 --micro-batches 1 --steps 10 --out batches.json --export-init init/
//! ```
//!
//! The flags are `gpt_longctx`'s training flags (the same defaults); the batches depend on the
//! data flags, `--seq-len`, `--micro-batches` and `--seed`, not on the mesh. Each micro-batch is
//! written whole (every rank's shard together): `tokens`, `positions` (within each sequence),
//! `labels` (the next token of the same sequence, `-1` where none) and `cu_seqlens`.

use std::path::PathBuf;

use burn::backend::Flex;
use burn_dcp_models::hf::{save_hf, ExportDtype, HfConfig};
use burn_dcp_train::TrainData;
use burn_dcp_train::TrainFlags;
use clap::Parser;
use serde_json::json;

/// The micro-batches of a run's first steps, and its initial weights.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    train: TrainFlags,
    /// Write the batches here (JSON) [default: stdout]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the run's initial weights here as a Hugging Face checkpoint (config.json and
    /// model.safetensors, f32: the master weights exactly)
    #[arg(long)]
    export_init: Option<PathBuf>,
}

fn run(args: Args) -> Result<(), String> {
    let config = args.train.config()?;
    config.validate()?;
    if let Some(dir) = &args.export_init {
        let model_config = config.model_config()?;
        let hf = HfConfig::for_model(&model_config, None, config.seq_len.max(2048))?;
        let model = model_config.init::<Flex>(config.seed, &Default::default())?;
        save_hf(&model, &hf, dir, ExportDtype::F32)?;
        eprintln!(
            "step_batches: initial weights ({} parameters) in {}",
            model_config.parameter_count(),
            dir.display()
        );
    }
    let data = TrainData::load(&config)?;
    let steps = (1..=config.steps)
        .map(|step| {
            let batches = data.step_batches(step, config.micro_batches)?;
            let batches: Vec<_> = batches
                .iter()
                .map(|b| {
                    json!({
                        "tokens": b.tokens,
                        "positions": b.positions,
                        "labels": b.labels,
                        "cu_seqlens": b.cu_seqlens,
                    })
                })
                .collect();
            Ok(json!({"step": step, "micro_batches": batches}))
        })
        .collect::<Result<Vec<_>, burn_dcp_train::TrainError>>()?;
    let text = serde_json::to_string(&json!({
        "seq_len": config.seq_len,
        "micro_batches": config.micro_batches,
        "seed": config.seed,
        "vocab_size": config.model_config()?.vocab_size,
        "steps": steps,
    }))
    .map_err(|e| e.to_string())?;
    match &args.out {
        Some(path) => {
            std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
        }
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

fn main() {
    burn_dcp_tools::exit_on_error(run(Args::parse()));
}
