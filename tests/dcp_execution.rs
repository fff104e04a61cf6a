//! DCP block plans executed: every mask, GQA, ragged lengths, sequences shorter than a block,
//! 2 to 16 ranks, one node and several: forward and backward equal the single-device reference,
//! and every rank sends exactly the bytes the plan predicts.

use crate::common;

use std::sync::Arc;

use burn_dcp::diagnostics::harness::{run_context_parallel, run_single_device};
use burn_dcp::kernels::MaskSpec;
use burn_dcp::planner::cost::{AttentionDims, Pass, RoutedPlan};
use burn_dcp::planner::dcp::{dcp_execution_plan, dcp_plan, DcpConfig};
use burn_dcp::planner::plan::{tile_grids, BlockProblem, ComputeBlock, Plan, PlanStats, TileGrid};
use burn_dcp::planner::topology::Topology;
use burn_dcp::strategy::block_plan::{BlockSchedule, Instruction};
use burn_dcp::{CpBatch, CpError, Layout, Strategy};
use common::{assert_close, masks, random_inputs, spec, B};

/// What a DCP plan of `seq_lens` under `mask` with `units` head units is made from: the problem
/// (blocks of `block` tokens), the attention dims `heads` (query heads, kv heads, head dim), the
/// topology of `cp` ranks over `nodes` nodes and the planner's settings (`stages`).
struct Setup {
    problem: BlockProblem,
    dims: AttentionDims,
    topology: Topology,
    config: DcpConfig,
}

impl Setup {
    fn new(
        seq_lens: &[usize],
        mask: &MaskSpec,
        heads: (usize, usize, usize),
        (cp, nodes): (usize, usize),
        (block, stages, units): (usize, usize, usize),
    ) -> Self {
        Self {
            problem: BlockProblem {
                seq_lens: seq_lens.to_vec(),
                masks: vec![mask.clone()],
                head_groups: units,
                block,
            },
            dims: AttentionDims {
                heads: heads.0,
                kv_heads: heads.1,
                head_dim: heads.2,
                element_bytes: 4,
            },
            topology: topology(cp, nodes),
            config: DcpConfig {
                stages,
                ..DcpConfig::default()
            },
        }
    }

    /// The plan made by `planner`, executable.
    fn schedule(&self, planner: Planner) -> BlockSchedule {
        let grids = tile_grids(&self.problem);
        let routed = planner(
            &self.problem,
            grids,
            &self.dims,
            &self.topology,
            &self.config,
        );
        BlockSchedule::new(&routed.unwrap().plan, &self.problem, &self.topology).unwrap()
    }
}

/// A DCP planner's signature (`dcp_plan`, `dcp_execution_plan`).
type Planner = fn(
    &BlockProblem,
    Vec<TileGrid>,
    &AttentionDims,
    &Topology,
    &DcpConfig,
) -> Result<RoutedPlan, CpError>;

/// `cp` ranks over `nodes` nodes of the a100-p4d preset.
fn topology(cp: usize, nodes: usize) -> Topology {
    Topology {
        devices_per_node: cp / nodes,
        ..Topology::a100_p4d(nodes)
    }
}

/// The executable DCP schedule of `seq_lens` under `mask` on `cp` ranks over `nodes` nodes.
fn schedule(
    seq_lens: &[usize],
    mask: &MaskSpec,
    heads: (usize, usize, usize),
    cp: usize,
    nodes: usize,
    block: usize,
    stages: usize,
) -> BlockSchedule {
    Setup::new(seq_lens, mask, heads, (cp, nodes), (block, stages, 1)).schedule(dcp_plan)
}

fn check(seq_lens: &[usize], mask: &MaskSpec, cp: usize, nodes: usize, block: usize, seed: u64) {
    let plan = schedule(seq_lens, mask, (4, 2, 8), cp, nodes, block, 3);
    check_schedule(plan, seq_lens, mask, (4, 2, 8), nodes, seed);
}

/// Runs `plan` forward and backward on `heads` (query heads, kv heads, head dim): equal to the
/// single-device reference, and every rank sends the bytes the plan predicts (in all and by
/// link class).
fn check_schedule(
    plan: BlockSchedule,
    seq_lens: &[usize],
    mask: &MaskSpec,
    (heads, kv_heads, dim): (usize, usize, usize),
    nodes: usize,
    seed: u64,
) {
    let (cp, block, units) = (plan.ranks, plan.block, plan.units);
    let inputs = random_inputs(seq_lens, heads, kv_heads, dim, seed);
    let predicted = plan.predicted_volume(heads, kv_heads, dim).unwrap();
    let predicted_links = plan.predicted_links(heads, kv_heads, dim).unwrap();
    let mut run = spec(cp, Strategy::Dcp, Layout::Contiguous, mask);
    run.blocks = Some(Arc::new(plan));
    run.nodes = nodes;
    let what = format!(
        "dcp cp {cp} nodes {nodes} block {block} {mask} {seq_lens:?} heads {heads}/{kv_heads} units {units}"
    );
    let report = run_context_parallel::<B>(&Default::default(), &inputs, &run)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let reference = run_single_device::<B>(&Default::default(), &inputs, &run.masks, None).unwrap();
    assert_close(&report.outputs, &reference, &what);
    let forward: Vec<u64> = predicted.iter().map(|v| v.forward).collect();
    let backward: Vec<u64> = predicted.iter().map(|v| v.backward).collect();
    assert_eq!(
        report.bytes_forward, forward,
        "{what}: forward bytes per rank"
    );
    assert_eq!(
        report.bytes_backward, backward,
        "{what}: backward bytes per rank"
    );
    let measured_links: Vec<_> = report.stats.iter().map(|s| s.bytes_by_link).collect();
    assert_eq!(
        measured_links, predicted_links,
        "{what}: bytes per link class"
    );
    if nodes > 1 {
        assert!(predicted_links.iter().any(|l| l.inter_node > 0), "{what}");
    }
    eprintln!("{what}: forward bytes {forward:?}, backward {backward:?}");
    assert!(
        forward.iter().sum::<u64>() > 0,
        "{what}: the plan moves nothing, so the test would not exercise the executor"
    );
}

#[test]
fn dcp_plans_are_exact_and_send_what_they_predict() {
    for (i, mask) in masks().iter().enumerate() {
        check(&[37, 5, 64, 2], mask, 4, 1, 8, i as u64);
    }
}

#[test]
fn dcp_across_nodes_relays_inside_each_node() {
    let causal = MaskSpec::Causal;
    // Two and four nodes: copies to a remote node go once, then over that node's links.
    check(&[200, 90, 3], &causal, 8, 2, 16, 1);
    check(&[150, 61], &"lambda:4,16".parse().unwrap(), 8, 4, 8, 2);
    check(
        &[96, 40, 7],
        &"shared-question:0.2,4".parse().unwrap(),
        4,
        2,
        8,
        3,
    );
}

#[test]
fn dcp_on_2_to_16_ranks() {
    for (cp, nodes) in [(2, 1), (3, 1), (6, 2), (16, 2)] {
        check(
            &[130, 17, 1, 66],
            &MaskSpec::Causal,
            cp,
            nodes,
            8,
            cp as u64,
        );
    }
}

#[test]
fn programs_move_each_block_once_per_destination() {
    let plan = schedule(&[200, 90], &MaskSpec::Causal, (4, 2, 8), 8, 2, 16, 3);
    let placement = plan.placement();
    assert_eq!(placement.total_tokens(), 290);
    for rank in 0..8 {
        let program = plan.program(rank, Pass::Forward);
        let mut received = std::collections::HashSet::new();
        for instruction in program {
            if let Instruction::Receive { side, block, .. } = instruction {
                assert!(
                    received.insert((*side, *block)),
                    "rank {rank} receives {side:?} {block:?} twice"
                );
            }
        }
        // A printable program: one line per instruction.
        let text: Vec<String> = program.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), program.len());
    }
}

/// Ranks that run different block plans fail at once, before any block moves, naming the rank
/// and the field; a plan for other sequences is refused with the rule.
#[test]
fn ranks_with_different_plans_fail_at_once() {
    let lens = [90, 40];
    let plan = |stages| schedule(&lens, &MaskSpec::Causal, (4, 2, 8), 4, 1, 8, stages);
    let (common, odd) = (plan(3), plan(1));
    assert_ne!(common.fingerprint(), odd.fingerprint());
    let inputs = random_inputs(&lens, 4, 2, 8, 9);
    let (common_plan, odd_plan) = (Arc::new(common), Arc::new(odd));
    let started = std::time::Instant::now();
    let results = forward_on_4_ranks(&inputs, |rank| {
        let schedule = if rank == 1 { &odd_plan } else { &common_plan };
        CpBatch::from_blocks(schedule.clone(), vec![MaskSpec::Causal])
    });
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    for (rank, result) in results.iter().enumerate() {
        let error = result.as_ref().unwrap_err().to_string();
        assert!(
            error.contains("disagree") && error.contains("rank 1"),
            "rank {rank}: {error}"
        );
    }
    // A batch whose placement is not the plan's.
    let placement = burn_dcp::Placement::of_layout(&lens, 4, Layout::Zigzag).unwrap();
    let mut batch = CpBatch::new(placement, vec![MaskSpec::Causal]);
    batch.blocks = Some(common_plan);
    let results = forward_on_4_ranks(&inputs, |_| batch.clone());
    for result in &results {
        let error = result.as_ref().unwrap_err().to_string();
        assert!(error.contains("places the tokens differently"), "{error}");
    }
}

/// Forward of `inputs` (4 heads, 2 kv heads, dim 8) on 4 ranks, rank `r` with `batch_of(r)`.
fn forward_on_4_ranks(
    inputs: &burn_dcp::diagnostics::harness::PackedInputs,
    batch_of: impl Fn(usize) -> CpBatch + Sync,
) -> Vec<Result<(), burn_dcp::comm::RankFailure>> {
    use burn_dcp::comm::{InProcessWorld, WorldConfig};
    use burn_dcp::{cp_attention_forward, CpGroup};
    let world = InProcessWorld::new(4, WorldConfig::default()).unwrap();
    world.run(|comm| -> Result<(), burn_dcp::CpError> {
        let batch = batch_of(comm.rank());
        let indices = batch.placement.packed_indices(comm.rank());
        let q = common::token_rows::<B>(&inputs.q, 4, 8, &indices);
        let k = common::token_rows::<B>(&inputs.k, 2, 8, &indices);
        let v = common::token_rows::<B>(&inputs.v, 2, 8, &indices);
        let group = CpGroup::new(comm, Strategy::Dcp)?;
        cp_attention_forward(&group, &batch, q, k, v).map(|_| ())
    })
}

/// The executable DCP plan with `units` head units (the planner weighing unit moves).
fn unit_schedule(
    seq_lens: &[usize],
    mask: &MaskSpec,
    heads: (usize, usize, usize),
    (cp, nodes): (usize, usize),
    block: usize,
    units: usize,
) -> BlockSchedule {
    Setup::new(seq_lens, mask, heads, (cp, nodes), (block, 3, units)).schedule(dcp_execution_plan)
}

/// A valid plan placed at random: every head unit's data block on a random home, every tile on
/// a random rank and stage (so units of one token block live and compute apart).
fn random_plan(problem: &BlockProblem, ranks: usize, seed: u64) -> Plan {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut below = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut plan = Plan::new(
        ranks,
        PlanStats::Other(serde_json::json!({"strategy": "random"})),
    );
    for seq in 0..problem.seq_lens.len() {
        for head in 0..problem.head_groups {
            for block in 0..problem.blocks_of(seq) {
                plan.home_token_block(seq, head, block, below(ranks));
            }
            for (q_block, row) in problem.nonempty_tiles(seq).iter().enumerate() {
                for &kv_block in row {
                    plan.blocks.push(ComputeBlock {
                        seq,
                        head,
                        q_block,
                        kv_block,
                        rank: below(ranks),
                        stage: below(3),
                    });
                }
            }
        }
    }
    plan
}

/// Instructions of `kind` over every rank's forward program.
fn count(plan: &BlockSchedule, kind: fn(&Instruction) -> bool) -> usize {
    (0..plan.ranks)
        .map(|rank| {
            plan.program(rank, Pass::Forward)
                .iter()
                .filter(|i| kind(i))
                .count()
        })
        .sum()
}

/// Head units placed by the plan: units of one token block homed and computed on different
/// ranks, moved from and back to the token's home; exact, and the bytes are the plan's.
#[test]
fn head_unit_plans_are_exact_and_send_what_they_predict() {
    // Units = kv heads, more units than kv heads (units share a kv head), fewer.
    type Case = (
        &'static [usize],
        &'static str,
        (usize, usize, usize),
        usize,
        (usize, usize),
    );
    let cases: [Case; 3] = [
        (&[61, 20, 5], "causal", (4, 2, 8), 2, (4, 1)),
        (&[70, 33], "lambda:4,16", (8, 2, 4), 4, (4, 2)),
        (&[50, 9, 30], "shared-question:0.2,4", (4, 4, 8), 2, (8, 2)),
    ];
    for (i, (lens, mask, heads, units, (cp, nodes))) in cases.into_iter().enumerate() {
        let mask: MaskSpec = mask.parse().unwrap();
        let problem = BlockProblem {
            seq_lens: lens.to_vec(),
            masks: vec![mask.clone()],
            head_groups: units,
            block: 8,
        };
        let topology = topology(cp, nodes);
        let random = random_plan(&problem, cp, i as u64 + 1);
        let plan = BlockSchedule::new(&random, &problem, &topology).unwrap();
        assert_eq!(plan.units, units);
        let moves = count(&plan, |i| matches!(i, Instruction::SendUnit { .. }));
        let unit_attends = count(
            &plan,
            |i| matches!(i, Instruction::Attend { unit, .. } if *unit > 0),
        );
        assert!(
            moves > 0 && unit_attends > 0,
            "case {i}: {moves} moves, {unit_attends} attends"
        );
        check_schedule(plan, lens, &mask, heads, nodes, 10 + i as u64);
        let planned = unit_schedule(lens, &mask, heads, (cp, nodes), 8, units);
        check_schedule(planned, lens, &mask, heads, nodes, 20 + i as u64);
    }
    // Every mask with two head units, DCP-planned.
    for (i, mask) in masks().iter().enumerate() {
        let plan = unit_schedule(&[37, 5, 64, 2], mask, (4, 2, 8), (4, 1), 8, 2);
        check_schedule(plan, &[37, 5, 64, 2], mask, (4, 2, 8), 1, i as u64);
    }
}

/// A plan's head units must fit the heads it runs on: named, not a panic.
#[test]
fn head_units_that_do_not_fit_the_heads_are_refused() {
    let lens = [40, 24];
    let plan = unit_schedule(&lens, &MaskSpec::Causal, (4, 2, 8), (4, 1), 8, 4);
    let inputs = random_inputs(&lens, 6, 2, 8, 3);
    let mut run = spec(4, Strategy::Dcp, Layout::Contiguous, &MaskSpec::Causal);
    run.blocks = Some(Arc::new(plan));
    let error = match run_context_parallel::<B>(&Default::default(), &inputs, &run) {
        Ok(_) => panic!("4 head units over 6 query heads ran"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("4 head units") && error.contains("6 query heads"),
        "{error}"
    );
}

/// DCP in bf16 (the LSE and every accumulator f32; the partial outputs and gradients a rank
/// sends travel in bf16): within TransformerEngine's bf16 CP tolerance of the single device in
/// bf16 (atol = rtol = 2.5e-2), over one node and two.
#[test]
fn dcp_in_bf16_matches_the_single_device_in_bf16() {
    use burn::tensor::DType;
    use burn_dcp::diagnostics::harness::run_single_device_in;
    use common::assert_allclose;
    let seq_lens = [40, 9, 23];
    for (index, mask) in masks().into_iter().enumerate() {
        for (cp, nodes) in [(4, 1), (4, 2)] {
            let plan = schedule(&seq_lens, &mask, (4, 2, 8), cp, nodes, 8, 3);
            let inputs = random_inputs(&seq_lens, 4, 2, 8, 600 + index as u64);
            let mut run = spec(cp, Strategy::Dcp, Layout::Contiguous, &mask);
            run.blocks = Some(Arc::new(plan));
            run.nodes = nodes;
            run.dtype = DType::BF16;
            let what = format!("bf16 dcp cp {cp} nodes {nodes} {mask}");
            let report = run_context_parallel::<B>(&Default::default(), &inputs, &run)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let single = run_single_device_in::<B>(
                &Default::default(),
                &inputs,
                &run.masks,
                None,
                run.dtype,
            )
            .unwrap();
            assert_allclose(&report.outputs, &single, 2.5e-2, &what);
        }
    }
}
