//! Statistics of a long-context corpus: document count, tokens, length percentiles, a histogram
//! and the packing efficiency at a token budget.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin dataset_stats -- --corpus default --json
//! cargo run --release -p burn-dcp-tools --bin dataset_stats -- --corpus ldc-like --samples 20000 --svg ldc.svg
//! cargo run --release -p burn-dcp-tools --bin dataset_stats -- --data-path data/train --json
//! ```

use std::path::PathBuf;

use burn_dcp_datasets::indexed::TokenType;
use burn_dcp_datasets::packing::packing_efficiency;
use burn_dcp_datasets::stats::{histogram_svg, histogram_text, log2_histogram, LengthStats};
use burn_dcp_datasets::tokenizer::{cache_dir, files_identity, tokenize_cached};
use burn_dcp_datasets::{
    corpus, FlatFormat, LengthMix, LengthSampler, PackingConfig, TokenFile, Tokenizer,
};
use clap::Parser;
use serde_json::json;

/// Length statistics and packing efficiency of a corpus.
#[derive(Parser, Debug)]
struct Args {
    /// default (Vim help files, Debian vim-runtime) | PATH (directory of text files, .jsonl or text file) | longalign-like | ldc-like
    #[arg(long, default_value = "default")]
    corpus: String,
    /// gpt2 (r50k BPE) | bytes
    #[arg(long, default_value = "gpt2")]
    tokenizer: String,
    /// A Hugging Face tokenizer.json (in place of --tokenizer)
    #[arg(long)]
    tokenizer_file: Option<PathBuf>,
    /// A token file in place of --corpus: a Megatron PREFIX (.bin/.idx; its sequences are the
    /// documents) or a flat token file (documents end with --eod-token)
    #[arg(long)]
    data_path: Option<String>,
    /// The end-of-document id of a flat token file
    #[arg(long)]
    eod_token: Option<u32>,
    /// The ids of a flat token file: uint16 | uint32
    #[arg(long, default_value = "uint16")]
    token_dtype: String,
    /// Tokens per rank of the packing budget.
    #[arg(long, default_value_t = 16384)]
    max_tokens_per_rank: usize,
    /// Ranks of the packing budget (budget = max-tokens-per-rank × ranks).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Longest packed sequence; longer documents are split (default: the budget).
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Seed of the packing order and of the synthetic samplers.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Synthetic corpora only: number of sequences [default: 10000]
    #[arg(long)]
    samples: Option<usize>,
    /// Synthetic corpora only: DCP's length scale factor (0.5, 1, 2, 4) [default: 1]
    #[arg(long)]
    scale: Option<f64>,
    /// Synthetic corpora only: longest sequence [default: 131072]
    #[arg(long)]
    max_len: Option<usize>,
    /// Also write the histogram as SVG to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() {
    burn_dcp_tools::exit_on_error(run(&Args::parse()));
}

/// The most synthetic sequences (10 M lengths take about 10 s to draw and sort).
const MAX_SAMPLES: usize = 10_000_000;

fn lengths(args: &Args) -> Result<Vec<usize>, String> {
    if let Some(path) = &args.data_path {
        if args.corpus != "default" {
            return Err(format!(
                "--corpus {} and --data-path {path}: give one source",
                args.corpus
            ));
        }
        let flat = FlatFormat {
            dtype: TokenType::parse_flat(&args.token_dtype).map_err(|e| e.to_string())?,
            eod: args.eod_token,
        };
        let file = TokenFile::open(path, flat).map_err(|e| e.to_string())?;
        return file.document_lengths().map_err(|e| e.to_string());
    }
    if let Ok(mix) = args.corpus.parse::<LengthMix>() {
        let samples = args.samples.unwrap_or(10_000);
        if samples == 0 || samples > MAX_SAMPLES {
            return Err(format!(
                "--samples {samples} must be between 1 and {MAX_SAMPLES}"
            ));
        }
        let (scale, max_len) = (args.scale.unwrap_or(1.0), args.max_len.unwrap_or(131_072));
        let sampler = LengthSampler::new(mix, scale, max_len).map_err(|e| e.to_string())?;
        return Ok(sampler.sample_many(samples, args.seed));
    }
    let synthetic_only = [
        ("--samples", args.samples.is_some()),
        ("--scale", args.scale.is_some()),
        ("--max-len", args.max_len.is_some()),
    ];
    if let Some((flag, _)) = synthetic_only.iter().find(|(_, given)| *given) {
        return Err(format!(
            "{flag} only applies to the synthetic corpora (longalign-like, ldc-like), not to --corpus {}",
            args.corpus
        ));
    }
    let tokenizer = match &args.tokenizer_file {
        Some(path) => Tokenizer::from_file(path),
        None => Tokenizer::from_name(&args.tokenizer),
    }
    .map_err(|e| e.to_string())?;
    let identity = if args.corpus == "default" {
        files_identity(&corpus::default_corpus_files().map_err(|e| e.to_string())?)
    } else {
        let path = PathBuf::from(&args.corpus);
        let files = if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .flatten()
                .map(|e| e.path())
                .collect();
            files.sort();
            files
        } else {
            vec![path]
        };
        files_identity(&files)
    };
    let corpus = tokenize_cached(
        &identity,
        || corpus::open_documents(&args.corpus),
        &tokenizer,
        &cache_dir(),
    )
    .map_err(|e| e.to_string())?;
    Ok(corpus.lengths())
}

fn run(args: &Args) -> Result<(), String> {
    let config = PackingConfig {
        max_tokens_per_rank: args.max_tokens_per_rank,
        ranks: args.ranks,
        max_seq_len: args.max_seq_len,
        seed: args.seed,
    };
    config.validate().map_err(|e| e.to_string())?;
    if let Some(len) = args.max_seq_len.filter(|&len| len > config.budget()) {
        return Err(format!(
            "--max-seq-len {len} exceeds the micro-batch budget of {} tokens (--max-tokens-per-rank {} × --ranks {}): no sequence can be longer than a micro-batch",
            config.budget(),
            args.max_tokens_per_rank,
            args.ranks
        ));
    }
    let lengths = lengths(args)?;
    let name = args.data_path.as_deref().unwrap_or(&args.corpus);
    if lengths.iter().all(|&len| len == 0) {
        return Err(format!("corpus '{}' holds no tokens", name));
    }
    let stats = LengthStats::of(&lengths);
    let (efficiency, micro_batches) =
        packing_efficiency(&lengths, &config).map_err(|e| e.to_string())?;
    let histogram = log2_histogram(&lengths);
    if let Some(path) = &args.svg {
        let title = format!(
            "{} — {} documents, {} tokens",
            name, stats.documents, stats.tokens
        );
        std::fs::write(path, histogram_svg(&histogram, &title))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        let summary = json!({
            "corpus": name,
            "tokenizer": if args.corpus.parse::<LengthMix>().is_ok() { "none (sampled lengths)" } else if args.data_path.is_some() { "none (token file)" } else { &args.tokenizer },
            "documents": stats.documents,
            "tokens": stats.tokens,
            "p50": stats.p50,
            "p90": stats.p90,
            "p99": stats.p99,
            "max": stats.max,
            "packing_efficiency": efficiency,
            "micro_batches": micro_batches,
            "budget_tokens": config.budget(),
            "histogram": histogram.iter().map(|&(low, count)| json!({"min": low, "count": count})).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!("corpus {} ({} tokenizer)", name, args.tokenizer);
    println!("documents {}  tokens {}", stats.documents, stats.tokens);
    println!(
        "length percentiles: p50 {}  p90 {}  p99 {}  max {}",
        stats.p50, stats.p90, stats.p99, stats.max
    );
    println!("histogram (tokens per document):");
    print!("{}", histogram_text(&histogram));
    println!(
        "packing: {micro_batches} micro-batches of {} tokens ({} per rank × {} ranks), efficiency {:.4}",
        config.budget(),
        args.max_tokens_per_rank,
        args.ranks,
        efficiency
    );
    Ok(())
}
