//! The gradients of a step: summed over the DP × CP pool (and replicated kv heads, tied
//! embeddings), checked for non-finite values before they spread.

use std::collections::HashMap;
use std::time::Instant;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::{Tensor, TensorData};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::comm::{Comm, CommError, Payload};
use burn_dcp::kernels::FlashOps;
use burn_dcp::CpError;

use crate::groups::RankGroups;
use crate::model::{CpTrain, TrainModel};

/// Summed gradients by parameter, flattened.
type Summed<B> = HashMap<ParamId, Tensor<<B as AutodiffBackend>::InnerBackend, 1>>;

/// The largest bucket of gradients summed by one all-reduce (PyTorch DDP's default bucket size).
pub const GRADIENT_BUCKET_BYTES: usize = 25 << 20;

/// One parameter's local gradient, flattened, in the model's parameter order.
struct FlatGradient<B: AutodiffBackend> {
    id: ParamId,
    values: Tensor<B::InnerBackend, 1>,
}

/// Takes every parameter's gradient out of `grads` (zeros where this rank has none), flattened.
struct Flatten<B: AutodiffBackend> {
    grads: GradientsParams,
    flat: Vec<FlatGradient<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| param.val().inner().zeros_like());
        let count = grad.shape().num_elements();
        self.flat.push(FlatGradient {
            id: param.id,
            values: burn_dcp_models::gpt::reshape(grad, [count]),
        });
    }
}

/// Puts the summed gradients back into `grads` in their parameters' shapes.
struct Register<B: AutodiffBackend> {
    grads: GradientsParams,
    summed: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Register<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(summed) = self.summed.remove(&param.id) {
            let dims: [usize; D] = param.val().dims();
            self.grads
                .register(param.id, burn_dcp_models::gpt::reshape(summed, dims));
        }
    }
}

/// The gradients summed over the pool: buckets of at most [`GRADIENT_BUCKET_BYTES`] in the
/// model's parameter order (the same on every rank), one all-reduce each; the parameters that
/// are also summed over another group (`extra`: the replicated kv projections over their TP
/// replicas when tp > kv heads, the tied embedding over the first and last stage) one by one.
/// Summing a bucket adds every element in rank order, as one all-reduce per parameter did, so
/// the result is bit for bit the same with fewer collectives. A pool of one rank with no other
/// group sums nothing: the gradients stay as they are, uncopied.
///
/// Whether each bucket (each parameter, for a pool of one) was finite before the sum is one flag
/// on the device; the flags are read back together, once, after every bucket is queued (the
/// parameters of a non-finite bucket are then checked one by one, to name them).
///
/// Not overlapped with the backward pass: burn 0.21's gradient-sync hooks (`DistributedBackend`,
/// feature `distributed`) are keyed by device and run burn's own collective server, which fits
/// neither ranks that share a device (threads-as-ranks on one CPU) nor this pool's communicator
/// (MPI, TCP, NCCL, with its byte accounting); so the buckets go after the step's last backward.
fn all_reduce_gradients<B: AutodiffBackend>(
    flat: Vec<FlatGradient<B>>,
    pool: &Comm,
    extra: &[(Vec<ParamId>, &Comm)],
) -> Result<(Summed<B>, Vec<usize>), CommError> {
    let invalid = |message: String| CommError::Invalid {
        group: pool.name().to_string(),
        message: format!("gradient all-reduce: {message}"),
    };
    let mut summed = HashMap::with_capacity(flat.len());
    // Each checked group of gradients (their indices and local values) and its finite flag.
    let mut checks: Checks<B::InnerBackend> = Vec::new();
    let alone = pool.size() == 1;
    let mut bucket: Vec<(usize, FlatGradient<B>)> = Vec::new();
    let mut bucket_bytes = 0;
    let flush = |bucket: &mut Vec<(usize, FlatGradient<B>)>,
                 summed: &mut Summed<B>,
                 checks: &mut Checks<B::InnerBackend>|
     -> Result<(), CommError> {
        if bucket.is_empty() {
            return Ok(());
        }
        let parts = std::mem::take(bucket);
        let values = Tensor::cat(parts.iter().map(|(_, g)| g.values.clone()).collect(), 0);
        checks.push((
            parts.iter().map(|(i, g)| (*i, g.values.clone())).collect(),
            finite_flag(&values),
        ));
        let device = values.device();
        let total = pool
            .all_reduce(Payload::device(values))?
            .into_tensor::<B::InnerBackend, 1>(&device)
            .map_err(|e| invalid(e.to_string()))?;
        let mut offset = 0;
        for (_, gradient) in parts {
            let count = gradient.values.dims()[0];
            summed.insert(gradient.id, total.clone().narrow(0, offset, count));
            offset += count;
        }
        Ok(())
    };
    for (index, gradient) in flat.into_iter().enumerate() {
        let groups: Vec<&Comm> = extra
            .iter()
            .filter(|(ids, _)| ids.contains(&gradient.id))
            .map(|(_, comm)| *comm)
            .collect();
        if alone && groups.is_empty() {
            let flag = finite_flag(&gradient.values);
            checks.push((vec![(index, gradient.values.clone())], flag));
            summed.insert(gradient.id, gradient.values);
            continue;
        }
        if !groups.is_empty() {
            // Summed over the pool, then over each of its groups, on its own.
            let flag = finite_flag(&gradient.values);
            checks.push((vec![(index, gradient.values.clone())], flag));
            let device = gradient.values.device();
            let mut total = pool.all_reduce(Payload::device(gradient.values))?;
            for comm in groups {
                total = comm.all_reduce(total)?;
            }
            let total = total
                .into_tensor::<B::InnerBackend, 1>(&device)
                .map_err(|e| invalid(e.to_string()))?;
            summed.insert(gradient.id, total);
            continue;
        }
        let bytes = gradient.values.dims()[0] * gradient.values.dtype().size();
        if bucket_bytes + bytes > GRADIENT_BUCKET_BYTES {
            flush(&mut bucket, &mut summed, &mut checks)?;
            bucket_bytes = 0;
        }
        bucket_bytes += bytes;
        bucket.push((index, gradient));
    }
    flush(&mut bucket, &mut summed, &mut checks)?;
    Ok((summed, non_finite_indices(checks)))
}

/// Groups of gradients (index in the model's order, local values) with their finite flag.
type Checks<I> = Vec<(
    Vec<(usize, Tensor<I, 1>)>,
    Tensor<I, 1, burn::prelude::Bool>,
)>;

/// `[1]`: whether every value is finite, on the device (nothing read back).
fn finite_flag<B: burn::prelude::Backend>(
    values: &Tensor<B, 1>,
) -> Tensor<B, 1, burn::prelude::Bool> {
    values.clone().is_finite().all()
}

/// The indices of the non-finite gradients: every group's flag read back at once, then the
/// gradients of a group that is not finite one by one.
fn non_finite_indices<I: burn::prelude::Backend>(checks: Checks<I>) -> Vec<usize> {
    if checks.is_empty() {
        return Vec::new();
    }
    let flags = Tensor::cat(checks.iter().map(|(_, flag)| flag.clone()).collect(), 0)
        .into_data()
        .iter::<bool>()
        .collect::<Vec<_>>();
    let mut non_finite: Vec<usize> = checks
        .into_iter()
        .zip(flags)
        .filter(|(_, finite)| !finite)
        .flat_map(|((parts, _), _)| parts)
        .filter(|(_, values)| !all_finite(values))
        .map(|(index, _)| index)
        .collect();
    non_finite.sort_unstable();
    non_finite
}

/// Sums any model's gradients over `pool` (every rank of it calls this with the same model):
/// the bucketed all-reduce the engine runs after each step's backward passes, on the device,
/// for training loops of one's own. A parameter without a gradient on this rank counts as zeros.
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: GradientsParams,
    pool: &Comm,
) -> Result<GradientsParams, CommError> {
    let mut flatten = Flatten::<B> {
        grads,
        flat: Vec::new(),
    };
    model.visit(&mut flatten);
    let (summed, _) = all_reduce_gradients(flatten.flat, pool, &[])?;
    let mut register = Register::<B> {
        grads: flatten.grads,
        summed,
    };
    model.visit(&mut register);
    Ok(register.grads)
}

/// A step's all-reduced results.
pub(crate) struct ReducedStep {
    /// The mean loss of the step.
    pub loss: f64,
    /// Every parameter's gradient summed over the pool.
    pub grads: GradientsParams,
    /// Time of the gradient all-reduces (none of it overlapped with the backward pass).
    pub grad_sync_ms: f64,
}

/// All-reduces the accumulated gradients and the loss over the world; stops on non-finite values.
pub(crate) fn reduce_step<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>>(
    model: &M,
    groups: &RankGroups,
    step: usize,
    mut accumulator: GradientsAccumulator<M>,
    loss_sum: f64,
    global_labels: usize,
) -> Result<ReducedStep, CpError> {
    let mut extra = Vec::new();
    if let Some(kv) = &groups.kv_replicas {
        extra.push((model.kv_param_ids(), kv));
    }
    if let (Some(id), Some(embedding)) = (model.tied_embedding_id(), &groups.embedding) {
        extra.push((vec![id], embedding));
    }
    let started = Instant::now();
    let span =
        burn_dcp::diagnostics::trace::span("gradient all-reduce", "sync", serde_json::Value::Null);
    let mut flatten = Flatten::<CpTrain<B, C>> {
        grads: accumulator.grads(),
        flat: Vec::new(),
    };
    model.visit(&mut flatten);
    let (summed, non_finite) = all_reduce_gradients(flatten.flat, &groups.world, &extra)?;
    let mut register = Register::<CpTrain<B, C>> {
        grads: flatten.grads,
        summed,
    };
    model.visit(&mut register);
    drop(span);
    let grad_sync_ms = started.elapsed().as_secs_f64() * 1e3;
    // Over the whole world: a non-finite gradient on one TP position stops every rank, named.
    check_finite(&groups.mesh.world, step, loss_sum, &non_finite)?;
    let total = sum_losses(groups, loss_sum)?;
    Ok(ReducedStep {
        loss: total / global_labels as f64,
        grads: register.grads,
        grad_sync_ms,
    })
}

/// The loss sums of every rank of the pool (and of every stage: only the last computes losses),
/// on every rank.
pub(crate) fn sum_losses(groups: &RankGroups, loss_sum: f64) -> Result<f64, CpError> {
    let mut total = groups
        .world
        .all_reduce(TensorData::new(vec![loss_sum], [1]).into())?;
    if groups.mesh.pp.size() > 1 {
        total = groups.mesh.pp.all_reduce(total)?;
    }
    Ok(total
        .into_host()
        .map_err(|e| CpError::Input(e.to_string()))?
        .to_vec::<f64>()
        .map_err(|e| CpError::Input(format!("{e:?}")))?[0])
}

pub(crate) fn all_finite<B: burn::prelude::Backend, const D: usize>(tensor: &Tensor<B, D>) -> bool {
    use burn::tensor::ElementConversion;
    tensor
        .clone()
        .is_finite()
        .all()
        .into_scalar()
        .elem::<bool>()
}

/// Stops the step on every rank when any rank's loss or gradients are not finite (NaN or ±∞),
/// naming the step and the ranks where they appeared (before the all-reduce spreads them).
pub(crate) fn check_finite(
    world: &Comm,
    step: usize,
    loss_sum: f64,
    non_finite_params: &[usize],
) -> Result<(), CpError> {
    let mut local = Vec::new();
    if !loss_sum.is_finite() {
        local.push(format!("loss sum {loss_sum}"));
    }
    if let Some(first) = non_finite_params.first() {
        local.push(format!(
            "gradients of {} parameter(s) (the first is parameter #{first} in the model's order)",
            non_finite_params.len()
        ));
    }
    let reports = world.all_gather_control("non-finite check", local.join(" and ").into_bytes())?;
    let bad: Vec<String> = reports
        .iter()
        .enumerate()
        .filter(|(_, report)| !report.is_empty())
        .map(|(rank, report)| format!("rank {rank}: {}", String::from_utf8_lossy(report)))
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    Err(CpError::Input(format!(
        "step {step}: non-finite values, training stopped ({})",
        bad.join("; ")
    )))
}

/// Every parameter's gradient in `grads`, in the model's parameter order (for checks).
pub fn gradient_values<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = self
                .0
                .get::<B::InnerBackend, D>(param.id)
                .expect("every parameter has a gradient");
            self.1.push(
                grad.into_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("f32 data"),
            );
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}

/// The global L2 norm of a step's gradients (after their all-reduce): over every parameter of
/// the model, each counted once — a TP shard on its rank, a parameter the TP ranks replicate
/// ([`TrainModel::tp_replicated_ids`]) on TP rank 0, a kv projection its TP replicas share on
/// the first of them, the tied embedding on the first stage — summed over the TP group and the
/// pipeline's stages, so every rank gets the norm cp 1 computes (in f64).
pub(crate) fn global_grad_norm<B: FlashOps, C: CheckpointStrategy, M: TrainModel<CpTrain<B, C>>>(
    model: &M,
    grads: &GradientsParams,
    groups: &RankGroups,
) -> Result<f64, CpError> {
    let mut skip: Vec<ParamId> = Vec::new();
    if groups.tp.comm.rank() > 0 {
        skip.extend(model.tp_replicated_ids());
    }
    if groups.kv_replicas.as_ref().is_some_and(|kv| kv.rank() > 0) {
        skip.extend(model.kv_param_ids());
    }
    if groups.mesh.pp.rank() > 0 {
        skip.extend(model.tied_embedding_id());
    }
    struct SquaredSums<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        skip: &'a [ParamId],
        sums: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredSums<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.skip.contains(&param.id) {
                return;
            }
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                let grad = grad.cast(burn::tensor::FloatDType::F32);
                self.sums.push(grad.clone().mul(grad).sum());
            }
        }
    }
    let mut squares = SquaredSums::<CpTrain<B, C>> {
        grads,
        skip: &skip,
        sums: Vec::new(),
    };
    model.visit(&mut squares);
    // One read-back: every parameter's sum of squares, added in f64 in the model's order.
    let local: f64 = match squares.sums.is_empty() {
        true => 0.0,
        false => Tensor::cat(squares.sums, 0)
            .into_data()
            .convert::<f64>()
            .to_vec::<f64>()
            .map_err(|e| CpError::Input(format!("gradient norm: {e:?}")))?
            .into_iter()
            .sum(),
    };
    // Over the control path (8 bytes a rank, not counted as the mesh's traffic).
    let mut total = local;
    for comm in [&groups.tp.comm, &groups.mesh.pp] {
        if comm.size() > 1 {
            let parts = comm.all_gather_control("gradient norm", total.to_le_bytes().to_vec())?;
            total = parts
                .iter()
                .map(|bytes| {
                    let bytes: [u8; 8] = bytes.as_slice().try_into().map_err(|_| {
                        CpError::Input(format!(
                            "a malformed gradient norm part of {} bytes",
                            bytes.len()
                        ))
                    })?;
                    Ok(f64::from_le_bytes(bytes))
                })
                .sum::<Result<f64, CpError>>()?;
        }
    }
    Ok(total.sqrt())
}

/// Scales every gradient by `max_norm / norm` when the global norm exceeds `max_norm` (PyTorch's
/// `clip_grad_norm_`, whose 1e-6 keeps a zero norm finite); returns the gradients.
pub(crate) fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: GradientsParams,
    norm: f64,
    max_norm: f64,
) -> GradientsParams {
    let scale = max_norm / (norm + 1e-6);
    if scale >= 1.0 {
        return grads;
    }
    struct Scale<B: AutodiffBackend> {
        grads: GradientsParams,
        scale: f64,
        _backend: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, grad.mul_scalar(self.scale));
            }
        }
    }
    let mut scaled = Scale::<B> {
        grads,
        scale,
        _backend: std::marker::PhantomData,
    };
    model.visit(&mut scaled);
    scaled.grads
}
