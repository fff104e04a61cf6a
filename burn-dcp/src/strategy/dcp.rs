//! The DCP executor: runs a rank's program of a [`BlockSchedule`] (see `block_plan`) on its
//! home blocks, forward and backward, exactly.
//!
//! - **Forward.** Copies carry `q` (query side) or `k`, `v` (key side). `Attend` computes the
//!   partial `(out, lse)` of a query block against the listed key blocks and merges it (LSE merge)
//!   into this rank's partial of that block. Results carry a partial `(out, lse)` home (merged at
//!   relays on the way), where it is merged into the block's output.
//! - **Backward.** Copies carry `q`, `out`, `lse`, `dout` (query side; `out`/`lse` are the final
//!   forward results) or `k`, `v`. `Attend` adds the tile's exact share of `dq` to the query
//!   block's and of `dk`/`dv` to each key block's. Results carry `dq` or `dk`, `dv` home (summed
//!   at relays).
//!
//! - **Head units.** Blocks are held per head unit (its share of the query heads and the kv heads
//!   they read). A token home starts with every unit of its blocks, sends those homed elsewhere
//!   (`SendUnit`: a query-side and a key-side copy at once) and at the end receives their final
//!   results (`ReceiveUnitResult`: replacing whatever partial it had sent away); its outputs and
//!   gradients are the units' concatenated along the heads (kv gradients of units that share a kv
//!   head summed).
//!
//! Bytes per token of a copy and a result are those of the planner's cost model
//! (`planner::cost::hop_bytes`) with 4-byte elements, so measured bytes equal the plan's.

use std::collections::HashMap;

use burn::prelude::Tensor;
use burn::tensor::{DType, TensorCreationOptions};
use burn_dcp_kernels::{
    AttentionShape, FlashGradients, FlashOps, FlashOutput, Segment, VarlenAttention,
};

use crate::batch::placement::Placement;
use crate::comm::{Comm, CommError, Payload, PendingSend};
use crate::error::CpError;
use crate::heads::HeadParts;
use crate::planner::bytes::{RankVolume, VolumeShape};
use crate::planner::cost::{Pass, Side};
use crate::planner::dcp::dcp_plan;
use crate::planner::plan::tile_grids;
use crate::planner::{PlanInput, RoutedPlan};
use crate::strategy::block_plan::{BlockId, BlockSchedule, Instruction};
use crate::strategy::exchange::{
    accumulator_dtype, cat_tokens, filled, narrow, split_sizes, widened,
};
use crate::strategy::{AttentionStrategy, BackwardInputs, CpBatch, CpCall, Qkv};

/// Dims of a pass's tensors: query and kv heads, head dim, and the head units they are cut
/// into.
#[derive(Clone, Copy, Debug)]
struct Heads {
    whole: crate::heads::Heads,
    dim: usize,
    units: usize,
    /// One unit's query and kv heads.
    unit: crate::heads::Heads,
}

impl Heads {
    /// `units` head units of `heads` query and `kv_heads` kv heads
    /// ([`crate::heads::Heads::split`]'s rule, the plan's).
    fn new(heads: usize, kv_heads: usize, dim: usize, units: usize) -> Result<Self, CpError> {
        let (whole, unit) = crate::heads::Heads::new(heads, kv_heads)
            .and_then(|whole| Ok((whole, whole.split(HeadParts::Units(units))?)))
            .map_err(|e| CpError::Config(format!("DCP plan: {e}")))?;
        Ok(Self {
            whole,
            dim,
            units,
            unit,
        })
    }

    /// Query heads of one unit.
    fn unit_heads(&self) -> usize {
        self.unit.heads()
    }

    /// Kv heads of one unit (units sharing a kv head each hold it).
    fn unit_kv_heads(&self) -> usize {
        self.unit.kv_heads()
    }

    /// A unit's query heads, kv heads and head dim.
    fn unit_dims(&self) -> (usize, usize, usize) {
        (self.unit_heads(), self.unit_kv_heads(), self.dim)
    }

    /// First query head of `unit`.
    fn first_head(&self, unit: usize) -> usize {
        unit * self.unit_heads()
    }

    /// First kv head of `unit`.
    fn first_kv_head(&self, unit: usize) -> usize {
        self.whole.first_kv_head(unit, HeadParts::Units(self.units))
    }
}

/// A head unit of a token block: the key of everything a rank holds.
type Key = (BlockId, usize);

/// What a rank holds during a pass: copies of blocks (its own and received) and its results,
/// per head unit.
struct Blocks<B: FlashOps> {
    /// Query side: `[q]` forward, `[q, out, lse, dout]` backward (lse as `[H, T]`).
    queries: HashMap<Key, QuerySide<B>>,
    keys: HashMap<Key, (Tensor<B, 3>, Tensor<B, 3>)>,
    outputs: HashMap<Key, FlashOutput<B>>,
    dq: HashMap<Key, Tensor<B, 3>>,
    dkv: HashMap<Key, (Tensor<B, 3>, Tensor<B, 3>)>,
}

#[derive(Clone)]
struct QuerySide<B: FlashOps> {
    q: Tensor<B, 3>,
    /// Backward only: the final `out`, `lse [H, T]` and `dout` of the block.
    grads: Option<(Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>)>,
}

/// One pass of a rank's program.
struct Run<'a, B: FlashOps> {
    comm: &'a Comm,
    batch: &'a CpBatch,
    schedule: &'a BlockSchedule,
    heads: Heads,
    dtype: DType,
    device: B::Device,
    blocks: Blocks<B>,
}

/// DCP as an [`AttentionStrategy`]: the batch's block plan ([`CpBatch::blocks`]) on the group.
#[derive(Clone, Copy, Debug)]
pub struct Dcp;

impl AttentionStrategy for Dcp {
    fn name(&self) -> String {
        "dcp".into()
    }

    /// DCP's planner over the kv heads as head units (`plan_sim`'s plan). The executor runs
    /// whatever plan the batch carries ([`CpBatch::from_blocks`]), such as
    /// [`crate::planner::auto::executable_dcp_plan`]'s.
    fn plan(&self, input: &PlanInput) -> Result<RoutedPlan, CpError> {
        let problem = input.problem(input.dims.kv_heads);
        let grids = tile_grids(&problem);
        dcp_plan(&problem, grids, &input.dims, &input.topology, &input.dcp)
    }

    /// Empty: DCP moves what its plan says ([`BlockSchedule::predicted_volume`]).
    fn volume(&self, _placement: &Placement, _shape: &VolumeShape) -> Vec<RankVolume> {
        Vec::new()
    }

    /// The block plan covers this group and places the tokens as the batch says; one dim for
    /// values and heads (the plan's byte model has one).
    fn validate_call(&self, call: CpCall<'_>, shape: AttentionShape) -> Result<(), CpError> {
        let batch = call.batch;
        let schedule = batch.schedule()?;
        if schedule.placement() != &*batch.placement {
            return Err(CpError::Config(format!(
                "the block plan places the tokens differently from the micro-batch's {}",
                batch.placement
            )));
        }
        if shape.value_dim != shape.head_dim {
            return Err(CpError::Config(format!(
                "strategy dcp needs value dim {} = head dim {} (its byte model has one dim)",
                shape.value_dim, shape.head_dim
            )));
        }
        Ok(())
    }

    fn forward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        [q, k, v]: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        forward(&group.comm, batch, batch.schedule()?, q, k, v)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        inputs: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        backward(&group.comm, batch, batch.schedule()?, inputs)
    }
}

/// DCP forward on this rank's home blocks: `q [T, H, D]`, `k`/`v [T, K, D]` in the placement's
/// order → `out [T, H, D]`, `lse [H, T]`.
pub fn forward<B: FlashOps>(
    comm: &Comm,
    batch: &CpBatch,
    schedule: &BlockSchedule,
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> Result<FlashOutput<B>, CpError> {
    let mut run = Run::<B>::new(comm, batch, schedule, &q, &k)?;
    for (block, range) in run.home_ranges() {
        for unit in 0..run.heads.units {
            let q = run.query_heads(narrow(q.clone(), 0, range.start, range.len()), unit);
            run.blocks
                .queries
                .insert((block, unit), QuerySide { q, grads: None });
            run.insert_keys((block, unit), &k, &v, range.clone());
        }
    }
    run.execute(schedule.program(comm.rank(), Pass::Forward), false)?;
    Ok(run.home_outputs())
}

/// DCP backward on this rank's home blocks (see [`BackwardInputs`]).
pub fn backward<B: FlashOps>(
    comm: &Comm,
    batch: &CpBatch,
    schedule: &BlockSchedule,
    inputs: BackwardInputs<B>,
) -> Result<FlashGradients<B>, CpError> {
    let BackwardInputs {
        q,
        k,
        v,
        out,
        lse,
        dout,
    } = inputs;
    let mut run = Run::<B>::new(comm, batch, schedule, &q, &k)?;
    for (block, range) in run.home_ranges() {
        for unit in 0..run.heads.units {
            let rows = |t: &Tensor<B, 3>| {
                run.query_heads(narrow(t.clone(), 0, range.start, range.len()), unit)
            };
            let lse = narrow(lse.clone(), 1, range.start, range.len());
            let grads = (
                rows(&out),
                narrow(lse, 0, run.heads.first_head(unit), run.heads.unit_heads()),
                rows(&dout),
            );
            let side = QuerySide {
                q: rows(&q),
                grads: Some(grads),
            };
            run.blocks.queries.insert((block, unit), side);
            run.insert_keys((block, unit), &k, &v, range.clone());
        }
    }
    run.execute(schedule.program(comm.rank(), Pass::Backward), true)?;
    Ok(run.home_gradients())
}

impl<'a, B: FlashOps> Run<'a, B> {
    fn new(
        comm: &'a Comm,
        batch: &'a CpBatch,
        schedule: &'a BlockSchedule,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
    ) -> Result<Self, CpError> {
        let [_, heads, dim] = q.dims();
        Ok(Self {
            comm,
            batch,
            schedule,
            heads: Heads::new(heads, k.dims()[1], dim, schedule.units)?,
            dtype: q.dtype(),
            device: q.device(),
            blocks: Blocks {
                queries: HashMap::new(),
                keys: HashMap::new(),
                outputs: HashMap::new(),
                dq: HashMap::new(),
                dkv: HashMap::new(),
            },
        })
    }

    /// The query heads of `unit` of `t [T, H, D]`.
    fn query_heads(&self, t: Tensor<B, 3>, unit: usize) -> Tensor<B, 3> {
        narrow(t, 1, self.heads.first_head(unit), self.heads.unit_heads())
    }

    /// The kv heads of `unit` of `t [T, K, D]`.
    fn kv_heads(&self, t: Tensor<B, 3>, unit: usize) -> Tensor<B, 3> {
        narrow(
            t,
            1,
            self.heads.first_kv_head(unit),
            self.heads.unit_kv_heads(),
        )
    }

    /// This rank's home blocks and their local token ranges.
    fn home_ranges(&self) -> Vec<(BlockId, std::ops::Range<usize>)> {
        let mut start = 0;
        self.schedule
            .home_blocks(self.comm.rank())
            .into_iter()
            .map(|block| {
                let len = self.schedule.block_tokens(block).len();
                start += len;
                (block, start - len..start)
            })
            .collect()
    }

    fn insert_keys(
        &mut self,
        key: Key,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        range: std::ops::Range<usize>,
    ) {
        let rows =
            |t: &Tensor<B, 3>| self.kv_heads(narrow(t.clone(), 0, range.start, range.len()), key.1);
        let pair = (rows(k), rows(v));
        self.blocks.keys.insert(key, pair);
    }

    fn execute(&mut self, program: &[Instruction], backward: bool) -> Result<(), CpError> {
        let mut sends = Vec::new();
        for instruction in program {
            match *instruction {
                Instruction::Send {
                    side,
                    block,
                    unit,
                    to,
                } => {
                    let parts = self.copy_of(side, (block, unit), backward)?;
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::Receive {
                    side,
                    block,
                    unit,
                    from,
                } => {
                    let shapes = self.copy_shapes(side, block, backward);
                    let parts = self.receive(from, &shapes, "a block copy")?;
                    self.store_copy(side, (block, unit), parts)?;
                }
                Instruction::Attend { q, unit, ref kv } => match backward {
                    false => self.attend_forward((q, unit), kv)?,
                    true => self.attend_backward((q, unit), kv)?,
                },
                Instruction::SendResult {
                    side,
                    block,
                    unit,
                    to,
                } => {
                    let parts = self.result_of(side, (block, unit), backward)?;
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::ReceiveResult {
                    side,
                    block,
                    unit,
                    from,
                } => {
                    let shapes = self.result_shapes(side, block, backward);
                    let parts = self.receive(from, &shapes, "a block result")?;
                    self.merge_result(side, (block, unit), parts, backward)?;
                }
                Instruction::SendUnit { block, unit, to } => {
                    let key = (block, unit);
                    let mut parts = self.copy_of(Side::QueryOutput, key, backward)?;
                    parts.extend(self.copy_of(Side::KeyValue, key, backward)?);
                    // It is the unit's home's now; a copy comes back if this rank computes with it.
                    self.blocks.queries.remove(&key);
                    self.blocks.keys.remove(&key);
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::ReceiveUnit { block, unit, from } => {
                    let mut shapes = self.copy_shapes(Side::QueryOutput, block, backward);
                    let queries = shapes.len();
                    shapes.extend(self.copy_shapes(Side::KeyValue, block, backward));
                    let mut parts = self.receive(from, &shapes, "a head unit")?;
                    let keys = parts.split_off(queries);
                    self.store_copy(Side::QueryOutput, (block, unit), parts)?;
                    self.store_copy(Side::KeyValue, (block, unit), keys)?;
                }
                Instruction::SendUnitResult { block, unit, to } => {
                    let parts = self.unit_result((block, unit), backward);
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::ReceiveUnitResult { block, unit, from } => {
                    let mut shapes = self.result_shapes(Side::QueryOutput, block, backward);
                    if backward {
                        shapes.extend(self.result_shapes(Side::KeyValue, block, backward));
                    }
                    let parts = self.receive(from, &shapes, "a head unit's results")?;
                    self.replace_results((block, unit), parts, backward)?;
                }
            }
        }
        for send in sends {
            send.wait()?;
        }
        Ok(())
    }

    /// Posts the sends of `parts` to `to`. Posting never blocks, and they are waited for at the
    /// end of the pass, so the program order cannot deadlock.
    fn send(
        &self,
        to: usize,
        parts: Vec<Payload>,
        sends: &mut Vec<PendingSend>,
    ) -> Result<(), CpError> {
        for part in parts {
            sends.push(self.comm.isend(to, part)?);
        }
        Ok(())
    }

    fn receive(
        &self,
        from: usize,
        shapes: &[Vec<usize>],
        what: &str,
    ) -> Result<Vec<Payload>, CpError> {
        let mut parts = Vec::with_capacity(shapes.len());
        for shape in shapes {
            let data = self.comm.irecv(from)?.wait()?;
            // LSE (the only 2-D part) is f32 whatever the inputs' dtype, as the kernels make it.
            let dtype = if shape.len() == 2 {
                DType::F32
            } else {
                self.dtype
            };
            if data.shape() != *shape || data.dtype() != dtype {
                return Err(CpError::Comm(CommError::Protocol {
                    group: self.comm.name().to_string(),
                    rank: self.comm.rank(),
                    peer_global: self.comm.global_rank(from),
                    message: format!(
                        "DCP {what}: expected a {shape:?} {dtype:?} block, got {:?} {:?}",
                        data.shape(),
                        data.dtype()
                    ),
                }));
            }
            parts.push(data);
        }
        Ok(parts)
    }

    fn tokens(&self, block: BlockId) -> usize {
        self.schedule.block_tokens(block).len()
    }

    fn copy_shapes(&self, side: Side, block: BlockId, backward: bool) -> Vec<Vec<usize>> {
        let t = self.tokens(block);
        let (h, kv, d) = self.heads.unit_dims();
        match (side, backward) {
            (Side::QueryOutput, false) => vec![vec![t, h, d]],
            (Side::QueryOutput, true) => {
                vec![vec![t, h, d], vec![t, h, d], vec![h, t], vec![t, h, d]]
            }
            (Side::KeyValue, _) => vec![vec![t, kv, d]; 2],
        }
    }

    fn result_shapes(&self, side: Side, block: BlockId, backward: bool) -> Vec<Vec<usize>> {
        let t = self.tokens(block);
        let (h, kv, d) = self.heads.unit_dims();
        match (side, backward) {
            (Side::QueryOutput, false) => vec![vec![t, h, d], vec![h, t]],
            (Side::QueryOutput, true) => vec![vec![t, h, d]],
            (Side::KeyValue, _) => vec![vec![t, kv, d]; 2],
        }
    }

    fn missing(&self, what: &str, (block, unit): Key) -> CpError {
        CpError::Config(format!(
            "DCP rank {}: the program uses {what} of block {} of sequence {} (head unit {unit}), which it does not hold (an inconsistent plan)",
            self.comm.rank(),
            block.block,
            block.seq
        ))
    }

    fn copy_of(&self, side: Side, key: Key, backward: bool) -> Result<Vec<Payload>, CpError> {
        match side {
            Side::QueryOutput => {
                let query = self
                    .blocks
                    .queries
                    .get(&key)
                    .ok_or_else(|| self.missing("the queries", key))?;
                let mut parts = vec![Payload::device(query.q.clone())];
                if backward {
                    let (out, lse, dout) = query
                        .grads
                        .clone()
                        .ok_or_else(|| self.missing("the output", key))?;
                    parts.extend([
                        Payload::device(out),
                        Payload::device(lse),
                        Payload::device(dout),
                    ]);
                }
                Ok(parts)
            }
            Side::KeyValue => {
                let (k, v) = self
                    .blocks
                    .keys
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| self.missing("the keys", key))?;
                Ok(vec![Payload::device(k), Payload::device(v)])
            }
        }
    }

    fn store_copy(&mut self, side: Side, key: Key, parts: Vec<Payload>) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match side {
            Side::QueryOutput => {
                let q = self.take::<3>(&mut parts)?;
                let grads = match parts.len() == 3 {
                    true => Some((
                        self.take::<3>(&mut parts)?,
                        self.take::<2>(&mut parts)?,
                        self.take::<3>(&mut parts)?,
                    )),
                    false => None,
                };
                self.blocks.queries.insert(key, QuerySide { q, grads });
            }
            Side::KeyValue => {
                let k = self.take::<3>(&mut parts)?;
                let v = self.take::<3>(&mut parts)?;
                self.blocks.keys.insert(key, (k, v));
            }
        }
        Ok(())
    }

    /// The next received part (checked by [`Self::receive`]) as a tensor on this rank's device.
    fn take<const D: usize>(
        &self,
        parts: &mut impl Iterator<Item = Payload>,
    ) -> Result<Tensor<B, D>, CpError> {
        let invalid = |message: String| {
            CpError::Comm(CommError::Invalid {
                group: self.comm.name().to_string(),
                message: format!("DCP: a received block {message}"),
            })
        };
        let part = parts
            .next()
            .ok_or_else(|| invalid("has too few parts".into()))?;
        part.into_tensor(&self.device)
            .map_err(|e| invalid(e.to_string()))
    }

    /// The kernel problem of query block `q` against key blocks `kv` of its sequence.
    fn problem(&self, q: BlockId, kv: &[usize]) -> VarlenAttention {
        let segment = |block: BlockId| {
            let tokens = self.schedule.block_tokens(block);
            Segment::contiguous(block.seq, tokens.start, tokens.len())
        };
        let kv_segments = kv
            .iter()
            .map(|&block| segment(BlockId { seq: q.seq, block }))
            .collect();
        VarlenAttention {
            seq_lens: self.schedule.seq_lens.clone(),
            masks: self.batch.masks.clone(),
            q_segments: vec![segment(q)],
            kv_segments,
            scale: self.batch.scale,
        }
    }

    /// The concatenated keys and values of blocks `kv` of sequence `seq`, head unit `unit`.
    fn keys_of(
        &self,
        seq: usize,
        unit: usize,
        kv: &[usize],
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), CpError> {
        let mut ks = Vec::with_capacity(kv.len());
        let mut vs = Vec::with_capacity(kv.len());
        for &block in kv {
            let key = (BlockId { seq, block }, unit);
            let (k, v) = self
                .blocks
                .keys
                .get(&key)
                .cloned()
                .ok_or_else(|| self.missing("the keys", key))?;
            ks.push(k);
            vs.push(v);
        }
        Ok((cat_tokens(ks, 0), cat_tokens(vs, 0)))
    }

    fn attend_forward(&mut self, key: Key, kv: &[usize]) -> Result<(), CpError> {
        let (q, unit) = key;
        let query = self
            .blocks
            .queries
            .get(&key)
            .ok_or_else(|| self.missing("the queries", key))?
            .q
            .clone();
        let (k, v) = self.keys_of(q.seq, unit, kv)?;
        let partial = B::flash_forward(query, k, v, &self.problem(q, kv))?;
        self.merge_output(key, partial)
    }

    /// Merges a partial output into the unit's, kept in the accumulator dtype (f32 for half
    /// inputs: one rounding, when the result is sent or returned).
    fn merge_output(&mut self, key: Key, partial: FlashOutput<B>) -> Result<(), CpError> {
        let partial = FlashOutput {
            out: widened(partial.out),
            lse: partial.lse,
        };
        let merged = match self.blocks.outputs.remove(&key) {
            Some(previous) => B::flash_merge(previous, partial)?,
            None => partial,
        };
        self.blocks.outputs.insert(key, merged);
        Ok(())
    }

    fn attend_backward(&mut self, key: Key, kv: &[usize]) -> Result<(), CpError> {
        let (q, unit) = key;
        let query = self
            .blocks
            .queries
            .get(&key)
            .cloned()
            .ok_or_else(|| self.missing("the queries", key))?;
        let (out, lse, dout) = query.grads.ok_or_else(|| self.missing("the output", key))?;
        let (k, v) = self.keys_of(q.seq, unit, kv)?;
        let grads = B::flash_backward(query.q, k, v, out, lse, dout, &self.problem(q, kv))?;
        add_into(&mut self.blocks.dq, key, grads.dq);
        let sizes: Vec<usize> = kv
            .iter()
            .map(|&block| self.tokens(BlockId { seq: q.seq, block }))
            .collect();
        let dks = split_sizes(grads.dk, 0, &sizes);
        let dvs = split_sizes(grads.dv, 0, &sizes);
        for ((&block, dk), dv) in kv.iter().zip(dks).zip(dvs) {
            let key = (BlockId { seq: q.seq, block }, unit);
            add_pair_into(&mut self.blocks.dkv, key, dk, dv);
        }
        Ok(())
    }

    fn result_of(&self, side: Side, key: Key, backward: bool) -> Result<Vec<Payload>, CpError> {
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let output = self
                    .blocks
                    .outputs
                    .get(&key)
                    .ok_or_else(|| self.missing("the partial output", key))?;
                Ok(vec![
                    self.sent(output.out.clone()),
                    Payload::device(output.lse.clone()),
                ])
            }
            (Side::QueryOutput, true) => {
                let dq = self
                    .blocks
                    .dq
                    .get(&key)
                    .ok_or_else(|| self.missing("the dq", key))?;
                Ok(vec![self.sent(dq.clone())])
            }
            (Side::KeyValue, _) => {
                let (dk, dv) = self
                    .blocks
                    .dkv
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| self.missing("the dk/dv", key))?;
                Ok(vec![self.sent(dk), self.sent(dv)])
            }
        }
    }

    fn merge_result(
        &mut self,
        side: Side,
        key: Key,
        parts: Vec<Payload>,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let out = self.take::<3>(&mut parts)?;
                let lse = self.take::<2>(&mut parts)?;
                self.merge_output(key, FlashOutput { out, lse })?;
            }
            (Side::QueryOutput, true) => {
                let dq = self.take::<3>(&mut parts)?;
                add_into(&mut self.blocks.dq, key, dq)
            }
            (Side::KeyValue, _) => {
                let dk = self.take::<3>(&mut parts)?;
                let dv = self.take::<3>(&mut parts)?;
                add_pair_into(&mut self.blocks.dkv, key, dk, dv);
            }
        }
        Ok(())
    }

    /// The final results of a head unit homed here, for its token home: `[out, lse]` forward,
    /// `[dq, dk, dv]` backward (a block no tile read: `out` 0, `lse` −∞, gradients 0).
    fn unit_result(&mut self, key: Key, backward: bool) -> Vec<Payload> {
        let t = self.tokens(key.0);
        match backward {
            false => {
                let output = self
                    .blocks
                    .outputs
                    .remove(&key)
                    .unwrap_or_else(|| self.empty_output(t));
                vec![self.sent(output.out), Payload::device(output.lse)]
            }
            true => {
                let dq = self.blocks.dq.remove(&key);
                let dq =
                    dq.unwrap_or_else(|| self.zeros([t, self.heads.unit_heads(), self.heads.dim]));
                let (dk, dv) = self
                    .blocks
                    .dkv
                    .remove(&key)
                    .unwrap_or_else(|| self.zero_kv(t));
                vec![self.sent(dq), self.sent(dk), self.sent(dv)]
            }
        }
    }

    /// Stores a head unit's final results received from its home, replacing this rank's
    /// partial of them (which it sent there).
    fn replace_results(
        &mut self,
        key: Key,
        parts: Vec<Payload>,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match backward {
            false => {
                let out = widened(self.take::<3>(&mut parts)?);
                let lse = self.take::<2>(&mut parts)?;
                self.blocks.outputs.insert(key, FlashOutput { out, lse });
            }
            true => {
                let dq = widened(self.take::<3>(&mut parts)?);
                let dk = widened(self.take::<3>(&mut parts)?);
                let dv = widened(self.take::<3>(&mut parts)?);
                self.blocks.dq.insert(key, dq);
                self.blocks.dkv.insert(key, (dk, dv));
            }
        }
        Ok(())
    }

    /// Zeros in the accumulator dtype (the results' before they are sent or returned).
    fn zeros(&self, dims: [usize; 3]) -> Tensor<B, 3> {
        let dtype = accumulator_dtype(self.dtype);
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(dtype);
        filled(dims, 0.0, options)
    }

    /// An accumulated result as a message: in the inputs' dtype.
    fn sent(&self, t: Tensor<B, 3>) -> Payload {
        Payload::device(t.cast(self.dtype))
    }

    /// A unit's output of `t` tokens no tile read: `out` 0, `lse` −∞.
    fn empty_output(&self, t: usize) -> FlashOutput<B> {
        let h = self.heads.unit_heads();
        let out = self.zeros([t, h, self.heads.dim]);
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
        let lse = filled([h, t], f32::NEG_INFINITY, options);
        FlashOutput { out, lse }
    }

    /// A unit's zero `dk`, `dv` of `t` tokens.
    fn zero_kv(&self, t: usize) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let dims = [t, self.heads.unit_kv_heads(), self.heads.dim];
        (self.zeros(dims), self.zeros(dims))
    }

    /// The merged output of every token block of this rank, its units' along the heads.
    fn home_outputs(mut self) -> FlashOutput<B> {
        let mut outs = Vec::new();
        let mut lses = Vec::new();
        for (block, range) in self.home_ranges() {
            let (mut unit_outs, mut unit_lses) = (Vec::new(), Vec::new());
            for unit in 0..self.heads.units {
                let output = self.blocks.outputs.remove(&(block, unit));
                let output = output.unwrap_or_else(|| self.empty_output(range.len()));
                unit_outs.push(output.out);
                unit_lses.push(output.lse);
            }
            outs.push(Tensor::cat(unit_outs, 1));
            lses.push(Tensor::cat(unit_lses, 0));
        }
        let h = self.heads;
        outs.push(self.zeros([0, h.whole.heads(), h.dim]));
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
        lses.push(Tensor::empty([h.whole.heads(), 0], options));
        FlashOutput {
            out: cat_tokens(outs, 0).cast(self.dtype),
            lse: cat_tokens(lses, 1),
        }
    }

    /// The gradients of every token block of this rank: its units' along the heads, the kv
    /// gradients of units sharing a kv head summed.
    fn home_gradients(mut self) -> FlashGradients<B> {
        let h = self.heads;
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        for (block, range) in self.home_ranges() {
            let t = range.len();
            let mut unit_dq = Vec::new();
            let mut unit_dk: Vec<Tensor<B, 3>> = Vec::new();
            let mut unit_dv: Vec<Tensor<B, 3>> = Vec::new();
            for unit in 0..h.units {
                let dq = self.blocks.dq.remove(&(block, unit));
                unit_dq.push(dq.unwrap_or_else(|| self.zeros([t, h.unit_heads(), h.dim])));
                let (dk, dv) = match self.blocks.dkv.remove(&(block, unit)) {
                    Some(pair) => pair,
                    None => self.zero_kv(t),
                };
                // Units sharing a kv head (more units than kv heads) add into it.
                match h.first_kv_head(unit) < unit_dk.len() {
                    true => {
                        let last = unit_dk.len() - 1;
                        unit_dk[last] = unit_dk[last].clone() + dk;
                        unit_dv[last] = unit_dv[last].clone() + dv;
                    }
                    false => {
                        unit_dk.push(dk);
                        unit_dv.push(dv);
                    }
                }
            }
            dqs.push(Tensor::cat(unit_dq, 1));
            dks.push(Tensor::cat(unit_dk, 1));
            dvs.push(Tensor::cat(unit_dv, 1));
        }
        dqs.push(self.zeros([0, h.whole.heads(), h.dim]));
        dks.push(self.zeros([0, h.whole.kv_heads(), h.dim]));
        dvs.push(self.zeros([0, h.whole.kv_heads(), h.dim]));
        FlashGradients {
            dq: cat_tokens(dqs, 0).cast(self.dtype),
            dk: cat_tokens(dks, 0).cast(self.dtype),
            dv: cat_tokens(dvs, 0).cast(self.dtype),
        }
    }
}

/// Adds `value` into the map's accumulator of `key` (kept in the accumulator dtype).
fn add_into<B: FlashOps>(map: &mut HashMap<Key, Tensor<B, 3>>, key: Key, value: Tensor<B, 3>) {
    let value = widened(value);
    let sum = match map.remove(&key) {
        Some(previous) => previous + value,
        None => value,
    };
    map.insert(key, sum);
}

fn add_pair_into<B: FlashOps>(
    map: &mut HashMap<Key, (Tensor<B, 3>, Tensor<B, 3>)>,
    key: Key,
    dk: Tensor<B, 3>,
    dv: Tensor<B, 3>,
) {
    let (dk, dv) = (widened(dk), widened(dv));
    let sum = match map.remove(&key) {
        Some((k, v)) => (k + dk, v + dv),
        None => (dk, dv),
    };
    map.insert(key, sum);
}
