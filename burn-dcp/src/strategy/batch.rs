//! What a call needs besides the tensors: the micro-batch (placement, masks, scale, block
//! plan) and, for the backward, the forward's results.

use std::sync::Arc;

use burn_dcp_kernels::{MaskSpec, Segment, VarlenAttention};

use crate::batch::placement::Placement;
use crate::batch::rows::{BatchRows, LocalRows};
use crate::error::CpError;
use crate::strategy::block_plan::BlockSchedule;

/// What a micro-batch's attention needs besides the tensors: where tokens live, the masks, the
/// scale, and (strategy dcp) the block plan. Identical on every rank of the group.
#[derive(Clone, Debug, PartialEq)]
pub struct CpBatch {
    pub placement: Arc<Placement>,
    /// One mask per sequence, or one for all.
    pub masks: Vec<MaskSpec>,
    /// Softmax scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// Strategy dcp: the executable block plan (its placement must be `placement`).
    pub blocks: Option<Arc<BlockSchedule>>,
    /// The rows of `[B, S, …]` batches ([`BatchRows`]); `None` is one packed row of every
    /// sequence (`[1, T_r, …]` in the placement's order).
    pub rows: Option<Arc<BatchRows>>,
}

impl CpBatch {
    pub fn new(placement: Placement, masks: Vec<MaskSpec>) -> Self {
        Self {
            placement: Arc::new(placement),
            masks,
            scale: None,
            blocks: None,
            rows: None,
        }
    }

    /// The micro-batch as the rows of `[B, S, …]` batches (see [`crate::batch::rows`]): checks that the
    /// rows hold every sequence.
    pub fn with_rows(mut self, rows: BatchRows) -> Result<Self, CpError> {
        rows.local(&self.placement, 0)?;
        self.rows = Some(Arc::new(rows));
        Ok(self)
    }

    /// Rank `rank`'s rows: its tokens of every row, their global positions and padding.
    pub fn local_rows(&self, rank: usize) -> Result<LocalRows, CpError> {
        match &self.rows {
            Some(rows) => rows.local(&self.placement, rank),
            None => {
                BatchRows::packed(vec![self.placement.seq_lens.len()]).local(&self.placement, rank)
            }
        }
    }

    /// A micro-batch run by a DCP block plan: tokens placed where the plan homes them.
    pub fn from_blocks(schedule: Arc<BlockSchedule>, masks: Vec<MaskSpec>) -> Self {
        Self {
            placement: Arc::new(schedule.placement().clone()),
            masks,
            scale: None,
            blocks: Some(schedule),
            rows: None,
        }
    }

    /// The block plan of strategy dcp.
    pub(crate) fn schedule(&self) -> Result<&BlockSchedule, CpError> {
        self.blocks.as_deref().ok_or_else(|| {
            CpError::Config(
                "strategy dcp needs the micro-batch's block plan (CpBatch::from_blocks)".into(),
            )
        })
    }

    /// The mask of sequence `seq` (the single mask when one is given for all).
    pub fn mask(&self, seq: usize) -> &MaskSpec {
        burn_dcp_kernels::mask_of(&self.masks, seq)
    }

    /// The kernel problem: queries `q_segments` against keys `kv_segments` (a strategy's
    /// kernel calls; see [`Placement::segments`](crate::batch::placement::Placement::segments)).
    pub fn problem(&self, q_segments: Vec<Segment>, kv_segments: Vec<Segment>) -> VarlenAttention {
        VarlenAttention {
            seq_lens: self.placement.seq_lens.clone(),
            masks: self.masks.clone(),
            q_segments,
            kv_segments,
            scale: self.scale,
        }
    }
}

/// Inputs of a backward pass, all local to this rank: `q [T, H, D]`, `k`/`v [T, K, D]`,
/// `out`/`dout [T, H, Dv]`, `lse [H, T]` (the forward's final output and LSE), as the kernels'
/// [`FlashOps::flash_backward`](burn_dcp_kernels::FlashOps::flash_backward) takes them.
pub type BackwardInputs<B> = burn_dcp_kernels::FlashBackward<B>;
