//! The inputs: random ones (Mode 1, sized against this machine's memory first) or read from a
//! safetensors file (Mode 2, see `INPUT_LAYOUT`), and Mode 2's outputs written back.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(crate) fn random_inputs(args: &Args, strategy: Strategy) -> Result<PackedInputs, String> {
    let kv_heads = args.kv_heads.unwrap_or(args.heads);
    if args.seqlens.is_empty() || args.head_dim == 0 || args.heads == 0 {
        return Err("--seqlens, --heads and --head-dim must be non-empty / positive".into());
    }
    strategy
        .validate_heads(args.heads, kv_heads, args.cp)
        .map_err(|e| e.to_string())?;
    let t = check_size(
        &args.seqlens,
        [args.heads, kv_heads, args.head_dim, args.head_dim],
        args.cp,
    )?;
    if t == 0 {
        return Err(format!(
            "--seqlens {:?} hold no token: at least one sequence needs a token",
            args.seqlens
        ));
    }
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let d = args.head_dim;
    let mut values = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    Ok(PackedInputs {
        seq_lens: args.seqlens.clone(),
        heads: args.heads,
        kv_heads,
        head_dim: d,
        value_dim: d,
        q: values(t * args.heads * d),
        k: values(t * kv_heads * d),
        v: values(t * kv_heads * d),
        dout: values(t * args.heads * d),
    })
}

/// Checks that a run of `seq_lens` tokens with `[heads, kv_heads, head_dim, value_dim]` on `cp`
/// ranks fits: sums and products must not overflow, and the estimated memory (inputs, the
/// single-device reference, per-rank shards, gathered keys/values and outputs, all f32) must
/// fit in the memory this machine has available. Returns the token count.
pub(crate) fn check_size(seq_lens: &[usize], dims: [usize; 4], cp: usize) -> Result<usize, String> {
    let [heads, kv_heads, head_dim, value_dim] = dims.map(|d| d as u128);
    let tokens = seq_lens
        .iter()
        .try_fold(0usize, |sum, &len| sum.checked_add(len))
        .ok_or_else(|| format!("--seqlens {seq_lens:?}: the total token count overflows"))?;
    // Per token: q, dout, out, dq (H·D or H·Dv each) and lse (H), six copies over the run
    // (inputs, reference, shards, results); k, v, dk, dv (K·(D+Dv)), once per rank when
    // gathered, plus four copies.
    let per_token = 6 * heads * (2 * head_dim + 2 * value_dim + 1)
        + (cp as u128 + 4) * 2 * kv_heads * (head_dim + value_dim);
    let estimate = 4 * tokens as u128 * per_token;
    let limit = available_memory();
    if estimate > limit as u128 {
        return Err(format!(
            "{tokens} tokens × {heads} heads ({kv_heads} kv heads) × head dim {head_dim} on cp {cp} needs about {} of memory, more than the {} available: use fewer tokens, heads or a smaller head dim",
            gib(estimate),
            gib(limit as u128)
        ));
    }
    Ok(tokens)
}

/// Memory this process may use: `MemAvailable` of /proc/meminfo (16 GiB when unreadable).
pub(crate) fn available_memory() -> u64 {
    let kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemAvailable:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        });
    kib.map_or(16 << 30, |kib| kib.saturating_mul(1024))
}

pub(crate) fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Reads a float tensor as f32 values with its shape.
pub(crate) fn read_float(
    file: &SafeTensors<'_>,
    name: &str,
    path: &Path,
) -> Result<(Vec<f32>, Vec<usize>), String> {
    let view = file.tensor(name).map_err(|e| {
        format!(
            "{}: tensor '{name}' is missing or unreadable ({e})",
            path.display()
        )
    })?;
    let dtype = match view.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        other => {
            return Err(format!(
                "{}: tensor '{name}' has dtype {other:?}; expected f32 (or f16/bf16/f64)",
                path.display()
            ))
        }
    };
    let shape = view.shape().to_vec();
    let data =
        TensorData::from_bytes_vec(view.data().to_vec(), shape.clone(), dtype).convert::<f32>();
    let values = data
        .into_vec::<f32>()
        .map_err(|e| format!("{}: tensor '{name}': {e:?}", path.display()))?;
    Ok((values, shape))
}

pub(crate) fn read_cu_seqlens(file: &SafeTensors<'_>, path: &Path) -> Result<Vec<i64>, String> {
    let view = file.tensor("cu_seqlens").map_err(|e| {
        format!(
            "{}: tensor 'cu_seqlens' is missing or unreadable ({e})",
            path.display()
        )
    })?;
    if view.shape().len() != 1 {
        return Err(format!(
            "{}: cu_seqlens has shape {:?}; expected a vector [S+1]",
            path.display(),
            view.shape()
        ));
    }
    let bytes = view.data();
    match view.dtype() {
        Dtype::I64 => Ok(bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()),
        Dtype::I32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
            .collect()),
        other => Err(format!(
            "{}: cu_seqlens has dtype {other:?}; expected i64 or i32",
            path.display()
        )),
    }
}

pub(crate) fn read_inputs(path: &Path) -> Result<PackedInputs, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a safetensors file: {e}", path.display()))?;
    let (q, q_shape) = read_float(&file, "q", path)?;
    let (k, k_shape) = read_float(&file, "k", path)?;
    let (v, v_shape) = read_float(&file, "v", path)?;
    let (dout, dout_shape) = read_float(&file, "dout", path)?;
    let bad = |reason: String| Err(format!("{}: {reason}", path.display()));
    if q_shape.len() != 3 || k_shape.len() != 3 || v_shape.len() != 3 {
        return bad(format!(
            "q {q_shape:?}, k {k_shape:?}, v {v_shape:?} must be rank 3 [T, heads, dim]"
        ));
    }
    let [t, heads, head_dim] = [q_shape[0], q_shape[1], q_shape[2]];
    if t == 0 || heads == 0 || head_dim == 0 || k_shape[1] == 0 || v_shape[2] == 0 {
        return bad(format!(
            "q {q_shape:?}, k {k_shape:?}, v {v_shape:?}: tokens, heads, kv heads, head dim and value dim must all be at least 1"
        ));
    }
    if k_shape[0] != t || v_shape[0] != t || k_shape[2] != head_dim || v_shape[..2] != k_shape[..2]
    {
        return bad(format!("q {q_shape:?}, k {k_shape:?}, v {v_shape:?} disagree: expected k and v [{t}, K, {head_dim}]"));
    }
    if dout_shape != [t, heads, v_shape[2]] {
        return bad(format!(
            "dout {dout_shape:?} must be {:?}",
            [t, heads, v_shape[2]]
        ));
    }
    let cu_seqlens = read_cu_seqlens(&file, path)?;
    let seq_lens =
        validate_cu_seqlens(&cu_seqlens, t).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(PackedInputs {
        seq_lens,
        heads,
        kv_heads: k_shape[1],
        head_dim,
        value_dim: v_shape[2],
        q,
        k,
        v,
        dout,
    })
}

pub(crate) fn write_outputs(
    path: &Path,
    x: &PackedInputs,
    outputs: &PackedOutputs,
) -> Result<(), String> {
    let t = x.tokens();
    let bytes = |values: &[f32]| {
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let tensors = [
        ("out", bytes(&outputs.out), vec![t, x.heads, x.value_dim]),
        ("lse", bytes(&outputs.lse), vec![x.heads, t]),
        ("dq", bytes(&outputs.dq), vec![t, x.heads, x.head_dim]),
        ("dk", bytes(&outputs.dk), vec![t, x.kv_heads, x.head_dim]),
        ("dv", bytes(&outputs.dv), vec![t, x.kv_heads, x.value_dim]),
    ];
    let views = tensors
        .iter()
        .map(|(name, data, shape)| {
            Ok((
                name.to_string(),
                TensorView::new(Dtype::F32, shape.clone(), data)?,
            ))
        })
        .collect::<Result<HashMap<_, _>, safetensors::SafeTensorError>>()
        .map_err(|e| format!("cannot build output tensors: {e}"))?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
