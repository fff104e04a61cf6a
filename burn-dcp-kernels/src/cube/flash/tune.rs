//! The forward's cube size, measured once per problem class and kept for the process, as burn
//! autotunes its matmuls: on tensor cores the forward of 4 and of 8 planes per cube
//! ([`FlashPlan::forward_candidates`]) each win on some shapes (on an H200, bf16, dim 128:
//! 8 planes on 8192 causal tokens × 32 heads, 4 on the same tokens unmasked and on GQA; see
//! `docs/flash-kernels.md`, "Cube size"). Both compute every row from the same key tiles in the
//! same order, so the choice changes the time, never the result.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::launch::{forward_flash, FlashPlan};
use super::FlashConfig;
use crate::definition::{AttentionShape, KernelError, VarlenAttention};
use crate::tiling::{DenseSpans, TileRuns};

/// What the choice depends on: the device, the dtype, the shape and how evenly the mask spreads
/// the work over query tiles (a causal mask does not, a full one does).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    device: String,
    dtype: DType,
    shape: [usize; 6],
    max_spans: usize,
    even: bool,
}

static CHOSEN: Mutex<Option<HashMap<Key, FlashConfig>>> = Mutex::new(None);

/// `plan` with the forward configuration measured fastest for this problem class: the kept
/// choice when there is one, else each candidate run twice (the first compiles) and timed on
/// the second. One candidate (no tensor cores, or [`super::launch::PLANES_ENV`] set) is taken
/// as it is.
#[allow(clippy::too_many_arguments)]
pub fn tuned_forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    problem: &VarlenAttention,
    s: &AttentionShape,
    dtype: DType,
    dense: &DenseSpans,
    plan: FlashPlan,
    limit: usize,
) -> Result<FlashPlan, KernelError> {
    let candidates = plan.forward_candidates(limit, dtype, s)?;
    if candidates.len() < 2 {
        return Ok(plan);
    }
    let key = Key {
        device: format!("{:?}", q.device),
        dtype,
        shape: [
            s.q_tokens,
            s.kv_tokens,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.value_dim,
        ],
        max_spans: dense.max_spans,
        even: evenly_spread(dense, &plan.forward),
    };
    if let Some(chosen) = kept(&key) {
        return Ok(FlashPlan {
            forward: chosen,
            ..plan
        });
    }
    let mut best: Option<(Duration, FlashConfig)> = None;
    for forward in candidates {
        let candidate = FlashPlan { forward, ..plan };
        let run = || {
            forward_flash(
                q.clone(),
                k.clone(),
                v.clone(),
                problem,
                s,
                dtype,
                dense,
                &candidate,
            )
        };
        run();
        synced(q)?;
        let start = Instant::now();
        run();
        synced(q)?;
        let took = start.elapsed();
        if best.is_none_or(|(fastest, _)| took < fastest) {
            best = Some((took, forward));
        }
    }
    let chosen = best.map_or(plan.forward, |(_, forward)| forward);
    CHOSEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, chosen);
    Ok(FlashPlan {
        forward: chosen,
        ..plan
    })
}

fn kept(key: &Key) -> Option<FlashConfig> {
    CHOSEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .as_ref()
        .and_then(|chosen| chosen.get(key).copied())
}

/// Whether every query tile of `config` lists the same number of key tiles.
fn evenly_spread(dense: &DenseSpans, config: &FlashConfig) -> bool {
    let runs = TileRuns::by_query_tile(dense, config.tokens_per_cube(), config.block);
    let weight = |tile: usize| -> usize { runs.runs(tile).map(|(first, end, _)| end - first).sum() };
    (1..runs.tiles()).all(|tile| weight(tile) == weight(0))
}

/// Waits for the device's queued work; an error names the failure.
fn synced<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Result<(), KernelError> {
    cubecl::future::block_on(tensor.client.sync()).map_err(|e| {
        KernelError::Unsupported(format!(
            "timing the flash forward's cube sizes: the device failed to finish its work: {e:?}"
        ))
    })
}
