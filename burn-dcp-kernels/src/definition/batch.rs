//! The packed micro-batch: the one type a batch of sequences has from the dataset to a rank's
//! shard.
//!
//! The datasets crate packs documents into [`MicroBatch`]es; training takes a step's micro-batches
//! as they are (static CP) or regroups their sequences ([`MicroBatch::gather`], dynamic CP); a
//! placement then says which tokens each rank of a CP group holds, and `burn_dcp::batch::shard` cuts the
//! rank's shard out of the micro-batch. It lives here, with the masks and segments it refers to,
//! so that the datasets and the CP library share it without depending on each other.

use std::ops::Range;

use crate::definition::error::KernelError;
use crate::definition::mask::{validate_masks, MaskSpec};

/// Where a sequence came from: tokens `start..start + len` of document `doc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    pub doc: usize,
    pub start: usize,
    pub len: usize,
}

/// Sequences laid end to end, no padding.
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch {
    pub tokens: Vec<u32>,
    /// Next token within the same sequence; `-1` at a sequence's last token.
    pub labels: Vec<i64>,
    /// Position of each token within its sequence.
    pub positions: Vec<usize>,
    /// `0, len_0, len_0 + len_1, …, tokens.len()`.
    pub cu_seqlens: Vec<usize>,
    /// One mask per sequence.
    pub masks: Vec<MaskSpec>,
    /// Where each sequence came from.
    pub pieces: Vec<Piece>,
}

impl MicroBatch {
    /// An empty micro-batch (no sequence).
    pub fn empty() -> Self {
        Self {
            tokens: Vec::new(),
            labels: Vec::new(),
            positions: Vec::new(),
            cu_seqlens: vec![0],
            masks: Vec::new(),
            pieces: Vec::new(),
        }
    }

    /// Whole documents packed in order, each one sequence under `mask` (document `d` is piece
    /// `d`); labels are the next token of the same document.
    pub fn from_documents(documents: &[Vec<u32>], mask: MaskSpec) -> Self {
        let mut batch = Self::empty();
        for (doc, tokens) in documents.iter().enumerate() {
            let piece = Piece {
                doc,
                start: 0,
                len: tokens.len(),
            };
            batch.push_sequence(tokens, mask.clone(), piece);
        }
        batch
    }

    /// Appends one sequence: its tokens, its mask and where it came from.
    pub fn push_sequence(&mut self, tokens: &[u32], mask: MaskSpec, piece: Piece) {
        self.tokens.extend_from_slice(tokens);
        self.labels
            .extend(tokens.iter().skip(1).map(|&t| i64::from(t)));
        if !tokens.is_empty() {
            self.labels.push(-1);
        }
        self.positions.extend(0..tokens.len());
        self.cu_seqlens.push(self.tokens.len());
        self.masks.push(mask);
        self.pieces.push(piece);
    }

    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// The token range of sequence `seq`.
    pub fn sequence(&self, seq: usize) -> Range<usize> {
        self.cu_seqlens[seq]..self.cu_seqlens[seq + 1]
    }

    pub fn seq_lens(&self) -> Vec<usize> {
        self.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Number of tokens with a label (the loss's denominator).
    pub fn label_count(&self) -> usize {
        self.labels.iter().filter(|&&l| l >= 0).count()
    }

    /// The sub-micro-batch of sequences picked from several micro-batches, packed in the order
    /// given: `(micro-batch, sequence in it)` pairs. Tokens, labels, positions, masks and pieces
    /// are copied as they are, so gathering every sequence of one micro-batch in order gives it
    /// back unchanged.
    pub fn gather<'a>(picks: impl IntoIterator<Item = (&'a MicroBatch, usize)>) -> Self {
        let mut batch = Self::empty();
        for (source, seq) in picks {
            let range = source.sequence(seq);
            batch
                .tokens
                .extend_from_slice(&source.tokens[range.clone()]);
            batch
                .labels
                .extend_from_slice(&source.labels[range.clone()]);
            batch
                .positions
                .extend_from_slice(&source.positions[range.clone()]);
            batch.cu_seqlens.push(batch.tokens.len());
            batch.masks.push(source.masks[seq].clone());
            batch.pieces.push(source.pieces[seq]);
        }
        batch
    }

    /// Checks that the parts fit together: `cu_seqlens` from 0 to the token count, non-decreasing;
    /// one label and one position per token; positions `0..len` within each sequence; one mask
    /// (valid for its sequence's length) and one piece per sequence.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |reason: String| Err(KernelError::InvalidPacking(reason));
        let tokens = self.tokens.len();
        if self.labels.len() != tokens || self.positions.len() != tokens {
            return bad(format!(
                "micro-batch holds {tokens} tokens but {} labels and {} positions",
                self.labels.len(),
                self.positions.len()
            ));
        }
        if self.cu_seqlens.first() != Some(&0)
            || self.cu_seqlens.last() != Some(&tokens)
            || self.cu_seqlens.windows(2).any(|w| w[1] < w[0])
        {
            return bad(format!(
                "cu_seqlens {:?} must rise from 0 to the token count {tokens}",
                self.cu_seqlens
            ));
        }
        let sequences = self.sequences();
        if self.masks.len() != sequences || self.pieces.len() != sequences {
            return bad(format!(
                "{sequences} sequences need one mask and one piece each, got {} masks and {} pieces",
                self.masks.len(),
                self.pieces.len()
            ));
        }
        for seq in 0..sequences {
            let range = self.sequence(seq);
            let start = range.start;
            if let Some(t) = range.clone().find(|&t| self.positions[t] != t - start) {
                return bad(format!(
                    "token {t} is at position {} of sequence {seq}, expected {}",
                    self.positions[t],
                    t - start
                ));
            }
        }
        validate_masks(&self.masks, &self.seq_lens())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_next_tokens_of_the_same_sequence() {
        let batch =
            MicroBatch::from_documents(&[vec![5, 6, 7], vec![], vec![1, 2]], MaskSpec::Causal);
        assert_eq!(batch.labels, vec![6, 7, -1, 2, -1]);
        assert_eq!(batch.positions, vec![0, 1, 2, 0, 1]);
        assert_eq!(batch.seq_lens(), vec![3, 0, 2]);
        assert_eq!(batch.label_count(), 3);
        batch.validate().unwrap();
    }

    #[test]
    fn gathering_every_sequence_in_order_gives_the_batch_back() {
        let a = MicroBatch::from_documents(&[vec![5, 6, 7], vec![1, 2]], MaskSpec::Causal);
        let b = MicroBatch::from_documents(&[vec![9, 8]], MaskSpec::Full);
        assert_eq!(MicroBatch::gather([(&a, 0), (&a, 1)]), a);
        let mixed = MicroBatch::gather([(&b, 0), (&a, 1)]);
        assert_eq!(mixed.tokens, vec![9, 8, 1, 2]);
        assert_eq!(mixed.masks, vec![MaskSpec::Full, MaskSpec::Causal]);
        mixed.validate().unwrap();
    }

    #[test]
    fn inconsistent_parts_are_refused() {
        let mut batch = MicroBatch::from_documents(&[vec![5, 6, 7]], MaskSpec::Causal);
        batch.positions[2] = 7;
        assert!(batch
            .validate()
            .unwrap_err()
            .to_string()
            .contains("position 7"));
        let mut batch = MicroBatch::from_documents(&[vec![5, 6, 7]], MaskSpec::Causal);
        batch.cu_seqlens = vec![0, 2];
        assert!(batch
            .validate()
            .unwrap_err()
            .to_string()
            .contains("cu_seqlens"));
    }
}
