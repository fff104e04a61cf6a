//! A checkpoint checked against a configuration from its safetensors headers alone (no tensor
//! read): what a run verifies before it writes anything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{io, ModelError};
use crate::gpt::{GptConfig, Mlp};

/// The safetensors files of `dir`: those the index names, or `model.safetensors`.
pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| io("read", &index, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| io("parse", &index, e))?;
        let Some(map) = json["weight_map"].as_object() else {
            return Err(io("read", &index, "it has no weight_map object"));
        };
        let mut files: Vec<&str> = map.values().filter_map(Value::as_str).collect();
        files.sort_unstable();
        files.dedup();
        Ok(files.into_iter().map(|f| dir.join(f)).collect())
    } else if single.exists() {
        Ok(vec![single])
    } else {
        Err(ModelError::Checkpoint(format!(
            "{} holds neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        )))
    }
}

/// Every tensor a checkpoint of `config` holds, with its shape in transformers' layout.
pub fn expected_tensors(config: &GptConfig) -> Vec<(String, Vec<usize>)> {
    let (d, ff, v) = (config.d_model, config.d_ff, config.vocab_size);
    let (q, kv) = (
        config.n_heads * config.head_dim(),
        config.n_kv_heads * config.head_dim(),
    );
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), vec![v, d])];
    for i in 0..config.n_layers {
        let p = format!("model.layers.{i}");
        tensors.push((format!("{p}.input_layernorm.weight"), vec![d]));
        tensors.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        for (name, out, inp) in [("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d)] {
            tensors.push((format!("{p}.self_attn.{name}.weight"), vec![out, inp]));
            if config.attention_bias {
                tensors.push((format!("{p}.self_attn.{name}.bias"), vec![out]));
            }
        }
        tensors.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q]));
        if config.mlp == Mlp::Swiglu {
            tensors.push((format!("{p}.mlp.gate_proj.weight"), vec![ff, d]));
        }
        tensors.push((format!("{p}.mlp.up_proj.weight"), vec![ff, d]));
        tensors.push((format!("{p}.mlp.down_proj.weight"), vec![d, ff]));
    }
    tensors.push(("model.norm.weight".into(), vec![d]));
    if !config.tied_embeddings {
        tensors.push(("lm_head.weight".into(), vec![v, d]));
    }
    tensors
}

/// One tensor of a safetensors header.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// The tensors of a safetensors file from its header alone (no data read), checking that the
/// file holds every byte the header promises (a truncated file is named).
fn header_tensors(path: &Path) -> Result<Vec<(String, HeaderEntry)>, ModelError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| io("open", path, e))?;
    let size = file.metadata().map_err(|e| io("read", path, e))?.len() as usize;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| {
        io(
            "read",
            path,
            "shorter than a safetensors header (truncated?)",
        )
    })?;
    let len = u64::from_le_bytes(len) as usize;
    if len > size.saturating_sub(8) || len > 100 << 20 {
        return Err(io(
            "read",
            path,
            format!("its header of {len} bytes does not fit a file of {size} bytes (truncated?)"),
        ));
    }
    let mut header = vec![0u8; len];
    file.read_exact(&mut header)
        .map_err(|e| io("read", path, e))?;
    let mut entries: serde_json::Map<String, Value> =
        serde_json::from_slice(&header).map_err(|e| io("parse the header of", path, e))?;
    entries.remove("__metadata__");
    let mut tensors = Vec::with_capacity(entries.len());
    let mut end = 0;
    for (name, entry) in entries {
        let entry: HeaderEntry = serde_json::from_value(entry)
            .map_err(|e| io("parse the header of", path, format!("tensor {name}: {e}")))?;
        end = end.max(entry.data_offsets[1]);
        tensors.push((name, entry));
    }
    if 8 + len + end > size {
        return Err(io(
            "read",
            path,
            format!(
                "its tensors need {} bytes, the file has {size} (truncated?)",
                8 + len + end
            ),
        ));
    }
    Ok(tensors)
}

/// Checks the checkpoint in `dir` against `config` from the safetensors headers alone (cheap:
/// before a run writes anything): every tensor there with its shape and a dtype of bf16, f16 or
/// f32, none missing, none extra (transformers' `rotary_emb.inv_freq` buffers aside), no file
/// truncated. The error names the tensor and both shapes.
pub fn check_hf(dir: &Path, config: &GptConfig) -> Result<(), ModelError> {
    let mut found = BTreeMap::new();
    for path in safetensors_files(dir)? {
        for (name, entry) in header_tensors(&path)? {
            found.insert(name, entry);
        }
    }
    for (name, shape) in expected_tensors(config) {
        let Some(entry) = found.remove(&name) else {
            return Err(ModelError::Checkpoint(format!(
                "{}: tensor {name} is missing (expected shape {shape:?})",
                dir.display()
            )));
        };
        if entry.shape != shape {
            return Err(ModelError::Checkpoint(format!(
                "{}: tensor {name} has shape {:?}, the configuration needs {shape:?}",
                dir.display(),
                entry.shape
            )));
        }
        if !matches!(entry.dtype.as_str(), "BF16" | "F16" | "F32") {
            return Err(ModelError::Checkpoint(format!(
                "{}: tensor {name} is {}: expected bf16, f16 or f32",
                dir.display(),
                entry.dtype
            )));
        }
    }
    // A tied model's lm_head equal to the embedding is accepted (some exporters write both).
    if config.tied_embeddings {
        found.remove("lm_head.weight");
    }
    found.retain(|name, _| !name.ends_with("rotary_emb.inv_freq"));
    match found.iter().next() {
        Some((name, entry)) => Err(ModelError::Checkpoint(format!(
            "{}: tensor {name} (shape {:?}) is not part of this configuration's model{}",
            dir.display(),
            entry.shape,
            match found.len() {
                1 => String::new(),
                n => format!(" ({n} unexpected tensors in all)"),
            }
        ))),
        None => Ok(()),
    }
}
