//! A run's checkpoint as a Hugging Face checkpoint: every TP rank's and pipeline stage's shard
//! joined into whole tensors, written with transformers' names (config.json, model.safetensors or
//! shards with their index), loadable by `AutoModelForCausalLM.from_pretrained(OUT)`.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin hf_export -- runs/extend-32k/checkpoint out/ --dtype bf16
//! ```
//!
//! `gpt_longctx --export-hf DIR` does the same at the end of a run (and `--export-hf-every N`).

use std::path::PathBuf;

use burn_dcp_models::hf::ExportDtype;
use clap::Parser;

/// Export a run's checkpoint as a Hugging Face checkpoint.
#[derive(Parser, Debug)]
struct Args {
    /// The run's checkpoint directory (`OUT/checkpoint` of `gpt_longctx --out OUT`)
    checkpoint: PathBuf,
    /// Where the Hugging Face checkpoint goes (replaced atomically if it exists)
    out: PathBuf,
    /// bf16 | f32
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

fn run(args: Args) -> Result<(), String> {
    let dtype = ExportDtype::parse(&args.dtype)?;
    let parameters = burn_dcp_train::hf::export_checkpoint(&args.checkpoint, &args.out, dtype)?;
    eprintln!(
        "hf_export: {parameters} parameters of {} in {}",
        args.checkpoint.display(),
        args.out.display()
    );
    Ok(())
}

fn main() {
    burn_dcp_tools::exit_on_error(run(Args::parse()));
}
