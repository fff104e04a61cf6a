//! Checkpoints: sharded over TP and PP, written atomically by rank 0, resumed with checks.

use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::prelude::TensorData;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::comm::panic_message;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::files::{read_json, write_json};
use crate::groups::RankGroups;
use crate::heartbeat::{await_commit, leader_with_heartbeats, received_bytes};

/// Where a run keeps its checkpoint.
pub(crate) fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// Saved training state besides the weights: the last completed step, and what the checkpoint
/// holds (absent in checkpoints written before these fields existed).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    pub step: usize,
    #[serde(default)]
    pub config: Option<TrainConfig>,
    /// The model's configuration ([`TrainConfig::model_identity`]).
    #[serde(default)]
    pub model: Option<serde_json::Value>,
    /// Where the run stands in its token files (`--data-path`): a resumed run checks that it
    /// reads the same files in the same order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<burn_dcp_datasets::DataState>,
}

/// A resumed run reads the same data as the saved one: the same files with the same sizes and
/// windows, each having given as many micro-batches at the saved step.
pub(crate) fn check_data_state(
    saved: Option<&burn_dcp_datasets::DataState>,
    now: Option<&burn_dcp_datasets::DataState>,
    checkpoint: &Path,
) -> Result<(), TrainError> {
    match (saved, now) {
        (Some(saved), Some(now)) if saved != now => Err(TrainError::Checkpoint(format!(
            "the training data differ from those of the checkpoint in {}: it read {}, this run \
             reads {} (a token file changed size, or --seq-len, --eval-tokens or the blend \
             changed)",
            checkpoint.display(),
            serde_json::to_string(saved).unwrap_or_default(),
            serde_json::to_string(now).unwrap_or_default()
        ))),
        _ => Ok(()),
    }
}

/// The checkpoint to load from the run directory `dir`: `checkpoint/`, or `checkpoint.old/` when
/// a save was cut between its two renames (see `save_checkpoint`).
pub fn saved_checkpoint(dir: &Path) -> Result<PathBuf, TrainError> {
    let current = checkpoint_dir(dir);
    if current.join("state.json").is_file() {
        return Ok(current);
    }
    let previous = dir.join("checkpoint.old");
    if previous.join("state.json").is_file() {
        return Ok(previous);
    }
    Err(TrainError::Checkpoint(format!(
        "{} holds no checkpoint (no {})",
        dir.display(),
        current.join("state.json").display()
    )))
}

/// Checks that the run saved in `dir` can continue under `config` and returns its saved step: the
/// checkpoint never moves backwards (`config.steps` ≥ the saved step), and the saved model has
/// the shape `config` describes (config.json may have been edited).
pub fn check_resume(dir: &Path, config: &TrainConfig) -> Result<usize, TrainError> {
    let checkpoint = saved_checkpoint(dir)?;
    let state: TrainState = read_json(&checkpoint.join("state.json"))?;
    if config.steps < state.step {
        return Err(TrainError::Config(format!(
            "--steps {} is below the step {} of the checkpoint in {}: a checkpoint never moves backwards (use --steps {} or more, or --out to start a new run)",
            config.steps,
            state.step,
            checkpoint.display(),
            state.step
        )));
    }
    if let Some(saved) = &state.model {
        let wanted = config.model_identity()?;
        let differences = model_differences(saved, &wanted);
        if !differences.is_empty() {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint in {} holds a different model than the configuration asks for ({}): {}",
                checkpoint.display(),
                dir.join("config.json").display(),
                differences.join(", ")
            )));
        }
    }
    Ok(state.step)
}

/// `field: checkpoint X, configuration Y` for every field where the two models differ (compared
/// through their JSON form, so every field of the configuration counts).
pub(crate) fn model_differences(
    saved: &serde_json::Value,
    wanted: &serde_json::Value,
) -> Vec<String> {
    let fields = |config: &serde_json::Value| match config {
        serde_json::Value::Object(fields) => fields.clone(),
        _ => serde_json::Map::new(),
    };
    let (saved, wanted) = (fields(saved), fields(wanted));
    wanted
        .iter()
        .filter(|(name, value)| saved.get(*name) != Some(value))
        .map(|(name, value)| {
            let old = saved
                .get(name)
                .map_or("(missing)".into(), |v| v.to_string());
            format!("{name}: checkpoint {old}, configuration {value}")
        })
        .collect()
}

pub(crate) type Recorder_ = NamedMpkFileRecorder<FullPrecisionSettings>;

/// Records to bytes exactly what `Recorder_` writes to a file (named MessagePack).
pub(crate) type BytesRecorder_ = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// `model` with the weights of `file` in the checkpoint directory `checkpoint`.
pub(crate) fn load_model<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: M,
    checkpoint: &Path,
    file: &str,
    device: &B::Device,
) -> Result<M, TrainError> {
    // burn's record loader panics on a record of another shape (a checkpoint older than the
    // shape check of `check_resume`): turn that into an error.
    let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.load_file(checkpoint.join(file), &Recorder_::new(), device)
    }))
    .map_err(|panic| {
        TrainError::Checkpoint(format!(
            "the model checkpoint in {} does not fit the configured model: {}",
            checkpoint.display(),
            panic_message(&*panic)
        ))
    })?;
    loaded.map_err(|e| {
        TrainError::Checkpoint(format!(
            "cannot load the model checkpoint from {}: {e}",
            checkpoint.display()
        ))
    })
}

/// The file names of one (TP rank, pipeline stage)'s shard in a checkpoint: `model` and
/// `optimizer`, with `-tp{r}` when tp > 1 and `-pp{s}` when pp > 1 (`model-tp1-pp0`).
pub(crate) struct CheckpointFiles {
    pub(crate) model: String,
    pub(crate) optimizer: String,
}

impl CheckpointFiles {
    pub(crate) fn of(config: &TrainConfig, tp_rank: usize, pp_rank: usize) -> Self {
        let mut suffix = String::new();
        if config.tp > 1 {
            suffix += &format!("-tp{tp_rank}");
        }
        if config.pp > 1 {
            suffix += &format!("-pp{pp_rank}");
        }
        Self {
            model: format!("model{suffix}"),
            optimizer: format!("optimizer{suffix}"),
        }
    }
}

/// What a checkpoint holds from one rank.
pub(crate) struct Checkpoint<'a, M, O> {
    pub(crate) out: &'a Path,
    pub(crate) model: &'a M,
    pub(crate) optimizer: &'a O,
    pub(crate) state: &'a TrainState,
    pub(crate) files: &'a CheckpointFiles,
    /// Checkpoints kept (`--keep-checkpoints`).
    pub(crate) keep: usize,
    /// The largest message (`--checkpoint-chunk-bytes`).
    pub(crate) chunk_bytes: usize,
    /// How often rank 0 says it is still writing (within the communication timeout).
    pub(crate) heartbeat: std::time::Duration,
    /// How long the other ranks wait for the commit in all (`--checkpoint-timeout-secs`).
    pub(crate) commit_limit: std::time::Duration,
    /// Told of the committed checkpoint (rank 0).
    pub(crate) observer: &'a dyn crate::metrics::StepObserver,
}

/// Saves the checkpoint atomically, sharded over TP and PP. The first rank of every (TP, PP)
/// position's pool records its shard (model and optimizer) to bytes and sends them to world rank
/// 0, which alone touches the file system (under MPI the ranks may be on other nodes). No
/// message is longer than `chunk_bytes` (`--checkpoint-chunk-bytes`): a file travels as a header
/// (its length, its chunk count and its name) and then its chunks, which rank 0 appends to the
/// file as they arrive, so it holds one chunk of another rank's shard at a time. Rank 0 writes
/// every shard to `checkpoint.tmp/`, then `state.json`, renames the old `checkpoint/` to
/// `checkpoint.old/`, `checkpoint.tmp/` to `checkpoint/`, and removes the old one. A run killed
/// at any point leaves a complete checkpoint (the old or the new) behind.
pub(crate) fn save_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>, O: Optimizer<M, B>>(
    groups: &RankGroups,
    saved: &Checkpoint<'_, M, O>,
) -> Result<(), TrainError> {
    let world = &groups.mesh.world;
    // The shard this rank owns, as (file name, bytes) pairs.
    let owner = groups.world.rank() == 0;
    let mut shard = Vec::new();
    if owner {
        let bytes = BytesRecorder_::default();
        let model = Recorder::<B>::record(&bytes, saved.model.clone().into_record(), ())
            .map_err(|e| TrainError::Model(format!("cannot record the model: {e}")))?;
        let optimizer = Recorder::<B>::record(&bytes, saved.optimizer.to_record(), ())
            .map_err(|e| TrainError::Model(format!("cannot record the optimizer: {e}")))?;
        shard.push((format!("{}.mpk", saved.files.model), model));
        shard.push((format!("{}.mpk", saved.files.optimizer), optimizer));
    }
    let owners = world.all_gather_control("checkpoint owners", vec![owner as u8])?;
    let chunk = saved.chunk_bytes;
    if world.rank() != 0 {
        let mut sends = Vec::new();
        for (name, bytes) in &shard {
            let header = ChunkHeader::new(name, bytes.len(), chunk).encode();
            let header_len = header.len();
            sends.push(world.isend(0, TensorData::new(header, [header_len]).into())?);
            for part in bytes.chunks(chunk) {
                let part = part.to_vec();
                let len = part.len();
                sends.push(world.isend(0, TensorData::new(part, [len]).into())?);
            }
        }
        // Rank 0 may write for longer than the communication timeout: it says so while it does.
        await_commit(world, saved.commit_limit)?;
        for send in sends {
            send.wait()?;
        }
        return Ok(());
    }
    leader_with_heartbeats(world, saved.heartbeat, || {
        gather_and_write(world, saved, shard, &owners)
    })
}

/// Rank 0's part of [`save_checkpoint`]: its own shard and every other owner's, chunk by chunk,
/// into `checkpoint.tmp/`, then the commit.
fn gather_and_write<M, O>(
    world: &burn_dcp::comm::Comm,
    saved: &Checkpoint<'_, M, O>,
    shard: Vec<(String, Vec<u8>)>,
    owners: &[Vec<u8>],
) -> Result<(), TrainError> {
    let writer = CheckpointWriter::begin(saved.out)?;
    for (name, bytes) in &shard {
        writer.write(name, bytes)?;
    }
    drop(shard);
    for (rank, flag) in owners.iter().enumerate() {
        if rank == 0 || flag.first() != Some(&1) {
            continue;
        }
        for _ in 0..2 {
            let header = ChunkHeader::decode(&received_bytes(world.irecv(rank)?.wait()?)?)?;
            let mut file = writer.create(&header.name)?;
            let mut written = 0;
            for _ in 0..header.chunks {
                let part = received_bytes(world.irecv(rank)?.wait()?)?;
                written += part.len();
                file.write_all(&part)
                    .map_err(|e| TrainError::io("write", writer.tmp.join(&header.name), e))?;
            }
            if written != header.len {
                return Err(TrainError::Malformed(format!(
                    "checkpoint file {} from rank {rank}: {written} bytes arrived, {} announced",
                    header.name, header.len
                )));
            }
        }
    }
    writer.commit(saved.state, saved.keep)?;
    saved
        .observer
        .on_checkpoint(saved.state.step, &checkpoint_dir(saved.out))
}

/// What precedes a checkpoint file's chunks: its length, its chunk count and its name.
#[derive(Debug, PartialEq, Eq)]
struct ChunkHeader {
    len: usize,
    chunks: usize,
    name: String,
}

impl ChunkHeader {
    fn new(name: &str, len: usize, chunk: usize) -> Self {
        Self {
            len,
            chunks: len.div_ceil(chunk),
            name: name.to_string(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(16 + self.name.len());
        bytes.extend((self.len as u64).to_le_bytes());
        bytes.extend((self.chunks as u64).to_le_bytes());
        bytes.extend(self.name.as_bytes());
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<Self, TrainError> {
        let malformed = || {
            TrainError::Malformed(format!(
                "a malformed checkpoint file header of {} bytes",
                bytes.len()
            ))
        };
        if bytes.len() < 16 {
            return Err(malformed());
        }
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        let name = String::from_utf8(bytes[16..].to_vec()).map_err(|_| malformed())?;
        // A file name of the checkpoint, never a path.
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(malformed());
        }
        Ok(Self {
            len: word(0),
            chunks: word(8),
            name,
        })
    }
}

/// Rank 0's side of [`save_checkpoint`]: files into `checkpoint.tmp/`, then [`Self::commit`].
pub(crate) struct CheckpointWriter<'a> {
    out: &'a Path,
    tmp: PathBuf,
}

impl<'a> CheckpointWriter<'a> {
    /// An empty `checkpoint.tmp/` under `out` (a leftover of a cut save removed first).
    pub(crate) fn begin(out: &'a Path) -> Result<Self, TrainError> {
        let tmp = out.join("checkpoint.tmp");
        remove_dir(&tmp)?;
        std::fs::create_dir_all(&tmp).map_err(|e| TrainError::io("create", &tmp, e))?;
        Ok(Self { out, tmp })
    }

    /// A new file `name` to append to.
    fn create(&self, name: &str) -> Result<std::fs::File, TrainError> {
        let path = self.tmp.join(name);
        std::fs::File::create(&path).map_err(|e| TrainError::io("create", &path, e))
    }

    pub(crate) fn write(&self, name: &str, bytes: &[u8]) -> Result<(), TrainError> {
        let path = self.tmp.join(name);
        std::fs::write(&path, bytes).map_err(|e| TrainError::io("write", &path, e))
    }

    /// `state.json`, then the atomic swap of directories (`checkpoint/` → `checkpoint.old/`,
    /// `checkpoint.tmp/` → `checkpoint/`); the old one kept as `checkpoint-<step>/` while fewer
    /// than `keep` exist, else removed. Every directory a resume or a user reads is complete: a
    /// directory is removed only after a rename to a `.removing` name.
    pub(crate) fn commit(self, state: &TrainState, keep: usize) -> Result<(), TrainError> {
        let (out, tmp) = (self.out, &self.tmp);
        let (dir, old) = (checkpoint_dir(out), out.join("checkpoint.old"));
        let io = |what: &'static str, path: &Path, e: std::io::Error| TrainError::io(what, path, e);
        write_json(&tmp.join("state.json"), state)?;
        if dir.exists() {
            remove_dir(&old)?;
            std::fs::rename(&dir, &old).map_err(|e| io("move aside", &dir, e))?;
        }
        std::fs::rename(tmp, &dir).map_err(|e| io("move into place", tmp, e))?;
        if old.exists() {
            if keep > 1 {
                let previous: TrainState = read_json(&old.join("state.json"))?;
                let archive = out.join(format!("checkpoint-{:08}", previous.step));
                remove_dir(&archive)?;
                std::fs::rename(&old, &archive).map_err(|e| io("keep", &old, e))?;
            } else {
                remove_dir(&old)?;
            }
        }
        // The newest keep − 1 archives stay beside `checkpoint/`.
        for (_, path) in archived_checkpoints(out)?
            .iter()
            .rev()
            .skip(keep.saturating_sub(1))
        {
            remove_dir(path)?;
        }
        Ok(())
    }
}

/// The run's archived checkpoints (`checkpoint-<step>/`), by step.
fn archived_checkpoints(out: &Path) -> Result<Vec<(usize, PathBuf)>, TrainError> {
    let entries = std::fs::read_dir(out).map_err(|e| TrainError::io("list", out, e))?;
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Removes a directory (if there) after renaming it to `<name>.removing`, so that a run killed
/// while removing never leaves a partial directory under a checkpoint's name.
fn remove_dir(path: &Path) -> Result<(), TrainError> {
    if !path.exists() {
        return Ok(());
    }
    let removing = path.with_extension("removing");
    let io = |what: &'static str, path: &Path, e: std::io::Error| TrainError::io(what, path, e);
    if removing.exists() {
        std::fs::remove_dir_all(&removing).map_err(|e| io("remove", &removing, e))?;
    }
    std::fs::rename(path, &removing).map_err(|e| io("move aside", path, e))?;
    std::fs::remove_dir_all(&removing).map_err(|e| io("remove", &removing, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_headers_round_trip_and_refuse_paths() {
        let header = ChunkHeader::new("model-tp1-pp0.mpk", 2500, 1000);
        assert_eq!(header.chunks, 3);
        assert_eq!(ChunkHeader::decode(&header.encode()).unwrap(), header);
        assert_eq!(ChunkHeader::new("empty.mpk", 0, 1000).chunks, 0);
        for name in ["../model.mpk", "a/b", ".hidden", ""] {
            let bytes = ChunkHeader::new(name, 1, 1).encode();
            let err = ChunkHeader::decode(&bytes).unwrap_err().to_string();
            assert!(
                err.contains("malformed checkpoint file header"),
                "{name}: {err}"
            );
        }
        assert!(ChunkHeader::decode(&[0; 15]).is_err());
    }
}
