//! The mode the flags name (`--strategy` with its layout and settings) as a [`TrainMode`].

use burn_dcp::{Layout, Strategy, StrategyKind};

use super::TrainFlags;
use crate::config::{AutoSettings, DcpSettings, GroupStrategy, TrainMode};
use crate::error::TrainError;
use crate::settings::{CpSizes, DynamicSettings};

/// The mode the flags name: `--strategy` with its layout and settings (`--strategy dynamic`'s
/// `--inner-strategy`, DCP's `--block`/`--stages`, auto's `--auto-candidates`); the flags of
/// another mode are an error.
pub(super) fn mode_from_args(
    args: &TrainFlags,
    cp: usize,
    seq_len: usize,
) -> Result<TrainMode, TrainError> {
    let auto = auto_settings(args)?;
    if let Some((inner, settings)) = dynamic_settings(args, cp, seq_len)? {
        let inner = match dcp_settings(args, inner)? {
            Some(dcp) => {
                no_layout(args, "--inner-strategy dcp")?;
                GroupStrategy::Dcp(dcp)
            }
            None => GroupStrategy::Static {
                strategy: inner,
                layout: layout_flag(args)?,
            },
        };
        return Ok(TrainMode::Dynamic { settings, inner });
    }
    let (strategy, layout) = strategy_and_layout(args, cp)?;
    let dcp = dcp_settings(args, strategy)?;
    Ok(match (auto, dcp) {
        (Some(settings), Some(dcp)) => TrainMode::Auto { settings, dcp },
        (None, Some(dcp)) => {
            no_layout(args, "--strategy dcp")?;
            TrainMode::Dcp(dcp)
        }
        _ => TrainMode::Static { strategy, layout },
    })
}

/// Strategy and layout from the flags (`ring-zigzag` is ring with the zigzag layout).
fn strategy_and_layout(args: &TrainFlags, cp: usize) -> Result<(Strategy, Layout), TrainError> {
    let name = args.strategy.as_deref().unwrap_or("ring");
    if name == "auto" {
        // Auto's static candidates run zigzag, the layout its cost model plans them with.
        if let Some(layout) = args.layout.as_deref().filter(|l| *l != "zigzag") {
            return Err(TrainError::Config(format!(
                "--strategy auto places its static candidates zigzag (as its cost model plans them); --layout {layout} is not supported with it"
            )));
        }
        if let Some(degree) = args.ulysses_degree {
            return Err(TrainError::Config(format!(
                "--ulysses-degree {degree} does not apply to --strategy auto: its usp candidate takes the largest degree that fits a node and the heads"
            )));
        }
        return Ok((Strategy::Ring, Layout::Zigzag));
    }
    // `ring` takes its layout from --layout; `ring-zigzag` names it (then --layout must agree).
    let kind = match name {
        "ring" => None,
        other => Some(other.parse::<StrategyKind>().map_err(|e| match other {
            // A ring's layout: the layout's own error.
            ring if ring.starts_with("ring-") => TrainError::from(e),
            _ => TrainError::Config(format!("{e} (or ring, auto)")),
        })?),
    };
    let implied_layout = kind.and_then(StrategyKind::layout);
    let layout = match (&args.layout, implied_layout) {
        (Some(given), Some(implied)) if given.parse::<Layout>()? != implied => {
            return Err(TrainError::Config(format!(
                "--strategy {} implies the {implied} layout but --layout is {given}",
                args.strategy.as_deref().unwrap_or_default()
            )))
        }
        (Some(given), _) => given
            .parse()
            .map_err(|e: burn_dcp::CpError| TrainError::from(e))?,
        (None, Some(implied)) => implied,
        (None, None) => Layout::Zigzag,
    };
    let strategy = kind
        .unwrap_or(StrategyKind::Ring(layout))
        .strategy(args.ulysses_degree, cp)?;
    Ok((strategy, layout))
}

/// `--strategy dynamic`: the inner strategy and the scheduler settings; `None` for static CP (then
/// the dynamic-only flags are an error).
fn dynamic_settings(
    args: &TrainFlags,
    cp: usize,
    seq_len: usize,
) -> Result<Option<(Strategy, DynamicSettings)>, TrainError> {
    if args.strategy.as_deref() != Some(StrategyKind::Dynamic.name()) {
        let given = [
            ("--inner-strategy", args.inner_strategy.is_some()),
            ("--min-cp-size", args.min_cp_size.is_some()),
            ("--cp-sizes", args.cp_sizes.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            return Err(TrainError::Config(format!(
                "{flag} only applies to --strategy dynamic"
            )));
        }
        return Ok(None);
    }
    let name = args.inner_strategy.as_deref().unwrap_or("ring");
    // USP keeps its Ulysses degree; the ring degree follows each group's size.
    let degree_cp = args.ulysses_degree.unwrap_or(1);
    let inner = Strategy::parse(name, args.ulysses_degree, degree_cp)?;
    let settings = DynamicSettings {
        max_tokens_per_rank: args
            .max_tokens_per_rank
            .unwrap_or(seq_len.div_ceil(cp.max(1))),
        min_cp_size: args.min_cp_size.unwrap_or(1),
        cp_sizes: args
            .cp_sizes
            .as_deref()
            .unwrap_or("pow2")
            .parse::<CpSizes>()?,
    };
    Ok(Some((inner, settings)))
}

/// `--strategy dcp` and `auto`: the block plans' settings; `None` otherwise (then
/// `--block`/`--stages` are an error).
fn dcp_settings(args: &TrainFlags, strategy: Strategy) -> Result<Option<DcpSettings>, TrainError> {
    let auto = args.strategy.as_deref() == Some("auto");
    if strategy != Strategy::Dcp && !auto {
        if let Some(flag) = [("--block", args.block), ("--stages", args.stages)]
            .iter()
            .find_map(|(flag, value)| value.map(|_| flag))
        {
            return Err(TrainError::Config(format!(
                "{flag} only applies to --strategy dcp or auto"
            )));
        }
        return Ok(None);
    }
    Ok(Some(DcpSettings {
        // The default block never exceeds a micro-batch.
        block: args
            .block
            .unwrap_or(128.min(args.seq_len.unwrap_or(128).max(1))),
        stages: args.stages.unwrap_or(4),
    }))
}

/// DCP places tokens where its plan homes them: a `--layout` beside it would be ignored.
fn no_layout(args: &TrainFlags, what: &str) -> Result<(), TrainError> {
    match &args.layout {
        Some(layout) => Err(TrainError::Config(format!(
            "--layout {layout} does not apply to {what}: DCP places every token where its block plan homes it"
        ))),
        None => Ok(()),
    }
}

/// `--strategy auto`: the candidates; `None` otherwise (then `--auto-candidates` is an error).
fn auto_settings(args: &TrainFlags) -> Result<Option<AutoSettings>, TrainError> {
    if args.strategy.as_deref() != Some("auto") {
        if args.auto_candidates.is_some() {
            return Err(TrainError::Config(
                "--auto-candidates only applies to --strategy auto".into(),
            ));
        }
        return Ok(None);
    }
    let candidates = match &args.auto_candidates {
        Some(text) => burn_dcp::planner::auto::parse_candidates(text)
            .map_err(|e| TrainError::Config(format!("--auto-candidates {text}: {e}")))?,
        None => burn_dcp::StrategyKind::ALL.to_vec(),
    };
    Ok(Some(AutoSettings { candidates }))
}

/// `--layout` alone (dynamic CP: the layout inside each group) [default: zigzag].
fn layout_flag(args: &TrainFlags) -> Result<Layout, TrainError> {
    args.layout
        .as_deref()
        .unwrap_or("zigzag")
        .parse()
        .map_err(|e: burn_dcp::CpError| TrainError::from(e))
}
