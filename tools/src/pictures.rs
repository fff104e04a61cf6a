//! Pictures of runs and plans (plotters: SVG, or PNG by the file's extension): a run's curves
//! from `metrics.jsonl` — several runs on one chart ([`plot_runs`], the `plot_metrics` tool) —
//! and what a plan does: each tile of a micro-batch coloured by the rank that computes it, the
//! compute blocks of each rank per stage, and the bytes each rank sends within and across nodes
//! ([`plot_plans`], `plan_sim --svg` / `--png`).
//!
//! Text is drawn with a TrueType font read at run time (`ab_glyph`, no system library):
//! `$BURN_DCP_FONT`, else DejaVu Sans (Debian's `fonts-dejavu-core`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use burn_dcp::planner::cost::RoutedPlan;
use burn_dcp::planner::Topology;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;

/// The font files tried, in order, when `$BURN_DCP_FONT` is not set.
const FONTS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers the font every picture's text uses (once per process).
fn load_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates: Vec<PathBuf> = match std::env::var_os("BURN_DCP_FONT") {
                Some(path) => vec![PathBuf::from(path)],
                None => FONTS.iter().map(PathBuf::from).collect(),
            };
            let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
                let tried: Vec<String> =
                    candidates.iter().map(|p| p.display().to_string()).collect();
                format!(
                    "no font for the picture's text: tried {} (install Debian's fonts-dejavu-core, or set BURN_DCP_FONT to a .ttf file)",
                    tried.join(", ")
                )
            })?;
            let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{}: not a TrueType/OpenType font", path.display()))
        })
        .clone()
}

/// A picture that draws itself on any plotters backend (the SVG and the PNG one alike).
trait Picture {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String>;
}

/// Draws `picture` on an SVG or a PNG (by `path`'s extension) of `size` pixels.
fn with_canvas(path: &Path, size: (u32, u32), picture: &impl Picture) -> Result<(), String> {
    load_font()?;
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let presented = match extension {
        "svg" => present(SVGBackend::new(path, size).into_drawing_area(), picture)?,
        "png" => present(BitMapBackend::new(path, size).into_drawing_area(), picture)?,
        _ => {
            return Err(format!(
                "{}: the picture's file must end in .svg or .png",
                path.display()
            ))
        }
    };
    presented.map_err(|e| format!("{}: {e}", path.display()))
}

/// `picture` on a white `root`, then written out (the write's own error apart, for its path).
fn present<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    picture: &impl Picture,
) -> Result<Result<(), String>, String> {
    root.fill(&WHITE).map_err(text)?;
    picture.draw(&root)?;
    Ok(root.present().map_err(text))
}

fn text(error: impl std::fmt::Display) -> String {
    error.to_string()
}

/// One run's curves, read from its `metrics.jsonl`.
#[derive(Clone, Debug, Default)]
pub struct RunCurves {
    pub label: String,
    /// (step, value) of each curve.
    pub loss: Vec<(f64, f64)>,
    pub val_loss: Vec<(f64, f64)>,
    pub tokens_per_second: Vec<(f64, f64)>,
    /// The largest rank's peak memory (MB), where the run measured it.
    pub memory_mb: Vec<(f64, f64)>,
}

impl RunCurves {
    /// Reads `metrics.jsonl` (or a directory holding one), labelled `label`.
    pub fn read(path: &Path, label: String) -> Result<Self, String> {
        if !path.exists() {
            return Err(format!(
                "{}: no such run (give a run's --out directory or its metrics.jsonl)",
                path.display()
            ));
        }
        let file = match path.is_dir() {
            true => path.join("metrics.jsonl"),
            false => path.to_path_buf(),
        };
        let content =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut run = RunCurves {
            label,
            ..Default::default()
        };
        for (number, line) in content
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let value: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| format!("{} line {}: {e}", file.display(), number + 1))?;
            let number_of = |key: &str| value.get(key).and_then(serde_json::Value::as_f64);
            let step = number_of("step").ok_or_else(|| {
                format!(
                    "{} line {}: no \"step\" (not a metrics.jsonl)",
                    file.display(),
                    number + 1
                )
            })?;
            if let Some(loss) = number_of("loss") {
                run.loss.push((step, loss));
            }
            if let Some(loss) = number_of("val_loss") {
                run.val_loss.push((step, loss));
            }
            if let (Some(tokens), Some(ms)) = (number_of("tokens"), number_of("step_ms")) {
                if ms > 0.0 {
                    run.tokens_per_second.push((step, tokens / (ms / 1e3)));
                }
            }
            let peak = value
                .get("peak_memory_mb")
                .and_then(serde_json::Value::as_array)
                .and_then(|ranks| {
                    ranks
                        .iter()
                        .filter_map(serde_json::Value::as_f64)
                        .reduce(f64::max)
                });
            if let Some(peak) = peak {
                run.memory_mb.push((step, peak));
            }
        }
        if run.loss.is_empty() {
            return Err(format!("{}: no step with a loss", file.display()));
        }
        Ok(run)
    }
}

/// The runs' loss, validation loss, tokens/s and peak memory per step, one panel each, every run
/// in its own colour (the same in every panel), written to `path` (`.svg` or `.png`).
pub fn plot_runs(path: &Path, runs: &[RunCurves]) -> Result<(), String> {
    if runs.is_empty() {
        return Err("no run to plot".into());
    }
    with_canvas(path, (1200, 800), &Runs(runs))
}

/// The runs' curves (`plot_runs`).
struct Runs<'a>(&'a [RunCurves]);

impl Picture for Runs<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_runs(root, self.0)
    }
}

fn draw_runs<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[RunCurves],
) -> Result<(), String> {
    let panels = root.split_evenly((2, 2));
    let curves: [(&str, Curve); 4] = [
        ("loss", |r| &r.loss),
        ("validation loss", |r| &r.val_loss),
        ("tokens/s", |r| &r.tokens_per_second),
        ("peak memory per rank (MB, the largest rank)", |r| {
            &r.memory_mb
        }),
    ];
    for (panel, (title, curve)) in panels.iter().zip(curves) {
        let points: Vec<(f64, f64)> = runs.iter().flat_map(|r| curve(r).iter().copied()).collect();
        if points.is_empty() {
            panel
                .titled(&format!("{title}: not in these runs"), ("sans-serif", 18))
                .map_err(text)?;
            continue;
        }
        let (x, y) = bounds(&points);
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(x.0..x.1, y.0..y.1)
            .map_err(text)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(text)?;
        for (index, run) in runs.iter().enumerate() {
            let colour = Palette99::pick(index).to_rgba();
            // Later runs dashed over earlier ones: equal curves stay visible on top of each other.
            let width = 3 - (index as u32 % 2) * 2;
            chart
                .draw_series(LineSeries::new(
                    curve(run).iter().copied(),
                    colour.stroke_width(width),
                ))
                .map_err(text)?
                .label(run.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(text)?;
    }
    Ok(())
}

/// One curve of a run: (step, value) points.
type Curve = fn(&RunCurves) -> &Vec<(f64, f64)>;

/// The smallest ranges that hold `points` (widened where flat).
fn bounds(points: &[(f64, f64)]) -> ((f64, f64), (f64, f64)) {
    let fold = |f: fn(&(f64, f64)) -> f64| {
        points
            .iter()
            .map(f)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            })
    };
    let widen = |(lo, hi): (f64, f64)| {
        let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-9);
        (lo - pad, hi + pad)
    };
    (widen(fold(|p| p.0)), widen(fold(|p| p.1)))
}

/// Each plan of `plans` in a row: its tiles coloured by the rank computing them (head unit 0;
/// the micro-batch's sequences one after the other on the diagonal), each rank's compute blocks
/// per stage, and the bytes each rank sends (forward and backward) within and across nodes of
/// `topology`. Written to `path` (`.svg` or `.png`).
pub fn plot_plans(path: &Path, plans: &[RoutedPlan], topology: &Topology) -> Result<(), String> {
    if plans.is_empty() {
        return Err("no plan to draw".into());
    }
    let height = 420 * plans.len() as u32;
    with_canvas(path, (1500, height), &Plans { plans, topology })
}

/// The plans on their topology (`plot_plans`).
struct Plans<'a> {
    plans: &'a [RoutedPlan],
    topology: &'a Topology,
}

impl Picture for Plans<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_plans(root, self.plans, self.topology)
    }
}

fn draw_plans<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plans: &[RoutedPlan],
    topology: &Topology,
) -> Result<(), String> {
    for (row, routed) in root.split_evenly((plans.len(), 1)).iter().zip(plans) {
        let parts = row.split_evenly((1, 3));
        draw_tiles(&parts[0], routed)?;
        draw_stages(&parts[1], routed)?;
        draw_bytes(&parts[2], routed, topology)?;
    }
    Ok(())
}

/// The colour of rank `rank`.
fn rank_colour(rank: usize) -> RGBAColor {
    Palette99::pick(rank).to_rgba()
}

fn draw_tiles<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    routed: &RoutedPlan,
) -> Result<(), String> {
    // Each sequence's first block on the packed diagonal.
    let mut offset = Vec::with_capacity(routed.problem.seq_lens.len());
    let mut total = 0usize;
    for seq in 0..routed.problem.seq_lens.len() {
        offset.push(total);
        total += routed.problem.blocks_of(seq);
    }
    let total = total.max(1) as f64;
    let title = format!(
        "{}: tiles of head unit 0 by computing rank ({} ranks, block {})",
        routed.name, routed.plan.ranks, routed.problem.block
    );
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(40)
        .build_cartesian_2d(0.0..total, total..0.0)
        .map_err(text)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("key block")
        .y_desc("query block")
        .draw()
        .map_err(text)?;
    let tiles = routed.plan.blocks.iter().filter(|b| b.head == 0).map(|b| {
        let (q, kv) = (
            (offset[b.seq] + b.q_block) as f64,
            (offset[b.seq] + b.kv_block) as f64,
        );
        Rectangle::new([(kv, q), (kv + 1.0, q + 1.0)], rank_colour(b.rank).filled())
    });
    chart.draw_series(tiles).map_err(text)?;
    Ok(())
}

fn draw_stages<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    routed: &RoutedPlan,
) -> Result<(), String> {
    let mut counts: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for block in &routed.plan.blocks {
        *counts.entry((block.rank, block.stage)).or_default() += 1;
    }
    let stages = counts.keys().map(|k| k.1 + 1).max().unwrap_or(1);
    let ranks = routed.plan.ranks.max(1);
    let most = counts.values().copied().max().unwrap_or(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("compute blocks per rank and stage ({stages} stages)"),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(40)
        .build_cartesian_2d(0.0..stages as f64, ranks as f64..0.0)
        .map_err(text)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("stage")
        .y_desc("rank")
        .x_labels(stages.min(16) + 1)
        .y_labels(ranks.min(16) + 1)
        .x_label_formatter(&|v| format!("{}", v.round() as usize))
        .y_label_formatter(&|v| format!("{}", v.round() as usize))
        .draw()
        .map_err(text)?;
    let cells = counts.iter().map(|(&(rank, stage), &count)| {
        let (x, y) = (stage as f64, rank as f64);
        let shade = 0.15 + 0.85 * count as f64 / most;
        Rectangle::new(
            [(x, y), (x + 1.0, y + 1.0)],
            rank_colour(rank).mix(shade).filled(),
        )
    });
    chart.draw_series(cells).map_err(text)?;
    Ok(())
}

fn draw_bytes<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    routed: &RoutedPlan,
    topology: &Topology,
) -> Result<(), String> {
    let ranks = routed.plan.ranks.max(1);
    // (intra-node, inter-node) MB each rank sends, forward and backward together
    let mut sent = vec![(0.0f64, 0.0f64); ranks];
    for t in &routed.transfers {
        if t.from == t.to || t.from >= ranks {
            continue;
        }
        let mb = t.bytes / 1e6;
        match topology.node_of(t.from) == topology.node_of(t.to) {
            true => sent[t.from].0 += mb,
            false => sent[t.from].1 += mb,
        }
    }
    let (intra, inter): (f64, f64) = sent.iter().fold((0.0, 0.0), |a, s| (a.0 + s.0, a.1 + s.1));
    let most = sent.iter().map(|s| s.0 + s.1).fold(0.0, f64::max).max(1e-6);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "MB sent per rank: {intra:.1} intra-node (light), {inter:.1} inter-node (dark)"
            ),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..ranks as f64, 0.0..most * 1.05)
        .map_err(text)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("rank")
        .x_labels(ranks.min(16) + 1)
        .x_label_formatter(&|v| format!("{}", v.round() as usize))
        .draw()
        .map_err(text)?;
    let bars = sent.iter().enumerate().flat_map(|(rank, &(intra, inter))| {
        let x = rank as f64;
        let colour = rank_colour(rank);
        [
            Rectangle::new(
                [(x + 0.1, 0.0), (x + 0.9, intra)],
                colour.mix(0.45).filled(),
            ),
            Rectangle::new(
                [(x + 0.1, intra), (x + 0.9, intra + inter)],
                colour.filled(),
            ),
        ]
    });
    chart.draw_series(bars).map_err(text)?;
    Ok(())
}
