//! How a run's CP ranks attend ([`TrainMode`]): one strategy and layout for every micro-batch,
//! DCP's block plans, dynamic CP's groups, or auto's choice per micro-batch — each with its own
//! settings. Flags become a mode at the flag boundary (`flags/mode.rs`); planning matches on it
//! (`planning::plan_step`).
//!
//! In `config.json` a mode keeps the flat fields it has always had (`strategy`, `layout`,
//! `dynamic`, `dcp`, `auto`; [`ModeRecord`]), so saved runs resume; a record that names no mode
//! (auto with a strategy, DCP settings on a ring) is refused when read.

use burn_dcp::{Layout, Strategy, StrategyKind};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::settings::DynamicSettings;
use crate::settings::{AutoSettings, DcpSettings};

/// How a run's CP ranks attend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "ModeRecord", try_from = "ModeRecord")]
pub enum TrainMode {
    /// One strategy (ring, Ulysses, USP or all-gather; never DCP) with one layout on every DP
    /// replica's CP group.
    Static { strategy: Strategy, layout: Layout },
    /// Every micro-batch runs its own DCP block plan for the group's topology.
    Dcp(DcpSettings),
    /// Dynamic CP (`--strategy dynamic`): the `dp × cp` ranks form one pool and every sequence
    /// gets a group per step; `inner` runs inside each group.
    Dynamic {
        settings: DynamicSettings,
        inner: GroupStrategy,
    },
    /// `--strategy auto`: every micro-batch runs the candidate with the lowest estimated
    /// attention time; a DCP candidate plans with `dcp`.
    Auto {
        settings: AutoSettings,
        dcp: DcpSettings,
    },
}

/// What runs inside each of dynamic CP's groups.
#[derive(Clone, Debug, PartialEq)]
pub enum GroupStrategy {
    /// Ring, Ulysses, USP (its Ulysses degree kept, the ring degree following the group's size)
    /// or all-gather, placed by `layout` over the group.
    Static { strategy: Strategy, layout: Layout },
    /// A DCP block plan per group (`--inner-strategy dcp`).
    Dcp(DcpSettings),
}

impl Default for TrainMode {
    /// Ring with the zigzag layout.
    fn default() -> Self {
        Self::Static {
            strategy: Strategy::Ring,
            layout: Layout::Zigzag,
        }
    }
}

impl TrainMode {
    /// The mode as `--strategy` names it: `auto`, `dynamic`, `dcp`, `ring-zigzag` (ring with its
    /// layout), `ulysses`, `usp` or `all-gather`.
    pub fn name(&self) -> String {
        match self {
            Self::Static { strategy, layout } => StrategyKind::of(*strategy, *layout).name().into(),
            Self::Dcp(_) => StrategyKind::Dcp.name().into(),
            Self::Dynamic { .. } => StrategyKind::Dynamic.name().into(),
            Self::Auto { .. } => "auto".into(),
        }
    }

    /// The strategy a CP group runs: the static one, DCP, dynamic CP's inner one, or ring for
    /// auto (what its split is planned as before it chooses).
    pub fn group_strategy(&self) -> Strategy {
        match self {
            Self::Static { strategy, .. }
            | Self::Dynamic {
                inner: GroupStrategy::Static { strategy, .. },
                ..
            } => *strategy,
            Self::Dcp(_)
            | Self::Dynamic {
                inner: GroupStrategy::Dcp(_),
                ..
            } => Strategy::Dcp,
            Self::Auto { .. } => Strategy::Ring,
        }
    }

    /// The layout tokens are placed by before a plan moves them: the static one, dynamic CP's
    /// inner one, or zigzag (DCP's plans and auto's static candidates start from it).
    pub fn layout(&self) -> Layout {
        match self {
            Self::Static { layout, .. }
            | Self::Dynamic {
                inner: GroupStrategy::Static { layout, .. },
                ..
            } => *layout,
            _ => Layout::Zigzag,
        }
    }

    /// DCP's settings where the mode plans blocks (dcp, dynamic with inner dcp, auto).
    pub fn dcp(&self) -> Option<&DcpSettings> {
        match self {
            Self::Dcp(dcp)
            | Self::Dynamic {
                inner: GroupStrategy::Dcp(dcp),
                ..
            }
            | Self::Auto { dcp, .. } => Some(dcp),
            Self::Static { .. }
            | Self::Dynamic {
                inner: GroupStrategy::Static { .. },
                ..
            } => None,
        }
    }

    /// Dynamic CP's scheduler settings (`None` in the other modes).
    pub fn dynamic(&self) -> Option<&DynamicSettings> {
        match self {
            Self::Dynamic { settings, .. } => Some(settings),
            _ => None,
        }
    }

    /// Auto's settings (`None` in the other modes).
    pub fn auto(&self) -> Option<&AutoSettings> {
        match self {
            Self::Auto { settings, .. } => Some(settings),
            _ => None,
        }
    }
}

/// A mode as `config.json` holds it: the flat fields of every earlier run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModeRecord {
    strategy: Strategy,
    layout: Layout,
    #[serde(default)]
    dynamic: Option<DynamicSettings>,
    #[serde(default)]
    dcp: Option<DcpSettings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    auto: Option<AutoSettings>,
}

impl From<TrainMode> for ModeRecord {
    fn from(mode: TrainMode) -> Self {
        let (strategy, layout) = (mode.group_strategy(), mode.layout());
        let dcp = mode.dcp().cloned();
        let (dynamic, auto) = match mode {
            TrainMode::Dynamic { settings, .. } => (Some(settings), None),
            TrainMode::Auto { settings, .. } => (None, Some(settings)),
            TrainMode::Static { .. } | TrainMode::Dcp(_) => (None, None),
        };
        Self {
            strategy,
            layout,
            dynamic,
            dcp,
            auto,
        }
    }
}

impl TryFrom<ModeRecord> for TrainMode {
    type Error = TrainError;

    /// The mode a record names: DCP settings exactly where the mode plans blocks, auto with
    /// nothing but its ring-zigzag split.
    fn try_from(record: ModeRecord) -> Result<Self, TrainError> {
        let ModeRecord {
            strategy,
            layout,
            dynamic,
            dcp,
            auto,
        } = record;
        let inner = |dcp: Option<DcpSettings>| match dcp {
            Some(dcp) => GroupStrategy::Dcp(dcp),
            None => GroupStrategy::Static { strategy, layout },
        };
        let dcp_plans = strategy == Strategy::Dcp;
        match (dynamic, auto, dcp) {
            (None, Some(settings), Some(dcp))
                if strategy == Strategy::Ring && layout == Layout::Zigzag =>
            {
                Ok(Self::Auto { settings, dcp })
            }
            (None, None, Some(dcp)) if dcp_plans => Ok(Self::Dcp(dcp)),
            (None, None, None) if !dcp_plans => Ok(Self::Static { strategy, layout }),
            (Some(settings), None, dcp) if dcp_plans == dcp.is_some() => Ok(Self::Dynamic {
                settings,
                inner: inner(dcp),
            }),
            (dynamic, auto, dcp) => Err(TrainError::Config(format!(
                "strategy {strategy} (layout {layout}) with dynamic settings {dynamic:?}, DCP settings {dcp:?} and auto settings {auto:?} names no mode: strategies dcp and auto need DCP settings and the others none; auto runs its ring-zigzag split and no dynamic CP"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::TrainFlags;
    use crate::settings::CpSizes;

    fn dcp() -> DcpSettings {
        DcpSettings {
            block: 64,
            stages: 2,
        }
    }

    fn dynamic() -> DynamicSettings {
        DynamicSettings {
            max_tokens_per_rank: 128,
            min_cp_size: 1,
            cp_sizes: CpSizes::Pow2,
        }
    }

    #[test]
    fn every_mode_reads_back_as_written() {
        let modes = [
            TrainMode::default(),
            TrainMode::Static {
                strategy: Strategy::Usp {
                    ulysses_degree: 2,
                    ring_degree: 2,
                },
                layout: Layout::Stripe,
            },
            TrainMode::Dcp(dcp()),
            TrainMode::Dynamic {
                settings: dynamic(),
                inner: GroupStrategy::Static {
                    strategy: Strategy::AllGather,
                    layout: Layout::Contiguous,
                },
            },
            TrainMode::Dynamic {
                settings: dynamic(),
                inner: GroupStrategy::Dcp(dcp()),
            },
            TrainMode::Auto {
                settings: AutoSettings {
                    candidates: StrategyKind::ALL.to_vec(),
                },
                dcp: dcp(),
            },
        ];
        for mode in modes {
            let json = serde_json::to_string(&mode).unwrap();
            let read: TrainMode = serde_json::from_str(&json).unwrap();
            assert_eq!(read, mode, "{json}");
        }
    }

    /// The flat fields of a saved run (dynamic CP with DCP inside its groups) read as their mode.
    #[test]
    fn a_saved_runs_flat_fields_name_their_mode() {
        let json = r#"{"strategy":"dcp","layout":"zigzag","dynamic":{"max_tokens_per_rank":128,"min_cp_size":1,"cp_sizes":"pow2"},"dcp":{"block":64,"stages":2}}"#;
        let mode: TrainMode = serde_json::from_str(json).unwrap();
        assert_eq!(
            mode,
            TrainMode::Dynamic {
                settings: dynamic(),
                inner: GroupStrategy::Dcp(dcp()),
            }
        );
        assert_eq!(mode.name(), "dynamic");
        assert_eq!(mode.group_strategy(), Strategy::Dcp);
    }

    #[test]
    fn fields_that_name_no_mode_are_refused() {
        for json in [
            // auto with another strategy than its ring-zigzag split
            r#"{"strategy":"ulysses","layout":"zigzag","auto":{"candidates":["dcp"]},"dcp":{"block":64,"stages":2}}"#,
            // dcp without its settings
            r#"{"strategy":"dcp","layout":"zigzag"}"#,
            // DCP settings on a ring
            r#"{"strategy":"ring","layout":"zigzag","dcp":{"block":64,"stages":2}}"#,
        ] {
            let err = serde_json::from_str::<TrainMode>(json)
                .unwrap_err()
                .to_string();
            assert!(err.contains("names no mode"), "{json}: {err}");
        }
    }

    /// DCP homes every token by its plan: a layout beside it is refused, not ignored.
    #[test]
    fn a_layout_beside_dcp_is_refused() {
        for inner in [None, Some("dcp")] {
            let flags = TrainFlags {
                strategy: Some(if inner.is_some() { "dynamic" } else { "dcp" }.into()),
                inner_strategy: inner.map(Into::into),
                layout: Some("stripe".into()),
                ..TrainFlags::default()
            };
            let err = flags.config().unwrap_err().to_string();
            assert!(
                err.contains("--layout stripe does not apply to")
                    && err.contains("DCP places every token where its block plan homes it"),
                "{err}"
            );
        }
    }
}
