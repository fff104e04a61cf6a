//! A [`Gpt`]'s weights as a Hugging Face checkpoint: transformers' tensor names
//! (`model.layers.{i}.self_attn.q_proj.weight`, …), projections in torch's `[out, in]` layout
//! (burn's `Linear` holds `[in, out]`), `model.safetensors` or, above [`SHARD_BYTES`], shards
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json`.
//!
//! Read: bf16, f16 or f32 tensors into f32; every tensor the configuration needs must be there
//! with its shape, and no other (transformers' `rotary_emb.inv_freq` buffers aside), else an error
//! names the tensor and both shapes. Written: into `DIR.tmp`, then renamed over `DIR` (a reader
//! sees the old checkpoint or the new one, never a part).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::{Backend, Tensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Value};

use crate::error::{io, ModelError};
use crate::gpt::{Block, Gpt};
use crate::hf::check::safetensors_files;
use crate::hf::config::HfConfig;

/// The largest shard written (transformers' default `max_shard_size`, 5 GB).
pub const SHARD_BYTES: usize = 5_000_000_000;

/// The dtype tensors are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    Bf16,
    F32,
}

impl ExportDtype {
    /// `bf16` or `f32` (`--export-dtype`).
    pub fn parse(name: &str) -> Result<Self, ModelError> {
        match name {
            "bf16" => Ok(Self::Bf16),
            "f32" => Ok(Self::F32),
            other => Err(ModelError::Config(format!(
                "--export-dtype {other}: expected bf16 or f32"
            ))),
        }
    }

    /// transformers' name of it (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F32 => "float32",
        }
    }

    fn bytes(self, values: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::Bf16 => values
                .iter()
                .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
                .collect(),
        }
    }
}

/// Round to nearest even, NaN kept a NaN.
fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// One tensor in transformers' layout, as f32 values.
struct Named {
    name: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Result<Vec<f32>, ModelError> {
    tensor
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| ModelError::Checkpoint(format!("reading a weight back: {e:?}")))
}

/// `model`'s tensors under transformers' names.
fn named_tensors<B: Backend>(model: &Gpt<B>) -> Result<Vec<Named>, ModelError> {
    let mut out = Vec::new();
    let mut matrix = |name: String, tensor: Tensor<B, 2>| -> Result<(), ModelError> {
        let shape = tensor.dims().to_vec();
        out.push(Named {
            name,
            shape,
            values: values(tensor)?,
        });
        Ok(())
    };
    matrix(
        "model.embed_tokens.weight".into(),
        model.embedding.weight.val(),
    )?;
    for (i, block) in model.blocks.iter().enumerate() {
        let prefix = format!("model.layers.{i}");
        let norm = |norm: &RmsNorm<B>| norm.gamma.val().unsqueeze::<2>();
        matrix(
            format!("{prefix}.input_layernorm.weight"),
            norm(&block.attn_norm),
        )?;
        matrix(
            format!("{prefix}.post_attention_layernorm.weight"),
            norm(&block.mlp_norm),
        )?;
        let projections = [
            ("self_attn.q_proj", Some(&block.q)),
            ("self_attn.k_proj", Some(&block.k)),
            ("self_attn.v_proj", Some(&block.v)),
            ("self_attn.o_proj", Some(&block.o)),
            ("mlp.gate_proj", block.gate.as_ref()),
            ("mlp.up_proj", Some(&block.up)),
            ("mlp.down_proj", Some(&block.down)),
        ];
        for (name, linear) in projections {
            let Some(linear) = linear else { continue };
            matrix(
                format!("{prefix}.{name}.weight"),
                linear.weight.val().transpose(),
            )?;
            if let Some(bias) = &linear.bias {
                matrix(format!("{prefix}.{name}.bias"), bias.val().unsqueeze())?;
            }
        }
    }
    matrix(
        "model.norm.weight".into(),
        model.norm.gamma.val().unsqueeze(),
    )?;
    if let Some(head) = &model.head {
        matrix("lm_head.weight".into(), head.weight.val().transpose())?;
    }
    // Norm gains and biases are vectors: drop the leading 1 the matrices above gave them.
    for named in &mut out {
        if named.name.ends_with("norm.weight") || named.name.ends_with(".bias") {
            named.shape.remove(0);
        }
    }
    Ok(out)
}

/// Writes `model` with `config` as a Hugging Face checkpoint in `dir` (replacing one there).
pub fn save_hf<B: Backend>(
    model: &Gpt<B>,
    config: &HfConfig,
    dir: &Path,
    dtype: ExportDtype,
) -> Result<(), ModelError> {
    let tensors = named_tensors(model)?;
    let tmp = sibling(dir, "tmp");
    remove_dir(&tmp)?;
    std::fs::create_dir_all(&tmp).map_err(|e| io("create", &tmp, e))?;
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|t| (t.name, t.shape, dtype.bytes(&t.values)))
        .collect();
    let sizes: Vec<usize> = encoded.iter().map(|(_, _, bytes)| bytes.len()).collect();
    let shards = shard(&sizes);
    let total: usize = encoded.iter().map(|(_, _, bytes)| bytes.len()).sum();
    let mut weight_map = BTreeMap::new();
    for (index, range) in shards.iter().enumerate() {
        let file = match shards.len() {
            1 => "model.safetensors".to_string(),
            n => format!("model-{:05}-of-{n:05}.safetensors", index + 1),
        };
        let views = encoded[range.clone()]
            .iter()
            .map(|(name, shape, bytes)| {
                let dtype = match dtype {
                    ExportDtype::Bf16 => Dtype::BF16,
                    ExportDtype::F32 => Dtype::F32,
                };
                weight_map.insert(name.clone(), file.clone());
                TensorView::new(dtype, shape.clone(), bytes)
                    .map(|view| (name.clone(), view))
                    .map_err(|e| ModelError::Checkpoint(format!("tensor {name}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = tmp.join(&file);
        safetensors::serialize_to_file(views, Some(metadata), &path)
            .map_err(|e| io("write", &path, e))?;
    }
    if shards.len() > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&tmp.join("model.safetensors.index.json"), &index)?;
    }
    write_json(
        &tmp.join("config.json"),
        &config.to_json(dtype.torch_name()),
    )?;
    commit(&tmp, dir)
}

/// Consecutive tensors of `sizes` bytes grouped into shards of at most [`SHARD_BYTES`] (a larger
/// tensor alone).
fn shard(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &size) in sizes.iter().enumerate() {
        if bytes > 0 && bytes + size > SHARD_BYTES {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    shards.push(start..sizes.len());
    shards
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    dir.with_file_name(format!("{name}.{suffix}"))
}

fn remove_dir(dir: &Path) -> Result<(), ModelError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", dir, e)),
        _ => Ok(()),
    }
}

fn write_json(path: &Path, value: &Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| io("encode", path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| io("write", path, e))
}

/// `tmp` → `dir`: the old `dir` moved aside first and removed after.
fn commit(tmp: &Path, dir: &Path) -> Result<(), ModelError> {
    let old = sibling(dir, "old");
    remove_dir(&old)?;
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(|e| io("move aside", dir, e))?;
    }
    std::fs::rename(tmp, dir).map_err(|e| io("move into place", tmp, e))?;
    remove_dir(&old)
}

/// The tensors of a checkpoint directory, file by file.
struct Files {
    /// Each file's bytes.
    files: Vec<(PathBuf, Vec<u8>)>,
}

impl Files {
    fn open(dir: &Path) -> Result<Self, ModelError> {
        let paths = safetensors_files(dir)?;
        let files = paths
            .into_iter()
            .map(|path| {
                let bytes = std::fs::read(&path).map_err(|e| io("read", &path, e))?;
                SafeTensors::deserialize(&bytes).map_err(|e| io("parse", &path, e))?;
                Ok((path, bytes))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self { files })
    }

    /// Every tensor: name → (file index, its view).
    fn views(&self) -> Result<BTreeMap<String, TensorView<'_>>, ModelError> {
        let mut views = BTreeMap::new();
        for (path, bytes) in &self.files {
            let tensors = SafeTensors::deserialize(bytes).map_err(|e| io("parse", path, e))?;
            for (name, view) in tensors.tensors() {
                if views.insert(name.clone(), view).is_some() {
                    return Err(io("read", path, format!("tensor {name} is in two files")));
                }
            }
        }
        Ok(views)
    }
}

fn to_f32(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, ModelError> {
    let data = view.data();
    let halves = || {
        data.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => halves()
            .map(|h| f32::from_bits(u32::from(h) << 16))
            .collect(),
        Dtype::F16 => halves().map(f16_to_f32).collect(),
        other => {
            return Err(ModelError::Checkpoint(format!(
                "tensor {name} is {other:?}: expected bf16, f16 or f32"
            )))
        }
    })
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let shift = m.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | (((m << shift) & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Takes the tensors a model needs out of a checkpoint, checking names and shapes.
struct Loader<'a, B: Backend> {
    views: BTreeMap<String, TensorView<'a>>,
    device: B::Device,
}

impl<B: Backend> Loader<'_, B> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let Some(view) = self.views.remove(name) else {
            return Err(ModelError::Checkpoint(format!(
                "tensor {name} is missing (expected shape {shape:?})"
            )));
        };
        if view.shape() != shape {
            return Err(ModelError::Checkpoint(format!(
                "tensor {name} has shape {:?}, the configuration needs {shape:?}",
                view.shape()
            )));
        }
        to_f32(name, &view)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor<B, 1>, ModelError> {
        let values = self.take(name, &[len])?;
        Ok(Tensor::from_data(
            TensorData::new(values, [len]),
            &self.device,
        ))
    }

    fn norm(&mut self, name: &str, d: usize, epsilon: f64) -> Result<RmsNorm<B>, ModelError> {
        Ok(RmsNorm {
            gamma: Param::from_tensor(self.vector(name, d)?),
            epsilon,
        })
    }

    /// A projection of torch's `[out, in]` as burn's `[in, out]`.
    fn linear(
        &mut self,
        name: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Linear<B>, ModelError> {
        let values = self.take(&format!("{name}.weight"), &[d_out, d_in])?;
        let weight: Tensor<B, 2> =
            Tensor::from_data(TensorData::new(values, [d_out, d_in]), &self.device);
        let bias = match bias {
            true => Some(Param::from_tensor(
                self.vector(&format!("{name}.bias"), d_out)?,
            )),
            false => None,
        };
        Ok(Linear {
            // A leaf of its own: on an autodiff backend a parameter is no operation's output.
            weight: Param::from_tensor(weight.transpose().detach()),
            bias,
        })
    }
}

/// Reads the checkpoint in `dir` (`config.json` and the safetensors) into a [`Gpt`] on `device`.
pub fn load_hf<B: Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<(Gpt<B>, HfConfig), ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io("read", &path, e))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| io("parse", &path, e))?;
    let config = HfConfig::from_json(json)?;
    let files = Files::open(dir)?;
    let mut loader = Loader::<B> {
        views: files.views()?,
        device: device.clone(),
    };
    let m = &config.model;
    let (d, ff, eps) = (m.d_model, m.d_ff, m.rms_norm_eps);
    let (q_dim, kv_dim) = (m.n_heads * m.head_dim(), m.n_kv_heads * m.head_dim());
    let embed = loader.take("model.embed_tokens.weight", &[m.vocab_size, d])?;
    let embedding = Embedding {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(embed, [m.vocab_size, d]),
            device,
        )),
    };
    let mut blocks = Vec::with_capacity(m.n_layers);
    for i in 0..m.n_layers {
        let p = format!("model.layers.{i}");
        let bias = m.attention_bias;
        blocks.push(Block {
            attn_norm: loader.norm(&format!("{p}.input_layernorm.weight"), d, eps)?,
            q: loader.linear(&format!("{p}.self_attn.q_proj"), d, q_dim, bias)?,
            k: loader.linear(&format!("{p}.self_attn.k_proj"), d, kv_dim, bias)?,
            v: loader.linear(&format!("{p}.self_attn.v_proj"), d, kv_dim, bias)?,
            o: loader.linear(&format!("{p}.self_attn.o_proj"), q_dim, d, false)?,
            mlp_norm: loader.norm(&format!("{p}.post_attention_layernorm.weight"), d, eps)?,
            gate: Some(loader.linear(&format!("{p}.mlp.gate_proj"), d, ff, false)?),
            up: loader.linear(&format!("{p}.mlp.up_proj"), d, ff, false)?,
            down: loader.linear(&format!("{p}.mlp.down_proj"), ff, d, false)?,
        });
    }
    let norm = loader.norm("model.norm.weight", d, eps)?;
    let head = match m.tied_embeddings {
        true => {
            // transformers writes no lm_head for a tied model; one equal to the embedding is
            // accepted (some exporters write both).
            loader.views.remove("lm_head.weight");
            None
        }
        false => Some(loader.linear("lm_head", d, m.vocab_size, false)?),
    };
    let extra: Vec<&String> = loader
        .views
        .keys()
        .filter(|name| !name.ends_with("rotary_emb.inv_freq"))
        .collect();
    if let Some(name) = extra.first() {
        return Err(ModelError::Checkpoint(format!(
            "tensor {name} (shape {:?}) is not part of a {} of this configuration{}",
            loader.views[*name].shape(),
            config.architecture.class(),
            match extra.len() {
                1 => String::new(),
                n => format!(" ({} unexpected tensors in all)", n),
            }
        )));
    }
    let model = Gpt {
        embedding,
        blocks,
        norm,
        head,
        n_heads: m.n_heads,
        n_kv_heads: m.n_kv_heads,
        head_dim: m.head_dim(),
        rope_theta: m.rope_theta,
        rope_scaling: m.rope_scaling.clone(),
    };
    Ok((model, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_conversions() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80, "ties to even");
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(f32::from_bits(u32::from(f32_to_bf16(f32::NAN)) << 16).is_nan());
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    }

    #[test]
    fn shards_stay_under_the_limit() {
        let big = SHARD_BYTES / 2 + 1;
        let shards = shard(&[big, big, 10, SHARD_BYTES * 2]);
        assert_eq!(shards, vec![0..1, 1..3, 3..4]);
    }
}
