//! Training micro-batches from token files (`--data-path`): one file or a weighted blend, read
//! window by window, planned from sizes alone.
//!
//! - **Windows**: a source's token stream ([`TokenFile`]) is cut into `⌊tokens / seq_len⌋`
//!   windows of `seq_len` tokens (the tail shorter than a window is left out, as Megatron-LM's
//!   `GPTDataset` leaves out its last partial sample). A window is one micro-batch; its
//!   sequences are the documents inside it (positions restart at each, as Megatron's
//!   `--reset-position-ids --reset-attention-mask`), each under the run's mask.
//! - **Order**: epoch `e` of a source visits its training windows in a seeded pseudo-random
//!   permutation (a Feistel network over the window numbers, cycle-walked: `O(1)` memory, a
//!   bijection, so no window repeats within an epoch and data-parallel replicas, which take
//!   distinct micro-batches of a step, never overlap).
//! - **Blends** (`--data-path 0.3 A 0.7 B`): micro-batch `k` comes from the source Megatron-LM's
//!   `build_blending_indices` (megatron/core/datasets/helpers.cpp) picks: the one whose weight ×
//!   `max(k, 1)` exceeds the micro-batches it already gave by the most (first on ties); it gives
//!   its next one. Weights are normalised to sum to 1.
//! - **Validation** (`--eval-every`): each source's last `⌈eval_tokens · weight / seq_len⌉`
//!   windows are held out (never trained on) and read in order, source by source.
//!
//! Nothing is read at start but each file's size and header; memory does not grow with the
//! data set.

use std::ops::Range;
use std::sync::Mutex;

use burn_dcp_kernels::{MicroBatch, Piece};
use serde::{Deserialize, Serialize};

use crate::error::DataError;
use crate::masks::MaskPolicy;
use crate::tokens::{FlatFormat, LossMask, TokenFile};

/// `--data-path` as Megatron-LM reads it: `PATH`, or weight/path pairs `W1 PATH1 W2 PATH2 …`.
#[derive(Clone, Debug, PartialEq)]
pub struct DataPath {
    /// (weight, path), weights normalised to sum to 1.
    pub parts: Vec<(f64, String)>,
}

impl DataPath {
    pub fn parse(words: &[String]) -> Result<Self, DataError> {
        let given = || words.join(" ");
        if words.len() == 1 {
            return Ok(Self {
                parts: vec![(1.0, words[0].clone())],
            });
        }
        if words.is_empty() || !words.len().is_multiple_of(2) {
            return Err(DataError::Invalid(format!(
                "--data-path '{}': one path, or weight and path pairs (0.3 A 0.7 B)",
                given()
            )));
        }
        let mut parts = Vec::new();
        for pair in words.chunks_exact(2) {
            let weight: f64 = pair[0].parse().map_err(|_| {
                DataError::Invalid(format!(
                    "--data-path '{}': '{}' is not a weight (pairs are weight then path)",
                    given(),
                    pair[0]
                ))
            })?;
            if !(weight.is_finite() && weight > 0.0) {
                return Err(DataError::Invalid(format!(
                    "--data-path '{}': weight {weight} of {} must be a positive number",
                    given(),
                    pair[1]
                )));
            }
            parts.push((weight, pair[1].clone()));
        }
        let total: f64 = parts.iter().map(|(w, _)| w).sum();
        parts.iter_mut().for_each(|(w, _)| *w /= total);
        Ok(Self { parts })
    }
}

/// The source micro-batch `sample` comes from, by Megatron-LM's blending rule (module docs);
/// `counts[d]` (what each source gave before `sample`) is advanced.
pub fn blend_next(weights: &[f64], counts: &mut [usize], sample: usize) -> usize {
    let at = (sample as f64).max(1.0);
    let mut best = 0;
    let mut best_error = weights[0] * at - counts[0] as f64;
    for (d, weight) in weights.iter().enumerate().skip(1) {
        let error = weight * at - counts[d] as f64;
        if error > best_error {
            (best, best_error) = (d, error);
        }
    }
    counts[best] += 1;
    best
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `index`'s place in a seeded permutation of `0..n` (`index < n`): four Feistel rounds over
/// the smallest even number of bits that holds `n`, repeated while the result is `≥ n` (cycle
/// walking keeps it a bijection of `0..n`; fewer than 4 rounds of walking are expected).
pub fn permute(index: usize, n: usize, seed: u64) -> usize {
    debug_assert!(index < n);
    let bits = (usize::BITS - (n.max(2) - 1).leading_zeros()).next_multiple_of(2);
    let half = bits / 2;
    let mask = (1u64 << half) - 1;
    let mut x = index as u64;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = splitmix(right ^ splitmix(seed ^ round)) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if (x as usize) < n {
            return x as usize;
        }
    }
}

/// How windows become micro-batches.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// Tokens per window (one micro-batch).
    pub seq_len: usize,
    pub seed: u64,
    /// Token ids must be below it (the model's vocabulary).
    pub vocab: usize,
    /// Tokens to hold out for validation (0: none).
    pub held_out_tokens: usize,
    pub masks: MaskPolicy,
}

struct Source {
    file: TokenFile,
    mask: Option<LossMask>,
    spec: String,
    /// Training windows (the first ones) and held-out windows (the last ones).
    train: usize,
    held: usize,
}

/// Where a run stands in its data: part of each checkpoint, so a resumed run can check that it
/// reads the same data in the same order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataState {
    /// Training micro-batches taken so far.
    pub micro_batches: usize,
    pub sources: Vec<SourceState>,
}

/// One source of a [`DataState`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceState {
    pub path: String,
    pub weight: f64,
    pub tokens: usize,
    pub train_windows: usize,
    pub held_out_windows: usize,
    /// Micro-batches it gave so far.
    pub taken: usize,
}

/// Micro-batches from one token file or a blend (module docs).
pub struct TokenData {
    sources: Vec<Source>,
    weights: Vec<f64>,
    options: StreamOptions,
    /// The blend's counts at micro-batch `i · SNAPSHOT` (a blend of several sources).
    snapshots: Mutex<Vec<Vec<usize>>>,
}

const SNAPSHOT: usize = 4096;

impl TokenData {
    /// Opens every source of `path` (headers and sizes only).
    pub fn open(
        path: &DataPath,
        flat: FlatFormat,
        options: StreamOptions,
    ) -> Result<Self, DataError> {
        if options.seq_len == 0 {
            return Err(DataError::Invalid(
                "the window (--seq-len) must be at least 1 token".into(),
            ));
        }
        let mut sources = Vec::new();
        for (weight, spec) in &path.parts {
            let file = TokenFile::open(spec, flat)?;
            let windows = file.total_tokens() / options.seq_len;
            let held = match options.held_out_tokens {
                0 => 0,
                tokens => {
                    ((tokens as f64 * weight / options.seq_len as f64).ceil() as usize).max(1)
                }
            };
            if windows <= held {
                return Err(DataError::Invalid(format!(
                    "--data-path {spec}: {} tokens make {windows} windows of --seq-len {}{}; at \
                     least one must stay for training",
                    file.total_tokens(),
                    options.seq_len,
                    if held > 0 {
                        format!(", and --eval-tokens holds out {held}")
                    } else {
                        String::new()
                    }
                )));
            }
            sources.push(Source {
                mask: file.loss_mask()?,
                file,
                spec: spec.clone(),
                train: windows - held,
                held,
            });
        }
        Ok(Self {
            weights: path.parts.iter().map(|(w, _)| *w).collect(),
            snapshots: Mutex::new(vec![vec![0; sources.len()]]),
            sources,
            options,
        })
    }

    /// Training windows over all sources (one epoch of each).
    pub fn train_windows(&self) -> usize {
        self.sources.iter().map(|s| s.train).sum()
    }

    /// Held-out micro-batches.
    pub fn validation_len(&self) -> usize {
        self.sources.iter().map(|s| s.held).sum()
    }

    /// The blend's counts before training micro-batch `sample`.
    fn counts_before(&self, sample: usize) -> Vec<usize> {
        let mut snapshots = self.snapshots.lock().unwrap_or_else(|e| e.into_inner());
        while snapshots.len() <= sample / SNAPSHOT {
            let index = snapshots.len();
            let mut counts = snapshots[index - 1].clone();
            for k in (index - 1) * SNAPSHOT..index * SNAPSHOT {
                blend_next(&self.weights, &mut counts, k);
            }
            snapshots.push(counts);
        }
        let mut counts = snapshots[sample / SNAPSHOT].clone();
        drop(snapshots);
        for k in sample / SNAPSHOT * SNAPSHOT..sample {
            blend_next(&self.weights, &mut counts, k);
        }
        counts
    }

    /// The source and window of training micro-batch `sample`.
    pub fn locate(&self, sample: usize) -> (usize, usize) {
        let (d, taken) = if self.sources.len() == 1 {
            (0, sample)
        } else {
            let mut counts = self.counts_before(sample);
            let d = blend_next(&self.weights, &mut counts, sample);
            (d, counts[d] - 1)
        };
        let train = self.sources[d].train;
        let (epoch, index) = (taken / train, taken % train);
        let seed = splitmix(self.options.seed ^ splitmix(d as u64 ^ splitmix(epoch as u64)));
        (d, permute(index, train, seed))
    }

    /// Training micro-batch `sample` (any number: epochs follow one another).
    pub fn batch(&self, sample: usize) -> Result<MicroBatch, DataError> {
        let (d, window) = self.locate(sample);
        self.window_batch(d, window)
    }

    /// Window `window` of the stream in file order (tokens `window·seq_len ..`; whole windows,
    /// not held out or permuted): `--eval-only`'s micro-batches. A blend has no file order: one
    /// source only.
    pub fn in_order_batch(&self, window: usize) -> Result<MicroBatch, DataError> {
        match self.sources.len() {
            1 => self.window_batch(0, window),
            n => Err(DataError::Invalid(format!(
                "a blend of {n} token files has no file order: evaluate one file"
            ))),
        }
    }

    /// Whole windows of `seq_len` tokens of the first source, in file order.
    pub fn in_order_windows(&self) -> usize {
        self.sources
            .first()
            .map_or(0, |s| s.file.total_tokens() / self.options.seq_len)
    }

    /// Held-out micro-batch `index < validation_len()`.
    pub fn validation_batch(&self, mut index: usize) -> Result<MicroBatch, DataError> {
        for (d, source) in self.sources.iter().enumerate() {
            if index < source.held {
                return self.window_batch(d, source.train + index);
            }
            index -= source.held;
        }
        Err(DataError::Invalid(format!(
            "held-out micro-batch {index}: there are {}",
            self.validation_len()
        )))
    }

    fn window_batch(&self, d: usize, window: usize) -> Result<MicroBatch, DataError> {
        let source = &self.sources[d];
        let range: Range<usize> =
            window * self.options.seq_len..(window + 1) * self.options.seq_len;
        let targets = match &source.mask {
            Some(mask) => Some(mask.targets(range.clone())?),
            None => None,
        };
        let mut batch = MicroBatch::empty();
        for segment in source.file.window(range.clone())? {
            if let Some(k) = segment
                .tokens
                .iter()
                .position(|&t| t as usize >= self.options.vocab)
            {
                return Err(DataError::Malformed {
                    path: source.file.path().to_path_buf(),
                    line: 0,
                    reason: format!(
                        "token {} is {}, outside the vocabulary of {} ids: train with the \
                         tokenizer that wrote the data (--tokenizer, --tokenizer-file)",
                        segment.at + k,
                        segment.tokens[k],
                        self.options.vocab
                    ),
                });
            }
            let piece = Piece {
                doc: segment.sequence,
                start: segment.offset,
                len: segment.tokens.len(),
            };
            let first_label = batch.labels.len();
            let mask = self.options.masks.mask_for(piece, self.options.seed);
            batch.push_sequence(&segment.tokens, mask, piece);
            if let Some(targets) = &targets {
                // Label j predicts token j + 1 of the segment: kept when that token is a target.
                let at = segment.at - range.start;
                for j in 0..segment.tokens.len().saturating_sub(1) {
                    if !targets[at + j + 1] {
                        batch.labels[first_label + j] = -1;
                    }
                }
            }
        }
        Ok(batch)
    }

    /// Where the run stands after `micro_batches` training micro-batches.
    pub fn state(&self, micro_batches: usize) -> DataState {
        let taken = if self.sources.len() == 1 {
            vec![micro_batches]
        } else {
            self.counts_before(micro_batches)
        };
        DataState {
            micro_batches,
            sources: self
                .sources
                .iter()
                .zip(&self.weights)
                .zip(taken)
                .map(|((source, &weight), taken)| SourceState {
                    path: source.spec.clone(),
                    weight,
                    tokens: source.file.total_tokens(),
                    train_windows: source.train,
                    held_out_windows: source.held,
                    taken,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::{indexed_paths, IndexedWriter, TokenType};

    #[test]
    fn permutations_are_bijections_for_every_size() {
        for n in [1, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            for seed in [0, 7] {
                let mut seen = vec![false; n];
                for i in 0..n {
                    let p = permute(i, n, seed);
                    assert!(!seen[p], "n {n} seed {seed}: {p} twice");
                    seen[p] = true;
                }
            }
        }
        let a: Vec<usize> = (0..50).map(|i| permute(i, 50, 1)).collect();
        let b: Vec<usize> = (0..50).map(|i| permute(i, 50, 2)).collect();
        assert_ne!(a, b, "the seed changes the order");
    }

    #[test]
    fn the_blend_follows_megatrons_rule() {
        let weights = [0.3, 0.7];
        let mut counts = vec![0, 0];
        let picks: Vec<usize> = (0..10)
            .map(|k| blend_next(&weights, &mut counts, k))
            .collect();
        // k = 0: errors 0.3, 0.7 → 1; k = 1: 0.3, -0.3 → 0; k = 2: 0.6 - 1, 1.4 - 1 → 1; …
        assert_eq!(picks, vec![1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
        assert_eq!(counts, vec![3, 7]);
        let parsed = DataPath::parse(&["3".into(), "a".into(), "1".into(), "b".into()]).unwrap();
        assert_eq!(parsed.parts, vec![(0.75, "a".into()), (0.25, "b".into())]);
        for bad in [
            &["0.5", "a", "0.5"][..],
            &["x", "a"],
            &["-1", "a", "1", "b"],
            &[],
        ] {
            let words: Vec<String> = bad.iter().map(|s| s.to_string()).collect();
            let err = DataPath::parse(&words).unwrap_err().to_string();
            assert!(err.contains("--data-path"), "{err}");
        }
    }

    fn write_indexed(name: &str, documents: &[Vec<u32>]) -> String {
        let prefix =
            std::env::temp_dir().join(format!("bdcp-stream-{name}-{}", std::process::id()));
        let mut writer = IndexedWriter::create(&prefix, TokenType::U16).unwrap();
        documents
            .iter()
            .for_each(|d| writer.add_document(d).unwrap());
        writer.finish().unwrap();
        prefix.to_str().unwrap().to_string()
    }

    fn remove(prefix: &str) {
        let (idx, bin) = indexed_paths(std::path::Path::new(prefix));
        std::fs::remove_file(idx).ok();
        std::fs::remove_file(bin).ok();
    }

    fn options(seq_len: usize, held_out_tokens: usize) -> StreamOptions {
        StreamOptions {
            seq_len,
            seed: 3,
            vocab: 1000,
            held_out_tokens,
            masks: MaskPolicy::Same(burn_dcp_kernels::MaskSpec::Causal),
        }
    }

    #[test]
    fn every_window_once_per_epoch_and_blends_in_proportion() {
        let a = write_indexed("a", &[(0..40).collect(), (100..140).collect()]);
        let b = write_indexed("b", &[(500..580).collect()]);
        let one = TokenData::open(
            &DataPath::parse(std::slice::from_ref(&a)).unwrap(),
            FlatFormat::default(),
            options(8, 0),
        )
        .unwrap();
        assert_eq!(one.train_windows(), 10);
        let mut firsts: Vec<u32> = (0..10).map(|k| one.batch(k).unwrap().tokens[0]).collect();
        firsts.sort_unstable();
        assert_eq!(firsts, vec![0, 8, 16, 24, 32, 100, 108, 116, 124, 132]);
        // A window across two documents: two sequences, positions restarting, no label across.
        let wide = TokenData::open(
            &DataPath::parse(std::slice::from_ref(&a)).unwrap(),
            FlatFormat::default(),
            options(16, 0),
        )
        .unwrap();
        let across = (0..5)
            .map(|k| wide.batch(k).unwrap())
            .find(|b| b.sequences() > 1)
            .unwrap();
        assert_eq!(across.tokens[..9], [32, 33, 34, 35, 36, 37, 38, 39, 100]);
        assert_eq!(
            across.positions,
            [(0..8).collect::<Vec<_>>(), (0..8).collect()].concat()
        );
        assert_eq!(
            (across.labels[6], across.labels[7], across.labels[8]),
            (39, -1, 101)
        );
        let blend = DataPath::parse(&["1".into(), a.clone(), "3".into(), b.clone()]).unwrap();
        let data = TokenData::open(&blend, FlatFormat::default(), options(8, 8)).unwrap();
        assert_eq!(
            (data.train_windows(), data.validation_len()),
            (9 + 9, 1 + 1)
        );
        let from_b = (0..400).filter(|&k| data.locate(k).0 == 1).count();
        assert_eq!(from_b, 300);
        let state = data.state(400);
        assert_eq!(state.sources[1].taken, 300);
        // The snapshot path and the direct path agree.
        let late = data.locate(9000);
        assert_eq!(
            data.state(9001).sources[late.0].taken,
            data.state(9000).sources[late.0].taken + 1
        );
        // Held-out windows are the last ones, never trained on.
        let held: Vec<u32> = (0..2)
            .map(|k| data.validation_batch(k).unwrap().tokens[0])
            .collect();
        assert_eq!(held, vec![132, 572]);
        assert!(data.validation_batch(2).is_err());
        assert!((0..200).all(|k| {
            let (d, w) = data.locate(k);
            w < [9, 9][d]
        }));
        let err = TokenData::open(
            &DataPath::parse(std::slice::from_ref(&a)).unwrap(),
            FlatFormat::default(),
            options(100, 0),
        )
        .err()
        .unwrap();
        assert!(
            err.to_string().contains("0 windows of --seq-len 100"),
            "{err}"
        );
        let mut small = options(8, 0);
        small.vocab = 120;
        let small = TokenData::open(
            &DataPath::parse(std::slice::from_ref(&a)).unwrap(),
            FlatFormat::default(),
            small,
        )
        .unwrap();
        let err = (0..10)
            .find_map(|k| small.batch(k).err())
            .unwrap()
            .to_string();
        assert!(err.contains("outside the vocabulary of 120 ids"), "{err}");
        remove(&a);
        remove(&b);
    }

    #[test]
    fn a_loss_mask_takes_prompt_tokens_out_of_the_labels() {
        let a = write_indexed("masked", &[vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        let bin = indexed_paths(std::path::Path::new(&a)).1;
        std::fs::write(crate::tokens::mask_path(&bin), [0u8, 0, 1, 1, 0, 1, 1, 1]).unwrap();
        let data = TokenData::open(
            &DataPath::parse(std::slice::from_ref(&a)).unwrap(),
            FlatFormat::default(),
            options(8, 0),
        )
        .unwrap();
        let batch = data.batch(0).unwrap();
        // Token 1 → 2 is a prompt token's prediction (2 is not a target); 2 → 3 and 3 → 4 are.
        assert_eq!(batch.labels, vec![-1, 3, 4, -1, 6, 7, 8, -1]);
        assert_eq!(batch.label_count(), 5);
        std::fs::remove_file(crate::tokens::mask_path(&bin)).ok();
        remove(&a);
    }
}
