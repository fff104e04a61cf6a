//! What a run reports: [`StepMetrics`] (a line of `metrics.jsonl`), the [`StepObserver`] hook of
//! rank 0, and [`Progress`], the observer the examples use (a progress line on a terminal, a
//! plain line per step in a log, `metrics.jsonl`).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use burn_dcp::comm::LinkBytes;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::files::write_atomically;
use crate::plan::AutoRecord;

/// One optimizer step's measurements (a line of `metrics.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean cross-entropy over every labelled token of the global batch.
    pub loss: f64,
    /// The learning rate the step's update used (the schedule's).
    #[serde(default)]
    pub lr: f64,
    /// The global gradient norm before clipping (every parameter counted once across TP, PP
    /// and the DP × CP pool: cp 1's).
    #[serde(default)]
    pub grad_norm: f64,
    /// `--eval-every`: the mean loss over every labelled token of the validation set after
    /// this step's update (on the steps it runs; `None` otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Tokens processed in the step (all replicas).
    pub tokens: usize,
    /// Bytes sent by all ranks during the step (attention and gradient all-reduce).
    pub bytes_communicated: u64,
    /// The step's bytes by link class (`--topology`/`--nodes`; intra-node only on one node).
    #[serde(default)]
    pub bytes_by_link: LinkBytes,
    /// The step's bytes by mesh axis: `tp` (the TP region all-reduces, the vocab-parallel max,
    /// replicated kv gradients), `cp` (attention), `dp`
    /// (the gradient all-reduce over DP × CP), `pp` (activations between stages).
    #[serde(default)]
    pub bytes_by_axis: BTreeMap<String, u64>,
    pub step_ms: f64,
    /// CP group size → number of sequences that ran in groups of that size.
    #[serde(default)]
    pub cp_group_sizes: BTreeMap<String, usize>,
    /// Max / mean of the per-rank estimated work of the step (see `dynamic`'s estimator).
    #[serde(default)]
    pub rank_workload_imbalance: f64,
    /// Time the step's planning took (on the planning thread; `None` only in metrics written
    /// before every strategy was planned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_ms: Option<f64>,
    /// Time the step waited for its plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_wait_ms: Option<f64>,
    /// Strategy → micro-batches of the step that ran it (`auto`: its choices; otherwise the one
    /// strategy, `dynamic` for dynamic CP).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub strategy_counts: BTreeMap<String, usize>,
    /// Time of the gradient all-reduces over the DP × CP pool (rank 0's), and the part of it
    /// not overlapped with compute: all of it (see `GRADIENT_BUCKET_BYTES`' docs for why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_sync_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_sync_exposed_ms: Option<f64>,
    /// Wall time in CP attention (forward and backward, kernels and communication waits) of the
    /// slowest rank in the step (`burn_dcp::backend::attention_time`; with `--emulate-links`,
    /// the waits include the emulated links).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_ms: Option<f64>,
    /// With `--emulate-links`: the cost model's attention time of the step's plan on the
    /// emulated machine (`burn_dcp_train::predict`), the slowest rank's; `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_attention_ms: Option<f64>,
    /// Every rank's peak memory so far, in MiB (2²⁰ bytes), in world rank order: its process's
    /// peak resident memory where ranks are processes (MPI, TCP), the allocation accounting of
    /// `burn_dcp::kernels::memory` where ranks are threads (when the binary installs its
    /// `TrackingAllocator`, as the examples do); `None` when a rank cannot tell
    /// ([`crate::rank_peak_memory_mb`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_mb: Option<Vec<f64>>,
    /// Every rank's device memory at its most so far, in MiB, in world rank order, on a backend
    /// with a device of its own (CUDA, wgpu: what the allocator holds on the device,
    /// [`crate::rank_peak_gpu_memory_mb`]); absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_gpu_memory_mb: Option<Vec<f64>>,
    /// The slowest rank's wall time in communication calls and waits during the step (sends,
    /// receives, collectives — in attention, the gradient all-reduce and the engine's own
    /// agreements; overlaps `attention_ms`), `burn_dcp::diagnostics::trace::comm_wait_time`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_wait_ms: Option<f64>,
    /// The slowest rank's optimizer update of the step (device time with `--sync-phases`, else
    /// the time to queue it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_ms: Option<f64>,
    /// The slowest rank's forwards of the step (device time with `--sync-phases`, else the time
    /// to queue them; pp 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_ms: Option<f64>,
    /// The slowest rank's backwards of the step (device time with `--sync-phases`, else the
    /// time to queue them; pp 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_ms: Option<f64>,
    /// With a pipeline (pp > 1): the pipeline's bubble, each rank's time in the step waiting for
    /// an activation or a gradient from another stage (the same clock as `--trace`'s spans),
    /// averaged over the ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_bubble_ms: Option<f64>,
    /// `auto` only: every micro-batch's choice, its sequences and every candidate's estimate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub auto_choices: Vec<AutoRecord>,
}

/// Hooks of rank 0: called after each step with its metrics (progress, metrics.jsonl).
pub trait StepObserver: Sync {
    fn on_step(&self, metrics: &StepMetrics);

    /// World rank 0, after the checkpoint of `step` is committed in `checkpoint` (while every
    /// other rank waits for it, as for the write): `--export-hf` converts it here. An error
    /// stops the run on every rank.
    fn on_checkpoint(&self, _step: usize, _checkpoint: &std::path::Path) -> Result<(), TrainError> {
        Ok(())
    }
}

/// Rank 0's report of a run: on a terminal an [`indicatif`] progress bar on stderr (steps, loss,
/// tokens/s, bytes sent, elapsed time and ETA); otherwise one plain line per step (`step 3/30 |
/// … | loss … | … tok/s | … MB sent | eta …s`), so mpirun and Slurm logs stay readable. With an
/// output directory, `metrics.jsonl` (one [`StepMetrics`] per line).
pub struct Progress {
    /// The program's name and the mesh, in each line.
    label: String,
    steps: usize,
    metrics_file: Option<Mutex<std::fs::File>>,
    /// The bar, on a terminal only.
    bar: Option<ProgressBar>,
    started: Instant,
    /// The first step this report saw (a resumed run starts past 1) and when.
    first: Mutex<Option<(usize, Instant)>>,
    error: Mutex<Option<TrainError>>,
}

impl Progress {
    /// A report of `steps` steps. With `out`, `metrics.jsonl` there is created (or appended to
    /// when `append`: a resumed run).
    pub fn new(
        label: impl Into<String>,
        steps: usize,
        out: Option<&Path>,
        append: bool,
    ) -> Result<Self, TrainError> {
        let metrics_file = out.map(|out| open_metrics(out, append)).transpose()?;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "[{bar:30}] step {pos}/{len} | {msg} | {elapsed} elapsed, eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("#>.");
            bar.set_style(style);
            bar
        });
        Ok(Self {
            label: label.into(),
            steps,
            metrics_file: metrics_file.map(Mutex::new),
            bar,
            started: Instant::now(),
            first: Mutex::new(None),
            error: Mutex::new(None),
        })
    }

    /// Seconds since the report started.
    pub fn elapsed_seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Ends the progress bar; returns the first error writing `metrics.jsonl`, if any.
    pub fn finish(&self) -> Result<(), TrainError> {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Seconds left at the pace since the first step this report saw (`None` before a second).
    fn eta_seconds(&self, step: usize) -> Option<f64> {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        let (first_step, at) = *first.get_or_insert((step, Instant::now()));
        let done = step.checked_sub(first_step).filter(|&done| done > 0)?;
        let per_step = at.elapsed().as_secs_f64() / done as f64;
        Some(per_step * self.steps.saturating_sub(step) as f64)
    }
}

impl StepObserver for Progress {
    fn on_step(&self, m: &StepMetrics) {
        let tokens_per_second = m.tokens as f64 / (m.step_ms / 1e3);
        let validation = m
            .val_loss
            .map(|loss| format!(" | val loss {loss:.4}"))
            .unwrap_or_default();
        let numbers = format!(
            "{} | loss {:.4}{validation} | {:.0} tok/s | {:.1} MB sent",
            self.label,
            m.loss,
            tokens_per_second,
            m.bytes_communicated as f64 / 1e6
        );
        let eta = self.eta_seconds(m.step);
        match &self.bar {
            Some(bar) => {
                bar.set_position(m.step as u64);
                bar.set_message(numbers);
            }
            None => {
                let eta = eta.map(|s| format!(" | eta {s:.0}s")).unwrap_or_default();
                eprintln!("step {}/{} | {numbers}{eta}", m.step, self.steps);
            }
        }
        if let Some(file) = &self.metrics_file {
            let line = serde_json::to_string(m).expect("metrics serialize");
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = writeln!(file, "{line}") {
                *self.error.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(TrainError::io("write", "metrics.jsonl", e));
            }
        }
    }
}

/// Drops the lines of `metrics.jsonl` past `last_step` (a run killed after its checkpoint logged
/// steps the checkpoint does not hold).
pub fn truncate_metrics(path: &Path, last_step: usize) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|line| serde_json::from_str::<StepMetrics>(line).is_ok_and(|m| m.step <= last_step))
        .collect();
    let mut content = kept.join("\n");
    if !content.is_empty() {
        content.push('\n');
    }
    write_atomically(path, content.as_bytes())
}

fn open_metrics(out: &Path, append: bool) -> Result<std::fs::File, TrainError> {
    let path = out.join("metrics.jsonl");
    std::fs::OpenOptions::new()
        .create(true)
        .append(append)
        .write(true)
        .truncate(!append)
        .open(&path)
        .map_err(|e| TrainError::io("open", &path, e))
}
