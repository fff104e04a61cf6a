//! Ring attention: key/value blocks travel around the ring; each rank merges the partial
//! attention of its queries against every block with the LSE merge.
//!
//! Forward, rank `r` of `R`: at step `s` it holds the key/values of rank `(r − s) mod R`. It first
//! posts the send of that block to `r + 1` and the receive from `r − 1` (step `s + 1`'s block),
//! then computes, then waits — so communication of step `s + 1` overlaps computation of step `s`.
//! `R − 1` passes. A step whose (query, key) pairs are all masked (e.g. causal, later chunks) is
//! skipped: no kernel call.
//!
//! Backward: the same rotation of key/values; next to each block travel its dK/dV accumulators.
//! At step `s`, rank `r` adds its contribution to the accumulators of block `(r − s) mod R` and
//! passes them on; the send after the last step delivers them to the block's owner.
//! dQ stays local. Gradients use the final `out`/`lse`, so each step's share is exact.
//!
//! The ring runs over any group whose member `p` holds the tokens `members[p]` (a list of
//! segments): the CP group for the ring strategy, a ring group of Ulysses groups for USP.

use burn::prelude::Tensor;
use burn::tensor::DType;
use burn_dcp_kernels::definition::packing::token_count;
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput, Segment};

use crate::batch::placement::Placement;
use crate::comm::{Comm, Payload, PendingRecv, PendingSend};
use crate::error::CpError;
use crate::planner::bytes::{kv_bytes, rank_tokens, Pass, RankVolume, Side, VolumeShape};
use crate::planner::{strategies, PlanInput, RoutedPlan};
use crate::strategy::exchange::{checked_tensor, filled, widened};
use crate::strategy::{AttentionStrategy, BackwardInputs, CpBatch, CpCall, CpGroup, Qkv};

/// A ring over `comm` whose member `p` holds the tokens `members[p]`.
pub struct RingPass<'a> {
    pub comm: &'a Comm,
    pub batch: &'a CpBatch,
    pub members: Vec<Vec<Segment>>,
}

/// Receives of the pieces of one block (in flight), with the dims and dtype each must have.
struct InFlight<'a> {
    comm: &'a Comm,
    from: usize,
    pieces: Vec<(PendingRecv, [usize; 3], DType)>,
    /// This rank's sends of the same step, waited for after the receives.
    sends: Vec<PendingSend>,
    what: &'static str,
}

impl InFlight<'_> {
    fn wait<B: FlashOps>(self, device: &B::Device) -> Result<Vec<Tensor<B, 3>>, CpError> {
        let (comm, from, what) = (self.comm, self.from, self.what);
        let received = self
            .pieces
            .into_iter()
            .map(|(pending, expected, dtype)| {
                Ok(checked_tensor(
                    comm,
                    pending.wait()?,
                    from,
                    expected,
                    dtype,
                    what,
                    device,
                )?)
            })
            .collect::<Result<Vec<_>, CpError>>()?;
        for send in self.sends {
            send.wait()?;
        }
        Ok(received)
    }

    /// [`Self::wait`] for a block of two pieces (k and v, or dk and dv).
    fn wait_pair<B: FlashOps>(self, device: &B::Device) -> Result<[Tensor<B, 3>; 2], CpError> {
        let pieces = self.wait(device)?;
        Ok(pieces.try_into().unwrap_or_else(|pieces: Vec<_>| {
            panic!("ring: two pieces posted, {} received", pieces.len())
        }))
    }
}

impl RingPass<'_> {
    fn next(&self) -> usize {
        (self.comm.rank() + 1) % self.comm.size()
    }

    fn prev(&self) -> usize {
        (self.comm.rank() + self.comm.size() - 1) % self.comm.size()
    }

    /// Member whose block this rank holds at `step`.
    fn owner(&self, step: usize) -> usize {
        (self.comm.rank() + self.comm.size() - step % self.comm.size()) % self.comm.size()
    }

    /// Posts the receives of `pieces` from the previous rank (the same pieces of the block of
    /// member `incoming`: its tokens, the pieces' heads and dims), then the sends of `pieces` to
    /// the next; [`InFlight::wait`] waits for the receives, then the sends. Receives are posted
    /// before any send is waited for, so the ring never depends on eager sends (MPI and NCCL
    /// sends of large messages complete only once the receiver has posted its receive).
    fn rotate<B: FlashOps>(
        &self,
        pieces: &[&Tensor<B, 3>],
        incoming: usize,
        what: &'static str,
    ) -> Result<InFlight<'_>, CpError> {
        let tokens = token_count(&self.members[incoming]);
        let receives = pieces
            .iter()
            .map(|piece| {
                let [_, heads, dim] = piece.dims();
                let pending = self.comm.irecv(self.prev())?;
                Ok((pending, [tokens, heads, dim], piece.dtype()))
            })
            .collect::<Result<Vec<_>, CpError>>()?;
        let sends = pieces
            .iter()
            .map(|piece| {
                self.comm
                    .isend(self.next(), Payload::device((*piece).clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(InFlight {
            comm: self.comm,
            from: self.prev(),
            pieces: receives,
            sends,
            what,
        })
    }

    /// Starts passing this step's k/v block on to the next rank (none after the last step).
    fn pass_on_kv<B: FlashOps>(
        &self,
        step: usize,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
    ) -> Result<Option<InFlight<'_>>, CpError> {
        if step + 1 == self.comm.size() {
            return Ok(None);
        }
        let in_flight = self.rotate(&[k, v], self.owner(step + 1), "ring k/v block")?;
        Ok(Some(in_flight))
    }

    fn step_problem(&self, owner: usize) -> burn_dcp_kernels::VarlenAttention {
        let me = self.comm.rank();
        self.batch
            .problem(self.members[me].clone(), self.members[owner].clone())
    }

    pub fn forward<B: FlashOps>(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) -> Result<FlashOutput<B>, CpError> {
        let device = q.device();
        let [tokens, heads, _] = q.dims();
        let value_dim = v.dims()[2];
        let mut merged: Option<FlashOutput<B>> = None;
        let (mut k, mut v) = (k, v);
        for step in 0..self.comm.size() {
            let in_flight = self.pass_on_kv(step, &k, &v)?;
            let problem = self.step_problem(self.owner(step));
            if problem.has_work() {
                let part = B::flash_forward(q.clone(), k.clone(), v.clone(), &problem)?;
                // The running merge in f32 for half inputs: one rounding of `out`, at the end.
                let part = FlashOutput {
                    out: widened(part.out),
                    lse: part.lse,
                };
                merged = Some(match merged {
                    None => part,
                    Some(acc) => B::flash_merge(acc, part)?,
                });
            }
            if let Some(in_flight) = in_flight {
                [k, v] = in_flight.wait_pair::<B>(&device)?;
            }
        }
        let dtype = q.dtype();
        let merged = merged.map(|merged| FlashOutput {
            out: merged.out.cast(dtype),
            lse: merged.lse,
        });
        Ok(merged.unwrap_or_else(|| FlashOutput {
            out: filled([tokens, heads, value_dim], 0.0, (&device, dtype).into()),
            lse: filled(
                [heads, tokens],
                f32::NEG_INFINITY,
                (&device, burn::tensor::DType::F32).into(),
            ),
        }))
    }

    pub fn backward<B: FlashOps>(
        &self,
        x: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        let device = x.q.device();
        // Zeros without a launch where a rank holds no tokens (see `filled`). dq accumulates here
        // in f32 for half inputs; dk/dv travel the ring in the inputs' dtype (the messages) and
        // each rank adds its part to them in f32.
        let zeros = |t: &Tensor<B, 3>| filled(t.dims(), 0.0, (&device, t.dtype()).into());
        let dtype = x.q.dtype();
        let mut dq = widened(zeros(&x.q));
        let (mut k, mut v) = (x.k.clone(), x.v.clone());
        let (mut dk, mut dv) = (zeros(&x.k), zeros(&x.v));
        for step in 0..self.comm.size() {
            let kv_in_flight = self.pass_on_kv(step, &k, &v)?;
            let problem = self.step_problem(self.owner(step));
            if problem.has_work() {
                let inputs = BackwardInputs {
                    k: k.clone(),
                    v: v.clone(),
                    ..x.clone()
                };
                let part = B::flash_backward(inputs, &problem)?;
                dq = dq + widened(part.dq);
                dk = (widened(dk) + widened(part.dk)).cast(dtype);
                dv = (widened(dv) + widened(part.dv)).cast(dtype);
            }
            // The accumulators follow their block; after the last step they reach its owner.
            let grads_in_flight =
                self.rotate(&[&dk, &dv], self.owner(step + 1), "ring dk/dv accumulators")?;
            if let Some(in_flight) = kv_in_flight {
                [k, v] = in_flight.wait_pair::<B>(&device)?;
            }
            [dk, dv] = grads_in_flight.wait_pair::<B>(&device)?;
        }
        Ok(FlashGradients {
            dq: dq.cast(dtype),
            dk,
            dv,
        })
    }
}

/// Ring attention over the whole CP group.
pub struct Ring;

impl Ring {
    fn pass<'a>(group: &'a CpGroup, batch: &'a CpBatch) -> RingPass<'a> {
        RingPass {
            comm: &group.comm,
            batch,
            members: batch.placement.ranks.clone(),
        }
    }
}

impl AttentionStrategy for Ring {
    fn name(&self) -> String {
        "ring".into()
    }

    /// Ring in the zigzag layout (the planner places ring's tokens zigzag).
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        strategies::ring_zigzag(input)
    }

    fn volume(&self, placement: &Placement, shape: &VolumeShape) -> Vec<RankVolume> {
        ring_volume(&rank_tokens(placement), shape, shape.kv_heads as u64)
    }

    fn forward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        [q, k, v]: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        Self::pass(group, batch).forward(q, k, v)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        inputs: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        Self::pass(group, batch).backward(inputs)
    }
}

/// Ring's bytes per rank ([`crate::diagnostics::volume`]'s formula) of a ring holding `tokens`
/// per member, `kv_heads` kv heads travelling.
pub(crate) fn ring_volume(tokens: &[u64], s: &VolumeShape, kv_heads: u64) -> Vec<RankVolume> {
    let size = tokens.len();
    let kv = kv_bytes(s, kv_heads as usize);
    let (forward_kv, _) = kv.hop(Side::KeyValue, Pass::Forward);
    let (backward_kv, accumulators) = kv.hop(Side::KeyValue, Pass::Backward);
    let owner_tokens = |r: usize, step: usize| tokens[(r + size - step) % size];
    (0..size)
        .map(|r| {
            if size == 1 {
                return RankVolume::default();
            }
            // KV passes on at steps 0..P−1; backward the dK/dV accumulators at every step
            let passes: u64 = (0..size - 1).map(|step| owner_tokens(r, step)).sum();
            let every: u64 = (0..size).map(|step| owner_tokens(r, step)).sum();
            RankVolume {
                forward: passes * forward_kv,
                backward: passes * backward_kv + every * accumulators,
            }
        })
        .collect()
}
