//! The export of a run's checkpoint (any TP × PP × VPP mesh) as one Hugging Face checkpoint
//! (`--export-hf`, `--export-hf-every`, the `hf_export` tool).

use std::path::Path;

use burn::backend::Flex;
use burn_dcp_models::hf::{save_hf, ExportDtype, HfConfig};
use burn_dcp_models::{Gpt, TpGpt};
use serde_json::Value;

use super::load::{model_config, read_hf_config};
use crate::checkpoint::{load_model, CheckpointFiles, TrainState};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::files::read_json;
use crate::gpt::GptChunks;
use crate::model::CpTrain;

/// The Hugging Face configuration a run's model is exported with: its checkpoint's keys when it
/// started from one, its sliding window when its mask is one (Mistral).
fn export_config(config: &TrainConfig) -> Result<HfConfig, TrainError> {
    let model = model_config(config)?;
    let window = config
        .mask
        .strip_prefix("sliding:")
        .and_then(|w| w.parse::<usize>().ok());
    let base = match &config.hf_checkpoint {
        Some(dir) => Some(read_hf_config(&Path::new(dir).join("config.json"))?),
        None => None,
    };
    let mut hf = HfConfig::for_model(&model, window, config.seq_len.max(2048))
        .map_err(|e| TrainError::Config(e.to_string()))?;
    if let Some(base) = base {
        hf.json = base.json;
        if base.architecture == hf.architecture || window.is_none() {
            hf.architecture = base.architecture;
        }
    }
    if let Some(max) = hf
        .json
        .get("max_position_embeddings")
        .and_then(Value::as_u64)
    {
        // A run longer than the checkpoint's context says so in the export.
        if (max as usize) < config.seq_len {
            hf.json["max_position_embeddings"] = config.seq_len.into();
        }
    }
    Ok(hf)
}

/// Writes the model of the run checkpoint `checkpoint` (a run's `checkpoint/` directory) to `to`
/// as a Hugging Face checkpoint: every TP rank's and pipeline stage's shard read on the CPU and
/// joined into whole tensors ([`Gpt::from_shards`]). Returns the parameter count.
pub fn export_checkpoint(
    checkpoint: &Path,
    to: &Path,
    dtype: ExportDtype,
) -> Result<usize, TrainError> {
    let state: TrainState = read_json(&checkpoint.join("state.json"))?;
    let Some(config) = state.config else {
        return Err(TrainError::Checkpoint(format!(
            "{} holds no run configuration (a checkpoint of an older version): it cannot be exported",
            checkpoint.display()
        )));
    };
    let model = model_config(&config)?;
    let device = Default::default();
    let skeleton = model
        .skeleton::<CpTrain<Flex>>(&device)
        .map_err(TrainError::from)?;
    let stages = config.pp * config.vpp;
    // shards[virtual stage][tp rank]
    let mut shards: Vec<Vec<TpGpt<CpTrain<Flex>>>> = (0..stages).map(|_| Vec::new()).collect();
    for tp_rank in 0..config.tp {
        for pp_rank in 0..config.pp {
            let chunks = (0..config.vpp)
                .map(|v| {
                    TpGpt::stage(
                        &skeleton,
                        &model,
                        tp_rank,
                        config.tp,
                        v * config.pp + pp_rank,
                        stages,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            let files = CheckpointFiles::of(&config, tp_rank, pp_rank);
            let loaded = load_model(GptChunks { chunks }, checkpoint, &files.model, &device)?;
            for (v, chunk) in loaded.chunks.into_iter().enumerate() {
                shards[v * config.pp + pp_rank].push(chunk);
            }
        }
    }
    let whole = Gpt::from_shards(&model, &shards)?;
    save_hf(&whole, &export_config(&config)?, to, dtype)
        .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
    Ok(model.parameter_count())
}

/// The export flags of a training program (`gpt_longctx`): the run's model as a Hugging Face
/// checkpoint at its end, and every N steps beside its checkpoints.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct ExportFlags {
    /// At the end of the run, write the model to DIR as a Hugging Face checkpoint (config.json,
    /// model.safetensors or shards with their index) that transformers' from_pretrained loads;
    /// the TP and PP ranks' pieces joined into whole tensors, written atomically
    #[cfg_attr(feature = "cli", arg(long, value_name = "DIR"))]
    pub export_hf: Option<String>,
    /// Also export after every N-th step (a checkpoint is written then too; DIR holds the newest)
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub export_hf_every: Option<usize>,
    /// The exported tensors' dtype, bf16 | f32 [default: bf16]
    #[cfg_attr(feature = "cli", arg(long))]
    pub export_dtype: Option<String>,
}

/// Where and when a run exports its model.
#[derive(Clone, Debug)]
pub struct HfExport {
    pub dir: std::path::PathBuf,
    pub every: Option<usize>,
    pub dtype: ExportDtype,
    /// The run's last step (always exported).
    pub last: usize,
}

impl ExportFlags {
    /// The export of a run of `config`, whose `checkpoint_every` it sets to `--export-hf-every`
    /// when none is given (an export is made from the checkpoint of its step); `None` without
    /// `--export-hf`.
    pub fn plan(&self, config: &mut TrainConfig) -> Result<Option<HfExport>, TrainError> {
        let Some(dir) = &self.export_hf else {
            if self.export_hf_every.is_some() || self.export_dtype.is_some() {
                return Err(TrainError::Config(
                    "--export-hf-every and --export-dtype need --export-hf DIR".into(),
                ));
            }
            return Ok(None);
        };
        let dtype = ExportDtype::parse(self.export_dtype.as_deref().unwrap_or("bf16"))?;
        // Refused before the first step: a model with no Hugging Face architecture.
        HfConfig::for_model(&model_config(config)?, None, 1)
            .map_err(|e| TrainError::Config(format!("--export-hf: {e}")))?;
        if let Some(every) = self.export_hf_every {
            match config.checkpoint_every {
                _ if every == 0 => {
                    return Err(TrainError::Config("--export-hf-every must be at least 1".into()))
                }
                None => config.checkpoint_every = Some(every),
                Some(c) if every % c != 0 => {
                    return Err(TrainError::Config(format!(
                        "--export-hf-every {every} must be a multiple of --checkpoint-every {c} (an export is made from the checkpoint of its step)"
                    )))
                }
                Some(_) => {}
            }
        }
        Ok(Some(HfExport {
            dir: dir.into(),
            every: self.export_hf_every,
            dtype,
            last: config.steps,
        }))
    }
}

impl HfExport {
    /// Whether the checkpoint of `step` is exported.
    pub fn at(&self, step: usize) -> bool {
        step == self.last || self.every.is_some_and(|n| step.is_multiple_of(n))
    }
}

/// A run's observer that also exports ([`HfExport`]) the checkpoints it is told of.
pub struct Exporting<'a> {
    pub inner: &'a dyn crate::metrics::StepObserver,
    pub export: &'a HfExport,
}

impl crate::metrics::StepObserver for Exporting<'_> {
    fn on_step(&self, metrics: &crate::metrics::StepMetrics) {
        self.inner.on_step(metrics);
    }

    fn on_checkpoint(&self, step: usize, checkpoint: &Path) -> Result<(), TrainError> {
        self.inner.on_checkpoint(step, checkpoint)?;
        if !self.export.at(step) {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let parameters = export_checkpoint(checkpoint, &self.export.dir, self.export.dtype)?;
        log::info!(
            "step {step}: {parameters} parameters exported to {} in {:.1} s",
            self.export.dir.display(),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}
