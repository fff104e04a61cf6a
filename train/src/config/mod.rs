//! The run's configuration ([`TrainConfig`]: written to `config.json`), its defaults (one home:
//! [`TrainConfig::default`]) and its rules ([`TrainConfig::validate`]).

mod derived;
mod rules;
mod run;

pub(crate) use derived::gpt_of_shape;
pub use run::*;

pub use crate::mode::{GroupStrategy, TrainMode};
pub use crate::settings::{
    AutoSettings, CpSizes, DcpSettings, DynamicSettings, EmulatedLinks, PpSchedule, Precision,
    Recompute,
};
