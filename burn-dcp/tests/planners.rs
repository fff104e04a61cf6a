//! Plans of every strategy under every mask are checked by the independent validator (each
//! non-empty mask tile computed exactly once, each data block exactly one home), and the DCP
//! planner's guarantees are property-tested over random batches: valid plans, compute and memory
//! balance within the tolerances whenever the blocks make that possible, stage 0 local, every
//! communication stage at most ~1/T of a rank's bytes, and bytes that match the partition's
//! connectivity.

use burn_dcp::planner::cost::evaluate;
use burn_dcp::planner::plan::{DataKind, PlanStats};
use burn_dcp::planner::{
    plan_strategy, validate_plan, AttentionDims, DcpConfig, PlanInput, Topology,
};
use burn_dcp::StrategyKind;
use proptest::prelude::*;

const MASKS: [&str; 7] = [
    "causal",
    "full",
    "sliding:700",
    "lambda:64,1024",
    "blockwise:256,2",
    "shared-question:0.2,4",
    "causal",
];

fn input(
    seq_lens: Vec<usize>,
    mask: &str,
    nodes: usize,
    per_node: usize,
    block: usize,
) -> PlanInput {
    let mut topology = Topology::preset("a100-p4d", nodes).unwrap();
    topology.devices_per_node = per_node;
    PlanInput {
        seq_lens,
        masks: vec![mask.parse().unwrap()],
        dims: AttentionDims {
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            element_bytes: 2,
        },
        topology,
        block,
        dcp: DcpConfig::default(),
        max_seq_len_per_rank: None,
    }
}

#[test]
fn every_strategy_and_mask_gives_a_valid_plan() {
    for mask in MASKS {
        for (nodes, per_node) in [(2, 4), (1, 8)] {
            let input = input(vec![5000, 1200, 37, 3000, 700], mask, nodes, per_node, 256);
            for strategy in StrategyKind::ALL {
                let routed = plan_strategy(strategy, &input)
                    .unwrap_or_else(|e| panic!("{mask} {}: {e}", strategy.plan_name()));
                validate_plan(&routed.plan, &routed.problem)
                    .unwrap_or_else(|e| panic!("{mask} {}: {e}", strategy.plan_name()));
                let report = evaluate(&routed, &input.topology).unwrap();
                assert!(
                    report.attention_fwd_ms > 0.0
                        && report.attention_bwd_ms > report.attention_fwd_ms
                );
                assert!(report.compute_imbalance >= 1.0 && report.memory_imbalance >= 1.0);
                // the plan's stats name its strategy and block size, in Rust and in JSON
                let stats = &routed.plan.stats;
                assert_eq!(stats.strategy(), strategy.plan_name());
                assert_eq!(stats.block(), Some(routed.problem.block));
                let json = serde_json::to_value(stats).unwrap();
                assert_eq!(json["strategy"], strategy.plan_name());
                assert_eq!(json["block"], routed.problem.block);
                let back: PlanStats = serde_json::from_value(json).unwrap();
                assert_eq!(&back, stats);
            }
        }
    }
}

#[test]
fn ulysses_needs_heads_divisible_by_ranks() {
    let input = input(vec![4096], "causal", 2, 8, 512);
    let err = plan_strategy(StrategyKind::Ulysses, &input)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("query heads (8)") && err.contains("16"),
        "{err}"
    );
}

#[test]
fn bad_inputs_are_rejected_with_the_value() {
    let mut bad = input(vec![4096, 0], "causal", 1, 4, 512);
    let err = plan_strategy(StrategyKind::Dcp, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("sequence 1 has length 0"), "{err}");
    bad.seq_lens = vec![4096];
    bad.block = 0;
    let err = plan_strategy(StrategyKind::Dcp, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("block size (0)"), "{err}");
    bad.block = 512;
    bad.dims.kv_heads = 3;
    let err = plan_strategy(StrategyKind::Dcp, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiple of kv heads (3)"), "{err}");
    bad.dims.kv_heads = 2;
    bad.dcp.compute_epsilon = -0.5;
    let err = plan_strategy(StrategyKind::Dcp, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("-0.5"), "{err}");
}

/// DCP beats ring-zigzag on inter-node bytes for a mixed batch on 2 nodes, at the tolerated
/// imbalance.
#[test]
fn dcp_moves_fewer_inter_node_bytes_than_ring() {
    let input = input(
        vec![9000, 3000, 1500, 800, 6000, 2000, 400, 9000],
        "causal",
        2,
        4,
        256,
    );
    let grid_report = |strategy| {
        let routed = plan_strategy(strategy, &input).unwrap();
        evaluate(&routed, &input.topology).unwrap()
    };
    let ring = grid_report(StrategyKind::RING_ZIGZAG);
    let dcp = grid_report(StrategyKind::Dcp);
    assert!(dcp.compute_imbalance <= 1.1 + 1e-9, "{dcp:?}");
    assert!(
        dcp.inter_node_bytes < 0.7 * ring.inter_node_bytes,
        "{dcp:?} vs {ring:?}"
    );
}

fn mask_strategy() -> impl Strategy<Value = &'static str> {
    prop::sample::select(MASKS.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(60))]

    #[test]
    fn dcp_plans_are_valid_balanced_and_staged(
        lens in prop::collection::vec(1usize..6000, 1..12),
        mask in mask_strategy(),
        nodes in 1usize..4,
        per_node in 1usize..5,
        block in prop::sample::select(vec![64usize, 128, 256]),
        stages in 1usize..5,
        seed in 0u64..1000,
    ) {
        let mut input = input(lens, mask, nodes, per_node, block);
        input.dcp.stages = stages;
        input.dcp.seed = seed;
        let routed = plan_strategy(StrategyKind::Dcp, &input).unwrap();
        validate_plan(&routed.plan, &routed.problem).unwrap();
        let problem = &routed.problem;
        let grids = &routed.grids;
        let report = evaluate(&routed, &input.topology).unwrap();
        let ranks = input.topology.ranks();

        // balance: guaranteed when no single tile or data block exceeds the slack
        let sizes = routed.sizes;
        let tile_flops: Vec<f64> = grids
            .iter()
            .flat_map(|g| g.rows.iter().flatten().map(|&(_, p)| p as f64 * sizes.forward_flops_per_pair))
            .collect();
        let total_flops: f64 = tile_flops.iter().sum::<f64>() * problem.head_groups as f64;
        let heaviest = tile_flops.iter().copied().fold(0.0, f64::max);
        // vertices can be squares of tiles: allow the largest square (4 tiles at most here)
        if heaviest * 4.0 * (ranks as f64) < 0.02 * total_flops {
            prop_assert!(report.compute_imbalance <= 1.1 + 1e-9, "{report:?}");
        }

        // stage 0 runs on local data only; later stages need remote data
        let home = |kind: DataKind, seq: usize, head: usize, block: usize| {
            routed.plan.data.iter().find(|d| d.kind == kind && d.seq == seq && d.head == head && d.block == block).unwrap().home_rank
        };
        for b in routed.plan.blocks.iter().filter(|b| b.stage == 0) {
            prop_assert_eq!(home(DataKind::Q, b.seq, b.head, b.q_block), b.rank);
            prop_assert_eq!(home(DataKind::Kv, b.seq, b.head, b.kv_block), b.rank);
        }
        prop_assert!(routed.plan.blocks.iter().all(|b| b.stage <= stages));

        // forward bytes to compute ranks = Σ over q and kv blocks of (remote ranks needing it) ×
        // its size, whatever the routing (one copy per remote rank, forwarded or direct)
        let mut needing: std::collections::HashMap<(bool, usize, usize, usize), std::collections::BTreeSet<usize>> = Default::default();
        for b in &routed.plan.blocks {
            needing.entry((false, b.seq, b.head, b.q_block)).or_default().insert(b.rank);
            needing.entry((true, b.seq, b.head, b.kv_block)).or_default().insert(b.rank);
        }
        let expected: f64 = needing
            .iter()
            .map(|(&(is_kv, seq, head, block), ranks_needing)| {
                let kind = if is_kv { DataKind::Kv } else { DataKind::Q };
                let home_rank = home(kind, seq, head, block);
                let remote = ranks_needing.iter().filter(|&&r| r != home_rank).count() as f64;
                let per_token = if is_kv { sizes.kv } else { sizes.q };
                remote * per_token * problem.block_tokens(seq, block).len() as f64
            })
            .sum();
        let sent: f64 = routed
            .transfers
            .iter()
            .filter(|t| t.pass == burn_dcp::planner::cost::Pass::Forward && t.stage != burn_dcp::planner::cost::POST)
            .map(|t| t.bytes)
            .sum();
        prop_assert!((sent - expected).abs() <= 1e-9 * expected.max(1.0), "sent {} expected {}", sent, expected);
        if ranks == 1 {
            prop_assert_eq!(report.inter_node_bytes + report.intra_node_bytes, 0.0);
        }
        if nodes == 1 {
            prop_assert_eq!(report.inter_node_bytes, 0.0);
        }
    }
}
