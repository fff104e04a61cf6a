//! Context-parallel attention on in-process ranks (threads), checked against one device.
//!
//! Mode 1 (default): random inputs; runs the chosen strategy's forward and backward on `--cp`
//! threads-as-ranks and the single-device reference, and reports the max relative error of
//! out, lse, dq, dk, dv, the bytes each rank sent (measured and analytic) and timings.
//!
//! ```text
//! cargo run --release -p burn-dcp-tools --bin cp_attention -- --strategy ring --layout zigzag --cp 4 \
//!     --heads 8 --kv-heads 2 --seqlens 1000,3000,517 --mask causal --json
//! ```
//!
//! With `--features wgpu` (or `cuda`), `--backend wgpu` runs the CP ranks on the cubecl kernels
//! (Mesa's lavapipe without a GPU); the reference stays on the CPU's portable implementation.
//!
//! Mode 2: `--inputs IN.safetensors --output OUT.safetensors` (see `--help` for the layout).
//!
//! `--strategy dcp` plans the inputs with the DCP planner (`--block`, `--stages`, for
//! `--topology` over `--nodes`) and executes the plan; `--explain` prints every rank's
//! instruction list. `--json` reports `"bytes_by_link"` (every strategy) and, for dcp,
//! `"predicted_bytes_by_link"` from the plan (`{"intra_node": [per rank], "inter_node": [...]}`).
//!
//! `--emulate-links` delays every message as over the `--topology` preset's links across
//! `--nodes`, slowed to this machine's compute (`--link-scale`, or measured: docs/training.md),
//! and reports `"measured_attention_ms"` (forward + backward, the slowest rank's) next to
//! `"predicted_attention_ms"`: the cost model's time of the same plan on the emulated machine
//! (the preset's links slowed alike, this machine's measured kernels, the ranks sharing its
//! cores). Ring with a contiguous or stripe layout has no plan in the cost model: `null`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::{DType, TensorData};
use burn_dcp::comm::LinkEmulation;
use burn_dcp::comm::{LinkBytes, WorldConfig, MAX_IN_PROCESS_RANKS, MAX_TIMEOUT};
use burn_dcp::diagnostics::harness::{
    max_rel_err, run_context_parallel_on, run_context_parallel_with_links, run_single_device_in,
    PackedInputs, PackedOutputs, RunReport, RunSpec,
};
use burn_dcp::diagnostics::volume::{analytic_volume, VolumeShape};
use burn_dcp::kernels::{validate_cu_seqlens, validate_scale, MaskSpec};
use burn_dcp::planner::cost::{evaluate_with, AttentionDims, Pass, RoutedPlan};
use burn_dcp::planner::dcp::{dcp_execution_plan, DcpConfig};
use burn_dcp::planner::plan::{tile_grids, BlockProblem};
use burn_dcp::planner::topology::Topology;
use burn_dcp::planner::{executed_plan, PlanInput};
use burn_dcp::strategy::block_plan::BlockSchedule;
use burn_dcp::{CpError, Layout, Placement, Strategy};
use burn_dcp_tools::on_backend;
use burn_dcp_train::launch::Ranks;
use burn_dcp_train::links::{cpu_compute, emulated_topology, time_scale, EmulatedLinks};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::json;

mod dcp;
mod inputs;
mod report;

use dcp::{block_plan, explain};
use inputs::{check_size, random_inputs, read_inputs, write_outputs};
use report::{print_text, summarize};

const INPUT_LAYOUT: &str = "\
Mode 2 tensors (safetensors, token-major packed tokens, no padding; T = total tokens):
  inputs:  q [T, H, D], k [T, K, D], v [T, K, D], dout [T, H, D]  (f32; f16/bf16/f64 are converted)
           cu_seqlens [S+1] (i64 or i32): 0, len_0, len_0+len_1, ..., T
  outputs: out [T, H, D], lse [H, T] (f32, natural log; -inf for queries with no allowed key),
           dq [T, H, D], dk [T, K, D], dv [T, K, D]  (f32)
  H must be a multiple of K; --mask applies to every sequence; positions restart at 0 per sequence.";

/// Context-parallel attention (forward and backward) on threads-as-ranks, checked against one device.
#[derive(Parser, Debug)]
#[command(after_help = INPUT_LAYOUT)]
struct Args {
    /// ulysses | ring | all-gather | usp | dcp (a DCP block plan, made for these inputs)
    #[arg(long, default_value = "ring")]
    strategy: String,
    /// Topology preset whose links the ranks model: a100-p4d | h100-dgx (dcp plans for it;
    /// bytes are counted per link class for every strategy)
    #[arg(long, default_value = "a100-p4d")]
    topology: String,
    /// Virtual nodes the ranks are spread over (consecutive ranks share a node; must divide --cp)
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// dcp: tokens per block [default: 64]
    #[arg(long)]
    block: Option<usize>,
    /// dcp: communication stages of the plan [default: 4]
    #[arg(long)]
    stages: Option<usize>,
    /// dcp: head units the plan places separately (each an equal share of the query heads and
    /// the kv heads they read; divides the query heads, divides or is a multiple of the kv
    /// heads). Each token stays on its token home; units homed elsewhere move there and back
    /// [default: 1]
    #[arg(long)]
    head_units: Option<usize>,
    /// dcp: print every rank's instruction list (forward and backward) before running
    #[arg(long)]
    explain: bool,
    /// contiguous | zigzag | stripe
    #[arg(long, default_value = "zigzag")]
    layout: String,
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    cp: usize,
    /// Ulysses degree of USP (ring degree = cp / ulysses degree). Required for usp only.
    #[arg(long)]
    ulysses_degree: Option<usize>,
    /// Query heads (mode 1).
    #[arg(long, default_value_t = 8, conflicts_with = "inputs")]
    heads: usize,
    /// Key/value heads (mode 1); defaults to --heads.
    #[arg(long, conflicts_with = "inputs")]
    kv_heads: Option<usize>,
    /// Head dimension (mode 1).
    #[arg(long, default_value_t = 64, conflicts_with = "inputs")]
    head_dim: usize,
    /// Sequence lengths of the packed batch (mode 1).
    #[arg(
        long,
        default_value = "1000,3000,517",
        value_delimiter = ',',
        conflicts_with = "inputs"
    )]
    seqlens: Vec<usize>,
    /// full | causal | sliding:W | lambda:S,W | blockwise:B,L | shared-question:F,N
    #[arg(long, default_value = "causal")]
    mask: String,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f64>,
    /// Seed of the random inputs (mode 1).
    #[arg(long, default_value_t = 0, conflicts_with = "inputs")]
    seed: u64,
    /// Backend of the CP run: flex (CPU, portable kernels), wgpu or cuda (cubecl kernels; build
    /// with `--features wgpu` / `--features cuda`). The reference always runs on flex.
    #[arg(long, default_value = "flex")]
    backend: String,
    /// With --backend wgpu: burn's plain `CubeBackend` instead of the default `Fusion<CubeBackend>`
    /// (the type burn's default features make `burn::backend::Wgpu`).
    #[arg(long)]
    no_fusion: bool,
    /// Timeout of every communication wait, in seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
    /// Mode 2: read q, k, v, dout, cu_seqlens from this safetensors file.
    #[arg(long, requires = "output")]
    inputs: Option<PathBuf>,
    /// Mode 2: write out, lse, dq, dk, dv to this safetensors file.
    #[arg(long, requires = "inputs")]
    output: Option<PathBuf>,
    /// Delay every message as over the --topology preset's links across --nodes, slowed to this
    /// machine's compute; report the measured attention time next to the cost model's prediction
    #[arg(long)]
    emulate_links: bool,
    /// The emulated links' time scale (bandwidth ÷ F, latency × F) [default: measured]
    #[arg(long)]
    link_scale: Option<f64>,
    /// The dtype q, k, v and dout are cast to, for the CP run and the reference alike: f32 |
    /// bf16 | f16 (the LSE and every accumulator stay f32)
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

impl Args {
    fn dtype(&self) -> Result<burn::tensor::DType, String> {
        match self.dtype.as_str() {
            "f32" => Ok(burn::tensor::DType::F32),
            "bf16" => Ok(burn::tensor::DType::BF16),
            "f16" => Ok(burn::tensor::DType::F16),
            other => Err(format!("--dtype {other:?}: expected f32, bf16 or f16")),
        }
    }
}

/// What `--emulate-links` gives the report: the links' scale and the cost model's prediction.
struct Emulation {
    scale: f64,
    links: LinkEmulation,
    /// Predicted (forward, backward) ms of the run's plan on the emulated machine; `None` for a
    /// strategy the cost model has no plan of.
    predicted: Option<(f64, f64)>,
    /// The plan's (intra-node, inter-node) bytes, forward + backward.
    predicted_link_bytes: Option<(f64, f64)>,
}

fn main() {
    burn_dcp_train::launch::init_logging();
    burn_dcp_train::launch::exit_on_error(run(&Args::parse()));
}

fn run(args: &Args) -> Result<(), String> {
    let (strategy, layout, mask) = parsed_flags(args)?;
    let inputs = match &args.inputs {
        Some(path) => {
            let inputs = read_inputs(path)?;
            let dims = [
                inputs.heads,
                inputs.kv_heads,
                inputs.head_dim,
                inputs.value_dim,
            ];
            check_size(&inputs.seq_lens, dims, args.cp)?;
            inputs
        }
        None => random_inputs(args, strategy)?,
    };
    let topology = Topology::for_ranks(&args.topology, args.nodes, args.cp)
        .map_err(|e| format!("--topology {} --nodes {}: {e}", args.topology, args.nodes))?;
    let (blocks, dcp_routed) = block_plan(args, strategy, &inputs, &mask, &topology)?;
    let ranks = Ranks::new(
        args.cp,
        WorldConfig {
            timeout: Duration::from_secs(args.timeout_secs),
            ranks_per_node: Some(args.cp / args.nodes.max(1)),
        },
    )
    .map_err(|e| e.to_string())?;
    if let (Some(scale), false) = (args.link_scale, args.emulate_links) {
        return Err(format!(
            "--link-scale {scale} only applies with --emulate-links"
        ));
    }
    let emulation = match args.emulate_links {
        false => None,
        true if ranks.is_distributed() => {
            return Err(
                "--emulate-links delays the messages of ranks that are threads of this process; these ranks are processes (MPI or TCP), whose links are real"
                    .into(),
            )
        }
        true => Some(emulation(
            args,
            &inputs,
            &mask,
            &topology,
            strategy,
            layout,
            dcp_routed,
        )?),
    };
    if let (true, true, Some(schedule)) = (ranks.is_leader(), args.explain, &blocks) {
        let text = explain(schedule);
        match args.json {
            true => eprint!("{text}"),
            false => print!("{text}"),
        }
    }
    let spec = RunSpec {
        cp: args.cp,
        strategy,
        layout,
        masks: vec![mask],
        scale: args.scale,
        timeout: Duration::from_secs(args.timeout_secs),
        blocks,
        nodes: args.nodes,
        dtype: args.dtype()?,
    };
    if ranks.is_distributed() {
        return run_distributed(args, &ranks, &inputs, &spec);
    }
    let links = emulation.as_ref().map(|e| e.links);
    let report = on_backend!(args.backend.as_str(), args.no_fusion, B => {
        run_context_parallel_with_links::<B>(&Default::default(), &inputs, &spec, links)
    })
    .map_err(|e| e.to_string())?;
    report_run(args, &inputs, &spec, &report, emulation.as_ref())
}

/// The flags' rules (backend, ranks, timeout, scale), then the strategy, layout and mask.
fn parsed_flags(args: &Args) -> Result<(Strategy, Layout, MaskSpec), String> {
    burn_dcp_tools::backend_type(
        &args.backend,
        args.no_fusion,
        "-p burn-dcp-tools --bin cp_attention",
    )?;
    if args.cp == 0 || args.cp > MAX_IN_PROCESS_RANKS {
        return Err(format!(
            "--cp {} must be between 1 and {MAX_IN_PROCESS_RANKS} (ranks are threads of this process)",
            args.cp
        ));
    }
    if args.timeout_secs == 0 || args.timeout_secs > MAX_TIMEOUT.as_secs() {
        return Err(format!(
            "--timeout-secs {} must be between 1 and {} (a week)",
            args.timeout_secs,
            MAX_TIMEOUT.as_secs()
        ));
    }
    if let Some(scale) = args.scale {
        validate_scale(scale).map_err(|e| format!("--scale {scale}: {e}"))?;
    }
    let strategy =
        Strategy::parse(&args.strategy, args.ulysses_degree, args.cp).map_err(|e| e.to_string())?;
    let layout: Layout = args
        .layout
        .parse()
        .map_err(|e: burn_dcp::CpError| e.to_string())?;
    let mask: MaskSpec = args
        .mask
        .parse()
        .map_err(|e: burn_dcp::kernels::KernelError| e.to_string())?;
    Ok((strategy, layout, mask))
}

/// One rank per process (MPI or TCP): every rank runs its part; rank 0 assembles and reports.
fn run_distributed(
    args: &Args,
    ranks: &Ranks,
    inputs: &PackedInputs,
    spec: &RunSpec,
) -> Result<(), String> {
    let report = ranks.run(|comm| {
        on_backend!(args.backend.as_str(), args.no_fusion, B => {
            run_context_parallel_on::<B>(comm, &Default::default(), inputs, spec)
        })
        .map_err(|e| e.to_string())
    })?;
    match report.flatten() {
        Some(report) => report_run(args, inputs, spec, &report, None),
        None => Ok(()),
    }
}

/// `--emulate-links`: the links' scale (given or measured), the delays, and the cost model's
/// prediction of the run's plan on the emulated machine (this machine's kernels, measured for
/// the inputs' heads and head dim, the ranks sharing its cores).
fn emulation(
    args: &Args,
    inputs: &PackedInputs,
    mask: &MaskSpec,
    topology: &Topology,
    strategy: Strategy,
    layout: Layout,
    dcp_routed: Option<RoutedPlan>,
) -> Result<Emulation, String> {
    if let Some(scale) = args.link_scale {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(format!("--link-scale {scale} must be a positive number"));
        }
    }
    let scale = time_scale(
        EmulatedLinks {
            scale: args.link_scale,
        },
        topology,
        args.cp,
    )
    .map_err(|e| e.to_string())?;
    let links = LinkEmulation::of_topology(topology, scale)
        .map_err(|e| format!("--link-scale {scale}: {e}"))?;
    let input = PlanInput {
        seq_lens: inputs.seq_lens.clone(),
        masks: vec![mask.clone()],
        dims: AttentionDims {
            heads: inputs.heads,
            kv_heads: inputs.kv_heads,
            head_dim: inputs.head_dim,
            element_bytes: 4,
        },
        topology: topology.clone(),
        block: 64,
        dcp: DcpConfig::default(),
        max_seq_len_per_rank: None,
    };
    let routed = match strategy {
        Strategy::Dcp => dcp_routed,
        _ => executed_plan(strategy, layout, &input)
            .map_err(|e| format!("the cost model's plan of {}: {e}", args.strategy))?,
    };
    let report = match routed {
        Some(routed) => {
            let cpu = cpu_compute(inputs.heads, inputs.kv_heads, inputs.head_dim, args.cp)
                .map_err(|e| e.to_string())?;
            let machine = emulated_topology(topology, scale, cpu.flops_per_rank);
            Some(evaluate_with(&routed, &machine, &cpu.model).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    Ok(Emulation {
        scale,
        links,
        predicted: report
            .as_ref()
            .map(|r| (r.attention_fwd_ms, r.attention_bwd_ms)),
        predicted_link_bytes: report
            .as_ref()
            .map(|r| (r.intra_node_bytes, r.inter_node_bytes)),
    })
}

/// Compares the run with the single-device reference and prints the summary (rank 0).
fn report_run(
    args: &Args,
    inputs: &PackedInputs,
    spec: &RunSpec,
    report: &RunReport,
    emulation: Option<&Emulation>,
) -> Result<(), String> {
    let started = Instant::now();
    let reference = run_single_device_in::<Flex>(
        &Default::default(),
        inputs,
        &spec.masks,
        spec.scale,
        spec.dtype,
    )
    .map_err(|e| e.to_string())?;
    let reference_ms = started.elapsed().as_secs_f64() * 1e3;
    if let Some(path) = &args.output {
        write_outputs(path, inputs, &report.outputs)?;
    }
    let summary = summarize(
        args,
        inputs,
        spec,
        report,
        &reference,
        reference_ms,
        emulation,
    )?;
    if summary["non_finite_inputs"] == true {
        eprintln!(
            "cp_attention: the inputs hold NaN or infinite values; they propagate into the outputs, so the errors against the reference are not finite"
        );
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?
        );
    } else {
        print_text(&summary);
    }
    Ok(())
}
