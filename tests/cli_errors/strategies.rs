//! The strategies' flags on gpt_longctx: dynamic CP groups running DCP plans exactly, the dynamic
//! and auto flags checked with the rule, and auto's choices equal to plan_sim's.

use super::*;

/// DCP inside dynamic CP's groups (`--inner-strategy dcp`): each group's sequences run a DCP
/// block plan on the group's ranks, and the losses are cp 1's.
#[test]
fn dynamic_cp_groups_run_dcp_plans_exactly() {
    let losses = |extra: &[&str]| -> Vec<f64> {
        let args = gpt(&[&["--steps", "2", "--json"][..], extra].concat());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let summary: serde_json::Value =
            serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
        summary["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect()
    };
    let reference = losses(&["--cp", "1"]);
    let dynamic = losses(&words(
        "--cp 4 --nodes 2 --strategy dynamic --inner-strategy dcp --block 16 \
        --max-tokens-per-rank 32",
    ));
    assert_eq!(dynamic.len(), reference.len());
    for (got, want) in dynamic.iter().zip(&reference) {
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{dynamic:?} vs {reference:?}"
        );
    }
}

#[test]
fn gpt_longctx_dynamic_flags_are_checked() {
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            (
                "--inner-strategy ring",
                "--inner-strategy only applies to --strategy dynamic",
            ),
            (
                "--cp-sizes pow2",
                "--cp-sizes only applies to --strategy dynamic",
            ),
            (
                "--strategy dynamic --cp-sizes odd",
                "unknown --cp-sizes 'odd'",
            ),
            (
                "--strategy dynamic --cp 2 --max-tokens-per-rank 16",
                "does not fit the pool",
            ),
            (
                "--strategy dynamic --cp 8 --inner-strategy ulysses",
                "dynamic CP may use groups of 8 ranks",
            ),
            (
                "--strategy dynamic --plan-ahead 0",
                "--plan-ahead 0 must be between 1",
            ),
        ],
    );
    let args = gpt(&words(
        "--steps 2 --cp 4 --strategy dynamic --max-tokens-per-rank 16 --json",
    ));
    let out = succeeded(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["cp_group_sizes"]["4"], 4, "{summary}");
    assert!(summary["plan_wait_ms"].as_f64().is_some(), "{summary}");
}

#[test]
fn gpt_longctx_auto_flags_are_checked() {
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            (
                "--auto-candidates dcp",
                "--auto-candidates only applies to --strategy auto",
            ),
            (
                "--strategy auto --auto-candidates dcp,ring",
                "unknown auto candidate 'ring'",
            ),
            (
                "--strategy auto --layout stripe",
                "--layout stripe is not supported with it",
            ),
            (
                "--strategy auto --ulysses-degree 2",
                "--ulysses-degree 2 does not apply to --strategy auto",
            ),
            (
                "--strategy auto --auto-candidates ulysses --cp 3",
                "--auto-candidates ulysses alone cannot run on cp 3",
            ),
            (
                "--strategy ring --block 16",
                "only applies to --strategy dcp or auto",
            ),
        ],
    );
    refused_each(
        "plan_sim",
        &[],
        &[
            (
                "--lengths 100 --auto-candidates dcp",
                "--auto-candidates only applies with auto in --strategies",
            ),
            (
                "--lengths 100 --strategies auto --auto-candidates usp,bogus",
                "unknown auto candidate 'bogus'",
            ),
            (
                "--lengths 100,200 --masks causal",
                "--masks gives 1 masks for 2 sequences",
            ),
            (
                "--lengths 100 --masks causal --mask full",
                "cannot be used with",
            ),
        ],
    );
}

/// `gpt_longctx --strategy auto` records each micro-batch's choice in metrics.jsonl, counts them
/// in `strategy_counts`, and `plan_sim --strategies auto` makes the same choice, with the same
/// estimates, for the same batch.
#[test]
fn gpt_longctx_auto_choices_match_plan_sim() {
    let out = temp_dir("auto");
    let out_text = out.display().to_string();
    let args = [
        "--corpus",
        "default",
        "--seq-len",
        "1024",
        "--micro-batches",
        "2",
        "--steps",
        "2",
        "--cp",
        "4",
        "--nodes",
        "2",
        "--strategy",
        "auto",
        "--mask",
        "mixed",
        "--out",
        &out_text,
        "--json",
    ];
    let report: serde_json::Value = serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    let counts = report["strategy_counts"].as_object().unwrap();
    assert_eq!(
        counts.values().map(|c| c.as_u64().unwrap()).sum::<u64>(),
        4,
        "{report}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut checked = 0;
    for line in metrics.lines() {
        let step: serde_json::Value = serde_json::from_str(line).unwrap();
        for choice in step["auto_choices"].as_array().unwrap() {
            let lengths: Vec<String> = choice["seq_lens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.to_string())
                .collect();
            let lengths = lengths.join(",");
            let masks: Vec<&str> = choice["masks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_str().unwrap())
                .collect();
            let masks = masks.join(";");
            let sim = [
                "--lengths",
                &lengths,
                "--masks",
                &masks,
                // The default GPT: 4 query heads of dim 16, 2 kv heads (moved unrepeated).
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--element-bytes",
                "4",
                "--topology",
                "a100-p4d",
                "--nodes",
                "2",
                "--devices-per-node",
                "2",
                "--block",
                "128",
                "--stages",
                "4",
                "--seed",
                "0",
                "--strategies",
                "auto",
                "--json",
            ];
            let sim: serde_json::Value =
                serde_json::from_str(&succeeded("plan_sim", &sim)).unwrap();
            let auto = &sim["auto"];
            assert_eq!(auto["choice"], choice["strategy"], "{sim} vs {choice}");
            for estimate in auto["estimates"].as_array().unwrap() {
                let name = estimate["strategy"].as_str().unwrap();
                assert_eq!(
                    estimate["estimated_ms"], choice["estimated_ms"][name],
                    "{name}: {sim} vs {choice}"
                );
            }
            checked += 1;
        }
        let counted: u64 = step["strategy_counts"]
            .as_object()
            .unwrap()
            .values()
            .map(|c| c.as_u64().unwrap())
            .sum();
        assert_eq!(counted, 2, "{line}");
    }
    assert_eq!(checked, 4);
    let _ = std::fs::remove_dir_all(&out);
}
