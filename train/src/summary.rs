//! The summary of a run (`gpt_longctx --json`, `custom_model --json`): its configuration, losses,
//! throughput, bytes and time by phase, memory, summed over the steps it ran.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::config::TrainConfig;
use crate::metrics::StepMetrics;
use crate::step::AXES;

/// The summary of `metrics` (the steps run, in order), `eval_loss` (`--eval-only`), `wall`
/// seconds of the run and its output directory. The caller adds what only it knows (the
/// backend type, its own flags).
pub fn run_summary(
    config: &TrainConfig,
    (metrics, eval_loss): (&[StepMetrics], Option<f64>),
    wall: f64,
    out: Option<&Path>,
) -> Value {
    let tokens: usize = metrics.iter().map(|m| m.tokens).sum();
    let bytes: u64 = metrics.iter().map(|m| m.bytes_communicated).sum();
    let train_seconds: f64 = metrics.iter().map(|m| m.step_ms).sum::<f64>() / 1e3;
    json!({
        "config": config,
        "parameters": config.model_config().ok().map(|m| m.parameter_count()),
        "steps_run": metrics.len(),
        "first_step": metrics.first().map(|m| m.step),
        "last_step": metrics.last().map(|m| m.step),
        "losses": metrics.iter().map(|m| m.loss).collect::<Vec<_>>(),
        "step_ms": metrics.iter().map(|m| m.step_ms).collect::<Vec<_>>(),
        "final_loss": metrics.last().map(|m| m.loss),
        "tokens": tokens,
        "tokens_per_second": if train_seconds > 0.0 { tokens as f64 / train_seconds } else { 0.0 },
        "bytes_communicated": bytes,
        "bytes_by_link": {
            "intra_node": metrics.iter().map(|m| m.bytes_by_link.intra_node).sum::<u64>(),
            "inter_node": metrics.iter().map(|m| m.bytes_by_link.inter_node).sum::<u64>(),
        },
        "bytes_by_axis": totals(
            &AXES,
            metrics.iter().map(|m| &m.bytes_by_axis)
        ),
        "cp_group_sizes": totals(&[], metrics.iter().map(|m| &m.cp_group_sizes)),
        "strategy_counts": totals(&[], metrics.iter().map(|m| &m.strategy_counts)),
        "rank_workload_imbalance": mean(metrics.iter().map(|m| m.rank_workload_imbalance)),
        "attention_ms": metrics.iter().filter_map(|m| m.attention_ms).sum::<f64>(),
        "comm_wait_ms": metrics.iter().filter_map(|m| m.comm_wait_ms).sum::<f64>(),
        "optimizer_ms": metrics.iter().filter_map(|m| m.optimizer_ms).sum::<f64>(),
        // pp 1: the forwards and the backwards (device time with --sync-phases), summed over
        // the steps.
        "forward_ms": metrics.iter().map(|m| m.forward_ms).sum::<Option<f64>>(),
        "backward_ms": metrics.iter().map(|m| m.backward_ms).sum::<Option<f64>>(),
        "grad_sync_ms": metrics.iter().filter_map(|m| m.grad_sync_ms).sum::<f64>(),
        // Each step's phases (device time with --sync-phases), for the steps after the first.
        "phases_ms": metrics.iter().map(|m| json!({
            "forward": m.forward_ms, "backward": m.backward_ms, "grad_sync": m.grad_sync_ms,
            "optimizer": m.optimizer_ms, "attention": m.attention_ms, "step": m.step_ms,
        })).collect::<Vec<_>>(),
        // With a pipeline: the ranks' mean wait for other stages, summed over the steps.
        "pipeline_bubble_ms": metrics.iter().map(|m| m.pipeline_bubble_ms).sum::<Option<f64>>(),
        // The largest of every rank's peak (MiB), or null when the ranks cannot tell.
        "peak_memory_mb": largest(metrics.iter().map(|m| &m.peak_memory_mb)),
        // The largest of every rank's device memory (MiB; CUDA, wgpu), or null on the CPU.
        "peak_gpu_memory_mb": largest(metrics.iter().map(|m| &m.peak_gpu_memory_mb)),
        // The cost model's time of the same steps on the emulated machine (--emulate-links;
        // null without it, or where a step's strategy has no plan in the cost model).
        "predicted_attention_ms": metrics
            .iter()
            .map(|m| m.predicted_attention_ms)
            .sum::<Option<f64>>(),
        "plan_wait_ms": metrics.iter().filter_map(|m| m.plan_wait_ms).fold(0.0, |a, b| a + b),
        // This process's peak resident memory (MiB; VmHWM: heap and mapped file pages alike).
        "process_peak_rss_mb": burn_dcp::kernels::memory::process_peak_bytes()
            .map(|bytes| bytes as f64 / (1u64 << 20) as f64),
        "wall_seconds": wall,
        "out": out.map(|p| p.display().to_string()),
        // --eval-only: the loss over the first eval_tokens tokens in file order.
        "val_loss": eval_loss,
        "eval_tokens": config.eval_only.then_some(config.eval_tokens),
    })
}

/// A per-step map (group sizes, strategy counts, bytes by axis) summed over the steps, starting
/// from `keys` at zero.
fn totals<'a, V: Copy + Default + std::ops::AddAssign + 'a>(
    keys: &[&str],
    maps: impl Iterator<Item = &'a BTreeMap<String, V>>,
) -> BTreeMap<String, V> {
    let mut totals: BTreeMap<String, V> =
        keys.iter().map(|k| (k.to_string(), V::default())).collect();
    for (key, value) in maps.flatten() {
        *totals.entry(key.clone()).or_default() += *value;
    }
    totals
}

/// The largest value of every step's per-rank list, or `None` when no step has one.
fn largest<'a>(per_rank: impl Iterator<Item = &'a Option<Vec<f64>>>) -> Option<f64> {
    per_rank.flatten().flatten().copied().reduce(f64::max)
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if count == 0 {
        0.0
    } else {
        sum / count as f64
    }
}
