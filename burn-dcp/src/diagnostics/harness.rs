//! Run context-parallel attention end to end on in-process ranks: shard packed inputs by the
//! layout, run forward and backward on one thread per rank, unshard the results, count bytes.
//! Used by the `cp_attention` tool (burn-dcp-tools) and the tests; handy to check a configuration by hand.

use std::time::{Duration, Instant};

use burn::prelude::Tensor;
use burn::tensor::{DType, TensorData};
use burn_dcp_kernels::{FlashOps, MaskSpec, VarlenAttention};

use crate::batch::layout::Layout;
use crate::batch::placement::Placement;
use crate::batch::shard::scatter_rows;
use crate::comm::{Comm, CommStats, InProcessWorld, LinkEmulation, WorldConfig};
use crate::error::CpError;
use crate::strategy::block_plan::BlockSchedule;
use crate::strategy::{
    cp_attention_backward_with, cp_attention_forward_with, with_strategy, AttentionStrategy,
    BackwardInputs, CpBatch, CpGroup, Strategy, WithStrategy,
};

/// A packed micro-batch's attention inputs, token-major f32:
/// `q [T, H, D]`, `k [T, K, D]`, `v [T, K, Dv]`, `dout [T, H, Dv]`, `T = Σ seq_lens`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedInputs {
    pub seq_lens: Vec<usize>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dout: Vec<f32>,
}

/// Results in the packed layout: `out [T, H, Dv]`, `lse [H, T]`, `dq`, `dk`, `dv` like their inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedOutputs {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// How to run: CP size, strategy, layout, masks (one per sequence or one for all), scale.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub cp: usize,
    pub strategy: Strategy,
    pub layout: Layout,
    pub masks: Vec<MaskSpec>,
    pub scale: Option<f64>,
    pub timeout: Duration,
    /// Strategy dcp: the block plan (it also decides the placement; `layout` is unused).
    pub blocks: Option<std::sync::Arc<BlockSchedule>>,
    /// Virtual nodes the ranks are spread over (consecutive ranks share a node; must divide
    /// `cp`): bytes are counted per link class.
    pub nodes: usize,
    /// The dtype q, k, v and dout are cast to on the device (f32, bf16 or f16; the LSE is f32
    /// whatever it is); the results come back as f32 values.
    pub dtype: DType,
}

/// A CP run: packed results, bytes each rank sent (forward, backward) and the slowest rank's times.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub outputs: PackedOutputs,
    pub bytes_forward: Vec<u64>,
    pub bytes_backward: Vec<u64>,
    pub stats: Vec<CommStats>,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Forward + backward of the slowest rank, its clock started with every rank's: the
    /// attention's wall time (`forward_ms + backward_ms` would count twice the wait of a rank
    /// that finished its forward early, at the backward's agreement).
    pub attention_ms: f64,
}

impl PackedInputs {
    pub fn tokens(&self) -> usize {
        self.seq_lens.iter().sum()
    }

    fn validate(&self) -> Result<(), CpError> {
        let t = self.tokens();
        let expected = [
            ("q", &self.q, t * self.heads * self.head_dim),
            ("k", &self.k, t * self.kv_heads * self.head_dim),
            ("v", &self.v, t * self.kv_heads * self.value_dim),
            ("dout", &self.dout, t * self.heads * self.value_dim),
        ];
        for (name, data, count) in expected {
            if data.len() != count {
                return Err(CpError::Input(format!(
                    "{name} holds {} values; {t} tokens × its heads × dim need {count}",
                    data.len()
                )));
            }
        }
        Ok(())
    }
}

fn tensor<B: FlashOps, const D: usize>(
    values: Vec<f32>,
    dims: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn host<B: FlashOps, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
}

/// Rows `indices` of a token-major buffer with `width` values per token.
fn gather_rows(data: &[f32], width: usize, indices: &[usize]) -> Vec<f32> {
    indices
        .iter()
        .flat_map(|&i| data[i * width..(i + 1) * width].iter().copied())
        .collect()
}

/// Single-device attention (the oracle of CP runs): the whole micro-batch on one device, f32.
pub fn run_single_device<B: FlashOps>(
    device: &B::Device,
    inputs: &PackedInputs,
    masks: &[MaskSpec],
    scale: Option<f64>,
) -> Result<PackedOutputs, CpError> {
    run_single_device_in::<B>(device, inputs, masks, scale, DType::F32)
}

/// [`run_single_device`] with the inputs cast to `dtype` on the device.
pub fn run_single_device_in<B: FlashOps>(
    device: &B::Device,
    inputs: &PackedInputs,
    masks: &[MaskSpec],
    scale: Option<f64>,
    dtype: DType,
) -> Result<PackedOutputs, CpError> {
    inputs.validate()?;
    let x = inputs;
    let t = x.tokens();
    let problem = VarlenAttention::packed(x.seq_lens.clone(), masks.to_vec()).with_scale(scale);
    let tensor = |values: &[f32], dims| tensor::<B, 3>(values.to_vec(), dims, device).cast(dtype);
    let q = tensor(&x.q, [t, x.heads, x.head_dim]);
    let k = tensor(&x.k, [t, x.kv_heads, x.head_dim]);
    let v = tensor(&x.v, [t, x.kv_heads, x.value_dim]);
    let dout = tensor(&x.dout, [t, x.heads, x.value_dim]);
    let fwd = B::flash_forward(q.clone(), k.clone(), v.clone(), &problem)?;
    let inputs = BackwardInputs {
        q,
        k,
        v,
        out: fwd.out.clone(),
        lse: fwd.lse.clone(),
        dout,
    };
    let grads = B::flash_backward(inputs, &problem)?;
    Ok(PackedOutputs {
        out: host(fwd.out),
        lse: host(fwd.lse),
        dq: host(grads.dq),
        dk: host(grads.dk),
        dv: host(grads.dv),
    })
}

/// One rank's results and measurements.
struct RankResult {
    indices: Vec<usize>,
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    bytes: (u64, u64),
    times: (f64, f64),
}

/// Context-parallel forward and backward on `spec.cp` in-process ranks.
pub fn run_context_parallel<B: FlashOps>(
    device: &B::Device,
    inputs: &PackedInputs,
    spec: &RunSpec,
) -> Result<RunReport, CpError> {
    run_context_parallel_with_links::<B>(device, inputs, spec, None)
}

/// [`run_context_parallel`] with every message delayed as over `links` (`None`: as fast as
/// memory copies), the ranks' nodes `spec.nodes` consecutive groups.
pub fn run_context_parallel_with_links<B: FlashOps>(
    device: &B::Device,
    inputs: &PackedInputs,
    spec: &RunSpec,
    links: Option<LinkEmulation>,
) -> Result<RunReport, CpError> {
    let run = RunParts::<B>::new(device, inputs, spec)?;
    run_ranks(inputs, spec, links, |comm| {
        with_strategy(spec.strategy, run.rank(comm))
    })
}

/// [`run_context_parallel`] with `strategy` (any [`AttentionStrategy`], one defined outside
/// this crate too) instead of `spec.strategy`, which still builds the group (its mesh).
pub fn run_context_parallel_of<B: FlashOps, S: AttentionStrategy + Sync>(
    device: &B::Device,
    inputs: &PackedInputs,
    spec: &RunSpec,
    strategy: &S,
) -> Result<RunReport, CpError> {
    let run = RunParts::<B>::new(device, inputs, spec)?;
    run_ranks(inputs, spec, None, |comm| run.rank(comm).apply(strategy))
}

/// `rank` on each of `spec.cp` in-process ranks, its results assembled.
fn run_ranks(
    inputs: &PackedInputs,
    spec: &RunSpec,
    links: Option<LinkEmulation>,
    rank: impl Fn(Comm) -> Result<RankResult, CpError> + Sync,
) -> Result<RunReport, CpError> {
    let world = InProcessWorld::new(
        spec.cp,
        WorldConfig {
            timeout: spec.timeout,
            ranks_per_node: Some(spec.cp / spec.nodes.max(1)),
        },
    )?;
    if let Some(links) = links {
        world.emulate_links(links)?;
    }
    let results = world.run(rank);
    if let Some(summary) = world.failure_summary(&results) {
        return Err(CpError::RunFailed(summary));
    }
    let ranks: Vec<RankResult> = results.into_iter().flatten().collect();
    Ok(assemble(inputs, ranks, world.stats()))
}

/// [`run_context_parallel`] as one rank of `comm` (a group of `spec.cp` ranks, e.g. the world of
/// an MPI job): every rank runs its part, then sends its results and byte counts to rank 0,
/// which alone returns the report (`None` on the other ranks).
pub fn run_context_parallel_on<B: FlashOps>(
    comm: Comm,
    device: &B::Device,
    inputs: &PackedInputs,
    spec: &RunSpec,
) -> Result<Option<RunReport>, CpError> {
    if comm.size() != spec.cp {
        return Err(CpError::Config(format!(
            "the group has {} ranks but the run needs cp = {}",
            comm.size(),
            spec.cp
        )));
    }
    let run = RunParts::<B>::new(device, inputs, spec)?;
    let mine = with_strategy(spec.strategy, run.rank(comm.clone()))?;
    let stats = serde_json::to_vec(&comm.stats()).map_err(|e| CpError::Config(e.to_string()))?;
    let messages = |r: RankResult| {
        let floats = |v: Vec<f32>| {
            let n = v.len();
            TensorData::new(v, [n])
        };
        let indices: Vec<i64> = r.indices.iter().map(|&i| i as i64).collect();
        let count = indices.len();
        let meta = vec![r.bytes.0 as f64, r.bytes.1 as f64, r.times.0, r.times.1];
        vec![
            TensorData::new(indices, [count]),
            floats(r.out),
            floats(r.lse),
            floats(r.dq),
            floats(r.dk),
            floats(r.dv),
            TensorData::new(meta, [4]),
        ]
    };
    if comm.rank() != 0 {
        let mut sends = Vec::new();
        for message in messages(mine) {
            sends.push(comm.isend(0, message.into())?);
        }
        let count = stats.len();
        sends.push(comm.isend(0, TensorData::new(stats, [count]).into())?);
        for send in sends {
            send.wait()?;
        }
        return Ok(None);
    }
    let malformed = |what: &str| CpError::Config(format!("a malformed {what} from a rank"));
    let mut receives = Vec::new();
    for peer in 1..comm.size() {
        receives.push(
            (0..8)
                .map(|_| comm.irecv(peer))
                .collect::<Result<Vec<_>, _>>()?,
        );
    }
    let mut ranks = vec![mine];
    let mut all_stats = vec![serde_json::from_slice(&stats).map_err(|_| malformed("byte count"))?];
    for pending in receives {
        let mut parts = Vec::new();
        for p in pending {
            parts.push(p.wait()?.into_host().map_err(|_| malformed("result"))?);
        }
        let floats = |d: TensorData| d.into_vec::<f32>().map_err(|_| malformed("result"));
        let mut parts = parts.into_iter();
        let mut next = || parts.next().ok_or_else(|| malformed("result"));
        let indices = next()?.into_vec::<i64>().map_err(|_| malformed("result"))?;
        let (out, lse, dq, dk, dv) = (
            floats(next()?)?,
            floats(next()?)?,
            floats(next()?)?,
            floats(next()?)?,
            floats(next()?)?,
        );
        let meta = next()?.into_vec::<f64>().map_err(|_| malformed("result"))?;
        let stats = next()?
            .into_vec::<u8>()
            .map_err(|_| malformed("byte count"))?;
        ranks.push(RankResult {
            indices: indices.into_iter().map(|i| i as usize).collect(),
            out,
            lse,
            dq,
            dk,
            dv,
            bytes: (meta[0] as u64, meta[1] as u64),
            times: (meta[2], meta[3]),
        });
        all_stats.push(serde_json::from_slice(&stats).map_err(|_| malformed("byte count"))?);
    }
    Ok(Some(assemble(inputs, ranks, all_stats)))
}

/// Checks the inputs and the run's settings; the batch every rank runs.
fn prepare(inputs: &PackedInputs, spec: &RunSpec) -> Result<CpBatch, CpError> {
    inputs.validate()?;
    spec.strategy.validate_mesh(spec.cp)?;
    crate::comm::nodes::NodeMap::new(spec.cp, spec.nodes)?;
    spec.strategy
        .validate_heads(inputs.heads, inputs.kv_heads, spec.cp)?;
    let mut batch = match &spec.blocks {
        Some(schedule) => CpBatch::from_blocks(schedule.clone(), spec.masks.clone()),
        None => CpBatch::new(
            Placement::of_layout(&inputs.seq_lens, spec.cp, spec.layout)?,
            spec.masks.clone(),
        ),
    };
    batch.scale = spec.scale;
    Ok(batch)
}

/// What every rank of a run shares: the device, the inputs, their batch and the spec.
struct RunParts<'a, B: FlashOps> {
    device: &'a B::Device,
    inputs: &'a PackedInputs,
    batch: CpBatch,
    spec: &'a RunSpec,
}

impl<'a, B: FlashOps> RunParts<'a, B> {
    fn new(
        device: &'a B::Device,
        inputs: &'a PackedInputs,
        spec: &'a RunSpec,
    ) -> Result<Self, CpError> {
        Ok(Self {
            device,
            inputs,
            batch: prepare(inputs, spec)?,
            spec,
        })
    }

    /// The run of the rank `comm` is.
    fn rank(&self, comm: Comm) -> RankRun<'_, B> {
        RankRun {
            device: self.device,
            inputs: self.inputs,
            batch: &self.batch,
            comm,
            spec: self.spec,
        }
    }
}

/// One rank's forward and backward of a run.
struct RankRun<'a, B: FlashOps> {
    device: &'a B::Device,
    inputs: &'a PackedInputs,
    batch: &'a CpBatch,
    comm: Comm,
    spec: &'a RunSpec,
}

impl<B: FlashOps> WithStrategy for RankRun<'_, B> {
    type Output = Result<RankResult, CpError>;

    fn apply<S: AttentionStrategy>(self, strategy: &S) -> Self::Output {
        let Self {
            device,
            inputs: x,
            batch,
            comm,
            spec,
        } = self;
        let rank = comm.rank();
        let indices = batch.placement.packed_indices(rank);
        let n = indices.len();
        let local = |data: &[f32], heads: usize, dim: usize| {
            tensor::<B, 3>(
                gather_rows(data, heads * dim, &indices),
                [n, heads, dim],
                device,
            )
            .cast(spec.dtype)
        };
        let (q, k, v) = (
            local(&x.q, x.heads, x.head_dim),
            local(&x.k, x.kv_heads, x.head_dim),
            local(&x.v, x.kv_heads, x.value_dim),
        );
        let dout = local(&x.dout, x.heads, x.value_dim);
        let group = CpGroup::new(comm.clone(), spec.strategy)?;
        // Every rank starts its clock together (a thread that started late cannot hide its wait).
        comm.barrier()?;
        let start_bytes = comm.stats().total_bytes();
        let started = Instant::now();
        let fwd =
            cp_attention_forward_with(strategy, &group, batch, q.clone(), k.clone(), v.clone())?;
        let forward_ms = started.elapsed().as_secs_f64() * 1e3;
        let mid_bytes = comm.stats().total_bytes();
        let started = Instant::now();
        let inputs = BackwardInputs {
            q,
            k,
            v,
            out: fwd.out.clone(),
            lse: fwd.lse.clone(),
            dout,
        };
        let grads = cp_attention_backward_with(strategy, &group, batch, inputs)?;
        let backward_ms = started.elapsed().as_secs_f64() * 1e3;
        let end_bytes = comm.stats().total_bytes();
        Ok(RankResult {
            indices,
            out: host(fwd.out),
            lse: host(fwd.lse),
            dq: host(grads.dq),
            dk: host(grads.dk),
            dv: host(grads.dv),
            bytes: (mid_bytes - start_bytes, end_bytes - mid_bytes),
            times: (forward_ms, backward_ms),
        })
    }
}

fn assemble(x: &PackedInputs, ranks: Vec<RankResult>, stats: Vec<CommStats>) -> RunReport {
    let t = x.tokens();
    let mut outputs = PackedOutputs {
        out: vec![0.0; t * x.heads * x.value_dim],
        lse: vec![0.0; x.heads * t],
        dq: vec![0.0; t * x.heads * x.head_dim],
        dk: vec![0.0; t * x.kv_heads * x.head_dim],
        dv: vec![0.0; t * x.kv_heads * x.value_dim],
    };
    for r in &ranks {
        let idx = &r.indices;
        scatter_rows(&mut outputs.out, x.heads * x.value_dim, idx, &r.out);
        scatter_rows(&mut outputs.dq, x.heads * x.head_dim, idx, &r.dq);
        scatter_rows(&mut outputs.dk, x.kv_heads * x.head_dim, idx, &r.dk);
        scatter_rows(&mut outputs.dv, x.kv_heads * x.value_dim, idx, &r.dv);
        for h in 0..x.heads {
            for (local, &i) in idx.iter().enumerate() {
                outputs.lse[h * t + i] = r.lse[h * idx.len() + local];
            }
        }
    }
    RunReport {
        outputs,
        bytes_forward: ranks.iter().map(|r| r.bytes.0).collect(),
        bytes_backward: ranks.iter().map(|r| r.bytes.1).collect(),
        stats,
        forward_ms: ranks.iter().map(|r| r.times.0).fold(0.0, f64::max),
        backward_ms: ranks.iter().map(|r| r.times.1).fold(0.0, f64::max),
        attention_ms: ranks
            .iter()
            .map(|r| r.times.0 + r.times.1)
            .fold(0.0, f64::max),
    }
}

/// `max |got − want| / max |want|` over entries where `want` is finite; a non-finite `want` must
/// be matched exactly (−∞ LSE of fully masked rows) and NaN never passes.
pub fn max_rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if g.is_nan() || w.is_nan() {
            return f64::INFINITY;
        }
        if !w.is_finite() {
            if g != w {
                return f64::INFINITY;
            }
            continue;
        }
        diff = diff.max((g as f64 - w as f64).abs());
        scale = scale.max((w as f64).abs());
    }
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}
