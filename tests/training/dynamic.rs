//! Dynamic CP pools, DCP block plans and `--strategy auto` in training: every step equals cp 1,
//! and auto refuses a kind that is no candidate (also on resuming with other candidates).

use super::*;

/// Dynamic CP over pools of 2, 4 and 8 ranks on the default corpus: every step's loss and every
/// parameter's gradient equal cp 1 on the same data, with groups of several sizes in use.
#[test]
fn dynamic_cp_pools_match_cp1_on_the_default_corpus() {
    use burn_dcp_suite::train::{plan_step, CpSizes, DynamicSettings};
    let (base, step) = mixed_lengths_step();
    let flex = burn::backend::flex::FlexDevice;
    let reference = step_on::<burn::backend::Flex>(&base, step, &flex);
    let mut mixed = false;
    let usp = Strategy::Usp {
        ulysses_degree: 2,
        ring_degree: 1,
    };
    for (cp, dp, budget, sizes, inner, min) in [
        (2, 1, 512, CpSizes::Pow2, Strategy::Ring, 1),
        (2, 2, 512, CpSizes::Pow2, Strategy::AllGather, 1),
        (4, 1, 512, CpSizes::Pow2, Strategy::Ulysses, 1),
        (8, 1, 200, CpSizes::Any, Strategy::Ring, 1),
        (4, 2, 256, CpSizes::Pow2, usp, 2),
    ] {
        let mut dynamic = base.clone();
        (dynamic.cp, dynamic.dp) = (cp, dp);
        dynamic.mode = TrainMode::Static {
            strategy: inner,
            layout: Layout::Zigzag,
        };
        with_dynamic(
            &mut dynamic,
            DynamicSettings {
                max_tokens_per_rank: budget,
                min_cp_size: min,
                cp_sizes: sizes,
            },
        );
        let data = TrainData::load(&dynamic).unwrap();
        let plan = plan_step(&dynamic, &data, step).unwrap();
        let mut used: Vec<usize> = plan.batches.iter().map(|b| b.ranks.len()).collect();
        used.sort_unstable();
        used.dedup();
        let got = step_on::<burn::backend::Flex>(&dynamic, step, &flex);
        let what = format!(
            "dynamic pool {} ({inner} inside, budget {budget}, sizes {used:?})",
            cp * dp
        );
        mixed |= used.len() > 1;
        eprintln!("{what}: loss {} vs {}", got.0, reference.0);
        assert_same_step(&got, &reference, &what);
    }
    assert!(mixed, "no configuration used groups of different sizes");
}

/// DCP block plans per micro-batch (cp 4, also over two virtual nodes, and cp 2 × dp 2): the loss
/// and every parameter's gradient equal cp 1 on the same data, with the tokens where each plan
/// homes them.
#[test]
fn dcp_plans_match_cp1_in_training() {
    use burn_dcp_suite::train::DcpSettings;
    let flex = burn::backend::flex::FlexDevice;
    for mask in ["causal", "mixed"] {
        let reference = one_step(&config(1, 1, Strategy::Ring, Layout::Zigzag, mask));
        for (cp, dp, nodes, block) in [(4, 1, 1, 16), (4, 1, 2, 32), (2, 2, 1, 8)] {
            let mut dcp = config(cp, dp, Strategy::Dcp, Layout::Zigzag, mask);
            dcp.mode = TrainMode::Dcp(DcpSettings { block, stages: 3 });
            dcp.nodes = nodes;
            let got = step_on::<burn::backend::Flex>(&dcp, 1, &flex);
            let what = format!("dcp cp {cp} dp {dp} nodes {nodes} block {block} mask {mask}");
            assert!(got.2 > 0, "{what}: nothing was communicated");
            assert_same_step(&got, &reference, &what);
        }
    }
}

/// Auto's candidates are `StrategyKind::ALL`: a config (say, a hand-edited config.json) naming a
/// ring in another layout is refused with the candidates, not run or ignored.
#[test]
fn auto_refuses_a_kind_that_is_no_candidate() {
    use burn_dcp::StrategyKind;
    use burn_dcp_suite::train::{AutoSettings, DcpSettings};
    let mut config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    config.mode = TrainMode::Auto {
        settings: AutoSettings {
            candidates: vec![StrategyKind::Dcp, StrategyKind::Ring(Layout::Stripe)],
        },
        dcp: DcpSettings {
            block: 64,
            stages: 2,
        },
    };
    let err = config.validate().unwrap_err().to_string();
    assert!(
        err.contains("strategy auto cannot run ring-stripe: its candidates are ring-zigzag, ulysses, usp, all-gather, dynamic, dcp"),
        "{err}"
    );
    let json = serde_json::to_value(config.mode.auto()).unwrap();
    assert_eq!(
        json["candidates"],
        serde_json::json!(["dcp", "ring-stripe"])
    );
}

/// Resuming an auto run with other candidates names both sets by their names.
#[test]
fn resuming_auto_with_other_candidates_names_both() {
    use burn_dcp_suite::train::TrainFlags;
    let flags = |candidates: &str| TrainFlags {
        strategy: Some("auto".into()),
        auto_candidates: Some(candidates.into()),
        ..TrainFlags::default()
    };
    let saved = flags("ring-zigzag,ulysses").config().unwrap();
    let dir = std::env::temp_dir().join(format!("bdcp-auto-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&saved).unwrap(),
    )
    .unwrap();
    let err = flags("dcp").resume(&dir).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        err.contains(
            "the auto settings candidates dcp differ from the resumed run's candidates ring-zigzag, ulysses"
        ),
        "{err}"
    );
}

/// `--strategy auto`: each candidate, forced alone, runs on every micro-batch and gives the loss
/// and gradients of cp 1 (on a step of the default corpus with long and short sequences, so
/// dynamic CP splits the replica into groups, and over two virtual nodes, so USP is a real 2 × 2
/// mesh and DCP crosses nodes); with every candidate, the recorded winner has the lowest estimate
/// and the step still equals cp 1.
#[test]
fn auto_runs_each_candidate_it_can_choose_exactly() {
    use burn_dcp::StrategyKind;
    use burn_dcp_suite::train::{plan_step, AutoSettings, DcpSettings};
    let mut base = config(1, 1, Strategy::Ring, Layout::Zigzag, "mixed");
    base.corpus = "default".into();
    base.seq_len = 1024;
    let data = TrainData::load(&base).unwrap();
    let step = step_with_short_and_long(&data, base.micro_batches, 600);
    let flex = burn::backend::flex::FlexDevice;
    let reference = step_on::<burn::backend::Flex>(&base, step, &flex);
    let auto = |cp: usize, dp: usize, nodes: usize, candidates: Vec<StrategyKind>| {
        let mut config = base.clone();
        (config.cp, config.dp, config.nodes) = (cp, dp, nodes);
        config.mode = TrainMode::Auto {
            settings: AutoSettings { candidates },
            dcp: DcpSettings {
                block: 64,
                stages: 2,
            },
        };
        config.validate().unwrap();
        config
    };
    for candidate in StrategyKind::ALL {
        let config = auto(4, 1, 2, vec![candidate]);
        let plan = plan_step(&config, &data, step).unwrap();
        assert_eq!(plan.strategies, vec![candidate.name(); 2]);
        assert_eq!(plan.auto_choices.len(), 2);
        let strategies: Vec<Strategy> = plan.batches.iter().map(|b| b.strategy).collect();
        match candidate {
            StrategyKind::Usp => assert!(strategies.iter().all(|s| *s
                == Strategy::Usp {
                    ulysses_degree: 2,
                    ring_degree: 2
                })),
            StrategyKind::Dynamic => assert!(
                plan.batches.len() > 2 && plan.batches.iter().any(|b| b.ranks.len() < 4),
                "dynamic did not split the replica: {:?}",
                plan.batches
            ),
            StrategyKind::Dcp => assert!(plan.batches.iter().all(|b| b.blocks.is_some())),
            _ => {}
        }
        let got = step_on::<burn::backend::Flex>(&config, step, &flex);
        assert_same_step(&got, &reference, &format!("auto with only {candidate}"));
    }
    for (cp, dp, nodes) in [(4, 1, 1), (2, 2, 2)] {
        let config = auto(cp, dp, nodes, StrategyKind::ALL.to_vec());
        let plan = plan_step(&config, &data, step).unwrap();
        assert_eq!(plan.auto_choices.len(), 2);
        for choice in &plan.auto_choices {
            let best = choice
                .estimated_ms
                .values()
                .copied()
                .fold(f64::INFINITY, f64::min);
            assert_eq!(choice.estimated_ms[&choice.strategy], best);
        }
        let got = step_on::<burn::backend::Flex>(&config, step, &flex);
        assert_same_step(
            &got,
            &reference,
            &format!("auto cp {cp} dp {dp} nodes {nodes}"),
        );
    }
}
