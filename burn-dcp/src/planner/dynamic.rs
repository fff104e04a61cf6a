//! Megatron-style dynamic CP: the DP×CP ranks form one pool; per optimizer step every sequence
//! of the global batch gets a CP group sized by its length, sequences that fit together share a
//! group, and groups are widened so that no rank stays idle.
//!
//! The rules (one small pure function each; property-tested in `burn-dcp/tests/dynamic_cp.rs`),
//! for a pool of `P` ranks, a per-rank token budget `B` (`max_seq_len_per_rank`) and a layout:
//!
//! 1. **Sizes** ([`DynamicCpConfig::sizes`]): powers of two `≥ min_cp_size` (Megatron) or every
//!    size `≥ min_cp_size` (`any`), and always the whole pool `P`.
//! 2. **Minimum size of a sequence** ([`min_cp_size_for`]): the smallest allowed size `c` whose
//!    layout puts at most `B` of its tokens on any rank ([`Layout::max_rank_tokens`]: `⌈len/c⌉`
//!    for contiguous/stripe, the largest head-tail chunk pair for zigzag). None → an error naming
//!    the length, `B` and `P` (so a sequence longer than `B·P` is always an error).
//! 3. **Work** of a sequence: a caller-given estimate (training: attention FLOPs of its mask plus
//!    its token-linear FLOPs; [`schedule`] uses Megatron's `len²`). A rank of a group of size `c`
//!    gets `work / c` of each of its sequences.
//! 4. **Placement** (`place`), longest sequence first: join an existing group (size ≥ the
//!    sequence's minimum, the group's per-rank tokens stay ≤ `B`) or open a group of the
//!    sequence's minimum size on free ranks, whichever gives the lower projected maximum per-rank
//!    work (ties: open, then the lower group index). A sequence that fits nowhere waits for the
//!    next sub-step.
//! 5. **No idle ranks** (`fill_idle_ranks`): while the groups use fewer than `P` ranks, widen
//!    the most loaded group that can grow (to the smallest larger allowed size at which its ranks
//!    stay within `B`) without exceeding `P`. If ranks stay idle, the sub-step becomes one
//!    whole-pool group of all its sequences when that fits `B` (Megatron's
//!    `fill_with_full_dpxcp_group`); otherwise the last group extends to the end of the pool when
//!    that fits `B`. The budget wins over idle ranks: under the zigzag layout a rank's share is
//!    not monotone in the group size, so rarely no group can take the remaining ranks (pool 10,
//!    budget 1, one 6-token sequence: 6 and 9 ranks fit, 10 do not; 1 rank idles). (The whole
//!    pool is not chosen merely because it balances work better: that would turn dynamic CP back
//!    into static CP over the pool, with its communication.)
//! 6. **Layout** (`lay_out`): groups get consecutive rank ranges, largest first, so a
//!    power-of-two group starts at a multiple of its size.
//!
//! Megatron's test vectors: `[6144, 2048]` on 2 ranks with `B = 4096` → one sub-step, both
//! sequences in one group of 2; `[50, 50]` on 14 ranks with `B = 100` → both on all 14 ranks.

use std::ops::Range;

use crate::batch::layout::Layout;
use crate::error::CpError;

/// Settings of the dynamic CP scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicCpConfig {
    /// Ranks of the pool (DP×CP).
    pub world: usize,
    /// Per-rank token budget.
    pub max_seq_len_per_rank: usize,
    pub min_cp_size: usize,
    /// Group sizes are powers of two (Megatron), or any size.
    pub power_of_two: bool,
}

/// One CP group of a sub-step and the sequences it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledGroup {
    pub ranks: Range<usize>,
    pub sequences: Vec<usize>,
}

/// The groups of one sub-step (one sub-micro-batch per group).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledMicroBatch {
    pub groups: Vec<ScheduledGroup>,
}

/// The dynamic CP schedule of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DynamicCpSchedule {
    pub micro_batches: Vec<ScheduledMicroBatch>,
    /// The size of the group every sequence runs in.
    pub cp_sizes: Vec<usize>,
}

impl DynamicCpConfig {
    pub fn validate(&self) -> Result<(), CpError> {
        if self.world == 0 || self.max_seq_len_per_rank == 0 || self.min_cp_size == 0 {
            return Err(CpError::Config(format!(
                "pool ({}), max_seq_len_per_rank ({}) and min_cp_size ({}) must be at least 1",
                self.world, self.max_seq_len_per_rank, self.min_cp_size
            )));
        }
        if self.min_cp_size > self.world {
            return Err(CpError::Config(format!(
                "min_cp_size {} exceeds the pool of {} ranks",
                self.min_cp_size, self.world
            )));
        }
        Ok(())
    }

    /// The allowed group sizes, ascending (rule 1).
    pub fn sizes(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> = (self.min_cp_size..=self.world)
            .filter(|s| !self.power_of_two || s.is_power_of_two())
            .collect();
        if sizes.last() != Some(&self.world) {
            sizes.push(self.world);
        }
        sizes
    }
}

/// The smallest allowed group size for a sequence of `len` tokens (rule 2).
pub fn min_cp_size_for(
    len: usize,
    config: &DynamicCpConfig,
    layout: Layout,
) -> Result<usize, CpError> {
    config
        .sizes()
        .into_iter()
        .find(|&size| layout.max_rank_tokens(len, size) <= config.max_seq_len_per_rank)
        .ok_or_else(|| {
            CpError::Config(format!(
                "a sequence of {len} tokens does not fit the pool: even on all {} ranks the {layout} layout puts {} tokens on a rank, over the per-rank budget of {} (the budget × pool size is {})",
                config.world,
                layout.max_rank_tokens(len, config.world),
                config.max_seq_len_per_rank,
                config.max_seq_len_per_rank.saturating_mul(config.world)
            ))
        })
}

/// The Megatron group size rule, `max(min_cp, 2^⌈log2(len/B)⌉)` (contiguous tokens), kept for
/// callers that want the size without the layout's rounding.
pub fn cp_size_for(len: usize, config: &DynamicCpConfig) -> Result<usize, CpError> {
    min_cp_size_for(len, config, Layout::Contiguous)
}

/// Megatron's workload estimate of a sequence (total over its group): `len²`.
pub fn workload(len: usize, cp: usize) -> f64 {
    (len as f64) * (len as f64) / cp as f64
}

/// Tokens each rank of a group of `cp` holds for a sequence of `len` tokens (contiguous chunks).
pub fn tokens_per_rank(len: usize, cp: usize) -> usize {
    len.div_ceil(cp)
}

/// What the scheduler knows about the batch.
struct Batch<'a> {
    lengths: &'a [usize],
    works: &'a [f64],
    min_sizes: Vec<usize>,
    config: &'a DynamicCpConfig,
    layout: Layout,
}

impl Batch<'_> {
    fn tokens(&self, sequence: usize, size: usize) -> usize {
        self.layout.max_rank_tokens(self.lengths[sequence], size)
    }

    fn budget(&self) -> usize {
        self.config.max_seq_len_per_rank
    }
}

/// A group being built: its size and sequences, before it gets ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftGroup {
    pub size: usize,
    pub sequences: Vec<usize>,
    /// Bound on the tokens a rank of the group holds (sum over its sequences).
    pub tokens: usize,
    /// Total work of its sequences.
    pub work: f64,
}

impl DraftGroup {
    /// Estimated work of each of its ranks.
    pub fn load(&self) -> f64 {
        self.work / self.size as f64
    }
}

fn max_load(groups: &[DraftGroup]) -> f64 {
    groups.iter().map(DraftGroup::load).fold(0.0, f64::max)
}

/// One way to place a sequence, with the maximum per-rank work it leads to.
#[derive(Clone, Copy, Debug)]
enum Choice {
    Open,
    Join(usize),
}

/// Rule 4: the sub-step's groups (not yet widened) and the sequences left for later.
fn place(pending: &[usize], batch: &Batch<'_>) -> (Vec<DraftGroup>, Vec<usize>) {
    let pool = batch.config.world;
    let mut groups: Vec<DraftGroup> = Vec::new();
    let mut left = Vec::new();
    for &sequence in pending {
        let work = batch.works[sequence];
        let current = max_load(&groups);
        let used: usize = groups.iter().map(|g| g.size).sum();
        let minimum = batch.min_sizes[sequence];
        let mut best: Option<(f64, Choice)> = None;
        if used + minimum <= pool {
            best = Some((current.max(work / minimum as f64), Choice::Open));
        }
        for (index, group) in groups.iter().enumerate() {
            let fits = group.size >= minimum
                && group.tokens + batch.tokens(sequence, group.size) <= batch.budget();
            let projected = current.max((group.work + work) / group.size as f64);
            if fits && best.is_none_or(|(load, _)| projected < load) {
                best = Some((projected, Choice::Join(index)));
            }
        }
        match best {
            Some((_, Choice::Open)) => groups.push(DraftGroup {
                size: minimum,
                sequences: vec![sequence],
                tokens: batch.tokens(sequence, minimum),
                work,
            }),
            Some((_, Choice::Join(index))) => {
                let group = &mut groups[index];
                group.tokens += batch.tokens(sequence, group.size);
                group.work += work;
                group.sequences.push(sequence);
            }
            None => left.push(sequence),
        }
    }
    (groups, left)
}

/// `group` at `size`: its per-rank token bound recomputed.
fn resized(group: &DraftGroup, size: usize, batch: &Batch<'_>) -> DraftGroup {
    DraftGroup {
        size,
        sequences: group.sequences.clone(),
        tokens: group.sequences.iter().map(|&s| batch.tokens(s, size)).sum(),
        work: group.work,
    }
}

/// The smallest allowed size above `group`'s at which it fits `room` ranks and its ranks stay
/// within the token budget, if any. Not simply the next size: under the zigzag layout a rank's
/// share is not monotone in the group size (6 tokens: 1 per rank on 6 ranks, 2 on 7 and 8, 1 on
/// 9, 2 on 10), so a larger group can overflow a rank where a smaller one did not.
fn next_fitting_size(
    group: &DraftGroup,
    sizes: &[usize],
    room: usize,
    batch: &Batch<'_>,
) -> Option<usize> {
    sizes
        .iter()
        .copied()
        .filter(|&size| size > group.size && size <= room)
        .find(|&size| resized(group, size, batch).tokens <= batch.budget())
}

/// Widens the most loaded group that can grow within the pool and the budget; `false` when none
/// can.
fn widen_once(groups: &mut [DraftGroup], sizes: &[usize], batch: &Batch<'_>) -> bool {
    let used: usize = groups.iter().map(|g| g.size).sum();
    let pool = batch.config.world;
    let candidate = (0..groups.len())
        .filter_map(|g| {
            let room = pool - used + groups[g].size;
            next_fitting_size(&groups[g], sizes, room, batch).map(|size| (g, size))
        })
        .max_by(|a, b| {
            let (load_a, load_b) = (groups[a.0].load(), groups[b.0].load());
            load_a.total_cmp(&load_b).then(b.0.cmp(&a.0))
        });
    match candidate {
        Some((g, size)) => {
            groups[g] = resized(&groups[g], size, batch);
            true
        }
        None => false,
    }
}

/// One group of every sequence of the sub-step on the whole pool, if it fits the budget.
fn whole_pool(groups: &[DraftGroup], batch: &Batch<'_>) -> Option<DraftGroup> {
    let mut sequences: Vec<usize> = groups.iter().flat_map(|g| g.sequences.clone()).collect();
    sequences.sort_by_key(|&s| (std::cmp::Reverse(batch.lengths[s]), s));
    let merged = DraftGroup {
        size: batch.config.world,
        work: groups.iter().map(|g| g.work).sum(),
        tokens: 0,
        sequences,
    };
    let merged = resized(&merged, batch.config.world, batch);
    (merged.tokens <= batch.budget()).then_some(merged)
}

/// Rule 5: widen groups until every rank of the pool is in one — within the budget, which wins:
/// where no group can take the remaining ranks without a rank over the budget (the zigzag
/// layout's non-monotone shares), they stay idle for the sub-step.
fn fill_idle_ranks(mut groups: Vec<DraftGroup>, batch: &Batch<'_>) -> Vec<DraftGroup> {
    let sizes = batch.config.sizes();
    while widen_once(&mut groups, &sizes, batch) {}
    let used: usize = groups.iter().map(|g| g.size).sum();
    if used == batch.config.world {
        return groups;
    }
    if let Some(merged) = whole_pool(&groups, batch) {
        return vec![merged];
    }
    // The last group in the layout (the smallest) takes the remaining ranks, if its ranks stay
    // within the budget.
    let last = smallest_last(&groups);
    let stretched = resized(
        &groups[last],
        groups[last].size + batch.config.world - used,
        batch,
    );
    if stretched.tokens <= batch.budget() {
        groups[last] = stretched;
    }
    groups
}

/// Index of the group that [`lay_out`] places last.
fn smallest_last(groups: &[DraftGroup]) -> usize {
    layout_order(groups).last().copied().unwrap_or(0)
}

/// Groups by decreasing size (ties: creation order).
fn layout_order(groups: &[DraftGroup]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&g| (std::cmp::Reverse(groups[g].size), g));
    order
}

/// Rule 6: consecutive rank ranges, largest group first.
fn lay_out(groups: &[DraftGroup]) -> ScheduledMicroBatch {
    let mut start = 0;
    let groups = layout_order(groups)
        .into_iter()
        .map(|g| {
            let ranks = start..start + groups[g].size;
            start = ranks.end;
            ScheduledGroup {
                ranks,
                sequences: groups[g].sequences.clone(),
            }
        })
        .collect();
    ScheduledMicroBatch { groups }
}

/// Schedules a batch with Megatron's `len²` work estimate and the zigzag layout.
pub fn schedule(lengths: &[usize], config: &DynamicCpConfig) -> Result<DynamicCpSchedule, CpError> {
    let works: Vec<f64> = lengths.iter().map(|&len| workload(len, 1)).collect();
    schedule_with(lengths, &works, config, Layout::Zigzag)
}

/// Schedules sequences of `lengths` with total work `works` (see the module docs), for groups
/// that shard with `layout`.
pub fn schedule_with(
    lengths: &[usize],
    works: &[f64],
    config: &DynamicCpConfig,
    layout: Layout,
) -> Result<DynamicCpSchedule, CpError> {
    config.validate()?;
    if works.len() != lengths.len() || works.iter().any(|w| !w.is_finite() || *w < 0.0) {
        return Err(CpError::Config(format!(
            "{} work estimates for {} sequences: give one finite, non-negative estimate per sequence",
            works.len(),
            lengths.len()
        )));
    }
    let min_sizes = lengths
        .iter()
        .map(|&len| min_cp_size_for(len, config, layout))
        .collect::<Result<Vec<_>, _>>()?;
    let batch = Batch {
        lengths,
        works,
        min_sizes,
        config,
        layout,
    };
    let mut pending: Vec<usize> = (0..lengths.len()).collect();
    pending.sort_by_key(|&s| (std::cmp::Reverse(lengths[s]), s));
    let mut micro_batches = Vec::new();
    let mut cp_sizes = vec![0; lengths.len()];
    while !pending.is_empty() {
        let (groups, left) = place(&pending, &batch);
        if groups.is_empty() {
            return Err(CpError::Config(format!(
                "could not place sequences {pending:?} on a pool of {} ranks",
                config.world
            )));
        }
        let micro_batch = lay_out(&fill_idle_ranks(groups, &batch));
        for group in &micro_batch.groups {
            group
                .sequences
                .iter()
                .for_each(|&s| cp_sizes[s] = group.ranks.len());
        }
        micro_batches.push(micro_batch);
        pending = left;
    }
    Ok(DynamicCpSchedule {
        micro_batches,
        cp_sizes,
    })
}

impl DynamicCpSchedule {
    /// Megatron-estimated (`len²/c`) work of every rank in sub-step `index`.
    pub fn rank_loads(&self, index: usize, lengths: &[usize], world: usize) -> Vec<f64> {
        let works: Vec<f64> = lengths.iter().map(|&len| workload(len, 1)).collect();
        self.rank_work(index, &works, world)
    }

    /// Estimated work of every rank in sub-step `index`, for sequence works `works`.
    pub fn rank_work(&self, index: usize, works: &[f64], world: usize) -> Vec<f64> {
        let groups = self.micro_batches[index].groups.iter();
        rank_work(
            groups.map(|g| (g.ranks.clone(), g.sequences.as_slice())),
            works,
            world,
        )
    }
}

/// Estimated work of every rank of a pool of `world` for groups given as (rank range, sequences):
/// each rank of a group gets `work / size` of each of the group's sequences (rule 3).
pub fn rank_work<'a>(
    groups: impl IntoIterator<Item = (Range<usize>, &'a [usize])>,
    works: &[f64],
    world: usize,
) -> Vec<f64> {
    let mut loads = vec![0.0; world];
    for (ranks, sequences) in groups {
        let per_rank = sequences.iter().map(|&s| works[s]).sum::<f64>() / ranks.len() as f64;
        ranks.for_each(|r| loads[r] += per_rank);
    }
    loads
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(world: usize, max: usize, min: usize, pow2: bool) -> DynamicCpConfig {
        DynamicCpConfig {
            world,
            max_seq_len_per_rank: max,
            min_cp_size: min,
            power_of_two: pow2,
        }
    }

    #[test]
    fn minimum_sizes_follow_megatron_rule_and_the_layout() {
        let c = config(16, 1000, 1, true);
        assert_eq!(cp_size_for(1, &c).unwrap(), 1);
        assert_eq!(cp_size_for(1000, &c).unwrap(), 1);
        assert_eq!(cp_size_for(1001, &c).unwrap(), 2);
        assert_eq!(cp_size_for(3001, &c).unwrap(), 4);
        assert_eq!(cp_size_for(3001, &config(16, 1000, 1, false)).unwrap(), 4);
        assert_eq!(cp_size_for(2001, &config(16, 1000, 1, false)).unwrap(), 3);
        assert_eq!(cp_size_for(10, &config(16, 1000, 2, true)).unwrap(), 2);
        // The whole pool is allowed even when it is not a power of two.
        assert_eq!(cp_size_for(1300, &config(14, 100, 1, true)).unwrap(), 14);
        let err = cp_size_for(17_000, &c).unwrap_err().to_string();
        assert!(
            err.contains("a sequence of 17000 tokens does not fit the pool"),
            "{err}"
        );
        // Zigzag puts two chunks on a rank: 9 tokens on 2 ranks → chunks of 2,2,2,3 → 5.
        assert_eq!(
            min_cp_size_for(9, &config(4, 4, 1, false), Layout::Zigzag).unwrap(),
            3
        );
    }

    #[test]
    fn sizes_are_powers_of_two_and_the_pool() {
        assert_eq!(config(14, 1, 1, true).sizes(), vec![1, 2, 4, 8, 14]);
        assert_eq!(config(8, 1, 2, true).sizes(), vec![2, 4, 8]);
        assert_eq!(config(5, 1, 2, false).sizes(), vec![2, 3, 4, 5]);
    }
}
