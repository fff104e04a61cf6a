//! `--strategy auto`: per micro-batch, plan every executable strategy, estimate its attention
//! time (forward + backward) with the cost model, and pick the fastest.
//!
//! The candidates, in tie-break order (an equal estimate goes to the earlier one):
//!
//! | candidate     | plan ([`crate::planner::strategies`])   | what runs                                  |
//! |---------------|-----------------------------------------|--------------------------------------------|
//! | `ring-zigzag` | ring-zigzag                             | ring, zigzag layout                        |
//! | `ulysses`     | ulysses (skipped: heads % ranks ≠ 0)    | Ulysses, zigzag layout                     |
//! | `usp`         | usp, Ulysses degree from the node       | USP (that degree × ranks / degree), zigzag |
//! | `all-gather`  | all-gather                              | all-gather KV, zigzag layout               |
//! | `dynamic`     | megatron-dynamic                        | its schedule: ring-zigzag groups, in turn  |
//! | `dcp`         | DCP with one head unit                  | the same plan, executed                    |
//!
//! DCP is planned with one head unit (a token's heads stay together), which is the plan the DCP
//! executor runs; `plan_sim --strategies dcp` plans one unit per kv head instead, so its `dcp`
//! row may differ a little from the `dcp` estimate here.
//!
//! The choice is pure: the same [`PlanInput`] gives the same choice on every rank, in training
//! and in `plan_sim --strategies auto`. It compares attention only (the token-linear layers cost
//! the same under every placement up to DCP's memory imbalance), with the cost model's limits
//! (`planner/cost.rs`: no congestion; on GPUs, no kernel overheads).

use serde::Serialize;

use crate::error::CpError;
use crate::planner::by_strategy::plan_strategy;
use crate::planner::cost::{evaluate, RoutedPlan, StrategyReport};
use crate::planner::dcp::dcp_execution_plan;
use crate::planner::plan::{tile_grids, validate_plan};
use crate::planner::strategies::PlanInput;
use crate::strategy::StrategyKind;

/// Plans candidate `kind` (one of [`StrategyKind::ALL`]) for `input` as it runs: DCP's
/// executable plan, the others' [`plan_strategy`].
pub fn plan_candidate(kind: StrategyKind, input: &PlanInput) -> Result<RoutedPlan, CpError> {
    match kind {
        StrategyKind::Dcp => executable_dcp_plan(input),
        other => plan_strategy(other, input),
    }
}

/// The DCP plan the executor runs: one head unit (every head of a token block together), planned
/// for `input`'s topology, block and DCP settings.
pub fn executable_dcp_plan(input: &PlanInput) -> Result<RoutedPlan, CpError> {
    executable_dcp_plan_with_head_units(input, 1)
}

/// The DCP plan of `input` as the executor runs it with `units` head units (each unit: an equal
/// share of the query heads and the kv heads they read; `units` divides the query heads and
/// divides or is a multiple of the kv heads): units of one token block may compute and live on
/// different ranks; each token block stays on its token home for the model's other layers
/// ([`crate::planner::plan::token_homes`]) and the moves of its units are in the plan's
/// transfers. See [`crate::planner::dcp::dcp_execution_plan`].
pub fn executable_dcp_plan_with_head_units(
    input: &PlanInput,
    units: usize,
) -> Result<RoutedPlan, CpError> {
    input.validate()?;
    let problem = input.problem(units);
    let grids = tile_grids(&problem);
    dcp_execution_plan(&problem, grids, &input.dims, &input.topology, &input.dcp)
}

/// One candidate's estimate, or why it cannot run this batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AutoEstimate {
    pub strategy: &'static str,
    /// Estimated attention time, forward + backward (ms); `None` when skipped.
    pub estimated_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report: Option<StrategyReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The choice for one batch: the winner, its plan, and every candidate's estimate.
#[derive(Clone, Debug)]
pub struct AutoChoice {
    pub winner: StrategyKind,
    /// The winner's plan (what it runs: DCP executes it; the others follow the same rules).
    pub plan: RoutedPlan,
    /// Every candidate considered, in [`StrategyKind::ALL`] order.
    pub estimates: Vec<AutoEstimate>,
}

impl AutoChoice {
    /// The winner's estimated attention time (ms).
    pub fn estimated_ms(&self) -> f64 {
        self.estimates
            .iter()
            .find(|e| e.strategy == self.winner.name())
            .and_then(|e| e.estimated_ms)
            .unwrap_or(f64::NAN)
    }
}

/// Parses a comma-separated candidate list (`--auto-candidates`): at least one, each known.
pub fn parse_candidates(text: &str) -> Result<Vec<StrategyKind>, CpError> {
    let candidates = text
        .split(',')
        .map(|name| StrategyKind::from_candidate_name(name.trim()))
        .collect::<Result<Vec<StrategyKind>, _>>()?;
    if candidates.is_empty() {
        return Err(CpError::Config("auto needs at least one candidate".into()));
    }
    Ok(candidates)
}

/// Plans every candidate of `candidates` (all: [`StrategyKind::ALL`]) for `input` and picks the
/// lowest estimated attention time (forward + backward); ties go to the candidate earlier in
/// [`StrategyKind::ALL`], whatever the order given. A candidate that cannot plan the batch
/// (Ulysses with heads not divisible by the ranks, …) is skipped with its reason; an invalid
/// input, no candidate, or a kind that is no candidate (ring in another layout) is an error.
pub fn choose_strategy(
    input: &PlanInput,
    candidates: &[StrategyKind],
) -> Result<AutoChoice, CpError> {
    input.validate()?;
    if candidates.is_empty() {
        return Err(CpError::Config("auto needs at least one candidate".into()));
    }
    if let Some(other) = candidates.iter().find(|c| !c.is_candidate()) {
        return Err(other.not_a_candidate());
    }
    let mut best: Option<(StrategyKind, f64, RoutedPlan)> = None;
    let mut estimates = Vec::with_capacity(StrategyKind::ALL.len());
    for candidate in StrategyKind::ALL
        .into_iter()
        .filter(|c| candidates.contains(c))
    {
        let estimate = plan_candidate(candidate, input).and_then(|routed| {
            validate_plan(&routed.plan, &routed.problem)
                .map_err(|e| CpError::Config(format!("{candidate}: invalid plan: {e}")))?;
            let report = evaluate(&routed, &input.topology)?;
            Ok((routed, report))
        });
        match estimate {
            Ok((routed, report)) => {
                let ms = report.attention_fwd_ms + report.attention_bwd_ms;
                estimates.push(AutoEstimate {
                    strategy: candidate.name(),
                    estimated_ms: Some(ms),
                    report: Some(report),
                    error: None,
                });
                if best.as_ref().is_none_or(|(_, best_ms, _)| ms < *best_ms) {
                    best = Some((candidate, ms, routed));
                }
            }
            Err(error) => estimates.push(AutoEstimate {
                strategy: candidate.name(),
                estimated_ms: None,
                report: None,
                error: Some(error.to_string()),
            }),
        }
    }
    let (winner, _, plan) = best.ok_or_else(|| {
        let reasons: Vec<String> = estimates
            .iter()
            .map(|e| format!("{}: {}", e.strategy, e.error.as_deref().unwrap_or("")))
            .collect();
        CpError::Config(format!(
            "auto: no strategy can run this batch ({})",
            reasons.join("; ")
        ))
    })?;
    Ok(AutoChoice {
        winner,
        plan,
        estimates,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::cost::AttentionDims;
    use crate::planner::dcp::DcpConfig;
    use crate::planner::topology::Topology;
    use burn_dcp_kernels::MaskSpec;

    fn input(seq_lens: Vec<usize>, mask: MaskSpec, nodes: usize, heads: usize) -> PlanInput {
        PlanInput {
            seq_lens,
            masks: vec![mask],
            dims: AttentionDims {
                heads,
                kv_heads: 2,
                head_dim: 128,
                element_bytes: 2,
            },
            topology: Topology::preset("a100-p4d", nodes).unwrap(),
            block: 512,
            dcp: DcpConfig::default(),
            max_seq_len_per_rank: None,
        }
    }

    #[test]
    fn the_winner_has_the_lowest_estimate_and_every_candidate_is_reported() {
        let input = input(vec![30_000, 8_000, 1_200, 900], MaskSpec::Causal, 2, 8);
        let choice = choose_strategy(&input, &StrategyKind::ALL).unwrap();
        let names: Vec<_> = choice.estimates.iter().map(|e| e.strategy).collect();
        assert_eq!(
            names,
            [
                "ring-zigzag",
                "ulysses",
                "usp",
                "all-gather",
                "dynamic",
                "dcp"
            ]
        );
        let best = choice
            .estimates
            .iter()
            .filter_map(|e| e.estimated_ms)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(choice.estimated_ms(), best);
        assert_eq!(choice.plan.plan.ranks, 16);
        // Ulysses over 16 ranks with 8 heads cannot run: skipped with the reason.
        let ulysses = &choice.estimates[1];
        assert!(ulysses.estimated_ms.is_none());
        assert!(ulysses.error.as_deref().unwrap().contains("multiple of 16"));
        // The same input gives the same choice.
        assert_eq!(
            choose_strategy(&input, &StrategyKind::ALL).unwrap().winner,
            choice.winner
        );
    }

    #[test]
    fn sparse_masks_across_nodes_choose_dcp_and_one_rank_chooses_ring() {
        let lambda = MaskSpec::Lambda {
            sink: 64,
            window: 4096,
        };
        let choice = choose_strategy(
            &input(vec![65_536, 32_768], lambda, 4, 8),
            &StrategyKind::ALL,
        )
        .unwrap();
        assert_eq!(choice.winner, StrategyKind::Dcp);
        let mut single = input(vec![4096, 2048], MaskSpec::Causal, 1, 8);
        single.topology.devices_per_node = 1;
        // One rank: nothing moves, every candidate estimates the same compute; ties go first.
        assert_eq!(
            choose_strategy(&single, &StrategyKind::ALL).unwrap().winner,
            StrategyKind::RING_ZIGZAG
        );
    }

    #[test]
    fn all_gather_moves_every_kv_to_every_rank_and_back_as_gradients() {
        let input = input(vec![8192], MaskSpec::Causal, 1, 8);
        let routed = plan_strategy(StrategyKind::AllGather, &input).unwrap();
        validate_plan(&routed.plan, &routed.problem).unwrap();
        let ranks = input.topology.ranks() as f64;
        // kv bytes of the whole sequence: 2 kv heads × 128 × 2 bytes × 2 (K and V) per token
        let kv = 8192.0 * 2.0 * 128.0 * 2.0 * 2.0;
        let total: f64 = routed.transfers.iter().map(|t| t.bytes).sum();
        // forward gather + backward gather + reduce-scatter: each (R − 1) / R of everything, R times
        assert!((total - 3.0 * kv * (ranks - 1.0)).abs() < 1e-6 * total);
    }

    #[test]
    fn invalid_inputs_are_errors_not_skips() {
        let mut bad = input(vec![1024], MaskSpec::Causal, 1, 8);
        bad.block = 0;
        assert!(choose_strategy(&bad, &StrategyKind::ALL).is_err());
        let good = input(vec![1024], MaskSpec::Causal, 1, 8);
        assert!(choose_strategy(&good, &[]).is_err());
        let only = choose_strategy(&good, &[StrategyKind::Dcp, StrategyKind::AllGather]).unwrap();
        let names: Vec<_> = only.estimates.iter().map(|e| e.strategy).collect();
        assert_eq!(names, ["all-gather", "dcp"]);
        assert!(StrategyKind::from_candidate_name("ring").is_err());
        let stripe = StrategyKind::Ring(crate::batch::layout::Layout::Stripe);
        let err = choose_strategy(&good, &[stripe]).unwrap_err().to_string();
        assert!(
            err.contains("unknown auto candidate 'ring-stripe'"),
            "{err}"
        );
        assert!(parse_candidates("dcp,,ulysses").is_err());
        assert_eq!(
            parse_candidates("dcp,ulysses").unwrap(),
            [StrategyKind::Dcp, StrategyKind::Ulysses]
        );
        assert_eq!(
            StrategyKind::from_candidate_name("dynamic").unwrap(),
            StrategyKind::Dynamic
        );
    }
}
