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
#[cfg(feature = "cuda")]
use burn_dcp_kernels::backends::{CudaFusion, CudaPlain};
#[cfg(feature = "wgpu")]
use burn_dcp_kernels::backends::{WgpuFusion, WgpuPlain};
use burn_dcp_train::launch::Ranks;
use burn_dcp_train::links::{cpu_compute, emulated_topology, time_scale, EmulatedLinks};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::json;

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
    let args = Args::parse();
    if let Err(message) = run(&args) {
        // With several processes (MPI or TCP) every rank finds the same error: rank 0 alone prints it.
        if burn_dcp_train::launch::launcher_rank() == 0 {
            eprintln!("error: {message}");
        }
        std::process::exit(2);
    }
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
    )?;
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
    let device = Default::default();
    let report = match args.backend.as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu" if args.no_fusion => {
            run_context_parallel_with_links::<WgpuPlain>(&Default::default(), &inputs, &spec, links)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => run_context_parallel_with_links::<WgpuFusion>(
            &Default::default(),
            &inputs,
            &spec,
            links,
        ),
        #[cfg(feature = "cuda")]
        "cuda" if args.no_fusion => {
            run_context_parallel_with_links::<CudaPlain>(&Default::default(), &inputs, &spec, links)
        }
        #[cfg(feature = "cuda")]
        "cuda" => run_context_parallel_with_links::<CudaFusion>(
            &Default::default(),
            &inputs,
            &spec,
            links,
        ),
        _ => run_context_parallel_with_links::<Flex>(&device, &inputs, &spec, links),
    }
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

/// Strategy dcp: the inputs' block plan for the topology (the schedule the ranks run, and the
/// routed plan the cost model predicts from); other strategies refuse DCP's flags.
fn block_plan(
    args: &Args,
    strategy: Strategy,
    inputs: &PackedInputs,
    mask: &MaskSpec,
    topology: &Topology,
) -> Result<(Option<Arc<BlockSchedule>>, Option<RoutedPlan>), String> {
    if strategy == Strategy::Dcp {
        let routed = dcp_routed_plan(args, inputs, mask, topology)?;
        let schedule = BlockSchedule::new(&routed.plan, &routed.problem, topology)
            .map_err(|e| format!("--strategy dcp: {e}"))?;
        return Ok((Some(Arc::new(schedule)), Some(routed)));
    }
    if let Some(flag) = [
        ("--block", args.block.is_some()),
        ("--stages", args.stages.is_some()),
        ("--head-units", args.head_units.is_some()),
        ("--explain", args.explain),
    ]
    .iter()
    .find_map(|(flag, given)| given.then_some(flag))
    {
        return Err(format!("{flag} only applies to --strategy dcp"));
    }
    Ok((None, None))
}

/// One rank per process (MPI or TCP): every rank runs its part; rank 0 assembles and reports.
fn run_distributed(
    args: &Args,
    ranks: &Ranks,
    inputs: &PackedInputs,
    spec: &RunSpec,
) -> Result<(), String> {
    let device = Default::default();
    let report = ranks.run(|comm| {
        match args.backend.as_str() {
            #[cfg(feature = "wgpu")]
            "wgpu" if args.no_fusion => {
                run_context_parallel_on::<WgpuPlain>(comm, &Default::default(), inputs, spec)
            }
            #[cfg(feature = "wgpu")]
            "wgpu" => {
                run_context_parallel_on::<WgpuFusion>(comm, &Default::default(), inputs, spec)
            }
            #[cfg(feature = "cuda")]
            "cuda" if args.no_fusion => {
                run_context_parallel_on::<CudaPlain>(comm, &Default::default(), inputs, spec)
            }
            #[cfg(feature = "cuda")]
            "cuda" => {
                run_context_parallel_on::<CudaFusion>(comm, &Default::default(), inputs, spec)
            }
            _ => run_context_parallel_on::<Flex>(comm, &device, inputs, spec),
        }
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

/// The DCP plan of the inputs on `topology`, for execution with `--head-units` (default 1: a
/// token's heads stay together).
fn dcp_routed_plan(
    args: &Args,
    inputs: &PackedInputs,
    mask: &MaskSpec,
    topology: &Topology,
) -> Result<RoutedPlan, String> {
    let problem = BlockProblem {
        seq_lens: inputs.seq_lens.clone(),
        masks: vec![mask.clone()],
        head_groups: args.head_units.unwrap_or(1),
        block: args.block.unwrap_or(64),
    };
    let dims = AttentionDims {
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        head_dim: inputs.head_dim,
        element_bytes: 4,
    };
    let config = DcpConfig {
        stages: args.stages.unwrap_or(DcpConfig::default().stages),
        ..DcpConfig::default()
    };
    let plan = |problem: &BlockProblem| -> Result<RoutedPlan, CpError> {
        problem.validate()?;
        dcp_execution_plan(problem, tile_grids(problem), &dims, topology, &config)
    };
    plan(&problem).map_err(|e| format!("--strategy dcp: {e}"))
}

/// Every rank's instruction lists, one instruction per line.
fn explain(schedule: &BlockSchedule) -> String {
    let mut text = String::new();
    for rank in 0..schedule.ranks {
        let homes: Vec<String> = schedule
            .home_blocks(rank)
            .iter()
            .map(|b| format!("s{}b{}", b.seq, b.block))
            .collect();
        text += &format!("rank {rank}: home blocks [{}]\n", homes.join(", "));
        for (name, pass) in [("forward", Pass::Forward), ("backward", Pass::Backward)] {
            text += &format!("  {name}:\n");
            for instruction in schedule.program(rank, pass) {
                text += &format!("    {instruction}\n");
            }
        }
    }
    text
}

fn random_inputs(args: &Args, strategy: Strategy) -> Result<PackedInputs, String> {
    let kv_heads = args.kv_heads.unwrap_or(args.heads);
    if args.seqlens.is_empty() || args.head_dim == 0 || args.heads == 0 {
        return Err("--seqlens, --heads and --head-dim must be non-empty / positive".into());
    }
    strategy
        .validate_heads(args.heads, kv_heads, args.cp)
        .map_err(|e| e.to_string())?;
    let t = check_size(
        &args.seqlens,
        [args.heads, kv_heads, args.head_dim, args.head_dim],
        args.cp,
    )?;
    if t == 0 {
        return Err(format!(
            "--seqlens {:?} hold no token: at least one sequence needs a token",
            args.seqlens
        ));
    }
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let d = args.head_dim;
    let mut values = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    Ok(PackedInputs {
        seq_lens: args.seqlens.clone(),
        heads: args.heads,
        kv_heads,
        head_dim: d,
        value_dim: d,
        q: values(t * args.heads * d),
        k: values(t * kv_heads * d),
        v: values(t * kv_heads * d),
        dout: values(t * args.heads * d),
    })
}

/// Checks that a run of `seq_lens` tokens with `[heads, kv_heads, head_dim, value_dim]` on `cp`
/// ranks fits: sums and products must not overflow, and the estimated memory (inputs, the
/// single-device reference, per-rank shards, gathered keys/values and outputs, all f32) must
/// fit in the memory this machine has available. Returns the token count.
fn check_size(seq_lens: &[usize], dims: [usize; 4], cp: usize) -> Result<usize, String> {
    let [heads, kv_heads, head_dim, value_dim] = dims.map(|d| d as u128);
    let tokens = seq_lens
        .iter()
        .try_fold(0usize, |sum, &len| sum.checked_add(len))
        .ok_or_else(|| format!("--seqlens {seq_lens:?}: the total token count overflows"))?;
    // Per token: q, dout, out, dq (H·D or H·Dv each) and lse (H), six copies over the run
    // (inputs, reference, shards, results); k, v, dk, dv (K·(D+Dv)), once per rank when
    // gathered, plus four copies.
    let per_token = 6 * heads * (2 * head_dim + 2 * value_dim + 1)
        + (cp as u128 + 4) * 2 * kv_heads * (head_dim + value_dim);
    let estimate = 4 * tokens as u128 * per_token;
    let limit = available_memory();
    if estimate > limit as u128 {
        return Err(format!(
            "{tokens} tokens × {heads} heads ({kv_heads} kv heads) × head dim {head_dim} on cp {cp} needs about {} of memory, more than the {} available: use fewer tokens, heads or a smaller head dim",
            gib(estimate),
            gib(limit as u128)
        ));
    }
    Ok(tokens)
}

/// Memory this process may use: `MemAvailable` of /proc/meminfo (16 GiB when unreadable).
fn available_memory() -> u64 {
    let kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemAvailable:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        });
    kib.map_or(16 << 30, |kib| kib.saturating_mul(1024))
}

fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn summarize(
    args: &Args,
    inputs: &PackedInputs,
    spec: &RunSpec,
    report: &RunReport,
    reference: &PackedOutputs,
    reference_ms: f64,
    emulation: Option<&Emulation>,
) -> Result<serde_json::Value, String> {
    let got = &report.outputs;
    let placement =
        Placement::of_layout(&inputs.seq_lens, spec.cp, spec.layout).map_err(|e| e.to_string())?;
    let shape = VolumeShape {
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        head_dim: inputs.head_dim,
        value_dim: inputs.value_dim,
        element_bytes: 4,
    };
    let analytic = match &spec.blocks {
        Some(schedule) => schedule
            .predicted_volume(inputs.heads, inputs.kv_heads, inputs.head_dim)
            .map_err(|e| e.to_string())?,
        None => analytic_volume(spec.strategy, &placement, &shape),
    };
    let links = |links: Vec<LinkBytes>| {
        json!({
            "intra_node": links.iter().map(|l| l.intra_node).collect::<Vec<_>>(),
            "inter_node": links.iter().map(|l| l.inter_node).collect::<Vec<_>>(),
        })
    };
    let measured_links = links(report.stats.iter().map(|s| s.bytes_by_link).collect());
    let predicted_links = match &spec.blocks {
        Some(schedule) => links(
            schedule
                .predicted_links(inputs.heads, inputs.kv_heads, inputs.head_dim)
                .map_err(|e| e.to_string())?,
        ),
        None => serde_json::Value::Null,
    };
    let total: Vec<u64> = report
        .bytes_forward
        .iter()
        .zip(&report.bytes_backward)
        .map(|(f, b)| f + b)
        .collect();
    let non_finite = [&inputs.q, &inputs.k, &inputs.v, &inputs.dout]
        .iter()
        .any(|values| values.iter().any(|v| !v.is_finite()));
    let (ulysses_degree, ring_degree) = match spec.strategy {
        Strategy::Ulysses => (spec.cp, 1),
        Strategy::Usp {
            ulysses_degree,
            ring_degree,
        } => (ulysses_degree, ring_degree),
        Strategy::Ring | Strategy::AllGather | Strategy::Dcp => (1, spec.cp),
    };
    Ok(json!({
        "mode": if args.inputs.is_some() { "inputs" } else { "random" },
        "strategy": args.strategy,
        "layout": if spec.blocks.is_some() { "dcp plan".to_string() } else { spec.layout.to_string() },
        "cp": spec.cp,
        "head_units": spec.blocks.as_ref().map_or(1, |schedule| schedule.units),
        "ulysses_degree": ulysses_degree,
        "ring_degree": ring_degree,
        "heads": inputs.heads,
        "kv_heads": inputs.kv_heads,
        "head_dim": inputs.head_dim,
        "seqlens": inputs.seq_lens,
        "tokens": inputs.tokens(),
        "mask": spec.masks[0].to_string(),
        "backend": args.backend,
        "dtype": args.dtype,
        "backend_type": burn_dcp_tools::backend_type(
        &args.backend,
        args.no_fusion,
        "-p burn-dcp-tools --bin cp_attention",
    )?,
        "seed": args.seed,
        "non_finite_inputs": non_finite,
        "max_rel_err": {
            "out": max_rel_err(&got.out, &reference.out),
            "lse": max_rel_err(&got.lse, &reference.lse),
            "dq": max_rel_err(&got.dq, &reference.dq),
            "dk": max_rel_err(&got.dk, &reference.dk),
            "dv": max_rel_err(&got.dv, &reference.dv),
        },
        "bytes_sent_per_rank": total,
        "bytes_forward_per_rank": report.bytes_forward,
        "bytes_backward_per_rank": report.bytes_backward,
        "analytic_bytes_per_rank": analytic.iter().map(|v| v.forward + v.backward).collect::<Vec<_>>(),
        "topology": args.topology,
        "nodes": args.nodes,
        "bytes_by_link": measured_links,
        "predicted_bytes_by_link": predicted_links,
        "timings_ms": {
            "cp_forward": report.forward_ms,
            "cp_backward": report.backward_ms,
            "reference_forward_backward": reference_ms,
        },
        "emulate_links": emulation.is_some(),
        "link_scale": emulation.map(|e| e.scale),
        "measured_attention_ms": report.attention_ms,
        "predicted_attention_ms": emulation.and_then(|e| e.predicted).map(|(f, b)| f + b),
        "predicted_forward_ms": emulation.and_then(|e| e.predicted).map(|(f, _)| f),
        "predicted_backward_ms": emulation.and_then(|e| e.predicted).map(|(_, b)| b),
        "predicted_link_bytes": emulation.and_then(|e| e.predicted_link_bytes).map(|(intra, inter)| {
            json!({"intra_node": intra, "inter_node": inter})
        }),
    }))
}

fn print_text(summary: &serde_json::Value) {
    println!(
        "{} ({} layout), cp {} [ulysses {} x ring {}], H {} K {} D {}, seqlens {}, mask {}",
        summary["strategy"].as_str().unwrap_or_default(),
        summary["layout"].as_str().unwrap_or_default(),
        summary["cp"],
        summary["ulysses_degree"],
        summary["ring_degree"],
        summary["heads"],
        summary["kv_heads"],
        summary["head_dim"],
        summary["seqlens"],
        summary["mask"].as_str().unwrap_or_default()
    );
    println!("max relative error vs single device:");
    for name in ["out", "lse", "dq", "dk", "dv"] {
        println!(
            "  {name:<4} {:.3e}",
            summary["max_rel_err"][name].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!(
        "bytes sent per rank:     {}",
        summary["bytes_sent_per_rank"]
    );
    println!(
        "analytic bytes per rank: {}",
        summary["analytic_bytes_per_rank"]
    );
    let t = &summary["timings_ms"];
    println!(
        "time: cp forward {:.1} ms, cp backward {:.1} ms, single-device forward+backward {:.1} ms",
        t["cp_forward"].as_f64().unwrap_or(0.0),
        t["cp_backward"].as_f64().unwrap_or(0.0),
        t["reference_forward_backward"].as_f64().unwrap_or(0.0)
    );
    if let Some(scale) = summary["link_scale"].as_f64() {
        println!(
            "emulated links (scale {scale:.0}): attention measured {:.1} ms, predicted {}",
            summary["measured_attention_ms"].as_f64().unwrap_or(0.0),
            match summary["predicted_attention_ms"].as_f64() {
                Some(ms) => format!("{ms:.1} ms"),
                None => "(no plan of this strategy in the cost model)".into(),
            }
        );
    }
}

/// Reads a float tensor as f32 values with its shape.
fn read_float(
    file: &SafeTensors<'_>,
    name: &str,
    path: &Path,
) -> Result<(Vec<f32>, Vec<usize>), String> {
    let view = file.tensor(name).map_err(|e| {
        format!(
            "{}: tensor '{name}' is missing or unreadable ({e})",
            path.display()
        )
    })?;
    let dtype = match view.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        other => {
            return Err(format!(
                "{}: tensor '{name}' has dtype {other:?}; expected f32 (or f16/bf16/f64)",
                path.display()
            ))
        }
    };
    let shape = view.shape().to_vec();
    let data =
        TensorData::from_bytes_vec(view.data().to_vec(), shape.clone(), dtype).convert::<f32>();
    let values = data
        .into_vec::<f32>()
        .map_err(|e| format!("{}: tensor '{name}': {e:?}", path.display()))?;
    Ok((values, shape))
}

fn read_cu_seqlens(file: &SafeTensors<'_>, path: &Path) -> Result<Vec<i64>, String> {
    let view = file.tensor("cu_seqlens").map_err(|e| {
        format!(
            "{}: tensor 'cu_seqlens' is missing or unreadable ({e})",
            path.display()
        )
    })?;
    if view.shape().len() != 1 {
        return Err(format!(
            "{}: cu_seqlens has shape {:?}; expected a vector [S+1]",
            path.display(),
            view.shape()
        ));
    }
    let bytes = view.data();
    match view.dtype() {
        Dtype::I64 => Ok(bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()),
        Dtype::I32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
            .collect()),
        other => Err(format!(
            "{}: cu_seqlens has dtype {other:?}; expected i64 or i32",
            path.display()
        )),
    }
}

fn read_inputs(path: &Path) -> Result<PackedInputs, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a safetensors file: {e}", path.display()))?;
    let (q, q_shape) = read_float(&file, "q", path)?;
    let (k, k_shape) = read_float(&file, "k", path)?;
    let (v, v_shape) = read_float(&file, "v", path)?;
    let (dout, dout_shape) = read_float(&file, "dout", path)?;
    let bad = |reason: String| Err(format!("{}: {reason}", path.display()));
    if q_shape.len() != 3 || k_shape.len() != 3 || v_shape.len() != 3 {
        return bad(format!(
            "q {q_shape:?}, k {k_shape:?}, v {v_shape:?} must be rank 3 [T, heads, dim]"
        ));
    }
    let [t, heads, head_dim] = [q_shape[0], q_shape[1], q_shape[2]];
    if t == 0 || heads == 0 || head_dim == 0 || k_shape[1] == 0 || v_shape[2] == 0 {
        return bad(format!(
            "q {q_shape:?}, k {k_shape:?}, v {v_shape:?}: tokens, heads, kv heads, head dim and value dim must all be at least 1"
        ));
    }
    if k_shape[0] != t || v_shape[0] != t || k_shape[2] != head_dim || v_shape[..2] != k_shape[..2]
    {
        return bad(format!("q {q_shape:?}, k {k_shape:?}, v {v_shape:?} disagree: expected k and v [{t}, K, {head_dim}]"));
    }
    if dout_shape != [t, heads, v_shape[2]] {
        return bad(format!(
            "dout {dout_shape:?} must be {:?}",
            [t, heads, v_shape[2]]
        ));
    }
    let cu_seqlens = read_cu_seqlens(&file, path)?;
    let seq_lens =
        validate_cu_seqlens(&cu_seqlens, t).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(PackedInputs {
        seq_lens,
        heads,
        kv_heads: k_shape[1],
        head_dim,
        value_dim: v_shape[2],
        q,
        k,
        v,
        dout,
    })
}

fn write_outputs(path: &Path, x: &PackedInputs, outputs: &PackedOutputs) -> Result<(), String> {
    let t = x.tokens();
    let bytes = |values: &[f32]| {
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let tensors = [
        ("out", bytes(&outputs.out), vec![t, x.heads, x.value_dim]),
        ("lse", bytes(&outputs.lse), vec![x.heads, t]),
        ("dq", bytes(&outputs.dq), vec![t, x.heads, x.head_dim]),
        ("dk", bytes(&outputs.dk), vec![t, x.kv_heads, x.head_dim]),
        ("dv", bytes(&outputs.dv), vec![t, x.kv_heads, x.value_dim]),
    ];
    let views = tensors
        .iter()
        .map(|(name, data, shape)| {
            Ok((
                name.to_string(),
                TensorView::new(Dtype::F32, shape.clone(), data)?,
            ))
        })
        .collect::<Result<HashMap<_, _>, safetensors::SafeTensorError>>()
        .map_err(|e| format!("cannot build output tensors: {e}"))?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
