//! Text to pre-tokenized training data, as Megatron-LM's `tools/preprocess_data.py` prepares it:
//! a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) or a flat token file (nanoGPT's
//! layout), and a loss mask beside it when jsonl lines are `{"prompt", "completion"}` pairs.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin prepare_data -- --input docs/ --output-prefix data/train --tokenizer gpt2 --append-eod
//! cargo run --release -p burn-dcp-tools --bin prepare_data -- --input sft.jsonl --output-prefix data/sft --tokenizer-file tokenizer.json --append-eod --eod-token 2
//! cargo run --release -p burn-dcp-tools --bin prepare_data -- --input docs/ --output-prefix data/flat --format flat --eod-token 50256
//! ```
//! It prints what it wrote as JSON, with the `--data-path` that trains on it.

use std::path::PathBuf;

use burn_dcp_datasets::corpus::open_documents;
use burn_dcp_datasets::prepare::{write_token_file, Format};
use burn_dcp_datasets::Tokenizer;
use clap::Parser;

/// Tokenizes text or jsonl into a Megatron indexed dataset or a flat token file.
#[derive(Parser, Debug)]
struct Args {
    /// default (Vim help files) | a directory of text files | a .jsonl file ({"text"},
    /// {"prompt", "completion"} or {"messages"} lines) | a text file
    #[arg(long)]
    input: String,
    /// Where to write: PREFIX.bin and PREFIX.idx (indexed), PREFIX.bin (flat), and
    /// PREFIX.bin.mask when a document has a prompt
    #[arg(long)]
    output_prefix: PathBuf,
    /// indexed (Megatron .bin/.idx) | flat (documents ended by --eod-token)
    #[arg(long, default_value = "indexed")]
    format: String,
    /// gpt2 (r50k BPE) | bytes
    #[arg(long, default_value = "gpt2")]
    tokenizer: String,
    /// A Hugging Face tokenizer.json (in place of --tokenizer)
    #[arg(long)]
    tokenizer_file: Option<PathBuf>,
    /// Append the end-of-document id to every document (Megatron's --append-eod; a flat file
    /// always does)
    #[arg(long)]
    append_eod: bool,
    /// The end-of-document id [default: gpt2's 50256; required with other tokenizers]
    #[arg(long)]
    eod_token: Option<u32>,
}

fn main() {
    burn_dcp_tools::exit_on_error(run(&Args::parse()));
}

fn run(args: &Args) -> Result<(), String> {
    let tokenizer = match &args.tokenizer_file {
        Some(path) => Tokenizer::from_file(path),
        None => Tokenizer::from_name(&args.tokenizer),
    }
    .map_err(|e| e.to_string())?;
    let format = match args.format.as_str() {
        "indexed" => Format::Indexed,
        "flat" => Format::Flat,
        other => return Err(format!("--format {other}: indexed or flat")),
    };
    let eod = match (args.eod_token, &tokenizer) {
        (Some(id), _) => Some(id),
        (None, Tokenizer::Gpt2) => Some(50_256),
        (None, _) => None,
    };
    let appended = match (format, args.append_eod) {
        (Format::Flat, _) | (Format::Indexed, true) => Some(eod.ok_or_else(|| {
            format!(
                "--eod-token: which id ends a document with the {} tokenizer?",
                tokenizer.name()
            )
        })?),
        (Format::Indexed, false) => None,
    };
    if let Some(parent) = args
        .output_prefix
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let documents = open_documents(&args.input).map_err(|e| e.to_string())?;
    let written = write_token_file(documents, &tokenizer, &args.output_prefix, format, appended)
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string_pretty(&written).map_err(|e| e.to_string())?
    );
    Ok(())
}
