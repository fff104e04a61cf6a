//! A run's files: JSON read, and written atomically (a temporary file renamed over the old), and
//! the rule that an output directory holds one run.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| TrainError::Malformed(format!("{} is not valid: {e}", path.display())))
}

/// Writes `value` as JSON atomically (a temporary file renamed over `path`).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), TrainError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| TrainError::Malformed(format!("{}: {e}", path.display())))?;
    write_atomically(path, text.as_bytes())
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader (or a run killed while writing) sees the old or the new content, never a mix.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| TrainError::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::io("write", path, e))
}

/// `--out DIR` must not overwrite another run: a directory holding a run's files (config.json,
/// metrics.jsonl, a checkpoint) is only written to when it is the run being resumed.
pub fn refuse_overwrite(out: &Path, resume: Option<&Path>) -> Result<(), TrainError> {
    if resume.is_some_and(|dir| same_dir(dir, out)) {
        return Ok(());
    }
    let files = [
        "config.json",
        "metrics.jsonl",
        "checkpoint",
        "checkpoint.old",
    ];
    if let Some(found) = files.iter().find(|name| out.join(name).exists()) {
        return Err(TrainError::Config(format!(
            "--out {} already holds a run ({found} exists): use --resume {} to continue it, or choose another --out",
            out.display(),
            out.display()
        )));
    }
    Ok(())
}

/// Whether `a` and `b` name the same directory (as written, where either does not exist).
pub fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}
