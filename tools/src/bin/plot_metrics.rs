//! Curves of training runs from their `metrics.jsonl`: loss, validation loss, tokens/s and peak
//! memory per step, several runs on one chart (e.g. cp 1 against cp 4: equal losses lie on top
//! of each other).
//!
//! ```text
//! plot_metrics --out runs.svg runs/cp1 runs/cp4 --label "cp 1" --label "cp 4"
//! ```

use std::path::PathBuf;

use burn_dcp_tools::pictures::{plot_runs, RunCurves};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Draw training runs' curves (metrics.jsonl) as SVG or PNG")]
struct Args {
    /// The runs: `--out` directories of gpt_longctx/custom_model, or metrics.jsonl files
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// The picture to write: FILE.svg or FILE.png
    #[arg(long)]
    out: PathBuf,
    /// A run's name in the legend, once per run in order (default: its path)
    #[arg(long)]
    label: Vec<String>,
}

fn main() {
    burn_dcp_tools::exit_on_error(run(&Args::parse()));
}

fn run(args: &Args) -> Result<(), String> {
    if !args.label.is_empty() && args.label.len() != args.runs.len() {
        return Err(format!(
            "--label given {} times for {} runs: give one per run, or none",
            args.label.len(),
            args.runs.len()
        ));
    }
    let runs = args
        .runs
        .iter()
        .enumerate()
        .map(|(i, path)| {
            let label = args
                .label
                .get(i)
                .cloned()
                .unwrap_or_else(|| path.display().to_string());
            RunCurves::read(path, label)
        })
        .collect::<Result<Vec<_>, _>>()?;
    plot_runs(&args.out, &runs)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
