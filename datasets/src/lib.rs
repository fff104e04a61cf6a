//! Long-context datasets for burn-dcp.
//!
//! ```text
//! corpus     documents, streamed: the default corpus (Vim's help files, Debian vim-runtime),
//!            a directory of text files, JSONL ({"text"} or chat {"messages"})
//! tokenizer  GPT-2 BPE (r50k, tiktoken-rs) or bytes; tokenized corpora cached on disk
//! packing    split long documents, pack by token budget (max_tokens_per_rank × ranks):
//!            tokens, labels, cu_seqlens, positions, one MaskSpec per sequence
//! masks      the DCP paper's masks (causal, λ, blockwise, shared-question, full)
//! sampler    length samplers: longalign-like, ldc-like, with DCP's scale factors and a cap
//! dataset    burn Dataset of packed micro-batches, background prefetch
//! stats      percentiles and histograms
//! indexed    Megatron-LM's .bin/.idx, memory-mapped reader and writer
//! prepare    text or jsonl → an indexed or flat token file (+ loss mask), for prepare_data
//! tokens     token files (indexed or flat with an end-of-document id), loss masks beside them
//! stream     --data-path: windows of token files, seeded order, blends, held-out windows
//! ```

pub mod corpus;
pub mod dataset;
pub mod error;
pub mod indexed;
pub mod masks;
pub mod packing;
pub mod prepare;
pub mod sampler;
pub mod stats;
pub mod stream;
pub mod tokenizer;
pub mod tokens;

pub use burn_dcp_kernels::MaskSpec;
pub use error::DataError;
pub use indexed::{IndexedDataset, IndexedWriter, TokenType};
pub use masks::MaskPolicy;
pub use packing::{
    micro_batch, pack_corpus, pack_corpus_pieces, MicroBatch, Packing, PackingConfig,
};
pub use sampler::{LengthMix, LengthSampler};
pub use stream::{DataPath, DataState, StreamOptions, TokenData};
pub use tokenizer::{TokenizedCorpus, Tokenizer};
pub use tokens::{FlatFormat, TokenFile};
