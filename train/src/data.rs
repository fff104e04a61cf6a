//! The training data: a corpus tokenized and packed once, or token files read window by window;
//! step `s` takes its micro-batches, built the first time a step asks for them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use burn_dcp::kernels::{MicroBatch, Piece};
use burn_dcp_datasets::corpus::{open_documents, Document};
use burn_dcp_datasets::indexed::TokenType;
use burn_dcp_datasets::sampler::recut;
use burn_dcp_datasets::tokenizer::{cache_dir, default_tokenized, files_identity, tokenize_cached};
use burn_dcp_datasets::{
    micro_batch, pack_corpus_pieces, DataError, DataPath, DataState, FlatFormat, MaskPolicy,
    PackingConfig, StreamOptions, TokenData, TokenizedCorpus,
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
        prompt: None,
    })
    .collect()
}

/// The training data: micro-batches of a text corpus ([`TrainData::load`] with `corpus`) or of
/// pre-tokenized files (`data_path`: `burn_dcp_datasets::stream`, read window by window). Step
/// `s` uses micro-batches `(s−1)·n .. s·n`, `n` = micro-batches per step, so any cp/dp split and
/// a resumed run see the same data.
pub struct TrainData {
    /// `--eval-every`: the held-out micro-batches (never trained on).
    validation: Option<Box<TrainData>>,
    source: Source,
}

enum Source {
    /// The corpus tokenized (with `--lengths-from`, recut into documents of a long-tailed
    /// dataset's lengths, each at most `seq_len`) and packed once into micro-batches of at most
    /// `seq_len` tokens (long documents split; see `burn_dcp_datasets::packing`), cyclically.
    Corpus {
        corpus: TokenizedCorpus,
        /// The pieces of every micro-batch (cheap); a micro-batch is built from its pieces when
        /// a step first uses it, so a run holds only its steps' micro-batches (the packed corpus
        /// would take ~20 bytes per token in every process).
        pieces: Vec<Vec<Piece>>,
        built: Vec<OnceLock<Arc<MicroBatch>>>,
        masks: MaskPolicy,
        seed: u64,
    },
    /// Token files, memory-mapped: a micro-batch is read when asked for and kept only among
    /// the last few (memory does not grow with the data set, nor with the steps).
    Tokens {
        data: Arc<TokenData>,
        held_out: bool,
        /// `--eval-only`: the first windows in file order (`TokenData::in_order_batch`), this
        /// many of them.
        in_order: Option<usize>,
        recent: Mutex<VecDeque<(usize, Arc<MicroBatch>)>>,
    },
}

/// Micro-batches of token files kept after use (planning, prediction and the step ask for the
/// same ones).
const RECENT: usize = 16;

impl TrainData {
    pub fn load(config: &TrainConfig) -> Result<Self, TrainError> {
        if !config.data_path.is_empty() {
            return Self::load_tokens(config);
        }
        let corpus = tokenized(config)?;
        let corpus = match config.length_sampler()? {
            Some(_) if !corpus.prompts.is_empty() => {
                return Err(TrainError::Config(format!(
                    "--lengths-from recuts documents, which would lose the prompts of corpus '{}' \
                     (prompt/completion lines)",
                    config.corpus
                )))
            }
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
            data.validation = Some(Box::new(validation));
        }
        data.check_validation(config)?;
        Ok(data)
    }

    /// `--eval-only`'s data: the first `eval_tokens` tokens in file order (a token file's
    /// stream, or the corpus's documents one after the other), cut into windows of `seq_len`
    /// tokens, each holding the parts of the documents in it; window `k` is micro-batch `k`.
    pub fn eval_windows(config: &TrainConfig) -> Result<Self, TrainError> {
        let windows = config.eval_tokens.div_ceil(config.seq_len.max(1));
        let too_few = |available: usize| {
            TrainError::Data(format!(
                "--eval-tokens {} takes {windows} windows of {} tokens (--seq-len), more than the {available} whole windows of {}",
                config.eval_tokens,
                config.seq_len,
                config.data_name()
            ))
        };
        if !config.data_path.is_empty() {
            let Self { source, .. } = Self::load_tokens(&TrainConfig {
                eval_every: None,
                ..config.clone()
            })?;
            let Source::Tokens { data, .. } = source else {
                unreachable!("load_tokens reads token files")
            };
            let available = data.in_order_windows();
            if windows > available {
                return Err(too_few(available));
            }
            return Ok(Self {
                validation: None,
                source: Source::Tokens {
                    data,
                    held_out: false,
                    in_order: Some(windows),
                    recent: Mutex::new(VecDeque::new()),
                },
            });
        }
        let corpus = tokenized(config)?;
        let mut pieces: Vec<Vec<Piece>> = vec![Vec::new()];
        let mut room = config.seq_len;
        for (doc, tokens) in corpus.documents.iter().enumerate() {
            let mut start = 0;
            while start < tokens.len() {
                if room == 0 {
                    pieces.push(Vec::new());
                    room = config.seq_len;
                }
                let len = room.min(tokens.len() - start);
                pieces.last_mut().unwrap().push(Piece { doc, start, len });
                (start, room) = (start + len, room - len);
            }
        }
        if room > 0 {
            pieces.pop(); // a last window that is not whole
        }
        if windows > pieces.len() {
            return Err(too_few(pieces.len()));
        }
        pieces.truncate(windows);
        Self::from_pieces(corpus, pieces, config)
    }

    /// `--data-path`: the token files opened (headers and sizes only).
    fn load_tokens(config: &TrainConfig) -> Result<Self, TrainError> {
        let data_error = |e: DataError| TrainError::Data(e.to_string());
        let path = DataPath::parse(&config.data_path).map_err(data_error)?;
        let flat = FlatFormat {
            dtype: TokenType::parse_flat(&config.token_dtype).map_err(data_error)?,
            eod: config.eod_token,
        };
        let options = StreamOptions {
            seq_len: config.seq_len,
            seed: config.seed,
            vocab: config.vocab_size()?,
            held_out_tokens: config.eval_every.map_or(0, |_| config.eval_tokens),
            masks: config.mask_policy()?,
        };
        let data = Arc::new(TokenData::open(&path, flat, options).map_err(data_error)?);
        let tokens = |held_out| Source::Tokens {
            data: data.clone(),
            held_out,
            in_order: None,
            recent: Mutex::new(VecDeque::new()),
        };
        let data = Self {
            validation: config.eval_every.map(|_| {
                Box::new(Self {
                    validation: None,
                    source: tokens(true),
                })
            }),
            source: tokens(false),
        };
        data.check_validation(config)?;
        Ok(data)
    }

    /// The validation set holds at least one step.
    fn check_validation(&self, config: &TrainConfig) -> Result<(), TrainError> {
        match &self.validation {
            Some(validation) if validation.len() < config.micro_batches => {
                Err(TrainError::Data(format!(
                    "--eval-tokens {} make {} micro-batches of at most {} tokens, fewer than one step's {} (--micro-batches): hold out more",
                    config.eval_tokens,
                    validation.len(),
                    config.seq_len,
                    config.micro_batches
                )))
            }
            _ => Ok(()),
        }
    }

    /// Micro-batches of `pieces` of `corpus`, each built when first read.
    fn from_pieces(
        corpus: TokenizedCorpus,
        pieces: Vec<Vec<Piece>>,
        config: &TrainConfig,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            validation: None,
            source: Source::Corpus {
                corpus,
                built: (0..pieces.len()).map(|_| OnceLock::new()).collect(),
                pieces,
                masks: config.mask_policy()?,
                seed: config.seed,
            },
        })
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
        Self::from_pieces(corpus, pieces, config)
    }

    /// The micro-batches of optimizer step `step` (1-based); an error names a token file's
    /// bad bytes (read when a step first asks for them).
    pub fn step_batches(
        &self,
        step: usize,
        count: usize,
    ) -> Result<Vec<Arc<MicroBatch>>, TrainError> {
        (0..count)
            .map(|i| self.batch((step - 1) * count + i))
            .collect()
    }

    /// [`Self::step_batches`] for the attention's callers (a data error as `CpError::Input`).
    pub(crate) fn cp_step_batches(
        &self,
        step: usize,
        count: usize,
    ) -> Result<Vec<Arc<MicroBatch>>, burn_dcp::CpError> {
        self.step_batches(step, count)
            .map_err(|e| burn_dcp::CpError::Input(e.to_string()))
    }

    /// Micro-batch `index`: of a corpus cyclically, built on first use; of token files read
    /// (training: any index, epoch after epoch; held out: cyclically).
    fn batch(&self, index: usize) -> Result<Arc<MicroBatch>, TrainError> {
        match &self.source {
            Source::Corpus {
                corpus,
                pieces,
                built,
                masks,
                seed,
            } => {
                let index = index % pieces.len();
                Ok(built[index]
                    .get_or_init(|| {
                        Arc::new(micro_batch(corpus, pieces[index].clone(), masks, *seed))
                    })
                    .clone())
            }
            Source::Tokens {
                data,
                held_out,
                in_order,
                recent,
            } => {
                if let Some(windows) = in_order {
                    return data
                        .in_order_batch(index % windows)
                        .map(Arc::new)
                        .map_err(|e| TrainError::Data(e.to_string()));
                }
                let index = match held_out {
                    true => index % data.validation_len(),
                    false => index,
                };
                let mut kept = recent.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((_, batch)) = kept.iter().find(|(i, _)| *i == index) {
                    return Ok(batch.clone());
                }
                drop(kept);
                let batch = match held_out {
                    true => data.validation_batch(index),
                    false => data.batch(index),
                }
                .map(Arc::new)
                .map_err(|e| TrainError::Data(e.to_string()))?;
                kept = recent.lock().unwrap_or_else(|e| e.into_inner());
                if kept.len() == RECENT {
                    kept.pop_front();
                }
                kept.push_back((index, batch.clone()));
                Ok(batch)
            }
        }
    }

    /// Micro-batches of one pass: a corpus's packing, or the training windows of every token
    /// file (one epoch each), or the held-out ones.
    pub fn len(&self) -> usize {
        match &self.source {
            Source::Corpus { pieces, .. } => pieces.len(),
            Source::Tokens {
                in_order: Some(windows),
                ..
            } => *windows,
            Source::Tokens {
                data,
                held_out: true,
                ..
            } => data.validation_len(),
            Source::Tokens { data, .. } => data.train_windows(),
        }
    }

    /// Where the data stand after `step` steps of `per_step` micro-batches: for token files,
    /// each source's size and the micro-batches it gave (a checkpoint records it; a resumed run
    /// must find the same); `None` for a corpus (its order is a function of the configuration).
    pub fn state(&self, step: usize, per_step: usize) -> Option<DataState> {
        match &self.source {
            Source::Tokens { data, .. } => Some(data.state(step * per_step)),
            Source::Corpus { .. } => None,
        }
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
        self.len() == 0
    }
}

/// The corpus of `config`, tokenized (cached for a directory or file of text).
fn tokenized(config: &TrainConfig) -> Result<TokenizedCorpus, TrainError> {
    let tokenizer = config.tokenizer()?;
    match config.corpus.as_str() {
        "builtin" => TokenizedCorpus::tokenize(builtin_documents().into_iter().map(Ok), &tokenizer),
        "default" => default_tokenized(&tokenizer),
        path => {
            let identity = format!("{path}:{}", files_identity(&[path.into()]));
            tokenize_cached(&identity, || open_documents(path), &tokenizer, &cache_dir())
        }
    }
    .map_err(|e| TrainError::Data(e.to_string()))
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
    let prompts: Vec<usize> = (0..held.len()).map(|d| corpus.prompt_len(d)).collect();
    let with_prompts = !corpus.prompts.is_empty();
    let documents = corpus.names.into_iter().zip(corpus.documents);
    for (((name, document), held), prompt) in documents.zip(held).zip(prompts) {
        let part = if held { &mut validation } else { &mut train };
        part.names.push(name);
        part.documents.push(document);
        if with_prompts {
            part.prompts.push(prompt);
        }
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
            prompts: Vec::new(),
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
