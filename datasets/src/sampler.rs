//! Sequence-length samplers calibrated to public descriptions of two long-context datasets, for
//! planner benchmarks (no text, only lengths).
//!
//! **LongAlign-10k** (Bai et al., 2024): 10,000 instruction samples of 8k–64k tokens whose
//! histogram falls off with length. Model: log-normal with median 14k tokens and σ = 0.5 (in
//! natural-log units), redrawn until it lies in [8k, 64k]. Confidence: the range is stated by the
//! authors; the shape (median, spread) is read off their length histogram and is approximate.
//!
//! **Long-Data-Collections** (Together, 2023) mixes short instruction / QA data, arXiv papers and
//! books; the DCP paper (Fig. 2) shows most sequences short with a long tail past 100k. Model: a
//! mixture of log-normals — 60% short (median 1.5k, σ 1.0: instructions, QA), 28% medium
//! (median 12k, σ 0.6: papers, multi-document QA), 12% long (median 80k, σ 0.5: books).
//! Confidence: low on the exact weights (no published per-source token histogram); it reproduces
//! the qualitative skew (p90 ≫ p50, a tail of book-length sequences).
//!
//! Both take DCP's length scaling factor (`0.5, 1, 2, 4`: lengths multiplied before capping) and a
//! cap on the length (`max_len`, default 131072 tokens).
//!
//! **Long-tailed training text** ([`LengthSampler::fitted`], [`recut`]): a corpus's tokens, in
//! order, cut into documents whose lengths are drawn from a sampler scaled so that the
//! dataset's own longest length ([`LengthMix::native_max`]: 64k for LongAlign, 128k for
//! Long-Data-Collections) becomes the training sequence length. The shape of the distribution
//! (the ratio of any two quantiles) is the dataset's; only the unit changes. At `--seq-len 8192`
//! LongAlign-like documents are 1k–8k tokens (median ≈ 1.75k) and LDC-like ones mostly under 200
//! tokens with a tail of 3k–8k-token books.

use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::error::DataError;
use crate::tokenizer::TokenizedCorpus;

/// Which dataset the lengths imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LengthMix {
    LongAlignLike,
    LdcLike,
}

impl FromStr for LengthMix {
    type Err = DataError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|mix| mix.name() == text)
            .ok_or_else(|| {
                DataError::Invalid(format!(
                    "unknown length distribution '{text}': expected longalign-like or ldc-like"
                ))
            })
    }
}

impl LengthMix {
    /// Every distribution, in the order the messages list them.
    pub const ALL: [Self; 2] = [Self::LongAlignLike, Self::LdcLike];

    /// The longest length of the dataset itself (LongAlign-10k: 64k tokens; the
    /// Long-Data-Collections mix: the 128k cap of DCP's experiments).
    pub fn native_max(self) -> usize {
        match self {
            Self::LongAlignLike => 65_536,
            Self::LdcLike => 131_072,
        }
    }

    /// The name `FromStr` parses.
    pub fn name(self) -> &'static str {
        match self {
            Self::LongAlignLike => "longalign-like",
            Self::LdcLike => "ldc-like",
        }
    }
}

/// Draws sequence lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct LengthSampler {
    pub mix: LengthMix,
    /// DCP's length scaling factor (0.5, 1, 2 or 4 in the paper; any positive value works).
    pub scale: f64,
    /// Longest length returned.
    pub max_len: usize,
}

/// A log-normal draw `exp(ln(median) + σ·z)`, `z ~ N(0, 1)` (Box–Muller).
fn log_normal(rng: &mut SmallRng, median: f64, sigma: f64) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    (median.ln() + sigma * z).exp()
}

/// The smallest and largest length scale factors a sampler accepts.
pub const MIN_SCALE: f64 = 0.01;
pub const MAX_SCALE: f64 = 100.0;

impl LengthSampler {
    /// A sampler of `mix` lengths times `scale` (in [`MIN_SCALE`], [`MAX_SCALE`]), at most
    /// `max_len` tokens.
    pub fn new(mix: LengthMix, scale: f64, max_len: usize) -> Result<Self, DataError> {
        if !(MIN_SCALE..=MAX_SCALE).contains(&scale) {
            return Err(DataError::Invalid(format!(
                "length scale {scale} must be a number in [{MIN_SCALE}, {MAX_SCALE}] (DCP uses 0.5 to 4)"
            )));
        }
        if max_len == 0 {
            return Err(DataError::Invalid("max_len must be at least 1".into()));
        }
        Ok(Self {
            mix,
            scale,
            max_len,
        })
    }

    /// A sampler of `mix`'s distribution rescaled so that its longest length
    /// ([`LengthMix::native_max`]) is `max_len`: scale `max_len / native_max`, cap `max_len`.
    /// Any `max_len ≥ 1` (small ones give short documents: lengths are at least 1 token).
    pub fn fitted(mix: LengthMix, max_len: usize) -> Result<Self, DataError> {
        if max_len == 0 {
            return Err(DataError::Invalid("max_len must be at least 1".into()));
        }
        Ok(Self {
            mix,
            scale: max_len as f64 / mix.native_max() as f64,
            max_len,
        })
    }

    /// One length (before scaling and capping it follows the model in the module docs).
    pub fn sample(&self, rng: &mut SmallRng) -> usize {
        let raw = match self.mix {
            LengthMix::LongAlignLike => loop {
                let x = log_normal(rng, 14_000.0, 0.5);
                if (8_192.0..=65_536.0).contains(&x) {
                    break x;
                }
            },
            LengthMix::LdcLike => {
                let pick: f64 = rng.random_range(0.0..1.0);
                let (median, sigma) = if pick < 0.60 {
                    (1_500.0, 1.0)
                } else if pick < 0.88 {
                    (12_000.0, 0.6)
                } else {
                    (80_000.0, 0.5)
                };
                log_normal(rng, median, sigma)
            }
        };
        ((raw * self.scale).round() as usize).clamp(1, self.max_len)
    }

    /// Lengths of one batch of exactly `total_tokens` tokens: draws until the total is reached and
    /// truncates the last length to fit. A pure function of `seed`.
    pub fn sample_batch(&self, total_tokens: usize, seed: u64) -> Vec<usize> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut lengths = Vec::new();
        let mut remaining = total_tokens;
        while remaining > 0 {
            let len = self.sample(&mut rng).min(remaining);
            lengths.push(len);
            remaining -= len;
        }
        lengths
    }

    /// `count` independent lengths.
    pub fn sample_many(&self, count: usize, seed: u64) -> Vec<usize> {
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..count).map(|_| self.sample(&mut rng)).collect()
    }
}

/// `corpus`'s tokens, concatenated in document order, cut into consecutive documents of lengths
/// drawn from `sampler` (seeded by `seed`); the last document takes what is left (at most one
/// drawn length). Documents are named `{mix}#{index}`. A pure function of its inputs.
pub fn recut(corpus: &TokenizedCorpus, sampler: &LengthSampler, seed: u64) -> TokenizedCorpus {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tokens = corpus.documents.iter().flatten().copied();
    let mut recut = TokenizedCorpus::default();
    loop {
        let length = sampler.sample(&mut rng);
        let document: Vec<u32> = tokens.by_ref().take(length).collect();
        if document.is_empty() {
            return recut;
        }
        recut
            .names
            .push(format!("{}#{}", sampler.mix.name(), recut.documents.len()));
        recut.documents.push(document);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn percentile(sorted: &[usize], p: f64) -> usize {
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }

    #[test]
    fn longalign_like_stays_in_its_range_and_scales() {
        let sampler = LengthSampler::new(LengthMix::LongAlignLike, 1.0, 131_072).unwrap();
        let lengths = sampler.sample_many(5000, 1);
        assert!(lengths.iter().all(|&l| (8_192..=65_536).contains(&l)));
        let doubled = LengthSampler::new(LengthMix::LongAlignLike, 2.0, 131_072)
            .unwrap()
            .sample_many(5000, 1);
        assert!(doubled
            .iter()
            .zip(&lengths)
            .all(|(&d, &l)| d.abs_diff(2 * l) <= 1));
    }

    #[test]
    fn ldc_like_is_skewed_with_a_long_tail() {
        let sampler = LengthSampler::new(LengthMix::LdcLike, 1.0, 131_072).unwrap();
        let mut lengths = sampler.sample_many(20_000, 2);
        lengths.sort_unstable();
        let (p50, p90) = (percentile(&lengths, 0.5), percentile(&lengths, 0.9));
        assert!(p90 >= 5 * p50, "p50 {p50} p90 {p90}");
        assert!(
            *lengths.last().unwrap() == 131_072,
            "the cap is reached by the tail"
        );
    }

    #[test]
    fn batches_sum_to_the_token_budget() {
        let sampler = LengthSampler::new(LengthMix::LdcLike, 0.5, 65_536).unwrap();
        for seed in 0..20 {
            assert_eq!(
                sampler.sample_batch(131_072, seed).iter().sum::<usize>(),
                131_072
            );
        }
    }

    #[test]
    fn recut_keeps_every_token_in_order_with_fitted_lengths() {
        let corpus = TokenizedCorpus {
            names: vec!["a".into(), "b".into()],
            documents: vec![(0..30_000).collect(), (30_000..50_000).collect()],
            prompts: Vec::new(),
        };
        for mix in [LengthMix::LongAlignLike, LengthMix::LdcLike] {
            let sampler = LengthSampler::fitted(mix, 2048).unwrap();
            let recut = recut(&corpus, &sampler, 3);
            let tokens: Vec<u32> = recut.documents.iter().flatten().copied().collect();
            assert_eq!(tokens, (0..50_000).collect::<Vec<u32>>());
            assert!(recut
                .documents
                .iter()
                .all(|d| (1..=2048).contains(&d.len())));
            assert_eq!(recut.names[1], format!("{}#1", mix.name()));
            assert_eq!(recut, super::recut(&corpus, &sampler, 3), "a pure function");
        }
        // LongAlign's range [8k, 64k] scaled by 2048 / 64k: [256, 2048] (the last one shorter).
        let sampler = LengthSampler::fitted(LengthMix::LongAlignLike, 2048).unwrap();
        let recut = recut(&corpus, &sampler, 3);
        let lengths = recut.lengths();
        assert!(lengths[..lengths.len() - 1].iter().all(|&l| l >= 256));
        assert!(LengthSampler::fitted(LengthMix::LdcLike, 0).is_err());
    }
}
