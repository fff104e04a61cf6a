//! Portable attention with LSE on host memory (f32), for CPU backends such as burn Flex.
//!
//! Exact attention over packed varlen sequences. Only the keys the mask allows (per query, the at
//! most two key ranges of [`MaskSpec::key_ranges`](crate::MaskSpec::key_ranges)) contribute, and
//! work on masked keys is skipped, not computed and discarded: the forward (`forward`)
//! is tiled like flash-attention, skipping key tiles no query of a block may attend and running
//! the others as `gemm` matrix products; the backward is tiled the same way (flash-attention 2's
//! five products per tile). Work runs on a persistent pool, as many workers per call as the
//! thread budget gives ([`threads`]: the process's cores shared among its ranks, or
//! `BURN_DCP_CPU_THREADS`): one task per key/value head and query block in the forward, per
//! key/value head and part of the query blocks in the backward.
//!
//! Numerics (f32 throughout, as flash-attention accumulates):
//! - forward: `lse_i = m_i + ln Σ_j exp(s_ij − m_i)` with `s_ij = scale·q_i·k_j`, `m_i = max_j s_ij`;
//!   `out_i = Σ_j exp(s_ij − lse_i) v_j`. A query with no allowed key gets `out = 0`, `lse = −∞`.
//! - backward (from the *final* `out`, `lse`): `p_ij = exp(s_ij − lse_i)`,
//!   `δ_i = dout_i·out_i`, `ds_ij = p_ij (dout_i·v_j − δ_i)`, `dq_i = scale Σ_j ds_ij k_j`,
//!   `dk_j = scale Σ_i ds_ij q_i`, `dv_j = Σ_i p_ij dout_i`. Because `lse` and `out` are final, the
//!   gradients of a partial key set (a ring step) are exact partial sums of the full gradients.
//! - merge: `lse = ln(e^{lse_a} + e^{lse_b})`, `out = e^{lse_a − lse} out_a + e^{lse_b − lse} out_b`
//!   (both parts are softmax-normalised over disjoint key sets, so re-weighting by their share of
//!   the total mass gives the softmax over the union).

/// `fn $name($args) -> $ret` calling `$body` (an `#[inline(always)]` function of the same
/// arguments) compiled with AVX2 where the CPU has it (its loops eight lanes wide), else as
/// compiled for the target.
macro_rules! with_avx2 {
    ($(#[$attr:meta])* fn $name:ident / $avx2:ident => $body:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty) => {
        $(#[$attr])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                return unsafe { $avx2($($arg),*) };
            }
            $body($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx2($($arg: $ty),*) -> $ret {
            $body($($arg),*)
        }
    };
}

mod backward;
mod forward;
mod host;
mod math;
mod pool;

pub use host::{backward, forward, merge, HostForward, HostGradients};
pub use math::log_add_exp;
use math::{axpy, dot, nan_max};
use pool::parallel_map;
pub use pool::{cores, threads, RankThreads, THREADS_VAR};
