//! Mask specs per sequence, as in the DCP paper's evaluation, in the representation the attention
//! core consumes ([`MaskSpec`]):
//!
//! | name | spec | default parameters |
//! |---|---|---|
//! | `causal` | `j ≤ i` | — |
//! | `lambda` | sink + window | 64 sink tokens, window 4096 |
//! | `blockwise` | causal-blockwise | block 256, 2 local blocks, first block as sink |
//! | `shared-question` | question then answers | question = 20% of the sequence, 4 answers |
//! | `full` | every key | — |
//!
//! A policy gives every sequence the same mask, or (`mixed`) draws one of the four sparse/causal
//! kinds per sequence from the seed and the sequence's identity.

use burn_dcp_kernels::MaskSpec;

use crate::error::DataError;
use burn_dcp_kernels::Piece;

/// Which mask each packed sequence gets.
#[derive(Clone, Debug, PartialEq)]
pub enum MaskPolicy {
    /// The same mask for every sequence.
    Same(MaskSpec),
    /// Causal, λ, blockwise or shared-question (DCP defaults), drawn per sequence.
    Mixed,
}

/// The DCP paper's λ mask: 64 sink tokens + a 4096-token window.
pub fn lambda_default() -> MaskSpec {
    MaskSpec::Lambda {
        sink: 64,
        window: 4096,
    }
}

/// The DCP paper's causal-blockwise mask: blocks of 256, 2 local blocks, first block as sink.
pub fn blockwise_default() -> MaskSpec {
    MaskSpec::Blockwise {
        block: 256,
        local_blocks: 2,
    }
}

/// The DCP paper's shared-question mask: question = 20% of the sequence, then 4 answers.
pub fn shared_question_default() -> MaskSpec {
    MaskSpec::SharedQuestion {
        question_fraction: 0.2,
        answers: 4,
    }
}

impl MaskPolicy {
    /// `causal`, `full`, `lambda`, `blockwise`, `shared-question` (DCP defaults), `mixed`, or an
    /// explicit spec such as `lambda:64,4096`.
    pub fn parse(text: &str) -> Result<Self, DataError> {
        Ok(match text {
            "mixed" => Self::Mixed,
            "lambda" => Self::Same(lambda_default()),
            "blockwise" => Self::Same(blockwise_default()),
            "shared-question" => Self::Same(shared_question_default()),
            other => {
                Self::Same(other.parse().map_err(|e: burn_dcp_kernels::KernelError| {
                    DataError::Invalid(e.to_string())
                })?)
            }
        })
    }

    /// The mask of a packed sequence.
    pub fn mask_for(&self, piece: Piece, seed: u64) -> MaskSpec {
        match self {
            Self::Same(spec) => spec.clone(),
            Self::Mixed => {
                let words = [seed, piece.doc as u64, piece.start as u64, piece.len as u64];
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                match crate::tokenizer::stable_hash(&bytes) % 4 {
                    0 => MaskSpec::Causal,
                    1 => lambda_default(),
                    2 => blockwise_default(),
                    _ => shared_question_default(),
                }
            }
        }
    }
}
