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

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}
