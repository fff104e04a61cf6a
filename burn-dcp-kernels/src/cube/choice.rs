//! Which body of the flash kernels ([`super::flash`]) runs: tensor cores or plain units;
//! chosen per process by [`KERNEL_ENV`] or per call.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::ComputeClient;

use super::flash::{plain_body, FlashBody, FlashPlan};
use crate::definition::{AttentionShape, KernelError};

/// Which kernels [`super::forward_with`] and [`super::backward_with`] run; [`super::forward`]
/// and [`super::backward`] (every `FlashOps` call, hence `ContextParallel`) take it from
/// [`KERNEL_ENV`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The fastest body the device and the problem allow: tensor cores (f16/bf16 on CUDA
    /// sm_80+, head and value dims up to 256 within the device's shared memory), else plain
    /// units (f32; devices without `mma.sync`), as `Flash { tensor_cores: false }`. The default.
    #[default]
    Auto,
    /// The flash kernels ([`super::flash`]), or an error naming what the device or the problem
    /// lacks. With `tensor_cores: false` their products, loads and reductions run on plain
    /// units, on any device and for f32 too: the path CI tests on lavapipe — by plane
    /// shuffles where the device's planes shuffle ([`plain_body`]), else through shared memory.
    Flash { tensor_cores: bool },
    /// The flash kernels on plain units exchanging through shared memory even where plane
    /// shuffles would serve ([`FlashBody::Shared`]): for a device whose shuffles misbehave,
    /// and to test that body anywhere.
    FlashShared,
}

/// The environment variable [`super::forward`] and [`super::backward`] read their
/// [`AttentionKernel`] from (once per process): `auto` (also when unset), `flash`,
/// `flash-plain` (the flash kernels without tensor cores) or `flash-plain-shared` (the same,
/// exchanging through shared memory).
pub const KERNEL_ENV: &str = "BURN_DCP_ATTENTION_KERNEL";

impl AttentionKernel {
    /// The kernel [`KERNEL_ENV`] names ([`AttentionKernel::Auto`] when it is unset), read
    /// once per process (at the first kernel call), so every call of the process agrees.
    pub fn from_env() -> Result<Self, KernelError> {
        static CHOICE: std::sync::OnceLock<Result<AttentionKernel, KernelError>> =
            std::sync::OnceLock::new();
        CHOICE.get_or_init(Self::read_env).clone()
    }

    fn read_env() -> Result<Self, KernelError> {
        match std::env::var(KERNEL_ENV) {
            Ok(value) => value.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(value)) => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={value:?} is not Unicode"
            ))),
        }
    }

    /// The flash kernels' plan for this choice: `Auto` takes tensor cores where they fit and
    /// plain units else; a forced choice errors where it does not fit.
    pub(super) fn flash_plan<R: CubeRuntime>(
        self,
        client: &ComputeClient<R>,
        dtype: DType,
        shape: &AttentionShape,
        max_spans: usize,
    ) -> Result<FlashPlan, KernelError> {
        let properties = client.properties();
        let plan = |body| FlashPlan::new(properties, dtype, shape, max_spans, body);
        match self {
            Self::Auto => plan(FlashBody::TensorCores).or_else(|_| plan(plain_body(client))),
            Self::Flash { tensor_cores: true } => plan(FlashBody::TensorCores),
            Self::Flash {
                tensor_cores: false,
            } => plan(plain_body(client)),
            Self::FlashShared => plan(FlashBody::Shared),
        }
    }
}

impl std::str::FromStr for AttentionKernel {
    type Err = KernelError;

    fn from_str(value: &str) -> Result<Self, KernelError> {
        match value {
            "auto" => Ok(Self::Auto),
            "flash" => Ok(Self::Flash { tensor_cores: true }),
            "flash-plain" => Ok(Self::Flash {
                tensor_cores: false,
            }),
            "flash-plain-shared" => Ok(Self::FlashShared),
            "vector" => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={value:?}: the vector kernels were retired (the flash kernels' \
                 plain bodies cover them: `auto` or `flash-plain`)"
            ))),
            "tiles" | "tensor-cores" => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={value:?}: the matrix-tile kernels were retired (the flash \
                 kernels cover them: `flash` on tensor cores, `flash-plain` on plain units)"
            ))),
            other => Err(KernelError::InvalidValue(format!(
                "{KERNEL_ENV}={other:?}: expected one of auto, flash, flash-plain, \
                 flash-plain-shared"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_parse_and_bad_ones_name_the_choices() {
        assert_eq!("auto".parse(), Ok(AttentionKernel::Auto));
        assert_eq!(
            "flash".parse(),
            Ok(AttentionKernel::Flash { tensor_cores: true })
        );
        assert_eq!(
            "flash-plain".parse(),
            Ok(AttentionKernel::Flash {
                tensor_cores: false
            })
        );
        assert_eq!(
            "flash-plain-shared".parse(),
            Ok(AttentionKernel::FlashShared)
        );
        let err = "cmma".parse::<AttentionKernel>().unwrap_err().to_string();
        assert!(
            err.contains("BURN_DCP_ATTENTION_KERNEL=\"cmma\"")
                && err.contains("flash-plain-shared"),
            "{err}"
        );
        for retired in ["tiles", "tensor-cores", "vector"] {
            let err = retired.parse::<AttentionKernel>().unwrap_err().to_string();
            assert!(err.contains("retired") && err.contains(retired), "{err}");
        }
    }
}
