//! One attention call over packed variable-length sequences.

use crate::definition::error::KernelError;
use crate::definition::mask::{mask_of, validate_masks, MaskSpec};
use crate::definition::packing::{token_count, whole_sequences, Segment};
use crate::heads::Heads;

/// What one attention call computes: which sequences exist, how each is masked, and which
/// (sequence, position) every query and key/value token holds.
///
/// Tensors are token-major and packed, no padding:
/// - `q`: `[q_tokens, heads, head_dim]`, tokens in the order of `q_segments`;
/// - `k`: `[kv_tokens, kv_heads, head_dim]`, `v`: `[kv_tokens, kv_heads, value_dim]`, tokens in
///   the order of `kv_segments`;
/// - `out`: `[q_tokens, heads, value_dim]`; `lse`: `[heads, q_tokens]` (f32, natural log).
///
/// Query token at position `i` of sequence `s` attends the key tokens of sequence `s` whose
/// positions `j` the mask of `s` allows. Query head `h` reads key/value head
/// `h / (heads / kv_heads)` (grouped-query attention).
#[derive(Clone, Debug, PartialEq)]
pub struct VarlenAttention {
    /// Length of every sequence of the micro-batch (the whole sequence, not only the tokens here).
    pub seq_lens: Vec<usize>,
    /// One mask per sequence, or a single mask for all of them.
    pub masks: Vec<MaskSpec>,
    pub q_segments: Vec<Segment>,
    pub kv_segments: Vec<Segment>,
    /// Softmax scale; `None` means `1/√head_dim`.
    pub scale: Option<f64>,
}

/// What a backward pass takes: the forward's inputs `q`, `k`, `v`, its *final* `out` and `lse`
/// (after any merge) and `dout`, the gradient of `out` — named, as six tensors of two shapes are
/// easy to pass in the wrong order. `T` is how a tensor is held (burn tensors, cubecl tensors,
/// host slices, [`Operand`](crate::ops::Operand)s), `L` the LSE's when it differs (burn's rank).
#[derive(Clone, Copy, Debug)]
pub struct BackwardTensors<T, L = T> {
    pub q: T,
    pub k: T,
    pub v: T,
    pub out: T,
    pub lse: L,
    pub dout: T,
}

impl<T, L> BackwardTensors<T, L> {
    /// Each tensor through `f`, the LSE through `g`.
    pub fn map<U, M>(self, f: impl Fn(T) -> U, g: impl FnOnce(L) -> M) -> BackwardTensors<U, M> {
        BackwardTensors {
            q: f(self.q),
            k: f(self.k),
            v: f(self.v),
            out: f(self.out),
            lse: g(self.lse),
            dout: f(self.dout),
        }
    }

    /// Borrows each tensor.
    pub fn as_ref(&self) -> BackwardTensors<&T, &L> {
        BackwardTensors {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            out: &self.out,
            lse: &self.lse,
            dout: &self.dout,
        }
    }
}

impl<T> BackwardTensors<T> {
    /// The six in the order `q, k, v, out, lse, dout`.
    pub fn into_array(self) -> [T; 6] {
        [self.q, self.k, self.v, self.out, self.lse, self.dout]
    }
}

/// Shapes of the tensors of an attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub q_tokens: usize,
    pub kv_tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

impl AttentionShape {
    /// Shapes from `q [Tq, H, D]`, `k [Tk, K, D]`, `v [Tk, K, Dv]`, checking they agree.
    pub fn from_dims(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self, KernelError> {
        let bad = |reason: String| {
            Err(KernelError::InvalidShape(format!(
                "q {q:?}, k {k:?}, v {v:?}: {reason}"
            )))
        };
        if q.len() != 3 || k.len() != 3 || v.len() != 3 {
            return bad("q, k and v must be rank 3 ([tokens, heads, dim])".into());
        }
        if k[0] != v[0] || k[1] != v[1] {
            return bad("k and v must have the same tokens and heads".into());
        }
        if q[2] != k[2] {
            return bad(format!(
                "q head dim {} differs from k head dim {}",
                q[2], k[2]
            ));
        }
        if q[1] == 0 || q[2] == 0 || v[2] == 0 {
            return bad(format!(
                "q heads ({}), head dim ({}) and value dim ({}) must be at least 1",
                q[1], q[2], v[2]
            ));
        }
        if let Err(e) = Heads::new(q[1], k[1]) {
            return bad(e.to_string());
        }
        Ok(Self {
            q_tokens: q[0],
            kv_tokens: k[0],
            heads: q[1],
            kv_heads: k[1],
            head_dim: q[2],
            value_dim: v[2],
        })
    }

    /// Number of query heads sharing one key/value head.
    pub fn group_size(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// The largest softmax scale accepted. The default `1/√head_dim` is below 1; a scale above 10⁴
/// only comes from a mistake, and makes `f32` scores overflow to ±∞ (NaN outputs).
pub const MAX_SOFTMAX_SCALE: f64 = 1e4;

/// Checks a softmax scale: finite, positive and at most [`MAX_SOFTMAX_SCALE`].
pub fn validate_scale(scale: f64) -> Result<(), KernelError> {
    if !scale.is_finite() || scale <= 0.0 || scale > MAX_SOFTMAX_SCALE {
        return Err(KernelError::InvalidValue(format!(
            "softmax scale {scale} must be a finite number in (0, {MAX_SOFTMAX_SCALE:e}]"
        )));
    }
    Ok(())
}

impl VarlenAttention {
    /// Self-attention over whole packed sequences: every query and key token of every sequence.
    pub fn packed(seq_lens: Vec<usize>, masks: Vec<MaskSpec>) -> Self {
        let segments = whole_sequences(&seq_lens);
        Self {
            seq_lens,
            masks,
            q_segments: segments.clone(),
            kv_segments: segments,
            scale: None,
        }
    }

    /// Queries and keys given by cumulative lengths with global offsets: sequence `s` has query
    /// tokens `cu_q[s]..cu_q[s+1]` at positions `q_offsets[s]..` and key tokens
    /// `cu_k[s]..cu_k[s+1]` at positions `k_offsets[s]..` (flash-attn's varlen convention plus
    /// offsets, so a ring step or block pair computes with global positions).
    pub fn from_cu_seqlens(
        seq_lens: Vec<usize>,
        masks: Vec<MaskSpec>,
        cu_q: &[usize],
        q_offsets: &[usize],
        cu_k: &[usize],
        k_offsets: &[usize],
    ) -> Result<Self, KernelError> {
        let segments = |cu: &[usize], offsets: &[usize], what: &str| {
            if cu.len() != seq_lens.len() + 1 || offsets.len() != seq_lens.len() {
                return Err(KernelError::InvalidPacking(format!(
                    "{what}: {} sequences need {} cu_seqlens entries and {} offsets, got {} and {}",
                    seq_lens.len(),
                    seq_lens.len() + 1,
                    seq_lens.len(),
                    cu.len(),
                    offsets.len()
                )));
            }
            cu.windows(2)
                .zip(offsets)
                .enumerate()
                .map(|(seq, (w, &offset))| {
                    if w[1] < w[0] {
                        return Err(KernelError::InvalidPacking(format!(
                            "{what} cu_seqlens must be non-decreasing, but {} follows {}",
                            w[1], w[0]
                        )));
                    }
                    Ok(Segment::contiguous(seq, offset, w[1] - w[0]))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            q_segments: segments(cu_q, q_offsets, "queries")?,
            kv_segments: segments(cu_k, k_offsets, "keys")?,
            seq_lens,
            masks,
            scale: None,
        })
    }

    /// With an explicit softmax scale.
    pub fn with_scale(mut self, scale: Option<f64>) -> Self {
        self.scale = scale;
        self
    }

    /// The mask of sequence `seq`.
    pub fn mask(&self, seq: usize) -> &MaskSpec {
        mask_of(&self.masks, seq)
    }

    pub fn q_tokens(&self) -> usize {
        token_count(&self.q_segments)
    }

    pub fn kv_tokens(&self) -> usize {
        token_count(&self.kv_segments)
    }

    /// The softmax scale for `head_dim`.
    pub fn softmax_scale(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }

    /// Checks the masks, the segments and their agreement with the tensor shapes.
    pub fn validate(&self, shape: &AttentionShape) -> Result<(), KernelError> {
        validate_masks(&self.masks, &self.seq_lens)?;
        if let Some(scale) = self.scale {
            validate_scale(scale)?;
        }
        self.validate_segments(&self.q_segments, "query")?;
        self.validate_segments(&self.kv_segments, "key/value")?;
        let (q_tokens, kv_tokens) = (self.q_tokens(), self.kv_tokens());
        if q_tokens != shape.q_tokens || kv_tokens != shape.kv_tokens {
            return Err(KernelError::InvalidShape(format!(
                "the packing holds {q_tokens} query and {kv_tokens} key tokens, but q has {} and k/v have {} tokens",
                shape.q_tokens, shape.kv_tokens
            )));
        }
        Ok(())
    }

    /// Every segment lies inside its sequence and no position appears twice.
    fn validate_segments(&self, segments: &[Segment], what: &str) -> Result<(), KernelError> {
        let mut seen: Vec<Vec<bool>> = self.seq_lens.iter().map(|&len| vec![false; len]).collect();
        for segment in segments {
            let bad = |reason: String| {
                Err(KernelError::InvalidPacking(format!(
                    "{what} segment {segment:?}: {reason}"
                )))
            };
            if segment.seq >= self.seq_lens.len() {
                return bad(format!(
                    "sequence {} does not exist ({} sequences)",
                    segment.seq,
                    self.seq_lens.len()
                ));
            }
            if segment.stride == 0 {
                return bad("stride must be at least 1".into());
            }
            let len = self.seq_lens[segment.seq];
            if let Some((_, last)) = segment.position_bounds() {
                if last >= len {
                    return bad(format!("position {last} is past the sequence length {len}"));
                }
            }
            for t in 0..segment.len {
                let pos = segment.position(t);
                if std::mem::replace(&mut seen[segment.seq][pos], true) {
                    return bad(format!(
                        "position {pos} of sequence {} appears twice",
                        segment.seq
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether any query may attend any key (a ring step or block pair without work is skipped).
    pub fn has_work(&self) -> bool {
        self.q_segments.iter().any(|qs| {
            let len = self.seq_lens[qs.seq];
            let mask = self.mask(qs.seq);
            self.kv_segments
                .iter()
                .filter(|ks| ks.seq == qs.seq && ks.len > 0)
                .any(|ks| {
                    (0..qs.len).any(|t| {
                        mask.key_ranges(qs.position(t), len)
                            .iter()
                            .any(|r| !ks.tokens_in(&r).is_empty())
                    })
                })
        })
    }

    /// Number of allowed (query, key) pairs per head: the unmasked work.
    pub fn allowed_pairs(&self) -> u64 {
        let mut total = 0u64;
        for qs in &self.q_segments {
            let len = self.seq_lens[qs.seq];
            let mask = self.mask(qs.seq);
            for ks in self.kv_segments.iter().filter(|ks| ks.seq == qs.seq) {
                for t in 0..qs.len {
                    total += mask
                        .key_ranges(qs.position(t), len)
                        .iter()
                        .map(|r| ks.tokens_in(&r).len() as u64)
                        .sum::<u64>();
                }
            }
        }
        total
    }
}
