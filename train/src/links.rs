//! `--emulate-links`: the in-process world's messages delayed as over the `--topology` preset's
//! links (`burn_dcp::comm::links`), slowed to the speed of this machine's compute.
//!
//! **The scale factor.** A preset's links sit beside GPUs that compute attention
//! `device FLOP/s` (e.g. 187 TFLOP/s for a100-p4d); a rank here computes it at the CPU's
//! attention FLOP/s divided among the process's ranks. Links slowed by
//! `time_scale = device FLOP/s ÷ CPU FLOP/s per rank` (bandwidth ÷ scale, latency × scale) keep
//! communication's share of the step's time. `--link-scale F` sets it; by default it is measured
//! at start ([`time_scale`]): the best of three runs of the portable flash-attention
//! forward (1024 tokens, causal, 8 heads of dim 128, every core), its FLOP/s divided by the
//! ranks of the process (they share the cores when they compute at once). Both rates are
//! sustained rates at a large head dim (the presets' 60 % of peak is one), so a small model
//! (the tiny GPT's head dim 16) is as inefficient here as it would be on the GPUs, and a small
//! model is as communication-bound here as it would be there.

use std::time::Instant;

use burn::backend::flex::FlexDevice;
use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor};
use burn_dcp::comm::{InProcessWorld, LinkEmulation};
use burn_dcp::kernels::{FlashOps, MaskSpec, VarlenAttention};
use burn_dcp::planner::topology::Topology;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::TrainError;

/// `--emulate-links` settings (the run's `config.json` keeps them).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmulatedLinks {
    /// The links' time scale (`--link-scale`); `None`: measured at start.
    pub scale: Option<f64>,
}

/// Tokens of the calibration forward.
const CALIBRATION_TOKENS: usize = 1024;

/// Heads and head dim of the calibration forward.
const CALIBRATION_HEADS: usize = 8;
const CALIBRATION_HEAD_DIM: usize = 128;

/// This machine's sustained attention FLOP/s per rank when `ranks` ranks of one process compute
/// at once (see the module docs).
pub fn cpu_attention_flops_per_rank(ranks: usize) -> Result<f64, TrainError> {
    let (heads, head_dim) = (CALIBRATION_HEADS, CALIBRATION_HEAD_DIM);
    let device = FlexDevice;
    let n = CALIBRATION_TOKENS;
    let tensor = || {
        Tensor::<Flex, 3>::random(
            [n, heads, head_dim],
            Distribution::Normal(0.0, 1.0),
            &device,
        )
    };
    let (q, k, v) = (tensor(), tensor(), tensor());
    let problem = VarlenAttention::packed(vec![n], vec![MaskSpec::Causal]);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let started = Instant::now();
        let out = Flex::flash_forward(q.clone(), k.clone(), v.clone(), &problem)
            .map_err(|e| TrainError::Config(format!("the link calibration's attention: {e}")))?;
        let _ = out.out.into_data();
        best = best.min(started.elapsed().as_secs_f64());
    }
    // Forward FLOPs of causal attention: 2 matmuls of 2·D FLOPs per allowed (query, key) pair.
    let pairs = (n * (n + 1) / 2) as f64;
    let flops = 4.0 * pairs * (heads * head_dim) as f64;
    Ok(flops / best.max(1e-9) / ranks.max(1) as f64)
}

/// The time scale of emulated `links` beside `topology`'s devices: `--link-scale`, or measured
/// for `ranks` ranks of this process.
pub fn time_scale(
    links: EmulatedLinks,
    topology: &Topology,
    ranks: usize,
) -> Result<f64, TrainError> {
    match links.scale {
        Some(scale) => Ok(scale),
        None => Ok(topology.device_flops / cpu_attention_flops_per_rank(ranks)?),
    }
}

/// Sets `config`'s emulated links on `world` (ranks as threads); returns the time scale used.
pub fn emulate_links(config: &TrainConfig, world: &InProcessWorld) -> Result<f64, TrainError> {
    let links = config
        .emulate_links
        .ok_or_else(|| TrainError::Config("the run does not emulate links".into()))?;
    let ranks = config.world_size();
    let topology = Topology::for_ranks(&config.topology, config.nodes, ranks)?;
    let scale = time_scale(links, &topology, ranks)?;
    let links = LinkEmulation::of_topology(&topology, scale)
        .map_err(|e| TrainError::Config(format!("--link-scale {scale}: {e}")))?;
    world.emulate_links(links)?;
    Ok(scale)
}
