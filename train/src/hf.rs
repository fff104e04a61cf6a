//! Hugging Face checkpoints in the engine: the architecture a run trains (`--model-config`,
//! `--hf-checkpoint`, with `--rope-theta` / `--rope-scaling` over it), its initial weights from a
//! checkpoint, and the export of a run's checkpoint (any TP × PP × VPP mesh) as one Hugging Face
//! checkpoint (`--export-hf`, the `hf_export` tool).

use std::path::Path;

use burn::backend::Flex;
use burn::prelude::Backend;
use burn_dcp_models::hf::{load_hf, save_hf, ExportDtype, HfConfig};
use burn_dcp_models::{Gpt, GptConfig, RopeScaling, TpGpt};
use serde_json::Value;

use crate::checkpoint::{load_model, read_json, CheckpointFiles, TrainState};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::gpt::GptChunks;
use crate::model::CpTrain;

/// `--rope-scaling`: `none`, `linear:FACTOR` or `llama3:FACTOR,LOW,HIGH,ORIGINAL` (Hugging Face's
/// `factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
pub fn parse_rope_scaling(spec: &str) -> Result<Option<RopeScaling>, TrainError> {
    let bad = |why: &str| {
        TrainError::Config(format!(
            "--rope-scaling {spec}: {why} (none, linear:FACTOR or llama3:FACTOR,LOW,HIGH,ORIGINAL, e.g. llama3:8,1,4,8192)"
        ))
    };
    let (kind, values) = spec.split_once(':').unwrap_or((spec, ""));
    let numbers = || -> Result<Vec<f64>, TrainError> {
        values
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<f64>()
                    .map_err(|_| bad("a value is not a number"))
            })
            .collect()
    };
    let scaling = match kind {
        "none" if values.is_empty() => return Ok(None),
        "linear" => match numbers()?.as_slice() {
            [factor] => RopeScaling::Linear { factor: *factor },
            _ => return Err(bad("linear takes one factor")),
        },
        "llama3" => match numbers()?.as_slice() {
            [factor, low, high, original] if original.fract() == 0.0 && *original >= 1.0 => {
                RopeScaling::Llama3 {
                    factor: *factor,
                    low_freq_factor: *low,
                    high_freq_factor: *high,
                    original_max_position_embeddings: *original as usize,
                }
            }
            _ => {
                return Err(bad(
                    "llama3 takes four values, the last a whole number of positions",
                ))
            }
        },
        _ => return Err(bad("unknown type")),
    };
    scaling.validate()?;
    Ok(Some(scaling))
}

/// The configuration of a `config.json` file (`--model-config`, or a checkpoint's).
pub fn read_hf_config(path: &Path) -> Result<HfConfig, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::Config(format!("{} is not JSON: {e}", path.display())))?;
    HfConfig::from_json(json).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))
}

/// `model` with RoPE's base and scaling as `config` has them (`--rope-theta`, `--rope-scaling`
/// over the checkpoint's).
fn with_overrides(mut model: GptConfig, config: &TrainConfig) -> Result<GptConfig, TrainError> {
    if let Some(theta) = config.rope_theta {
        model.rope_theta = theta;
    }
    if let Some(spec) = &config.rope_scaling {
        model.rope_scaling = parse_rope_scaling(spec)?;
    }
    model
        .validate()
        .map_err(|e| TrainError::Config(e.to_string()))?;
    Ok(model)
}

/// The model a run trains: `config.architecture` (from `--model-config` / `--hf-checkpoint`) or
/// the preset `model_size`, with the RoPE overrides.
pub(crate) fn model_config(config: &TrainConfig) -> Result<GptConfig, TrainError> {
    let tokenizer_vocab = config.tokenizer()?.vocab_size();
    let model = match &config.architecture {
        Some(architecture) => {
            if architecture.vocab_size < tokenizer_vocab && config.data_path.is_empty() {
                return Err(TrainError::Config(format!(
                    "the model embeds {} token ids, fewer than the tokenizer's {tokenizer_vocab}: a token id of the data would fall outside it",
                    architecture.vocab_size
                )));
            }
            architecture.clone()
        }
        None => GptConfig::sized(&config.model_size, tokenizer_vocab)
            .map_err(|e| TrainError::Config(e.to_string()))?,
    };
    with_overrides(model, config)
}

/// The whole model of `config` from its checkpoint `dir` (`--hf-checkpoint`), on `device`: the
/// checkpoint's configuration must still be the run's (with the run's RoPE settings over it).
pub(crate) fn load_initial<B: Backend>(
    config: &TrainConfig,
    dir: &Path,
    device: &B::Device,
) -> Result<Gpt<B>, TrainError> {
    let (model, hf) = load_hf::<B>(dir, device)
        .map_err(|e| TrainError::Checkpoint(format!("--hf-checkpoint {}: {e}", dir.display())))?;
    let wanted = model_config(config)?;
    let found = with_overrides(hf.model, config)?;
    if found != wanted {
        return Err(TrainError::Checkpoint(format!(
            "--hf-checkpoint {}: its config.json no longer describes this run's model ({found:?} here, {wanted:?} when the run started)",
            dir.display()
        )));
    }
    Ok(model.with_rope(wanted.rope()))
}

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
