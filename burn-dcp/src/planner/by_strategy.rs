//! The plan of a strategy named by its kind or given by value: a static strategy's
//! [`AttentionStrategy::plan`] through the registry, or dynamic CP's schedule of ring groups.

use crate::batch::layout::Layout;
use crate::error::CpError;
use crate::planner::cost::RoutedPlan;
use crate::planner::strategies::{megatron_dynamic, usp_ulysses_degree, PlanInput};
use crate::strategy::registry::{with_strategy, WithStrategy};
use crate::strategy::usp::Usp;
use crate::strategy::{plan_with, AttentionStrategy, Strategy, StrategyKind};

/// Plans `strategy` (one of [`StrategyKind::ALL`]) for `input`: a static strategy's
/// [`AttentionStrategy::plan`] (USP with [`usp_ulysses_degree`]), or the dynamic CP schedule, whose
/// groups each run ring-zigzag.
pub fn plan_strategy(
    strategy: impl Into<StrategyKind>,
    input: &PlanInput,
) -> Result<RoutedPlan, CpError> {
    input.validate()?;
    let kind = strategy.into();
    let ulysses_degree = match kind {
        StrategyKind::Ring(layout) if layout != Layout::Zigzag => {
            return Err(CpError::Config(format!(
                "the planner places ring's tokens zigzag: it has no plan of ring-{layout}"
            )))
        }
        StrategyKind::Dynamic => return megatron_dynamic(input),
        StrategyKind::Usp => Some(usp_ulysses_degree(input)?),
        _ => None,
    };
    let strategy = kind.strategy(ulysses_degree, input.topology.ranks())?;
    with_strategy(strategy, Planned(input))
}

/// The cost model's plan of a static strategy as the executor runs it: ring and all-gather with
/// the zigzag layout, Ulysses, USP of its Ulysses degree. `None` for what it has no plan of: ring
/// or all-gather with another layout, and dcp (whose executed plan is its own).
pub fn executed_plan(
    strategy: Strategy,
    layout: Layout,
    input: &PlanInput,
) -> Result<Option<RoutedPlan>, CpError> {
    match (strategy, layout) {
        (Strategy::Dcp, _) => Ok(None),
        (Strategy::Ring | Strategy::AllGather, layout) if layout != Layout::Zigzag => Ok(None),
        _ => {
            input.validate()?;
            with_strategy(strategy, Planned(input)).map(Some)
        }
    }
}

/// USP with a given Ulysses degree (Ulysses inside groups of `ulysses_degree` consecutive ranks,
/// a ring of `ranks / ulysses_degree` across them), as `--strategy usp --ulysses-degree` runs it.
pub fn plan_usp(input: &PlanInput, ulysses_degree: usize) -> Result<RoutedPlan, CpError> {
    let usp = Usp {
        ulysses_degree,
        ring_degree: input
            .topology
            .ranks()
            .checked_div(ulysses_degree)
            .unwrap_or(0),
    };
    plan_with(&usp, input)
}

/// A strategy's [`AttentionStrategy::plan`] through the registry.
struct Planned<'a>(&'a PlanInput);

impl WithStrategy for Planned<'_> {
    type Output = Result<RoutedPlan, CpError>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        strategy.plan(self.0)
    }
}
