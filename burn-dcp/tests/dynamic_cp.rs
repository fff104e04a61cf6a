//! Property tests of the Megatron-style dynamic CP scheduler over thousands of random batches:
//! every sequence exactly once, groups disjoint / aligned / of the sequence's size, no rank over
//! `max_seq_len_per_rank`, and the LPT balance bound. (Megatron's reviewed version had a negative
//! index wrap-around, an inverted emptiness assertion and shared mutable lists; each would break
//! one of these properties.)

use burn_dcp::planner::dynamic::{
    cp_size_for, schedule, tokens_per_rank, workload, DynamicCpConfig, ScheduledGroup,
};
use proptest::prelude::*;

fn configs() -> impl Strategy<Value = DynamicCpConfig> {
    (0u32..6, 1usize..5000, 0u32..3, any::<bool>()).prop_map(|(log_world, max, log_min, pow2)| {
        let world = if pow2 {
            1usize << log_world
        } else {
            (1usize << log_world) + log_world as usize % 3
        };
        DynamicCpConfig {
            world,
            max_seq_len_per_rank: max,
            min_cp_size: (1usize << log_min).min(world),
            power_of_two: pow2,
        }
    })
}

fn group_load(group: &ScheduledGroup, lengths: &[usize]) -> f64 {
    group
        .sequences
        .iter()
        .map(|&s| workload(lengths[s], group.ranks.len()))
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn schedules_are_valid(config in configs(), raw in proptest::collection::vec(1usize..200_000, 0..40)) {
        // Lengths that need more ranks than the world must be rejected with an error.
        let fits: Vec<usize> = raw.iter().copied().filter(|&l| cp_size_for(l, &config).is_ok()).collect();
        if fits.len() < raw.len() {
            prop_assert!(schedule(&raw, &config).is_err());
        }
        let plan = schedule(&fits, &config).unwrap();
        let mut seen = vec![0usize; fits.len()];
        for (index, micro_batch) in plan.micro_batches.iter().enumerate() {
            prop_assert!(!micro_batch.groups.is_empty(), "micro-batch {} is empty", index);
            let mut rank_used = vec![false; config.world];
            for group in &micro_batch.groups {
                let size = group.ranks.len();
                prop_assert!(group.ranks.end <= config.world);
                prop_assert_eq!(group.ranks.start % size, 0, "group {:?} is not aligned", group.ranks);
                prop_assert!(!group.sequences.is_empty());
                for rank in group.ranks.clone() {
                    prop_assert!(!rank_used[rank], "rank {} in two groups", rank);
                    rank_used[rank] = true;
                }
                let mut tokens = 0;
                for &s in &group.sequences {
                    prop_assert_eq!(plan.cp_sizes[s], size);
                    seen[s] += 1;
                    tokens += tokens_per_rank(fits[s], size);
                }
                prop_assert!(tokens <= config.max_seq_len_per_rank, "a rank holds {} tokens", tokens);
            }
        }
        prop_assert!(seen.iter().all(|&n| n == 1), "a sequence is missing or repeated: {:?}", seen);
        // LPT bound when everything fits one micro-batch: within a bucket, group loads differ by at
        // most the heaviest sequence's workload.
        if plan.micro_batches.len() == 1 {
            let groups = &plan.micro_batches[0].groups;
            for size in groups.iter().map(|g| g.ranks.len()) {
                let same: Vec<&ScheduledGroup> = groups.iter().filter(|g| g.ranks.len() == size).collect();
                let heaviest = same.iter().flat_map(|g| g.sequences.iter()).map(|&s| workload(fits[s], size)).fold(0.0, f64::max);
                let loads: Vec<f64> = same.iter().map(|g| group_load(g, &fits)).collect();
                let (max, min) = loads.iter().fold((0.0f64, f64::MAX), |(a, b), &l| (a.max(l), b.min(l)));
                prop_assert!(max - min <= heaviest * (1.0 + 1e-9), "bucket {}: loads {} .. {}, heaviest {}", size, min, max, heaviest);
            }
        }
    }
}

#[test]
fn a_skewed_batch_uses_all_ranks() {
    let config = DynamicCpConfig {
        world: 8,
        max_seq_len_per_rank: 4096,
        min_cp_size: 1,
        power_of_two: true,
    };
    let lengths = [
        16000, 3000, 2500, 2000, 1800, 1500, 1200, 900, 800, 600, 500, 300,
    ];
    let plan = schedule(&lengths, &config).unwrap();
    assert_eq!(plan.cp_sizes[0], 4);
    let loads = plan.rank_loads(0, &lengths, 8);
    assert!(loads.iter().all(|&l| l > 0.0), "idle ranks: {loads:?}");
}
