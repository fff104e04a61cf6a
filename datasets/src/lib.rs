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
//! ```

pub mod corpus;
pub mod dataset;
pub mod error;
pub mod indexed;
pub mod masks;
pub mod packing;
pub mod sampler;
pub mod stats;
pub mod tokenizer;

pub use burn_dcp_kernels::MaskSpec;
pub use error::DataError;
pub use indexed::{IndexedDataset, IndexedWriter, TokenType};
pub use masks::MaskPolicy;
pub use packing::{
    micro_batch, pack_corpus, pack_corpus_pieces, MicroBatch, Packing, PackingConfig,
};
pub use sampler::{LengthMix, LengthSampler};
pub use tokenizer::{TokenizedCorpus, Tokenizer};
