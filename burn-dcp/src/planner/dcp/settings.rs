//! The DCP planner's settings and their rules.

use crate::error::CpError;

/// Settings of the DCP planner.
#[derive(Clone, Debug, PartialEq)]
pub struct DcpConfig {
    /// Per-device compute imbalance tolerance (max ≤ (1 + ε) · mean).
    pub compute_epsilon: f64,
    /// Per-device memory imbalance tolerance.
    pub memory_epsilon: f64,
    /// Communication stages.
    pub stages: usize,
    pub seed: u64,
}

impl Default for DcpConfig {
    fn default() -> Self {
        Self {
            compute_epsilon: 0.1,
            memory_epsilon: 0.4,
            stages: 4,
            seed: 0,
        }
    }
}

/// The most communication stages a DCP schedule may have.
pub const MAX_STAGES: usize = 64;

impl DcpConfig {
    pub fn validate(&self) -> Result<(), CpError> {
        for (name, value) in [
            ("compute epsilon", self.compute_epsilon),
            ("memory epsilon", self.memory_epsilon),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CpError::Config(format!(
                    "{name} must be a non-negative number, got {value}"
                )));
            }
        }
        if self.stages == 0 || self.stages > MAX_STAGES {
            return Err(CpError::Config(format!(
                "DCP needs 1 to {MAX_STAGES} communication stages, got {}",
                self.stages
            )));
        }
        Ok(())
    }
}
