//! Plans one batch with every strategy and compares them on a cluster model: inter- and
//! intra-node bytes, compute and memory imbalance, estimated attention time (forward and
//! backward, communication overlapped per the plan's stages) and planning time.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin plan_sim -- --lengths-from ldc-like --tokens 131072 \
//!     --topology a100-p4d --nodes 4 --mask causal --json
//! ```
//!
//! Every plan is checked by the independent validator before it is reported. With `auto` in
//! `--strategies` it also reports the choice of `gpt_longctx --strategy auto` for the batch: give
//! the micro-batch's `--lengths`, the model's `--heads --kv-heads --head-dim`, `--element-bytes`
//! (4 in f32, 2 with `--precision bf16|f16`), the group's `--topology --nodes
//! --devices-per-node`, and the run's `--block --stages --seed` (and `--auto-candidates`).

use std::path::PathBuf;
use std::time::Instant;

use burn_dcp::planner::{
    choose_strategy, evaluate, parse_candidates, plan_strategy, plan_usp, validate_plan,
    AttentionDims, AutoChoice, DcpConfig, Plan, PlanInput, RoutedPlan, StrategyReport, Topology,
};
use burn_dcp::StrategyKind;
use burn_dcp_datasets::{LengthMix, LengthSampler};
use burn_dcp_kernels::MaskSpec;
use burn_dcp_tools::pictures::plot_plans;
use clap::Parser;
use serde_json::json;

/// Compare CP strategies' plans on a cluster model.
#[derive(Parser, Debug)]
struct Args {
    /// Sequence lengths, comma-separated (instead of --lengths-from, --tokens and --scale).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["lengths_from", "tokens", "scale"])]
    lengths: Option<Vec<usize>>,
    /// Draw lengths from a distribution: longalign-like | ldc-like.
    #[arg(long, default_value = "ldc-like")]
    lengths_from: String,
    /// DCP's length scale factor for --lengths-from.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Tokens of the drawn batch (the last length is cut to fit).
    #[arg(long, default_value_t = 131072)]
    tokens: usize,
    /// Seed of the drawn lengths and of the DCP partitioner.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// causal | full | lambda:SINK,WINDOW | blockwise:BLOCK,LOCAL | shared-question:FRACTION,ANSWERS | sliding:W
    #[arg(long, default_value = "causal", conflicts_with = "masks")]
    mask: String,
    /// One mask per sequence, ';'-separated (e.g. "causal;lambda:64,4096"), instead of --mask.
    #[arg(long)]
    masks: Option<String>,
    /// a100-p4d | h100-dgx
    #[arg(long, default_value = "a100-p4d")]
    topology: String,
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Override the preset's devices per node.
    #[arg(long)]
    devices_per_node: Option<usize>,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Bytes per element (2: bf16).
    #[arg(long, default_value_t = 2)]
    element_bytes: usize,
    /// Block size in tokens.
    #[arg(long, default_value_t = 512)]
    block: usize,
    /// Comma-separated: ring-zigzag,ulysses,usp,all-gather,megatron-dynamic,dcp, and auto (the
    /// strategy `gpt_longctx --strategy auto` would choose for this batch, with every candidate's
    /// estimate).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ring-zigzag,ulysses,usp,all-gather,megatron-dynamic,dcp"
    )]
    strategies: Vec<String>,
    /// auto: the strategies it may choose (ring-zigzag,ulysses,usp,all-gather,dynamic,dcp) [default: all]
    #[arg(long)]
    auto_candidates: Option<String>,
    /// DCP: communication stages.
    #[arg(long, default_value_t = 4)]
    stages: usize,
    /// DCP: per-device compute imbalance tolerance.
    #[arg(long, default_value_t = 0.1)]
    compute_epsilon: f64,
    /// DCP: per-device memory imbalance tolerance.
    #[arg(long, default_value_t = 0.4)]
    memory_epsilon: f64,
    /// Megatron-dynamic: tokens per rank (default: twice an even split).
    #[arg(long)]
    max_seq_len_per_rank: Option<usize>,
    /// Write the plan of the last strategy (JSON) to this file (with auto: the winner's).
    #[arg(long)]
    plan_out: Option<PathBuf>,
    /// Plan each strategy this many times and report the median planning time.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// usp: this Ulysses degree (groups of consecutive ranks; default: the largest that fits a
    /// node and the heads), e.g. 2 for TransformerEngine's a2a+p2p baseline of the DCP paper
    #[arg(long)]
    ulysses_degree: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw every plan (each strategy's, and auto's winner): tiles by computing rank, compute
    /// blocks per rank and stage, bytes each rank sends within and across nodes
    #[arg(long)]
    svg: Option<PathBuf>,
    /// As --svg, as a PNG
    #[arg(long)]
    png: Option<PathBuf>,
}

fn main() {
    burn_dcp_tools::exit_on_error(run(&Args::parse()));
}

/// The most tokens a drawn batch may have (the planners' tile limit is reached long before).
const MAX_TOKENS: usize = 1 << 32;

fn lengths(args: &Args) -> Result<Vec<usize>, String> {
    if let Some(lengths) = &args.lengths {
        if lengths.is_empty() || lengths.contains(&0) {
            return Err(format!(
                "--lengths {lengths:?}: every length must be at least 1"
            ));
        }
        return Ok(lengths.clone());
    }
    let mix: LengthMix = args.lengths_from.parse().map_err(|e| format!("{e}"))?;
    if args.tokens == 0 || args.tokens > MAX_TOKENS {
        return Err(format!(
            "--tokens {} must be between 1 and {MAX_TOKENS}",
            args.tokens
        ));
    }
    let sampler = LengthSampler::new(mix, args.scale, args.tokens).map_err(|e| e.to_string())?;
    Ok(sampler.sample_batch(args.tokens, args.seed))
}

/// The planned strategies: each one's report (by the cost model), those that could not plan
/// the batch, auto's choice with its planning time, and the plan `--plan-out` writes.
struct Outcome {
    reports: Vec<StrategyReport>,
    skipped: Vec<serde_json::Value>,
    choice: Option<(AutoChoice, f64)>,
    last_plan: Option<Plan>,
    /// Every plan made (the pictures' input).
    plans: Vec<RoutedPlan>,
}

fn run(args: &Args) -> Result<(), String> {
    if args.repeat == 0 || args.repeat > 1000 {
        return Err(format!(
            "--repeat {} must be between 1 and 1000",
            args.repeat
        ));
    }
    let input = plan_input(args)?;
    let auto = args.strategies.iter().any(|s| s == "auto");
    let strategies = args
        .strategies
        .iter()
        .filter(|s| *s != "auto")
        .map(|s| StrategyKind::from_plan_name(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{e} (or auto)"))?;
    let candidates = match (&args.auto_candidates, auto) {
        (Some(_), false) => {
            return Err("--auto-candidates only applies with auto in --strategies".into())
        }
        (Some(text), true) => {
            parse_candidates(text).map_err(|e| format!("--auto-candidates {text}: {e}"))?
        }
        (None, _) => StrategyKind::ALL.to_vec(),
    };
    let mut outcome = plan_each(args, &strategies, &input)?;
    if auto {
        let started = Instant::now();
        let choice = choose_strategy(&input, &candidates).map_err(|e| e.to_string())?;
        let planning_ms = started.elapsed().as_secs_f64() * 1e3;
        // --plan-out writes the plan of the last strategy: auto's winner comes last.
        outcome.last_plan = Some(choice.plan.plan.clone());
        if args.svg.is_some() || args.png.is_some() {
            let mut winner = choice.plan.clone();
            winner.name = format!("auto ({})", winner.name);
            outcome.plans.push(winner);
        }
        outcome.choice = Some((choice, planning_ms));
    }
    if outcome.reports.is_empty() && outcome.choice.is_none() {
        let reasons: Vec<String> = outcome
            .skipped
            .iter()
            .map(|s| format!("{}: {}", s["name"].as_str().unwrap_or(""), s["error"]))
            .collect();
        return Err(format!(
            "no strategy could plan this batch ({})",
            reasons.join("; ")
        ));
    }
    if let (Some(path), Some(plan)) = (&args.plan_out, &outcome.last_plan) {
        let text = serde_json::to_string(plan).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    for path in [&args.svg, &args.png].into_iter().flatten() {
        plot_plans(path, &outcome.plans, &input.topology)?;
    }
    if args.json {
        print_json(&outcome);
    } else {
        print_table(args, &input, &outcome);
    }
    Ok(())
}

/// The planners' input the flags describe: the batch's lengths and masks, the attention's
/// dimensions, the topology, DCP's block and settings.
fn plan_input(args: &Args) -> Result<PlanInput, String> {
    let seq_lens = lengths(args)?;
    let masks: Vec<MaskSpec> = match &args.masks {
        Some(text) => {
            let masks = text
                .split(';')
                .map(|m| m.parse().map_err(|e| format!("--masks: '{m}': {e}")))
                .collect::<Result<Vec<MaskSpec>, String>>()?;
            if masks.len() != seq_lens.len() {
                return Err(format!(
                    "--masks gives {} masks for {} sequences: give one per sequence",
                    masks.len(),
                    seq_lens.len()
                ));
            }
            masks
        }
        None => vec![args
            .mask
            .parse()
            .map_err(|e| format!("--mask {}: {e}", args.mask))?],
    };
    let mut topology = Topology::preset(&args.topology, args.nodes).map_err(|e| e.to_string())?;
    if let Some(devices) = args.devices_per_node {
        topology.devices_per_node = devices;
        topology.validate().map_err(|e| e.to_string())?;
    }
    let input = PlanInput {
        seq_lens,
        masks,
        dims: AttentionDims {
            heads: args.heads,
            kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            element_bytes: args.element_bytes,
        },
        topology,
        block: args.block,
        dcp: DcpConfig {
            compute_epsilon: args.compute_epsilon,
            memory_epsilon: args.memory_epsilon,
            stages: args.stages,
            seed: args.seed,
        },
        max_seq_len_per_rank: args.max_seq_len_per_rank,
    };
    input.validate().map_err(|e| e.to_string())?;
    Ok(input)
}

/// Plans the batch with each strategy (`--repeat` times, the median planning time kept),
/// validates each plan and evaluates it on the topology.
fn plan_each(
    args: &Args,
    strategies: &[StrategyKind],
    input: &PlanInput,
) -> Result<Outcome, String> {
    let mut outcome = Outcome {
        reports: Vec::new(),
        skipped: Vec::new(),
        choice: None,
        last_plan: None,
        plans: Vec::new(),
    };
    for &strategy in strategies {
        let mut times = Vec::new();
        let mut planned = None;
        for _ in 0..args.repeat.max(1) {
            let start = Instant::now();
            let result = match (strategy, args.ulysses_degree) {
                (StrategyKind::Usp, Some(degree)) => plan_usp(input, degree),
                _ => plan_strategy(strategy, input),
            };
            times.push(start.elapsed().as_secs_f64() * 1e3);
            planned = Some(result);
        }
        let routed = match planned.expect("at least one run") {
            Ok(routed) => routed,
            Err(e) => {
                outcome
                    .skipped
                    .push(json!({"name": strategy.plan_name(), "error": e.to_string()}));
                continue;
            }
        };
        times.sort_by(f64::total_cmp);
        let planning_ms = times[times.len() / 2];
        validate_plan(&routed.plan, &routed.problem)
            .map_err(|e| format!("{}: {e}", strategy.plan_name()))?;
        let mut report = evaluate(&routed, &input.topology).map_err(|e| e.to_string())?;
        report.planning_ms = planning_ms;
        outcome.reports.push(report);
        outcome.last_plan = Some(routed.plan.clone());
        if args.svg.is_some() || args.png.is_some() {
            outcome.plans.push(routed);
        }
    }
    Ok(outcome)
}

/// `--json`: one object of the strategies' reports, the skipped ones and auto's choice.
fn print_json(outcome: &Outcome) {
    let mut out = json!({ "strategies": outcome.reports });
    if !outcome.skipped.is_empty() {
        out["skipped"] = json!(outcome.skipped);
    }
    if let Some((choice, planning_ms)) = &outcome.choice {
        out["auto"] = json!({
            "choice": choice.winner.name(),
            "estimated_ms": choice.estimated_ms(),
            "estimates": choice.estimates,
            "planning_ms": planning_ms,
        });
    }
    println!("{out}");
}

/// The table: the batch, one row per strategy, the skipped ones, auto's choice, and each
/// strategy against ring-zigzag.
fn print_table(args: &Args, input: &PlanInput, outcome: &Outcome) {
    let (seq_lens, topology, reports) = (&input.seq_lens, &input.topology, &outcome.reports);
    let mask_text = args.masks.clone().unwrap_or_else(|| args.mask.clone());
    let tokens: usize = seq_lens.iter().sum();
    println!(
        "{} sequences, {tokens} tokens (longest {}), mask {}, {} × {} ranks ({}), H {} / KV {} × D {}, block {}",
        seq_lens.len(),
        seq_lens.iter().max().unwrap_or(&0),
        mask_text,
        topology.nodes,
        topology.devices_per_node,
        args.topology,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block
    );
    println!(
        "{:<17} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10} {:>10}",
        "strategy", "inter GB", "intra GB", "compute", "memory", "fwd ms", "bwd ms", "plan ms"
    );
    for r in reports {
        println!(
            "{:<17} {:>12.3} {:>12.3} {:>8.3} {:>8.3} {:>10.3} {:>10.3} {:>10.1}",
            r.name,
            r.inter_node_bytes / 1e9,
            r.intra_node_bytes / 1e9,
            r.compute_imbalance,
            r.memory_imbalance,
            r.attention_fwd_ms,
            r.attention_bwd_ms,
            r.planning_ms
        );
    }
    for s in &outcome.skipped {
        println!(
            "{:<17} skipped: {}",
            s["name"].as_str().unwrap_or(""),
            s["error"]
        );
    }
    if let Some((choice, planning_ms)) = &outcome.choice {
        print_choice(choice, *planning_ms);
    }
    let ring = reports
        .iter()
        .find(|r| r.name == StrategyKind::RING_ZIGZAG.plan_name());
    if let Some(ring) = ring {
        for r in reports
            .iter()
            .filter(|r| r.name != StrategyKind::RING_ZIGZAG.plan_name())
        {
            print_against_ring(ring, r);
        }
    }
}

/// Auto's line: its choice, the estimate, and every candidate's estimate (or why it was skipped).
fn print_choice(choice: &AutoChoice, planning_ms: f64) {
    let estimates: Vec<String> = choice
        .estimates
        .iter()
        .map(|e| match (e.estimated_ms, &e.error) {
            (Some(ms), _) => format!("{} {ms:.3} ms", e.strategy),
            (None, error) => {
                format!("{} skipped", e.strategy)
                    + &error
                        .as_deref()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default()
            }
        })
        .collect();
    println!(
        "auto chooses {} (estimated attention fwd+bwd {:.3} ms; planned all in {planning_ms:.1} ms): {}",
        choice.winner,
        choice.estimated_ms(),
        estimates.join(", ")
    );
}

/// A strategy against ring-zigzag: inter-node bytes and the attention speedup.
fn print_against_ring(ring: &StrategyReport, r: &StrategyReport) {
    let time = |x: &StrategyReport| x.attention_fwd_ms + x.attention_bwd_ms;
    let bytes = if ring.inter_node_bytes > 0.0 {
        format!(
            "{:+.1}%",
            100.0 * (r.inter_node_bytes / ring.inter_node_bytes - 1.0)
        )
    } else {
        format!(
            "n/a (ring moves none; {} moves {:.0} B)",
            r.name, r.inter_node_bytes
        )
    };
    println!(
        "{} vs ring-zigzag: inter-node bytes {bytes}, attention (fwd+bwd) speedup {:.2}×",
        r.name,
        time(ring) / time(r).max(1e-12)
    );
}
