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
//! Bytes per token of a copy and a result are those of the planner's cost model
//! (`planner::cost::hop_bytes`) with 4-byte elements, so measured bytes equal the plan's.

use std::collections::HashMap;

use burn::prelude::Tensor;
use burn::tensor::{DType, TensorCreationOptions};
use burn_dcp_kernels::{FlashGradients, FlashOps, FlashOutput, Segment, VarlenAttention};

use crate::comm::{Comm, CommError, Payload, PendingSend};
use crate::error::CpError;
use crate::planner::cost::{Pass, Side};
use crate::strategy::block_plan::{BlockId, BlockSchedule, Instruction};
use crate::strategy::exchange::{cat_tokens, narrow, split_sizes};
use crate::strategy::{BackwardInputs, CpBatch};

/// Dims of a pass's tensors: query heads, kv heads, head dim.
#[derive(Clone, Copy, Debug)]
struct Heads {
    heads: usize,
    kv_heads: usize,
    dim: usize,
}

/// What a rank holds during a pass: copies of blocks (its own and received) and its results.
struct Blocks<B: FlashOps> {
    /// Query side: `[q]` forward, `[q, out, lse, dout]` backward (lse as `[H, T]`).
    queries: HashMap<BlockId, QuerySide<B>>,
    keys: HashMap<BlockId, (Tensor<B, 3>, Tensor<B, 3>)>,
    outputs: HashMap<BlockId, FlashOutput<B>>,
    dq: HashMap<BlockId, Tensor<B, 3>>,
    dkv: HashMap<BlockId, (Tensor<B, 3>, Tensor<B, 3>)>,
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
    let mut run = Run::<B>::new(comm, batch, schedule, &q, &k);
    for (block, range) in run.home_ranges() {
        let q = narrow(q.clone(), 0, range.start, range.len());
        run.blocks
            .queries
            .insert(block, QuerySide { q, grads: None });
        run.insert_keys(block, &k, &v, range);
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
    let mut run = Run::<B>::new(comm, batch, schedule, &q, &k);
    for (block, range) in run.home_ranges() {
        let rows = |t: &Tensor<B, 3>| narrow(t.clone(), 0, range.start, range.len());
        let grads = (
            rows(&out),
            narrow(lse.clone(), 1, range.start, range.len()),
            rows(&dout),
        );
        let side = QuerySide {
            q: rows(&q),
            grads: Some(grads),
        };
        run.blocks.queries.insert(block, side);
        run.insert_keys(block, &k, &v, range);
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
    ) -> Self {
        let [_, heads, dim] = q.dims();
        Self {
            comm,
            batch,
            schedule,
            heads: Heads {
                heads,
                kv_heads: k.dims()[1],
                dim,
            },
            dtype: q.dtype(),
            device: q.device(),
            blocks: Blocks {
                queries: HashMap::new(),
                keys: HashMap::new(),
                outputs: HashMap::new(),
                dq: HashMap::new(),
                dkv: HashMap::new(),
            },
        }
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
        block: BlockId,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        range: std::ops::Range<usize>,
    ) {
        let rows = |t: &Tensor<B, 3>| narrow(t.clone(), 0, range.start, range.len());
        self.blocks.keys.insert(block, (rows(k), rows(v)));
    }

    fn execute(&mut self, program: &[Instruction], backward: bool) -> Result<(), CpError> {
        let mut sends = Vec::new();
        for instruction in program {
            match instruction {
                Instruction::Send { side, block, to } => {
                    let parts = self.copy_of(*side, *block, backward)?;
                    self.send(*to, parts, &mut sends)?;
                }
                Instruction::Receive { side, block, from } => {
                    let shapes = self.copy_shapes(*side, *block, backward);
                    let parts = self.receive(*from, &shapes, "a block copy")?;
                    self.store_copy(*side, *block, parts)?;
                }
                Instruction::Attend { q, kv } => match backward {
                    false => self.attend_forward(*q, kv)?,
                    true => self.attend_backward(*q, kv)?,
                },
                Instruction::SendResult { side, block, to } => {
                    let parts = self.result_of(*side, *block, backward)?;
                    self.send(*to, parts, &mut sends)?;
                }
                Instruction::ReceiveResult { side, block, from } => {
                    let shapes = self.result_shapes(*side, *block, backward);
                    let parts = self.receive(*from, &shapes, "a block result")?;
                    self.merge_result(*side, *block, parts, backward)?;
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
        let (t, h) = (self.tokens(block), self.heads);
        match (side, backward) {
            (Side::QueryOutput, false) => vec![vec![t, h.heads, h.dim]],
            (Side::QueryOutput, true) => vec![
                vec![t, h.heads, h.dim],
                vec![t, h.heads, h.dim],
                vec![h.heads, t],
                vec![t, h.heads, h.dim],
            ],
            (Side::KeyValue, _) => vec![vec![t, h.kv_heads, h.dim]; 2],
        }
    }

    fn result_shapes(&self, side: Side, block: BlockId, backward: bool) -> Vec<Vec<usize>> {
        let (t, h) = (self.tokens(block), self.heads);
        match (side, backward) {
            (Side::QueryOutput, false) => vec![vec![t, h.heads, h.dim], vec![h.heads, t]],
            (Side::QueryOutput, true) => vec![vec![t, h.heads, h.dim]],
            (Side::KeyValue, _) => vec![vec![t, h.kv_heads, h.dim]; 2],
        }
    }

    fn missing(&self, what: &str, block: BlockId) -> CpError {
        CpError::Config(format!(
            "DCP rank {}: the program uses {what} of block {} of sequence {}, which it does not hold (an inconsistent plan)",
            self.comm.rank(),
            block.block,
            block.seq
        ))
    }

    fn copy_of(&self, side: Side, block: BlockId, backward: bool) -> Result<Vec<Payload>, CpError> {
        match side {
            Side::QueryOutput => {
                let query = self
                    .blocks
                    .queries
                    .get(&block)
                    .ok_or_else(|| self.missing("the queries", block))?;
                let mut parts = vec![Payload::device(query.q.clone())];
                if backward {
                    let (out, lse, dout) = query
                        .grads
                        .clone()
                        .ok_or_else(|| self.missing("the output", block))?;
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
                    .get(&block)
                    .cloned()
                    .ok_or_else(|| self.missing("the keys", block))?;
                Ok(vec![Payload::device(k), Payload::device(v)])
            }
        }
    }

    fn store_copy(
        &mut self,
        side: Side,
        block: BlockId,
        parts: Vec<Payload>,
    ) -> Result<(), CpError> {
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
                self.blocks.queries.insert(block, QuerySide { q, grads });
            }
            Side::KeyValue => {
                let k = self.take::<3>(&mut parts)?;
                let v = self.take::<3>(&mut parts)?;
                self.blocks.keys.insert(block, (k, v));
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
        part.into_tensor(&self.device).map_err(invalid)
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

    /// The concatenated keys and values of blocks `kv` of sequence `seq`.
    fn keys_of(&self, seq: usize, kv: &[usize]) -> Result<(Tensor<B, 3>, Tensor<B, 3>), CpError> {
        let mut ks = Vec::with_capacity(kv.len());
        let mut vs = Vec::with_capacity(kv.len());
        for &block in kv {
            let id = BlockId { seq, block };
            let (k, v) = self
                .blocks
                .keys
                .get(&id)
                .cloned()
                .ok_or_else(|| self.missing("the keys", id))?;
            ks.push(k);
            vs.push(v);
        }
        Ok((cat_tokens(ks, 0), cat_tokens(vs, 0)))
    }

    fn attend_forward(&mut self, q: BlockId, kv: &[usize]) -> Result<(), CpError> {
        let query = self
            .blocks
            .queries
            .get(&q)
            .ok_or_else(|| self.missing("the queries", q))?
            .q
            .clone();
        let (k, v) = self.keys_of(q.seq, kv)?;
        let partial = B::flash_forward(query, k, v, &self.problem(q, kv))?;
        self.merge_output(q, partial)
    }

    fn merge_output(&mut self, q: BlockId, partial: FlashOutput<B>) -> Result<(), CpError> {
        let merged = match self.blocks.outputs.remove(&q) {
            Some(previous) => B::flash_merge(previous, partial)?,
            None => partial,
        };
        self.blocks.outputs.insert(q, merged);
        Ok(())
    }

    fn attend_backward(&mut self, q: BlockId, kv: &[usize]) -> Result<(), CpError> {
        let query = self
            .blocks
            .queries
            .get(&q)
            .cloned()
            .ok_or_else(|| self.missing("the queries", q))?;
        let (out, lse, dout) = query.grads.ok_or_else(|| self.missing("the output", q))?;
        let (k, v) = self.keys_of(q.seq, kv)?;
        let grads = B::flash_backward(query.q, k, v, out, lse, dout, &self.problem(q, kv))?;
        add_into(&mut self.blocks.dq, q, grads.dq);
        let sizes: Vec<usize> = kv
            .iter()
            .map(|&block| self.tokens(BlockId { seq: q.seq, block }))
            .collect();
        let dks = split_sizes(grads.dk, 0, &sizes);
        let dvs = split_sizes(grads.dv, 0, &sizes);
        for ((&block, dk), dv) in kv.iter().zip(dks).zip(dvs) {
            add_pair_into(&mut self.blocks.dkv, BlockId { seq: q.seq, block }, dk, dv);
        }
        Ok(())
    }

    fn result_of(
        &self,
        side: Side,
        block: BlockId,
        backward: bool,
    ) -> Result<Vec<Payload>, CpError> {
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let output = self
                    .blocks
                    .outputs
                    .get(&block)
                    .ok_or_else(|| self.missing("the partial output", block))?;
                Ok(vec![
                    Payload::device(output.out.clone()),
                    Payload::device(output.lse.clone()),
                ])
            }
            (Side::QueryOutput, true) => {
                let dq = self
                    .blocks
                    .dq
                    .get(&block)
                    .ok_or_else(|| self.missing("the dq", block))?;
                Ok(vec![Payload::device(dq.clone())])
            }
            (Side::KeyValue, _) => {
                let (dk, dv) = self
                    .blocks
                    .dkv
                    .get(&block)
                    .cloned()
                    .ok_or_else(|| self.missing("the dk/dv", block))?;
                Ok(vec![Payload::device(dk), Payload::device(dv)])
            }
        }
    }

    fn merge_result(
        &mut self,
        side: Side,
        block: BlockId,
        parts: Vec<Payload>,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let out = self.take::<3>(&mut parts)?;
                let lse = self.take::<2>(&mut parts)?;
                self.merge_output(block, FlashOutput { out, lse })?;
            }
            (Side::QueryOutput, true) => {
                let dq = self.take::<3>(&mut parts)?;
                add_into(&mut self.blocks.dq, block, dq)
            }
            (Side::KeyValue, _) => {
                let dk = self.take::<3>(&mut parts)?;
                let dv = self.take::<3>(&mut parts)?;
                add_pair_into(&mut self.blocks.dkv, block, dk, dv);
            }
        }
        Ok(())
    }

    fn zeros(&self, dims: [usize; 3]) -> Tensor<B, 3> {
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(self.dtype);
        Tensor::zeros(dims, options)
    }

    /// The merged output of every home block (a block no tile reads: `out` 0, `lse` −∞).
    fn home_outputs(mut self) -> FlashOutput<B> {
        let mut outs = Vec::new();
        let mut lses = Vec::new();
        for (block, range) in self.home_ranges() {
            let t = range.len();
            let output = self.blocks.outputs.remove(&block).unwrap_or_else(|| {
                let out = self.zeros([t, self.heads.heads, self.heads.dim]);
                let options =
                    TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
                let lse = Tensor::full([self.heads.heads, t], f32::NEG_INFINITY, options);
                FlashOutput { out, lse }
            });
            outs.push(output.out);
            lses.push(output.lse);
        }
        let h = self.heads;
        outs.push(self.zeros([0, h.heads, h.dim]));
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
        lses.push(Tensor::empty([h.heads, 0], options));
        FlashOutput {
            out: cat_tokens(outs, 0),
            lse: cat_tokens(lses, 1),
        }
    }

    fn home_gradients(mut self) -> FlashGradients<B> {
        let h = self.heads;
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        for (block, range) in self.home_ranges() {
            let t = range.len();
            let dq = self.blocks.dq.remove(&block);
            dqs.push(dq.unwrap_or_else(|| self.zeros([t, h.heads, h.dim])));
            let (dk, dv) = match self.blocks.dkv.remove(&block) {
                Some(pair) => pair,
                None => (
                    self.zeros([t, h.kv_heads, h.dim]),
                    self.zeros([t, h.kv_heads, h.dim]),
                ),
            };
            dks.push(dk);
            dvs.push(dv);
        }
        dqs.push(self.zeros([0, h.heads, h.dim]));
        dks.push(self.zeros([0, h.kv_heads, h.dim]));
        dvs.push(self.zeros([0, h.kv_heads, h.dim]));
        FlashGradients {
            dq: cat_tokens(dqs, 0),
            dk: cat_tokens(dks, 0),
            dv: cat_tokens(dvs, 0),
        }
    }
}

fn add_into<B: FlashOps>(
    map: &mut HashMap<BlockId, Tensor<B, 3>>,
    block: BlockId,
    value: Tensor<B, 3>,
) {
    let sum = match map.remove(&block) {
        Some(previous) => previous + value,
        None => value,
    };
    map.insert(block, sum);
}

fn add_pair_into<B: FlashOps>(
    map: &mut HashMap<BlockId, (Tensor<B, 3>, Tensor<B, 3>)>,
    block: BlockId,
    dk: Tensor<B, 3>,
    dv: Tensor<B, 3>,
) {
    let sum = match map.remove(&block) {
        Some((k, v)) => (k + dk, v + dv),
        None => (dk, dv),
    };
    map.insert(block, sum);
}
