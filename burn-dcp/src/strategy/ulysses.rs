//! Ulysses (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards, full attention on
//! `H/P` heads over all tokens, all-to-all back.
//!
//! Rank `p` computes query heads `p·H/P .. (p+1)·H/P`. Key/value heads it needs:
//! - `K % P == 0`: kv heads `p·K/P .. (p+1)·K/P` (each rank a disjoint share);
//! - a slice inside one kv head's group (`(H/K) % (H/P) == 0`): that one kv head (shared, i.e.
//!   replicated on several ranks — GQA with Ulysses degree > kv heads);
//! - otherwise one kv head per query head of the slice (replicated to keep the local GQA mapping
//!   uniform). Gradients of replicated heads are summed back onto their owner.
//!
//! The [`UlyssesStage`] is shared with USP, which runs it inside each Ulysses group.

use std::ops::Range;

use burn::prelude::{Backend, Int, Tensor};
use burn::tensor::IndexingUpdateOp;
use burn_dcp_kernels::{AttentionShape, FlashGradients, FlashOps, FlashOutput};

use crate::batch::placement::Placement;
use crate::comm::Comm;
use crate::error::CpError;
use crate::planner::bytes::{rank_tokens, Pass, RankVolume, TokenBytes, VolumeShape};
use crate::planner::{strategies, PlanInput, RoutedPlan};
use crate::strategy::exchange::{
    accumulator_dtype, all_to_all, cat_tokens, concat_segments, filled, narrow, split_sizes,
    widened,
};
use crate::strategy::{
    AttentionStrategy, BackwardInputs, CpBatch, CpCall, CpGroup, Qkv, StrategyKind,
};
use burn_dcp_kernels::heads::HeadParts;

/// Which heads each rank of a Ulysses group computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadSplit {
    pub heads: usize,
    pub kv_heads: usize,
    pub degree: usize,
}

impl HeadSplit {
    /// Query heads of rank `slice`.
    pub fn q_heads(&self, slice: usize) -> Range<usize> {
        let per = self.heads / self.degree;
        slice * per..(slice + 1) * per
    }

    /// Key/value heads rank `slice` needs, in local order (see the module docs).
    pub fn kv_heads(&self, slice: usize) -> Vec<usize> {
        let per = self.heads / self.degree;
        let group = self.heads / self.kv_heads;
        if self.kv_heads.is_multiple_of(self.degree) {
            let kv_per = self.kv_heads / self.degree;
            (slice * kv_per..(slice + 1) * kv_per).collect()
        } else if group.is_multiple_of(per) {
            vec![slice * per / group]
        } else {
            self.q_heads(slice).map(|h| h / group).collect()
        }
    }
}

/// Selects `heads` (indices into dim 1) of `[T, heads, D]`.
fn select_heads<B: Backend>(tensor: Tensor<B, 3>, heads: &[usize]) -> Tensor<B, 3> {
    if is_range(heads) {
        return narrow(tensor, 1, heads[0], heads.len());
    }
    let device = tensor.device();
    let indices: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
    tensor.select(
        1,
        Tensor::<B, 1, Int>::from_data(indices.as_slice(), &device),
    )
}

fn is_range(heads: &[usize]) -> bool {
    !heads.is_empty() && heads.windows(2).all(|w| w[1] == w[0] + 1)
}

/// One rank's side of the all-to-alls of a Ulysses group whose member `p` holds
/// `member_tokens[p]` tokens.
pub struct UlyssesStage<'a> {
    pub comm: &'a Comm,
    pub split: HeadSplit,
    pub member_tokens: Vec<usize>,
}

impl UlyssesStage<'_> {
    fn me(&self) -> usize {
        self.comm.rank()
    }

    /// Sequence → heads of several tensors of this rank's tokens in **one** all-to-all (one
    /// message per peer, one latency): `xs[i] [T_me, *, D]` with head sets `heads[i][p]` →
    /// `[ΣT_p, |heads[i][me]|, D]`. The pieces for a peer are concatenated on the head dim and
    /// split again on arrival; tensors whose last dim differs from the first's (a value dim other
    /// than the head dim) go in their own.
    fn many_to_heads<B: Backend>(
        &self,
        xs: Vec<(Tensor<B, 3>, Vec<Vec<usize>>)>,
    ) -> Result<Vec<Tensor<B, 3>>, CpError> {
        let dim = xs[0].0.dims()[2];
        if xs.iter().any(|(x, _)| x.dims()[2] != dim) {
            return xs
                .into_iter()
                .map(|(x, heads)| self.one_to_heads(x, heads))
                .collect();
        }
        let device = xs[0].0.device();
        let tokens = xs[0].0.dims()[0];
        let parts = (0..self.comm.size())
            .map(|p| {
                let total = xs.iter().map(|(_, heads)| heads[p].len()).sum();
                if tokens == 0 {
                    let options = burn::tensor::TensorCreationOptions::new(device.clone())
                        .with_dtype(xs[0].0.dtype());
                    return Tensor::empty([0, total, dim], options);
                }
                let selected = xs
                    .iter()
                    .map(|(x, heads)| select_heads(x.clone(), &heads[p]))
                    .collect();
                Tensor::cat(selected, 1)
            })
            .collect();
        let mine: Vec<usize> = xs.iter().map(|(_, heads)| heads[self.me()].len()).collect();
        let total = mine.iter().sum();
        let expected = |p: usize| [self.member_tokens[p], total, dim];
        let pieces = all_to_all(self.comm, parts, &device, expected, "ulysses to heads")?;
        let mut per_input: Vec<Vec<Tensor<B, 3>>> = vec![Vec::new(); xs.len()];
        for piece in pieces {
            let mut start = 0;
            for (i, &count) in mine.iter().enumerate() {
                per_input[i].push(narrow(piece.clone(), 1, start, count));
                start += count;
            }
        }
        Ok(per_input
            .into_iter()
            .map(|pieces| cat_tokens(pieces, 0))
            .collect())
    }

    /// [`Self::many_to_heads`] of one tensor.
    fn one_to_heads<B: Backend>(
        &self,
        x: Tensor<B, 3>,
        heads: Vec<Vec<usize>>,
    ) -> Result<Tensor<B, 3>, CpError> {
        let mut received = self.many_to_heads(vec![(x, heads)])?;
        Ok(received.pop().expect("one tensor per input"))
    }

    /// Every peer's query head set (and kv head set) as lists.
    fn q_head_sets(&self) -> Vec<Vec<usize>> {
        (0..self.comm.size())
            .map(|p| self.split.q_heads(p).collect())
            .collect()
    }

    fn kv_head_sets(&self) -> Vec<Vec<usize>> {
        (0..self.comm.size())
            .map(|p| self.split.kv_heads(p))
            .collect()
    }

    /// Queries (or out/dout): `[T_me, H, D]` → `[ΣT_p, H/P, D]`.
    pub fn q_to_heads<B: Backend>(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, CpError> {
        self.one_to_heads(x, self.q_head_sets())
    }

    /// Keys/values: `[T_me, K, D]` → `[ΣT_p, K_me, D]` (see [`HeadSplit::kv_heads`]).
    pub fn kv_to_heads<B: Backend>(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, CpError> {
        self.one_to_heads(x, self.kv_head_sets())
    }

    /// LSE: `[H, T_me]` → `[H/P, ΣT_p]`.
    ///
    /// Exchanged as `[H, T]` slices (rows of heads, columns of tokens), never through a
    /// transpose + reshape: burn 0.21's `reshape` of a transposed `[1, T]` (a size-1 dim with a
    /// large stride, as with one head per rank) computes wrong strides on the cubecl backends
    /// (`burn_std::tensor::split_strides`), which read garbage or overflow a binding.
    pub fn lse_to_heads<B: Backend>(&self, lse: Tensor<B, 2>) -> Result<Tensor<B, 2>, CpError> {
        let device = lse.device();
        let parts = (0..self.comm.size())
            .map(|p| {
                let heads = self.split.q_heads(p);
                narrow(lse.clone(), 0, heads.start, heads.len())
            })
            .collect();
        // Received piece p: [H/P, T_p]; tokens in member order.
        let mine = self.split.q_heads(self.me()).len();
        let expected = |p: usize| [mine, self.member_tokens[p]];
        let pieces = all_to_all(self.comm, parts, &device, expected, "ulysses lse to heads")?;
        Ok(cat_tokens(pieces, 1))
    }

    /// Heads → sequence: splits the token dim `tokens` of `x` (`ΣT_p` long) by member and returns
    /// the pieces (`T_me` tokens, rank `p`'s `heads_of(p)` heads on dim `heads`) every rank `p`
    /// sent here.
    fn to_sequence<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        [tokens, heads]: [usize; 2],
        heads_of: impl Fn(usize) -> usize,
    ) -> Result<Vec<Tensor<B, D>>, CpError> {
        let device = x.device();
        let dims = x.dims();
        let parts = split_sizes(x, tokens, &self.member_tokens);
        let expected = |p: usize| {
            let mut piece = dims;
            piece[tokens] = self.member_tokens[self.me()];
            piece[heads] = heads_of(p);
            piece
        };
        Ok(all_to_all(
            self.comm,
            parts,
            &device,
            expected,
            "ulysses to sequence",
        )?)
    }

    /// Outputs (or dq): `[ΣT_p, H/P, D]` → `[T_me, H, D]`.
    pub fn q_to_sequence<B: Backend>(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, CpError> {
        // Piece p holds query heads q_heads(p): concatenating by rank restores head order.
        let heads_of = |p: usize| self.split.q_heads(p).len();
        Ok(Tensor::cat(self.to_sequence(x, [0, 1], heads_of)?, 1))
    }

    /// LSE: `[H/P, ΣT_p]` → `[H, T_me]` (see [`Self::lse_to_heads`] for why no transpose).
    pub fn lse_to_sequence<B: Backend>(&self, lse: Tensor<B, 2>) -> Result<Tensor<B, 2>, CpError> {
        // Piece p holds query heads q_heads(p): concatenating by rank restores head order.
        let heads_of = |p: usize| self.split.q_heads(p).len();
        Ok(Tensor::cat(self.to_sequence(lse, [1, 0], heads_of)?, 0))
    }

    /// [`Self::to_sequence`] of several `[ΣT_p, *, D]` tensors (token dim 0, head dim 1) in
    /// **one** all-to-all: per input, the pieces `[T_me, counts[i][p], D]` every rank `p` sent
    /// here (`counts[i][p]`: the heads of input `i` on rank `p`). Inputs of another last dim than
    /// the first's go in their own.
    fn many_to_sequence<B: Backend>(
        &self,
        xs: Vec<(Tensor<B, 3>, Vec<usize>)>,
    ) -> Result<Vec<Vec<Tensor<B, 3>>>, CpError> {
        let dim = xs[0].0.dims()[2];
        if xs.len() == 1 || xs.iter().any(|(x, _)| x.dims()[2] != dim) {
            return xs
                .into_iter()
                .map(|(x, counts)| self.to_sequence(x, [0, 1], |p| counts[p]))
                .collect();
        }
        let device = xs[0].0.device();
        let dtype = xs[0].0.dtype();
        let me = self.me();
        let splits: Vec<Vec<Tensor<B, 3>>> = xs
            .iter()
            .map(|(x, _)| split_sizes(x.clone(), 0, &self.member_tokens))
            .collect();
        let mine: usize = xs.iter().map(|(_, counts)| counts[me]).sum();
        let parts = (0..self.comm.size())
            .map(|p| match self.member_tokens[p] {
                0 => {
                    let options =
                        burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype);
                    Tensor::empty([0, mine, dim], options)
                }
                _ => Tensor::cat(splits.iter().map(|split| split[p].clone()).collect(), 1),
            })
            .collect();
        let tokens = self.member_tokens[me];
        let expected = |p: usize| {
            let heads = xs.iter().map(|(_, counts)| counts[p]).sum();
            [tokens, heads, dim]
        };
        let pieces = all_to_all(self.comm, parts, &device, expected, "ulysses to sequence")?;
        let mut per_input: Vec<Vec<Tensor<B, 3>>> = vec![Vec::new(); xs.len()];
        for (p, piece) in pieces.into_iter().enumerate() {
            let mut start = 0;
            for (i, (_, counts)) in xs.iter().enumerate() {
                per_input[i].push(narrow(piece.clone(), 1, start, counts[p]));
                start += counts[p];
            }
        }
        Ok(per_input)
    }

    /// Key/value gradients: `[ΣT_p, K_me, D]` → `[T_me, K, D]`, summing replicated heads.
    pub fn kv_grad_to_sequence<B: Backend>(
        &self,
        x: Tensor<B, 3>,
    ) -> Result<Tensor<B, 3>, CpError> {
        let dim = x.dims()[2];
        let pieces = self.to_sequence(x, [0, 1], |p| self.split.kv_heads(p).len())?;
        Ok(self.sum_kv_pieces(pieces, dim))
    }

    /// The key/value gradient pieces every rank sent here (`[T_me, |kv_heads(p)|, D]`), summed
    /// onto this rank's tokens of every kv head (replicated heads added up).
    fn sum_kv_pieces<B: Backend>(&self, pieces: Vec<Tensor<B, 3>>, dim: usize) -> Tensor<B, 3> {
        let tokens = self.member_tokens[self.me()];
        let device = pieces[0].device();
        let dims = [tokens, self.split.kv_heads, dim];
        let dtype = pieces[0].dtype();
        // Replicated heads add up in f32 for half inputs, rounded once at the end.
        let wide = accumulator_dtype(dtype);
        let mut grad = filled::<B, 3>(dims, 0.0, (&device, wide).into());
        if tokens == 0 {
            return grad.cast(dtype);
        }
        for (p, piece) in pieces.into_iter().enumerate() {
            let heads = self.split.kv_heads(p);
            let indices: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
            let indices = Tensor::<B, 1, Int>::from_data(indices.as_slice(), &device);
            // Add-update accumulates repeated indices (replicated heads) on every backend
            // that implements select_assign's Add, which burn's backends do sequentially.
            grad = grad.select_assign(1, indices, widened(piece), IndexingUpdateOp::Add);
        }
        grad.cast(dtype)
    }

    /// Forward inputs to heads: `q [T_me, H, D]`, `k`/`v [T_me, K, D]` → the group's tokens on
    /// this rank's heads.
    pub fn inputs_to_heads<B: Backend>(&self, [q, k, v]: Qkv<B>) -> Result<Qkv<B>, CpError> {
        let (q_sets, kv_sets) = (self.q_head_sets(), self.kv_head_sets());
        let mut heads = self
            .many_to_heads(vec![(q, q_sets), (k, kv_sets.clone()), (v, kv_sets)])?
            .into_iter();
        let mut next = || heads.next().expect("one tensor per input");
        Ok([next(), next(), next()])
    }

    /// Forward result back to this rank's tokens on all heads.
    pub fn output_to_sequence<B: FlashOps>(
        &self,
        result: FlashOutput<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        Ok(FlashOutput {
            out: self.q_to_sequence(result.out)?,
            lse: self.lse_to_sequence(result.lse)?,
        })
    }

    /// Backward inputs to heads (q, k, v, out, lse, dout).
    pub fn backward_inputs_to_heads<B: FlashOps>(
        &self,
        x: BackwardInputs<B>,
    ) -> Result<BackwardInputs<B>, CpError> {
        let (q_sets, kv_sets) = (self.q_head_sets(), self.kv_head_sets());
        let inputs = vec![
            (x.q, q_sets.clone()),
            (x.k, kv_sets.clone()),
            (x.v, kv_sets),
            (x.out, q_sets.clone()),
            (x.dout, q_sets),
        ];
        let mut heads = self.many_to_heads(inputs)?.into_iter();
        let mut next = || heads.next().expect("one tensor per input");
        let (q, k, v, out, dout) = (next(), next(), next(), next(), next());
        Ok(BackwardInputs {
            q,
            k,
            v,
            out,
            lse: self.lse_to_heads(x.lse)?,
            dout,
        })
    }

    /// Gradients back to this rank's tokens (replicated kv heads summed onto their owner).
    pub fn gradients_to_sequence<B: FlashOps>(
        &self,
        grads: FlashGradients<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let size = self.comm.size();
        let q_counts: Vec<usize> = (0..size).map(|p| self.split.q_heads(p).len()).collect();
        let kv_counts: Vec<usize> = (0..size).map(|p| self.split.kv_heads(p).len()).collect();
        let (dk_dim, dv_dim) = (grads.dk.dims()[2], grads.dv.dims()[2]);
        let inputs = vec![
            (grads.dq, q_counts),
            (grads.dk, kv_counts.clone()),
            (grads.dv, kv_counts),
        ];
        let mut pieces = self.many_to_sequence(inputs)?.into_iter();
        let mut next = || pieces.next().expect("pieces per input");
        // Piece p holds query heads q_heads(p): concatenating by rank restores head order.
        let dq = Tensor::cat(next(), 1);
        let dk = self.sum_kv_pieces(next(), dk_dim);
        let dv = self.sum_kv_pieces(next(), dv_dim);
        Ok(FlashGradients { dq, dk, dv })
    }
}

/// Ulysses over the whole CP group.
pub struct Ulysses;

impl Ulysses {
    fn stage<'a>(
        group: &'a CpGroup,
        batch: &CpBatch,
        heads: usize,
        kv_heads: usize,
    ) -> UlyssesStage<'a> {
        let placement = &batch.placement;
        UlyssesStage {
            comm: &group.comm,
            split: HeadSplit {
                heads,
                kv_heads,
                degree: group.cp(),
            },
            member_tokens: (0..placement.cp()).map(|r| placement.tokens(r)).collect(),
        }
    }

    fn problem(batch: &CpBatch) -> burn_dcp_kernels::VarlenAttention {
        let all = concat_segments(batch.placement.ranks.iter().map(Vec::as_slice));
        batch.problem(all.clone(), all)
    }
}

impl AttentionStrategy for Ulysses {
    fn name(&self) -> String {
        "ulysses".into()
    }

    /// Ulysses over every rank of the topology.
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        let ranks = input.topology.ranks();
        let heads = input.dims.head_pair()?;
        if heads.split_queries(HeadParts::Ulysses(ranks)).is_err() {
            // `Heads`' rule, in the words plan_sim's reports have always used.
            return Err(CpError::Config(format!(
                "ulysses over {ranks} ranks needs the query heads ({}) to be a multiple of {ranks}",
                heads.heads()
            )));
        }
        strategies::usp(input, ranks, StrategyKind::Ulysses)
    }

    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume> {
        let tokens = rank_tokens(placement);
        ulysses_volume(&tokens, shape, shape.heads, placement.cp())
    }

    /// The query heads split evenly over the group ([`burn_dcp_kernels::heads`]' rule).
    fn validate_call(&self, call: CpCall<'_>, shape: AttentionShape) -> Result<(), CpError> {
        crate::strategy::Strategy::Ulysses.validate_heads(
            shape.heads,
            shape.kv_heads,
            call.group.cp(),
        )
    }

    fn forward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        qkv: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        let stage = Self::stage(group, batch, qkv[0].dims()[1], qkv[1].dims()[1]);
        let [q, k, v] = stage.inputs_to_heads(qkv)?;
        stage.output_to_sequence(B::flash_forward(q, k, v, &Self::problem(batch))?)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        x: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let stage = Self::stage(group, batch, x.q.dims()[1], x.k.dims()[1]);
        let x = stage.backward_inputs_to_heads(x)?;
        let problem = Self::problem(batch);
        let grads = B::flash_backward(x, &problem)?;
        stage.gradients_to_sequence(grads)
    }
}

/// Ulysses' bytes per rank ([`crate::diagnostics::volume`]'s formula) of a group holding
/// `tokens` per rank, `heads` query heads split over `degree` ranks.
pub(crate) fn ulysses_volume(
    tokens: &[u64],
    s: &VolumeShape,
    heads: usize,
    degree: usize,
) -> Vec<RankVolume> {
    let split = HeadSplit {
        heads,
        kv_heads: s.kv_heads,
        degree,
    };
    // per rank, the bytes per token of the heads it computes
    let computed_by: Vec<TokenBytes<u64>> = (0..degree)
        .map(|p| {
            let kv_heads = split.kv_heads(p).len();
            TokenBytes::exact(
                heads / degree,
                kv_heads,
                s.head_dim,
                s.value_dim,
                s.element_bytes,
            )
        })
        .collect();
    (0..degree)
        .map(|r| {
            let mut volume = RankVolume::default();
            for p in (0..degree).filter(|&p| p != r) {
                let (mine, theirs) = (tokens[r], tokens[p]);
                // my tokens' q, k, v (backward: also out, lse, dout) to p's heads; the results
                // of my heads for p's tokens back to p
                for pass in [Pass::Forward, Pass::Backward] {
                    let (out, _) = computed_by[p].both_sides(pass);
                    let (_, back) = computed_by[r].both_sides(pass);
                    *volume.pass_mut(pass) += mine * out + theirs * back;
                }
            }
            volume
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_query_head_finds_its_kv_head_locally() {
        for (heads, kv_heads) in [
            (8, 8),
            (8, 4),
            (8, 2),
            (8, 1),
            (12, 3),
            (12, 4),
            (6, 2),
            (16, 4),
        ] {
            for degree in (1..=heads).filter(|d| heads % d == 0) {
                let split = HeadSplit {
                    heads,
                    kv_heads,
                    degree,
                };
                for slice in 0..degree {
                    let kv = split.kv_heads(slice);
                    let q: Vec<usize> = split.q_heads(slice).collect();
                    assert_eq!(q.len() % kv.len(), 0, "H{heads} K{kv_heads} P{degree}");
                    let local_group = q.len() / kv.len();
                    for (local, &h) in q.iter().enumerate() {
                        assert_eq!(
                            kv[local / local_group],
                            h / (heads / kv_heads),
                            "H{heads} K{kv_heads} P{degree} slice {slice}"
                        );
                    }
                }
            }
        }
    }
}
