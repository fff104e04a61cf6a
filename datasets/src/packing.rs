//! Packing documents into micro-batches by token budget.
//!
//! 1. **Split**: a document longer than `max_seq_len` becomes consecutive pieces of exactly
//!    `max_seq_len` tokens plus a shorter last piece; each piece is its own sequence (positions
//!    restart at 0, its last token has no label). Empty documents are dropped.
//! 2. **Order**: pieces are shuffled with `seed` (so equal lengths do not keep corpus order), then
//!    sorted by length, longest first (stable).
//! 3. **Best fit**: each piece goes to the open micro-batch with the least room that still fits
//!    it, or opens a new one. Budget = `max_tokens_per_rank × ranks` tokens per micro-batch.
//! 4. Micro-batches are shuffled with `seed` (training order).
//!
//! Packing efficiency = real tokens / (micro-batches × budget). Everything is a pure function of
//! the lengths, the budget and the seed.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

pub use burn_dcp_kernels::{MicroBatch, Piece};

use crate::error::DataError;
use crate::masks::MaskPolicy;
use crate::tokenizer::TokenizedCorpus;

/// How to pack.
#[derive(Clone, Debug, PartialEq)]
pub struct PackingConfig {
    pub max_tokens_per_rank: usize,
    pub ranks: usize,
    /// Longest sequence; longer documents are split. Defaults to the budget.
    pub max_seq_len: Option<usize>,
    pub seed: u64,
}

impl PackingConfig {
    /// Tokens per micro-batch, `max_tokens_per_rank × ranks` (saturating; [`Self::validate`]
    /// refuses a product that overflows).
    pub fn budget(&self) -> usize {
        self.max_tokens_per_rank.saturating_mul(self.ranks)
    }

    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
            .unwrap_or_else(|| self.budget())
            .min(self.budget())
    }

    pub fn validate(&self) -> Result<(), DataError> {
        if self.max_tokens_per_rank == 0 || self.ranks == 0 {
            return Err(DataError::Invalid(format!(
                "max_tokens_per_rank ({}) and ranks ({}) must be at least 1",
                self.max_tokens_per_rank, self.ranks
            )));
        }
        if self.max_tokens_per_rank.checked_mul(self.ranks).is_none() {
            return Err(DataError::Invalid(format!(
                "max_tokens_per_rank ({}) × ranks ({}) overflows the tokens of a micro-batch",
                self.max_tokens_per_rank, self.ranks
            )));
        }
        if self.max_seq_len == Some(0) {
            return Err(DataError::Invalid("max_seq_len must be at least 1".into()));
        }
        Ok(())
    }
}

/// Splits documents of the given lengths into pieces of at most `max_seq_len` tokens.
pub fn split_documents(lengths: &[usize], max_seq_len: usize) -> Vec<Piece> {
    lengths
        .iter()
        .enumerate()
        .flat_map(|(doc, &len)| {
            (0..len.div_ceil(max_seq_len)).map(move |i| Piece {
                doc,
                start: i * max_seq_len,
                len: max_seq_len.min(len - i * max_seq_len),
            })
        })
        .collect()
}

/// Packs pieces into micro-batches (lists of pieces) of at most `budget` tokens (see module docs).
pub fn pack_pieces(mut pieces: Vec<Piece>, budget: usize, seed: u64) -> Vec<Vec<Piece>> {
    let mut rng = SmallRng::seed_from_u64(seed);
    pieces.shuffle(&mut rng);
    pieces.sort_by_key(|piece| std::cmp::Reverse(piece.len));
    let mut bins: Vec<(usize, Vec<Piece>)> = Vec::new();
    for piece in pieces {
        let best = bins
            .iter()
            .enumerate()
            .filter(|(_, (used, _))| used + piece.len <= budget)
            .min_by_key(|(_, (used, _))| budget - used)
            .map(|(index, _)| index);
        match best {
            Some(index) => {
                bins[index].0 += piece.len;
                bins[index].1.push(piece);
            }
            None => bins.push((piece.len, vec![piece])),
        }
    }
    let mut bins: Vec<Vec<Piece>> = bins.into_iter().map(|(_, pieces)| pieces).collect();
    bins.shuffle(&mut rng);
    bins
}

/// The micro-batch of `pieces`, in that order, each piece one sequence with its policy's mask
/// (how [`pack_corpus`] builds each micro-batch of [`pack_corpus_pieces`]).
pub fn micro_batch(
    corpus: &TokenizedCorpus,
    pieces: Vec<Piece>,
    masks: &MaskPolicy,
    seed: u64,
) -> MicroBatch {
    let mut batch = MicroBatch::empty();
    for piece in pieces {
        let tokens = &corpus.documents[piece.doc][piece.start..piece.start + piece.len];
        let first_label = batch.labels.len();
        batch.push_sequence(tokens, masks.mask_for(piece, seed), piece);
        // A prompt's tokens are no targets: label j predicts document token start + j + 1.
        let prompt = corpus.prompt_len(piece.doc);
        let unlabelled = (prompt.saturating_sub(piece.start + 1)).min(piece.len);
        batch.labels[first_label..first_label + unlabelled].fill(-1);
    }
    batch
}

/// The packing of a corpus.
#[derive(Clone, Debug)]
pub struct Packing {
    pub micro_batches: Vec<MicroBatch>,
    pub budget: usize,
}

impl Packing {
    /// Real tokens / (micro-batches × budget).
    pub fn efficiency(&self) -> f64 {
        efficiency(
            self.micro_batches.iter().map(|b| b.tokens.len()).sum(),
            self.micro_batches.len(),
            self.budget,
        )
    }
}

/// Real tokens / (micro-batches × budget).
pub fn efficiency(tokens: usize, micro_batches: usize, budget: usize) -> f64 {
    if micro_batches == 0 {
        return 0.0;
    }
    tokens as f64 / (micro_batches as f64 * budget as f64)
}

/// Packs a tokenized corpus into micro-batches with per-sequence masks.
pub fn pack_corpus(
    corpus: &TokenizedCorpus,
    config: &PackingConfig,
    masks: &MaskPolicy,
) -> Result<Packing, DataError> {
    let micro_batches = pack_corpus_pieces(corpus, config)?
        .into_iter()
        .map(|pieces| micro_batch(corpus, pieces, masks, config.seed))
        .collect();
    Ok(Packing {
        micro_batches,
        budget: config.budget(),
    })
}

/// The pieces of every micro-batch [`pack_corpus`] packs, without building the micro-batches
/// (their tokens, labels and positions take ~20 bytes per token; build the ones a run uses with
/// [`micro_batch`]).
pub fn pack_corpus_pieces(
    corpus: &TokenizedCorpus,
    config: &PackingConfig,
) -> Result<Vec<Vec<Piece>>, DataError> {
    config.validate()?;
    let pieces = split_documents(&corpus.lengths(), config.max_seq_len());
    Ok(pack_pieces(pieces, config.budget(), config.seed))
}

/// Packing efficiency of documents of the given lengths (no tokens needed).
pub fn packing_efficiency(
    lengths: &[usize],
    config: &PackingConfig,
) -> Result<(f64, usize), DataError> {
    config.validate()?;
    let pieces = split_documents(lengths, config.max_seq_len());
    let tokens: usize = pieces.iter().map(|p| p.len).sum();
    let bins = pack_pieces(pieces, config.budget(), config.seed).len();
    Ok((efficiency(tokens, bins, config.budget()), bins))
}
