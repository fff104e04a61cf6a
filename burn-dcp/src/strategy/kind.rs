//! A strategy by name: the one table of strategy names, read and written here only. The CLI's
//! `--strategy`, the planner (`plan_sim --strategies`, the plan format's `stats.strategy`),
//! `auto`'s candidates and `strategy_counts`, the engine's metrics and checkpoints all name a
//! strategy through [`StrategyKind`].
//!
//! Two spellings differ on purpose, each where a peer defined it: the plan format (
//! `plan_sim --strategies …,megatron-dynamic,…` and its JSON) calls dynamic CP
//! `megatron-dynamic` ([`StrategyKind::plan_name`]); training and `auto` call it `dynamic`
//! ([`StrategyKind::name`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::batch::layout::Layout;
use crate::error::CpError;
use crate::strategy::Strategy;

/// What a CP strategy is, by name: the static strategies (ring with its layout, which its name
/// carries: `ring-zigzag`), Megatron-style dynamic CP and DCP's block plans.
///
/// A static strategy runs on a fixed group with a [`Strategy`] and a [`Layout`]
/// ([`StrategyKind::strategy`] builds it, [`StrategyKind::of`] names one); only ring's name
/// carries the layout (`ulysses` may run zigzag or contiguous under the same name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StrategyKind {
    /// Ring attention over a layout: `ring-zigzag`, `ring-contiguous`, `ring-stripe`.
    Ring(Layout),
    /// `ulysses`: all-to-all between sequence and head shards.
    Ulysses,
    /// `usp`: Ulysses inside groups, ring across them.
    Usp,
    /// `all-gather`: every rank gathers the keys and values.
    AllGather,
    /// `dynamic` (`megatron-dynamic` in the plan format): Megatron-style dynamic CP, group sizes
    /// chosen per micro-batch.
    Dynamic,
    /// `dcp`: a DCP block plan.
    Dcp,
}

impl StrategyKind {
    /// Ring in the zigzag layout, the ring the planner plans and `auto` may choose.
    pub const RING_ZIGZAG: Self = Self::Ring(Layout::Zigzag);

    /// The strategies the planner plans and `auto` chooses among, in auto's tie-break order (ring
    /// in the zigzag layout only: the block planner places ring's tokens zigzag).
    pub const ALL: [Self; 6] = [
        Self::RING_ZIGZAG,
        Self::Ulysses,
        Self::Usp,
        Self::AllGather,
        Self::Dynamic,
        Self::Dcp,
    ];

    /// The static strategies, one per family (ring's layout given apart).
    const STATIC: [Self; 5] = [
        Self::RING_ZIGZAG,
        Self::Ulysses,
        Self::Usp,
        Self::AllGather,
        Self::Dcp,
    ];

    /// Every name [`FromStr`] reads, ring in each layout.
    const NAMED: [Self; 8] = [
        Self::Ring(Layout::Contiguous),
        Self::RING_ZIGZAG,
        Self::Ring(Layout::Stripe),
        Self::Ulysses,
        Self::Usp,
        Self::AllGather,
        Self::Dynamic,
        Self::Dcp,
    ];

    /// The name training, `auto` and the CLI use: `ring-zigzag`, `ring-contiguous`,
    /// `ring-stripe`, `ulysses`, `usp`, `all-gather`, `dynamic`, `dcp`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ring(Layout::Contiguous) => "ring-contiguous",
            Self::Ring(Layout::Zigzag) => "ring-zigzag",
            Self::Ring(Layout::Stripe) => "ring-stripe",
            Self::Ulysses => "ulysses",
            Self::Usp => "usp",
            Self::AllGather => "all-gather",
            Self::Dynamic => "dynamic",
            Self::Dcp => "dcp",
        }
    }

    /// The [`name`](Self::name)s of `kinds`, comma-separated, in their order
    /// (`"ring-zigzag, ulysses"`): how messages list a set of kinds.
    pub fn names(kinds: &[Self]) -> String {
        join(kinds, Self::name)
    }

    /// Whether `auto` may choose it: one of [`ALL`](Self::ALL) (ring only in the zigzag layout).
    pub fn is_candidate(self) -> bool {
        Self::ALL.contains(&self)
    }

    /// The error for a kind `auto` cannot choose: [`from_candidate_name`](Self::from_candidate_name)'s
    /// for its name.
    pub(crate) fn not_a_candidate(self) -> CpError {
        unknown("auto candidate", self.name(), &Self::ALL, Self::name)
    }

    /// The name in the plan format (`stats.strategy`) and `plan_sim --strategies`: as
    /// [`name`](Self::name), but dynamic CP is `megatron-dynamic`.
    pub fn plan_name(self) -> &'static str {
        match self {
            Self::Dynamic => "megatron-dynamic",
            other => other.name(),
        }
    }

    /// The name without a layout: `ring` for every ring, else [`name`](Self::name).
    pub fn family(self) -> &'static str {
        match self {
            Self::Ring(_) => "ring",
            other => other.name(),
        }
    }

    /// The layout the name carries (ring's); `None` for the others.
    pub fn layout(self) -> Option<Layout> {
        match self {
            Self::Ring(layout) => Some(layout),
            _ => None,
        }
    }

    /// The kind of a static strategy run with `layout`.
    pub fn of(strategy: Strategy, layout: Layout) -> Self {
        match strategy {
            Strategy::Ring => Self::Ring(layout),
            Strategy::Ulysses => Self::Ulysses,
            Strategy::Usp { .. } => Self::Usp,
            Strategy::AllGather => Self::AllGather,
            Strategy::Dcp => Self::Dcp,
        }
    }

    /// The static strategy of this kind on a CP group of `cp` ranks. `usp` needs
    /// `ulysses_degree` (its ring degree is `cp / ulysses_degree`); the others reject one, so a
    /// degree is never silently ignored. Dynamic CP is no static strategy: an error.
    pub fn strategy(self, ulysses_degree: Option<usize>, cp: usize) -> Result<Strategy, CpError> {
        let name = self.family();
        let strategy = match (self, ulysses_degree) {
            (Self::Dynamic, _) => {
                return Err(CpError::Config(
                    "dynamic CP is no static strategy: it chooses group sizes per micro-batch, each group running a static one".into(),
                ))
            }
            (Self::Usp, Some(0)) => {
                return Err(CpError::Config(
                    "the ulysses degree must be at least 1, got 0".into(),
                ))
            }
            (Self::Usp, Some(ulysses_degree)) => {
                if !cp.is_multiple_of(ulysses_degree) {
                    return Err(CpError::Config(format!(
                        "cp size {cp} is not divisible by ulysses degree {ulysses_degree}"
                    )));
                }
                Strategy::Usp {
                    ulysses_degree,
                    ring_degree: cp / ulysses_degree,
                }
            }
            (Self::Usp, None) => {
                return Err(CpError::Config(
                    "strategy usp needs the ulysses degree (ulysses_degree × ring_degree = cp); none was given".into(),
                ))
            }
            (_, Some(degree)) => {
                return Err(CpError::Config(format!(
                    "a ulysses degree ({degree}) only applies to strategy usp, not {name}"
                )))
            }
            (Self::Ring(_), None) => Strategy::Ring,
            (Self::Ulysses, None) => Strategy::Ulysses,
            (Self::AllGather, None) => Strategy::AllGather,
            (Self::Dcp, None) => Strategy::Dcp,
        };
        strategy.validate_mesh(cp)?;
        Ok(strategy)
    }

    /// Reads a static strategy's [`family`](Self::family) name (`ring`, not `ring-zigzag`: the
    /// layout is given apart), as [`Strategy::parse`] does.
    pub fn from_static_name(text: &str) -> Result<Self, CpError> {
        read("strategy", text, &Self::STATIC, Self::family)
    }

    /// Reads a plan-format name ([`plan_name`](Self::plan_name)) of one of [`ALL`](Self::ALL).
    pub fn from_plan_name(text: &str) -> Result<Self, CpError> {
        read("strategy", text, &Self::ALL, Self::plan_name)
    }

    /// Reads one of `auto`'s candidates: a [`name`](Self::name) of one of [`ALL`](Self::ALL).
    pub fn from_candidate_name(text: &str) -> Result<Self, CpError> {
        read("auto candidate", text, &Self::ALL, Self::name)
    }
}

/// The one of `kinds` whose `name` is `text`, or an error listing their names.
fn read(
    what: &str,
    text: &str,
    kinds: &[StrategyKind],
    name: fn(StrategyKind) -> &'static str,
) -> Result<StrategyKind, CpError> {
    kinds
        .iter()
        .copied()
        .find(|kind| name(*kind) == text)
        .ok_or_else(|| unknown(what, text, kinds, name))
}

/// "unknown `what` '`text`': expected one of" `kinds`' names.
fn unknown(
    what: &str,
    text: &str,
    kinds: &[StrategyKind],
    name: fn(StrategyKind) -> &'static str,
) -> CpError {
    CpError::Config(format!(
        "unknown {what} '{text}': expected one of {}",
        join(kinds, name)
    ))
}

/// `kinds`' names by `name`, comma-separated.
fn join(kinds: &[StrategyKind], name: fn(StrategyKind) -> &'static str) -> String {
    let names: Vec<&str> = kinds.iter().map(|kind| name(*kind)).collect();
    names.join(", ")
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads a [`name`](StrategyKind::name); `ring-…` with an unknown layout is the layout's error.
impl FromStr for StrategyKind {
    type Err = CpError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(layout) = text.strip_prefix("ring-") {
            return Ok(Self::Ring(layout.parse()?));
        }
        read("strategy", text, &Self::NAMED, Self::name)
    }
}

/// As its [`name`](StrategyKind::name) (a JSON string).
impl Serialize for StrategyKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for StrategyKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_and_only_dynamic_has_two() {
        for kind in StrategyKind::NAMED {
            assert_eq!(kind.name().parse::<StrategyKind>().unwrap(), kind);
            assert_eq!(kind.to_string(), kind.name());
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<StrategyKind>(&json).unwrap(), kind);
            assert_eq!(
                kind.plan_name() != kind.name(),
                kind == StrategyKind::Dynamic
            );
        }
        for kind in StrategyKind::ALL {
            assert_eq!(
                StrategyKind::from_plan_name(kind.plan_name()).unwrap(),
                kind
            );
            assert_eq!(
                StrategyKind::from_candidate_name(kind.name()).unwrap(),
                kind
            );
        }
        assert_eq!(
            StrategyKind::from_plan_name("megatron-dynamic").unwrap(),
            StrategyKind::Dynamic
        );
    }

    #[test]
    fn unknown_names_list_what_is_known() {
        let err = "ring-diagonal"
            .parse::<StrategyKind>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown layout 'diagonal'"), "{err}");
        let err = "a2a".parse::<StrategyKind>().unwrap_err().to_string();
        assert!(
            err.contains("unknown strategy 'a2a': expected one of ring-contiguous, ring-zigzag, ring-stripe, ulysses, usp, all-gather, dynamic, dcp"),
            "{err}"
        );
        let err = StrategyKind::from_candidate_name("ring-stripe")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown auto candidate 'ring-stripe': expected one of ring-zigzag, ulysses, usp, all-gather, dynamic, dcp"),
            "{err}"
        );
        assert!(
            err.ends_with(&StrategyKind::names(&StrategyKind::ALL)),
            "{err}"
        );
        let err = StrategyKind::from_plan_name("dynamic")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "expected one of ring-zigzag, ulysses, usp, all-gather, megatron-dynamic, dcp"
            ),
            "{err}"
        );
    }

    #[test]
    fn static_kinds_build_their_strategy_and_name_it_back() {
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Stripe] {
            for kind in StrategyKind::NAMED {
                let degree = (kind == StrategyKind::Usp).then_some(2);
                match kind.strategy(degree, 4) {
                    Ok(strategy) => {
                        let named = StrategyKind::of(strategy, kind.layout().unwrap_or(layout));
                        assert_eq!(named, kind);
                    }
                    Err(e) => {
                        assert_eq!(kind, StrategyKind::Dynamic, "{e}");
                    }
                }
            }
        }
        let err = StrategyKind::Ulysses.strategy(Some(2), 4).unwrap_err();
        assert!(err
            .to_string()
            .contains("only applies to strategy usp, not ulysses"));
        let err = StrategyKind::Usp.strategy(Some(3), 4).unwrap_err();
        assert!(err
            .to_string()
            .contains("not divisible by ulysses degree 3"));
    }
}
