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
use burn_dcp_kernels::heads::HeadParts;

mod attend;
mod blocks;

use blocks::{add_into, add_pair_into};

/// Dims of a pass's tensors: query and kv heads, head dim, and the head units they are cut
/// into.
#[derive(Clone, Copy, Debug)]
struct Heads {
    whole: burn_dcp_kernels::heads::Heads,
    dim: usize,
    units: usize,
    /// One unit's query and kv heads.
    unit: burn_dcp_kernels::heads::Heads,
}

impl Heads {
    /// `units` head units of `heads` query and `kv_heads` kv heads
    /// ([`burn_dcp_kernels::heads::Heads::split`]'s rule, the plan's).
    fn new(heads: usize, kv_heads: usize, dim: usize, units: usize) -> Result<Self, CpError> {
        let (whole, unit) = burn_dcp_kernels::heads::Heads::new(heads, kv_heads)
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
        qkv: Qkv<B>,
    ) -> Result<FlashOutput<B>, CpError> {
        forward(&group.comm, batch, batch.schedule()?, qkv)
    }

    fn backward<B: FlashOps>(
        &self,
        CpCall { group, batch }: CpCall<'_>,
        inputs: BackwardInputs<B>,
    ) -> Result<FlashGradients<B>, CpError> {
        backward(&group.comm, batch, batch.schedule()?, inputs)
    }
}

/// DCP forward on this rank's home blocks: `[q, k, v]` (`q [T, H, D]`, `k`/`v [T, K, D]`) in the
/// placement's order → `out [T, H, D]`, `lse [H, T]`.
pub fn forward<B: FlashOps>(
    comm: &Comm,
    batch: &CpBatch,
    schedule: &BlockSchedule,
    [q, k, v]: Qkv<B>,
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
                    let shapes = self.shapes(side, block, backward, false);
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
                    let shapes = self.shapes(side, block, backward, true);
                    let parts = self.receive(from, &shapes, "a block result")?;
                    self.merge_result(side, (block, unit), parts, backward)?;
                }
                Instruction::SendUnit { block, unit, to } => {
                    let parts = self.give_unit((block, unit), backward)?;
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::ReceiveUnit { block, unit, from } => {
                    self.receive_unit((block, unit), from, backward)?
                }
                Instruction::SendUnitResult { block, unit, to } => {
                    let parts = self.unit_result((block, unit), backward);
                    self.send(to, parts, &mut sends)?;
                }
                Instruction::ReceiveUnitResult { block, unit, from } => {
                    let mut shapes = self.shapes(Side::QueryOutput, block, backward, true);
                    if backward {
                        shapes.extend(self.shapes(Side::KeyValue, block, backward, true));
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
}
