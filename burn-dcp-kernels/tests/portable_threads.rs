//! `BURN_DCP_CPU_THREADS`: the thread count of the portable kernels. Its own test binary: it sets
//! a process-wide environment variable, which would race with tests running beside it.

use burn_dcp_kernels::portable::{self, THREADS_VAR};
use burn_dcp_kernels::{AttentionShape, MaskSpec, VarlenAttention};

#[test]
fn the_thread_count_is_honoured_and_a_bad_one_is_an_error() {
    let problem = VarlenAttention::packed(vec![70, 30], vec![MaskSpec::Causal]);
    let shape = AttentionShape {
        q_tokens: 100,
        kv_tokens: 100,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        value_dim: 8,
    };
    let values = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    };
    let (q, k, v) = (values(3200, 1), values(1600, 2), values(1600, 3));
    let mut results = Vec::new();
    let mut gradients = Vec::new();
    for threads in ["1", "3", " 2 "] {
        std::env::set_var(THREADS_VAR, threads);
        assert_eq!(
            portable::threads().unwrap(),
            threads.trim().parse::<usize>().unwrap()
        );
        results.push(portable::forward(&q, &k, &v, &shape, &problem).unwrap());
        let out = &results.last().unwrap();
        let grads = portable::backward(&q, &k, &v, &out.out, &out.lse, &q, &shape, &problem);
        gradients.push(grads.unwrap());
    }
    // Work items never share an output row, and the backward's key gradients are summed over a
    // fixed number of parts in order, so the thread count cannot change a bit.
    assert!(results.windows(2).all(|w| w[0] == w[1]));
    assert!(gradients.windows(2).all(|w| w[0] == w[1]));
    for bad in ["0", "-1", "two", ""] {
        std::env::set_var(THREADS_VAR, bad);
        let err = portable::forward(&q, &k, &v, &shape, &problem)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(THREADS_VAR) && err.contains(&format!("{bad:?}")),
            "{err}"
        );
        let out = vec![0.0; 3200];
        let lse = vec![0.0; 400];
        let err = portable::backward(&q, &k, &v, &out, &lse, &q, &shape, &problem)
            .unwrap_err()
            .to_string();
        assert!(err.contains("positive integer"), "{err}");
    }
    std::env::remove_var(THREADS_VAR);
    // By default the ranks running as threads share the cores.
    let cores = portable::cores();
    assert_eq!(portable::RankThreads::current(), 0);
    assert_eq!(portable::threads().unwrap(), cores);
    {
        let _ranks = portable::RankThreads::enter(2);
        assert_eq!(portable::threads().unwrap(), (cores / 2).max(1));
        let _more = portable::RankThreads::enter(4 * cores);
        assert_eq!(portable::RankThreads::current(), 2 + 4 * cores);
        assert_eq!(portable::threads().unwrap(), 1);
        std::env::set_var(THREADS_VAR, "3");
        assert_eq!(
            portable::threads().unwrap(),
            3,
            "the variable overrides the share"
        );
        std::env::remove_var(THREADS_VAR);
    }
    assert_eq!(portable::RankThreads::current(), 0);
    assert_eq!(portable::threads().unwrap(), cores);
}
