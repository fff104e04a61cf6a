//! Megatron-style dynamic CP: each sequence gets a CP group size from its length, and sequences
//! are scheduled onto groups of the DP×CP world so every rank has similar attention work.
//!
//! Rules (small pure functions, each tested):
//! 1. [`cp_size_for`]: `need = ⌈len / max_seq_len_per_rank⌉`, rounded up to a power of two
//!    (Megatron) or not (`any size`), at least `min_cp_size`; an error if it exceeds the world.
//! 2. Workload of a sequence on each rank of its group: `len² / cp` (attention is quadratic).
//! 3. Per micro-batch, ranks are partitioned into **aligned** groups: a group of size `c` is ranks
//!    `k·c .. (k+1)·c` (power-of-two sizes tile the world; with any size, groups start at a multiple
//!    of their size too, so they never straddle). Sequences only go to groups of their own size.
//! 4. Group allocation: one group per bucket present (largest size first), then, while free aligned
//!    blocks remain, another group for the bucket with the most work per allocated rank.
//! 5. Within a bucket, longest-processing-time first: each sequence (heaviest first) goes to the
//!    group with the least load that still has room (`tokens per rank ≤ max_seq_len_per_rank`);
//!    what does not fit waits for the next micro-batch.
//!
//! Guarantees checked by the property tests: every sequence is scheduled exactly once; groups of a
//! micro-batch are disjoint, aligned and of the sequence's size; no rank holds more than
//! `max_seq_len_per_rank` tokens; within a bucket, the most loaded group exceeds the least loaded
//! one by at most the heaviest sequence's workload (the LPT bound).

use std::ops::Range;

use crate::error::CpError;

/// Settings of the dynamic CP scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicCpConfig {
    /// Ranks of the DP×CP world.
    pub world: usize,
    pub max_seq_len_per_rank: usize,
    pub min_cp_size: usize,
    /// Round group sizes up to powers of two (Megatron); otherwise any size.
    pub power_of_two: bool,
}

/// One CP group of a micro-batch and the sequences it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledGroup {
    pub ranks: Range<usize>,
    pub sequences: Vec<usize>,
}

/// The groups of one micro-batch (ranks not in any group are idle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledMicroBatch {
    pub groups: Vec<ScheduledGroup>,
}

/// The dynamic CP schedule of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DynamicCpSchedule {
    pub micro_batches: Vec<ScheduledMicroBatch>,
    /// Group size of every sequence.
    pub cp_sizes: Vec<usize>,
}

impl DynamicCpConfig {
    pub fn validate(&self) -> Result<(), CpError> {
        if self.world == 0 || self.max_seq_len_per_rank == 0 || self.min_cp_size == 0 {
            return Err(CpError::Config(format!(
                "world ({}), max_seq_len_per_rank ({}) and min_cp_size ({}) must be at least 1",
                self.world, self.max_seq_len_per_rank, self.min_cp_size
            )));
        }
        if self.min_cp_size > self.world {
            return Err(CpError::Config(format!(
                "min_cp_size {} exceeds the world of {} ranks",
                self.min_cp_size, self.world
            )));
        }
        if self.power_of_two && !self.world.is_power_of_two() {
            return Err(CpError::Config(format!(
                "power-of-two group sizes need a power-of-two world, got {} ranks",
                self.world
            )));
        }
        Ok(())
    }
}

/// The CP group size of a sequence of `len` tokens (rule 1).
pub fn cp_size_for(len: usize, config: &DynamicCpConfig) -> Result<usize, CpError> {
    let need = len.div_ceil(config.max_seq_len_per_rank).max(1);
    let need = if config.power_of_two {
        need.next_power_of_two()
    } else {
        need
    };
    let size = need.max(config.min_cp_size);
    if size > config.world {
        return Err(CpError::Config(format!(
            "a sequence of {len} tokens needs a CP group of {size} ranks (max_seq_len_per_rank {}), more than the world's {}",
            config.max_seq_len_per_rank, config.world
        )));
    }
    Ok(size)
}

/// Attention workload of a sequence on each rank of its group (rule 2).
pub fn workload(len: usize, cp: usize) -> f64 {
    (len as f64) * (len as f64) / cp as f64
}

/// Tokens each rank of a group of `cp` holds for a sequence of `len` tokens.
pub fn tokens_per_rank(len: usize, cp: usize) -> usize {
    len.div_ceil(cp)
}

/// The first free aligned block of `size` ranks, if any (rule 3).
pub fn free_aligned_block(busy: &[bool], size: usize) -> Option<Range<usize>> {
    (0..busy.len() / size)
        .map(|k| k * size..(k + 1) * size)
        .find(|block| busy[block.clone()].iter().all(|b| !b))
}

/// Allocates groups for the buckets (`(size, total workload)`), rule 4. Returns, per bucket, the
/// rank ranges of its groups.
pub fn allocate_groups(world: usize, buckets: &[(usize, f64)]) -> Vec<Vec<Range<usize>>> {
    let mut busy = vec![false; world];
    let mut groups: Vec<Vec<Range<usize>>> = vec![Vec::new(); buckets.len()];
    let mut order: Vec<usize> = (0..buckets.len()).collect();
    order.sort_by_key(|&b| std::cmp::Reverse(buckets[b].0));
    for &bucket in &order {
        if let Some(block) = free_aligned_block(&busy, buckets[bucket].0) {
            busy[block.clone()].iter_mut().for_each(|b| *b = true);
            groups[bucket].push(block);
        }
    }
    loop {
        let work_per_rank =
            |b: usize| buckets[b].1 / (groups[b].len() * buckets[b].0).max(1) as f64;
        let candidate = (0..buckets.len())
            .filter(|&b| !groups[b].is_empty() && free_aligned_block(&busy, buckets[b].0).is_some())
            .max_by(|&a, &b| work_per_rank(a).total_cmp(&work_per_rank(b)));
        let Some(bucket) = candidate else { break };
        let block = free_aligned_block(&busy, buckets[bucket].0).expect("checked above");
        busy[block.clone()].iter_mut().for_each(|b| *b = true);
        groups[bucket].push(block);
    }
    groups
}

/// LPT assignment of `sequences` (indices into `lengths`) to `groups` of size `cp` (rule 5).
/// Returns each group's sequences and the sequences left for a later micro-batch.
pub fn assign_longest_first(
    sequences: &[usize],
    lengths: &[usize],
    cp: usize,
    groups: usize,
    max_tokens_per_rank: usize,
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mut order = sequences.to_vec();
    order.sort_by_key(|&s| (std::cmp::Reverse(lengths[s]), s));
    let mut load = vec![0.0f64; groups];
    let mut tokens = vec![0usize; groups];
    let mut assigned = vec![Vec::new(); groups];
    let mut left = Vec::new();
    for sequence in order {
        let need = tokens_per_rank(lengths[sequence], cp);
        let target = (0..groups)
            .filter(|&g| tokens[g] + need <= max_tokens_per_rank)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
        match target {
            Some(g) => {
                load[g] += workload(lengths[sequence], cp);
                tokens[g] += need;
                assigned[g].push(sequence);
            }
            None => left.push(sequence),
        }
    }
    (assigned, left)
}

/// Schedules a batch of sequences of the given lengths (see the module docs).
pub fn schedule(lengths: &[usize], config: &DynamicCpConfig) -> Result<DynamicCpSchedule, CpError> {
    config.validate()?;
    let cp_sizes = lengths
        .iter()
        .map(|&len| cp_size_for(len, config))
        .collect::<Result<Vec<_>, _>>()?;
    let mut pending: Vec<usize> = (0..lengths.len()).collect();
    let mut micro_batches = Vec::new();
    while !pending.is_empty() {
        let mut sizes: Vec<usize> = pending.iter().map(|&s| cp_sizes[s]).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let buckets: Vec<(usize, f64)> = sizes
            .iter()
            .map(|&size| {
                let work = pending
                    .iter()
                    .filter(|&&s| cp_sizes[s] == size)
                    .map(|&s| workload(lengths[s], size))
                    .sum();
                (size, work)
            })
            .collect();
        let allocation = allocate_groups(config.world, &buckets);
        let mut groups = Vec::new();
        let mut left = Vec::new();
        for ((size, _), ranges) in buckets.iter().zip(allocation) {
            let members: Vec<usize> = pending
                .iter()
                .copied()
                .filter(|&s| cp_sizes[s] == *size)
                .collect();
            let (assigned, rest) = assign_longest_first(
                &members,
                lengths,
                *size,
                ranges.len(),
                config.max_seq_len_per_rank,
            );
            left.extend(rest);
            groups.extend(
                ranges
                    .into_iter()
                    .zip(assigned)
                    .filter(|(_, sequences)| !sequences.is_empty())
                    .map(|(ranks, sequences)| ScheduledGroup { ranks, sequences }),
            );
        }
        if left.len() == pending.len() {
            return Err(CpError::Config(format!(
                "could not schedule sequences {left:?}: no group fits them (world {}, max_seq_len_per_rank {})",
                config.world, config.max_seq_len_per_rank
            )));
        }
        left.sort_unstable();
        pending = left;
        micro_batches.push(ScheduledMicroBatch { groups });
    }
    Ok(DynamicCpSchedule {
        micro_batches,
        cp_sizes,
    })
}

impl DynamicCpSchedule {
    /// Attention workload of every rank in micro-batch `index`.
    pub fn rank_loads(&self, index: usize, lengths: &[usize], world: usize) -> Vec<f64> {
        let mut loads = vec![0.0; world];
        for group in &self.micro_batches[index].groups {
            let work: f64 = group
                .sequences
                .iter()
                .map(|&s| workload(lengths[s], group.ranks.len()))
                .sum();
            group.ranks.clone().for_each(|r| loads[r] += work);
        }
        loads
    }
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
    fn group_sizes_follow_megatron_rule() {
        let c = config(16, 1000, 1, true);
        assert_eq!(cp_size_for(1, &c).unwrap(), 1);
        assert_eq!(cp_size_for(1000, &c).unwrap(), 1);
        assert_eq!(cp_size_for(1001, &c).unwrap(), 2);
        assert_eq!(cp_size_for(3001, &c).unwrap(), 4);
        assert_eq!(cp_size_for(3001, &config(16, 1000, 1, false)).unwrap(), 4);
        assert_eq!(cp_size_for(2001, &config(16, 1000, 1, false)).unwrap(), 3);
        assert_eq!(cp_size_for(10, &config(16, 1000, 2, true)).unwrap(), 2);
        let err = cp_size_for(17_000, &c).unwrap_err().to_string();
        assert!(
            err.contains("needs a CP group of 32 ranks") && err.contains("world's 16"),
            "{err}"
        );
    }

    #[test]
    fn aligned_blocks_never_straddle() {
        let mut busy = vec![false; 8];
        busy[1] = true;
        assert_eq!(free_aligned_block(&busy, 2), Some(2..4));
        assert_eq!(free_aligned_block(&busy, 4), Some(4..8));
        assert_eq!(free_aligned_block(&busy, 8), None);
        assert_eq!(free_aligned_block(&busy, 3), Some(3..6));
    }
}
