//! Whether a run fits the host's memory, said before anything is allocated: a model trained on
//! the CPU holds, per rank, its f32 weights, their gradients and AdamW's two moments (16 bytes a
//! parameter of its shard), and while it starts, the whole model it cuts its shard from (4 bytes
//! a parameter). A run that would not fit is refused with both numbers, rather than killed by the
//! kernel midway.

use crate::config::TrainConfig;
use crate::error::TrainError;

/// Bytes of the host's memory still available (Linux's `MemAvailable`), if known.
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The least memory `ranks` ranks of `config` take on the host when they train on the CPU: each
/// rank's shard of the parameters at 16 bytes (weights, gradients, two AdamW moments) plus the
/// whole model at 4 bytes while it is built. Activations come on top.
pub fn estimated_bytes(config: &TrainConfig, ranks: usize) -> Result<u64, TrainError> {
    let parameters = config.model_config()?.parameter_count() as u64;
    let shards = (config.tp * config.pp).max(1) as u64;
    Ok(ranks as u64 * (16 * parameters / shards + 4 * parameters))
}

/// Refuses a CPU run of `ranks` ranks in this process that cannot fit the available memory.
pub fn check_host_memory(config: &TrainConfig, ranks: usize) -> Result<(), TrainError> {
    let (Some(available), needed) = (available_bytes(), estimated_bytes(config, ranks)?) else {
        return Ok(());
    };
    if needed <= available {
        return Ok(());
    }
    let gb = |bytes: u64| bytes as f64 / 1e9;
    Err(TrainError::Config(format!(
        "{} model of {:.2} B parameters needs at least {:.2} GB on the CPU for {ranks} rank(s) in this process (f32 weights, gradients and AdamW moments: 16 bytes a parameter of each rank's shard, and the whole model while it is built), and this machine has {:.2} GB available: use a smaller model, more --tp or --pp ranks, processes on several machines, or a GPU (--backend cuda)",
        config.model_size,
        config.model_config()?.parameter_count() as f64 / 1e9,
        gb(needed),
        gb(available)
    )))
}
