//! The model's [`TensorParallel`] ops on a TP group's communicator: `f`/`g` are burn-dcp's
//! autodiff region ops ([`tp_copy`], [`tp_reduce`]), the max is an all-gather of a detached
//! tensor.

use burn::prelude::{Tensor, TensorData};
use burn_dcp::backend::{tp_copy, tp_reduce, ContextParallel, TpInner};
use burn_dcp::comm::Comm;
use burn_dcp_models::{ModelError, TensorParallel};

/// A TP group: the communicator of this rank's TP ranks.
#[derive(Clone)]
pub struct TpGroup {
    pub comm: Comm,
}

impl<B: TpInner> TensorParallel<ContextParallel<B>> for TpGroup {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn copy<const D: usize>(
        &self,
        x: Tensor<ContextParallel<B>, D>,
    ) -> Result<Tensor<ContextParallel<B>, D>, ModelError> {
        tp_copy(x, &self.comm).map_err(|e| ModelError::Collective(e.to_string()))
    }

    fn reduce<const D: usize>(
        &self,
        x: Tensor<ContextParallel<B>, D>,
    ) -> Result<Tensor<ContextParallel<B>, D>, ModelError> {
        tp_reduce(x, &self.comm).map_err(|e| ModelError::Collective(e.to_string()))
    }

    fn all_reduce_max<const D: usize>(
        &self,
        x: Tensor<ContextParallel<B>, D>,
    ) -> Result<Tensor<ContextParallel<B>, D>, ModelError> {
        if self.comm.size() == 1 {
            return Ok(x.detach());
        }
        let device = x.device();
        let shape = x.shape();
        let dtype = x.dtype();
        let gathered = self
            .comm
            .all_gather(x.detach().into_data().convert::<f32>().into())
            .map_err(|e| ModelError::Collective(e.to_string()))?;
        let mut max: Vec<f32> = vec![f32::NEG_INFINITY; shape.num_elements()];
        for part in gathered {
            let values = part
                .into_host()
                .map_err(|e| ModelError::Collective(e.to_string()))?
                .to_vec::<f32>()
                .map_err(|e| ModelError::Collective(format!("TP max: {e:?}")))?;
            for (m, v) in max.iter_mut().zip(values) {
                // NaN wins, so a NaN logit stays visible.
                if v.is_nan() || v > *m {
                    *m = v;
                }
            }
        }
        // In `x`'s dtype (the maxima are values of `x`: exact in it).
        Ok(Tensor::from_data(
            TensorData::new(max, shape),
            (&device, dtype),
        ))
    }
}
