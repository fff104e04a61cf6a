//! `--strategy dcp`: the DCP planner's plan of the inputs, its executable schedule, and
//! `--explain`'s listing of every rank's instructions.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Strategy dcp: the inputs' block plan for the topology (the schedule the ranks run, and the
/// routed plan the cost model predicts from); other strategies refuse DCP's flags.
pub(crate) fn block_plan(
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

/// The DCP plan of the inputs on `topology`, for execution with `--head-units` (default 1: a
/// token's heads stay together).
pub(crate) fn dcp_routed_plan(
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
pub(crate) fn explain(schedule: &BlockSchedule) -> String {
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
