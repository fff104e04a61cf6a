//! The examples' training flags ([`TrainFlags`]) and how they become a [`TrainConfig`]: for a new
//! run ([`TrainFlags::config`]) or to continue a saved one ([`TrainFlags::resume`], where every
//! given flag must agree with the saved configuration).

mod args;
mod build;
mod mode;
mod resume;

pub use args::TrainFlags;
