//! The training data: the corpus tokenized and packed once; step `s` takes its micro-batches,
//! built the first time a step asks for them.

use std::sync::OnceLock;

use burn_dcp::kernels::{MicroBatch, Piece};
use burn_dcp_datasets::corpus::{open_documents, Document};
use burn_dcp_datasets::sampler::recut;
use burn_dcp_datasets::tokenizer::{cache_dir, default_tokenized, files_identity, tokenize_cached};
use burn_dcp_datasets::{
    micro_batch, pack_corpus_pieces, MaskPolicy, PackingConfig, TokenizedCorpus,
};

use crate::config::TrainConfig;
use crate::error::TrainError;

/// The `builtin` corpus: this crate's own README and sources (small, always at hand; for tests and
/// examples that must not depend on installed files).
pub(crate) fn builtin_documents() -> Vec<Document> {
    [
        ("README.md", include_str!("../README.md")),
        ("lib.rs", include_str!("lib.rs")),
        ("plan.rs", include_str!("plan.rs")),
        ("pipeline.rs", include_str!("pipeline.rs")),
        ("groups.rs", include_str!("groups.rs")),
        ("model.rs", include_str!("model.rs")),
        ("launch.rs", include_str!("launch.rs")),
    ]
    .iter()
    .map(|(name, text)| Document {
        name: name.to_string(),
        text: text.to_string(),
    })
    .collect()
}

/// The training data: the corpus tokenized (with `--lengths-from`, recut into documents of a
/// long-tailed dataset's lengths, each at most `seq_len`) and packed once into micro-batches of
/// at most `seq_len` tokens (long documents split; see `burn_dcp_datasets::packing`). Step `s` uses
/// micro-batches `(s−1)·n .. s·n` (cyclically), `n` = micro-batches per step, so any cp/dp split
/// and a resumed run see the same data.
pub struct TrainData {
    /// `--eval-every`: the held-out documents' micro-batches (never trained on).
    validation: Option<Box<TrainData>>,
    corpus: TokenizedCorpus,
    /// The pieces of every micro-batch (cheap); a micro-batch is built from its pieces when a
    /// step first uses it, so a run holds only its steps' micro-batches (the packed corpus would
    /// take ~20 bytes per token in every process).
    pieces: Vec<Vec<Piece>>,
    built: Vec<OnceLock<MicroBatch>>,
    masks: MaskPolicy,
    seed: u64,
}

impl TrainData {
    pub fn load(config: &TrainConfig) -> Result<Self, TrainError> {
        let tokenizer = config.tokenizer()?;
        let corpus = match config.corpus.as_str() {
            "builtin" => {
                TokenizedCorpus::tokenize(builtin_documents().into_iter().map(Ok), tokenizer)
            }
            "default" => default_tokenized(tokenizer),
            path => {
                let identity = format!("{path}:{}", files_identity(&[path.into()]));
                tokenize_cached(&identity, || open_documents(path), tokenizer, &cache_dir())
            }
        }
        .map_err(|e| TrainError::Data(e.to_string()))?;
        let corpus = match config.length_sampler()? {
            Some(sampler) => recut(&corpus, &sampler, config.seed),
            None => corpus,
        };
        let (corpus, held_out) = match config.eval_every {
            Some(_) => {
                let (train, held_out) = hold_out(corpus, config.eval_tokens, config.seed)?;
                (train, Some(held_out))
            }
            None => (corpus, None),
        };
        let mut data = Self::packed(corpus, config)?;
        if let Some(held_out) = held_out {
            let validation = Self::packed(held_out, config)?;
            if validation.len() < config.micro_batches {
                return Err(TrainError::Data(format!(
                    "--eval-tokens {} pack into {} micro-batches of at most {} tokens, fewer than one step's {} (--micro-batches): hold out more",
                    config.eval_tokens,
                    validation.len(),
                    config.seq_len,
                    config.micro_batches
                )));
            }
            data.validation = Some(Box::new(validation));
        }
        Ok(data)
    }

    /// `corpus` packed into micro-batches of at most `seq_len` tokens.
    fn packed(corpus: TokenizedCorpus, config: &TrainConfig) -> Result<Self, TrainError> {
        let packing = PackingConfig {
            max_tokens_per_rank: config.seq_len,
            ranks: 1,
            max_seq_len: None,
            seed: config.seed,
        };
        let pieces =
            pack_corpus_pieces(&corpus, &packing).map_err(|e| TrainError::Data(e.to_string()))?;
        if pieces.is_empty() {
            return Err(TrainError::Data(format!(
                "corpus '{}' holds no tokens",
                config.corpus
            )));
        }
        // A label is a next token in the same sequence (piece).
        if pieces.iter().flatten().all(|piece| piece.len < 2) {
            return Err(TrainError::Data(format!(
                "corpus '{}' holds no token with a next token to predict (every document is a single token)",
                config.corpus
            )));
        }
        Ok(Self {
            validation: None,
            corpus,
            built: (0..pieces.len()).map(|_| OnceLock::new()).collect(),
            pieces,
            masks: config.mask_policy()?,
            seed: config.seed,
        })
    }

    /// The micro-batches of optimizer step `step` (1-based).
    pub fn step_batches(&self, step: usize, count: usize) -> Vec<&MicroBatch> {
        (0..count)
            .map(|i| self.batch((step - 1) * count + i))
            .collect()
    }

    /// Micro-batch `index` (cyclically), built on first use.
    fn batch(&self, index: usize) -> &MicroBatch {
        let index = index % self.pieces.len();
        self.built[index].get_or_init(|| {
            let pieces = self.pieces[index].clone();
            micro_batch(&self.corpus, pieces, &self.masks, self.seed)
        })
    }

    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// The validation set (`--eval-every`): the held-out documents packed alike; its "step"
    /// `k` is its micro-batches `(k−1)·n .. k·n`.
    pub fn validation(&self) -> Option<&TrainData> {
        self.validation.as_deref()
    }

    /// The validation steps: every whole step of `per_step` micro-batches of the set (the
    /// remainder, fewer than a step's, is left out).
    pub(crate) fn whole_steps(&self, per_step: usize) -> usize {
        self.len() / per_step.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

/// Splits off documents never trained on, at least `tokens` tokens of them: drawn in a seeded
/// order, whole documents, so the split is the same on every rank and for any cp, dp or mesh.
/// At least one document stays for training.
fn hold_out(
    corpus: TokenizedCorpus,
    tokens: usize,
    seed: u64,
) -> Result<(TokenizedCorpus, TokenizedCorpus), TrainError> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let total = corpus.total_tokens();
    let mut order: Vec<usize> = (0..corpus.documents.len()).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed ^ 0x5EED_E7A1));
    let mut held = vec![false; order.len()];
    let mut taken = 0;
    for &document in &order {
        if taken >= tokens {
            break;
        }
        held[document] = true;
        taken += corpus.documents[document].len();
    }
    if taken < tokens || held.iter().all(|&h| h) {
        return Err(TrainError::Data(format!(
            "--eval-tokens {tokens}: the corpus holds {total} tokens in {} documents, and at least one document must stay for training",
            corpus.documents.len()
        )));
    }
    let (mut train, mut validation) = (TokenizedCorpus::default(), TokenizedCorpus::default());
    for ((name, document), held) in corpus.names.into_iter().zip(corpus.documents).zip(held) {
        let part = if held { &mut validation } else { &mut train };
        part.names.push(name);
        part.documents.push(document);
    }
    Ok((train, validation))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(lengths: &[usize]) -> TokenizedCorpus {
        TokenizedCorpus {
            names: (0..lengths.len()).map(|i| format!("doc{i}")).collect(),
            documents: lengths.iter().map(|&n| vec![7; n]).collect(),
        }
    }

    #[test]
    fn held_out_documents_are_whole_disjoint_and_seeded() {
        let all = corpus(&[50, 10, 300, 40, 25, 80, 60]);
        let (train, held) = hold_out(all.clone(), 100, 3).unwrap();
        assert!(held.total_tokens() >= 100);
        assert_eq!(
            train.total_tokens() + held.total_tokens(),
            all.total_tokens()
        );
        assert!(train.names.iter().all(|name| !held.names.contains(name)));
        assert_eq!(hold_out(all.clone(), 100, 3).unwrap().1, held);
        let err = hold_out(all, 10_000, 3).unwrap_err().to_string();
        assert!(err.contains("--eval-tokens 10000"), "{err}");
    }
}
