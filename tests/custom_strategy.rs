//! A strategy defined in a test, outside burn-dcp (`custom_strategy/fused_gather.rs`), runs,
//! plans and counts its bytes through the same trait as the built-in ones, with no registry line:
//! [`run_context_parallel_of`] runs it on in-process ranks (the same checks, agreement and
//! failure handling as every strategy), [`plan_with`] plans it for the cost model.

use crate::common;
#[path = "custom_strategy/fused_gather.rs"]
mod fused_gather;

use burn_dcp::comm::OpKind;
use burn_dcp::diagnostics::harness::{run_context_parallel, run_context_parallel_of};
use burn_dcp::planner::cost::evaluate;
use burn_dcp::planner::{plan_strategy, AttentionDims, DcpConfig, PlanInput, Topology};
use burn_dcp::strategy::{plan_with, AttentionStrategy};
use burn_dcp::{Layout, Placement, Strategy, StrategyKind};
use common::*;
use fused_gather::FusedAllGather;

#[test]
fn a_strategy_defined_in_a_test_runs_exactly_with_its_own_collectives() {
    let device = Default::default();
    let mut seed = 40;
    for (seq_lens, cp) in [(&[13usize, 3, 1, 6][..], 4), (&[16, 8][..], 2)] {
        for (heads, kv_heads) in [(4, 4), (4, 2)] {
            for mask in masks() {
                seed += 1;
                let inputs = random_inputs(seq_lens, heads, kv_heads, 8, seed);
                for layout in layouts() {
                    let spec = spec(cp, Strategy::AllGather, layout, &mask);
                    let what = format!("cp {cp} H{heads} K{kv_heads} {seq_lens:?} {mask} {layout}");
                    let builtin = run_context_parallel::<B>(&device, &inputs, &spec).unwrap();
                    let fused =
                        run_context_parallel_of::<B, _>(&device, &inputs, &spec, &FusedAllGather)
                            .unwrap();
                    // the same kernel calls on the same gathered data: the same values
                    assert_close(&fused.outputs, &builtin.outputs, &what);
                    // the same bytes, half the collectives
                    assert_eq!(fused.bytes_forward, builtin.bytes_forward, "{what}");
                    assert_eq!(fused.bytes_backward, builtin.bytes_backward, "{what}");
                    let gathers = |stats: &[burn_dcp::comm::CommStats]| -> u64 {
                        stats.iter().map(|s| s.messages).sum()
                    };
                    if cp > 1 {
                        assert!(
                            gathers(&fused.stats) < gathers(&builtin.stats),
                            "{what}: {} messages vs the built-in's {}",
                            gathers(&fused.stats),
                            gathers(&builtin.stats)
                        );
                    }
                    // its closed-form bytes are what it sends
                    let placement = Placement::of_layout(seq_lens, cp, layout).unwrap();
                    let shape = f32_volume_shape(heads, kv_heads, 8);
                    let volume = FusedAllGather.volume(&placement, &shape);
                    for (rank, v) in volume.iter().enumerate() {
                        let sent = |stats: &burn_dcp::comm::CommStats| -> u64 {
                            [OpKind::AllGather, OpKind::ReduceScatter]
                                .iter()
                                .filter_map(|op| stats.bytes_by_op.get(op))
                                .sum()
                        };
                        assert_eq!(
                            v.forward + v.backward,
                            sent(&fused.stats[rank]),
                            "{what} rank {rank}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_strategy_defined_in_a_test_is_refused_like_a_builtin_one() {
    let device = Default::default();
    let inputs = random_inputs(&[9, 4], 4, 2, 8, 7);
    // a negative softmax scale: the checks every strategy shares refuse it on every rank
    let mut spec = spec(
        4,
        Strategy::AllGather,
        Layout::Zigzag,
        &"causal".parse().unwrap(),
    );
    spec.scale = Some(-1.0);
    let err = run_context_parallel_of::<B, _>(&device, &inputs, &spec, &FusedAllGather)
        .unwrap_err()
        .to_string();
    let builtin = run_context_parallel::<B>(&device, &inputs, &spec)
        .unwrap_err()
        .to_string();
    // every rank fails on the shared rule, as with the built-in strategy
    for report in [&err, &builtin] {
        assert!(
            report.contains("returned an error: invalid value: softmax scale -1 must be"),
            "{report}"
        );
        assert!(report.contains("failed because of it"), "{report}");
    }
}

#[test]
fn a_strategy_defined_in_a_test_plans_through_the_trait() {
    let mut topology = Topology::preset("a100-p4d", 2).unwrap();
    topology.devices_per_node = 4;
    let input = PlanInput {
        seq_lens: vec![5000, 1200, 37, 3000],
        masks: vec!["causal".parse().unwrap()],
        dims: AttentionDims {
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            element_bytes: 2,
        },
        topology,
        block: 256,
        dcp: DcpConfig::default(),
        max_seq_len_per_rank: None,
    };
    let routed = plan_with(&FusedAllGather, &input).unwrap();
    assert_eq!(routed.name, "fused-all-gather");
    let fused = evaluate(&routed, &input.topology).unwrap();
    let builtin = plan_strategy(StrategyKind::AllGather, &input).unwrap();
    let builtin = evaluate(&builtin, &input.topology).unwrap();
    assert_eq!(fused.inter_node_bytes, builtin.inter_node_bytes);
    assert_eq!(fused.intra_node_bytes, builtin.intra_node_bytes);
    assert_eq!(fused.attention_fwd_ms, builtin.attention_fwd_ms);
    // the input is checked before the strategy plans
    let mut bad = input.clone();
    bad.block = 0;
    assert!(plan_with(&FusedAllGather, &bad).is_err());
}
