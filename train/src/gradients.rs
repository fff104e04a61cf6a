//! The gradients of a step: summed over the DP × CP pool (and replicated kv heads, tied
//! embeddings), checked for non-finite values before they spread.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::{Tensor, TensorData};
use burn::tensor::backend::AutodiffBackend;
use burn_dcp::comm::{Comm, CommError, Payload};
use burn_dcp::kernels::FlashOps;
use burn_dcp::CpError;

use crate::groups::RankGroups;
use crate::model::{CpTrain, TrainModel};

/// Sums every parameter's gradient over the pool (zeros where a rank has none), in the model's
/// parameter order, which is the same on every rank of the pool; some parameters are then also
/// summed over another group (`extra`).
pub(crate) struct AllReduceGradients<'a, B: AutodiffBackend> {
    grads: GradientsParams,
    comm: &'a Comm,
    /// Parameters whose gradient is also summed over a group: the replicated kv projections over
    /// their TP replicas (tp > kv heads), the tied embedding over the first and last stage.
    extra: Vec<(Vec<ParamId>, &'a Comm)>,
    error: Option<CommError>,
    /// Parameters (in visiting order) whose local gradient on this rank is not finite.
    non_finite: Vec<usize>,
    visited: usize,
    phantom: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for AllReduceGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_some() {
            return;
        }
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| param.val().inner().zeros_like());
        let device = grad.device();
        // One flag read back; the gradient itself stays on its device.
        if !all_finite(&grad) {
            self.non_finite.push(self.visited);
        }
        self.visited += 1;
        let summed = self.extra.iter().fold(
            self.comm.all_reduce(Payload::device(grad)),
            |summed, (ids, comm)| {
                summed.and_then(|summed| match ids.contains(&param.id) {
                    true => comm.all_reduce(summed),
                    false => Ok(summed),
                })
            },
        );
        let summed = summed.and_then(|summed| {
            summed
                .into_tensor::<B::InnerBackend, D>(&device)
                .map_err(|message| CommError::Invalid {
                    group: self.comm.name().to_string(),
                    message: format!("gradient all-reduce: {message}"),
                })
        });
        match summed {
            Ok(summed) => self.grads.register(param.id, summed),
            Err(error) => self.error = Some(error),
        }
    }
}

/// All-reduces the accumulated gradients and the loss over the world; stops on non-finite values.
pub(crate) fn reduce_step<B: FlashOps, M: TrainModel<CpTrain<B>>>(
    model: &M,
    groups: &RankGroups,
    step: usize,
    mut accumulator: GradientsAccumulator<M>,
    loss_sum: f64,
    global_labels: usize,
) -> Result<(f64, GradientsParams), CpError> {
    let mut extra = Vec::new();
    if let Some(kv) = &groups.kv_replicas {
        extra.push((model.kv_param_ids(), kv));
    }
    if let (Some(id), Some(embedding)) = (model.tied_embedding_id(), &groups.embedding) {
        extra.push((vec![id], embedding));
    }
    let mut reducer = AllReduceGradients {
        grads: accumulator.grads(),
        comm: &groups.world,
        extra,
        error: None,
        non_finite: Vec::new(),
        visited: 0,
        phantom: std::marker::PhantomData,
    };
    model.visit(&mut reducer);
    if let Some(error) = reducer.error {
        return Err(error.into());
    }
    // Over the whole world: a non-finite gradient on one TP position stops every rank, named.
    check_finite(&groups.mesh.world, step, loss_sum, &reducer.non_finite)?;
    let mut total = groups
        .world
        .all_reduce(TensorData::new(vec![loss_sum], [1]).into())?;
    if groups.mesh.pp.size() > 1 {
        // Only the last stage computes losses: every stage gets their sum.
        total = groups.mesh.pp.all_reduce(total)?;
    }
    let total: f64 = total
        .into_host()
        .map_err(CpError::Input)?
        .to_vec::<f64>()
        .map_err(|e| CpError::Input(format!("{e:?}")))?[0];
    Ok((total / global_labels as f64, reducer.grads))
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
