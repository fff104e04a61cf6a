//! Failure behaviour: ranks that disagree, ranks that die, leave, stall or lose messages.
//!
//! - Mismatched configurations across the ranks of a group fail on every rank before data moves,
//!   naming the ranks and the fields (never `Ok` with wrong results, never a timeout).
//! - The fault-injection suite injects a random fault (panic, error, delay past the timeout, early
//!   exit, dropped or duplicated message) at a random communication call of a random rank, for
//!   every strategy and layout, on the direct path and through `ContextParallel<Autodiff<Flex>>`:
//!   no trial hangs, no rank returns `Ok` with a wrong result, and every failed rank's error
//!   names the rank that failed first.

use crate::common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Tensor, TensorData};
use burn_dcp::backend::{set_context, ContextParallel, CpContext};
use burn_dcp::comm::{
    CommError, Fault, FaultKind, InProcessWorld, RankFailure, RankFailureKind, WorldConfig,
};
use burn_dcp::diagnostics::harness::PackedInputs;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::{
    cp_attention_backward, cp_attention_forward, BackwardInputs, CpBatch, CpError, CpGroup, Layout,
    Placement, Strategy,
};
use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

type Cp = ContextParallel<Autodiff<Flex>>;

/// What one rank runs: its strategy, layout, masks, scale and inputs.
#[derive(Clone)]
struct RankSetup {
    strategy: Strategy,
    layout: Layout,
    seq_lens: Vec<usize>,
    masks: Vec<MaskSpec>,
    scale: Option<f64>,
    inputs: PackedInputs,
}

/// Which way attention is called.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// `cp_attention_forward` / `cp_attention_backward`.
    Direct,
    /// burn's `attention` on `ContextParallel<Autodiff<Flex>>`, then `backward()`.
    Decorator,
}

fn host<Bk: burn::tensor::backend::Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// This rank's token indices, its micro-batch description and its CP group.
fn rank_call(
    comm: burn_dcp::comm::Comm,
    setup: &RankSetup,
) -> Result<(Vec<usize>, CpBatch, CpGroup), CpError> {
    let placement = Placement::of_layout(&setup.seq_lens, comm.size(), setup.layout)?;
    let indices = placement.packed_indices(comm.rank());
    let mut batch = CpBatch::new(placement, setup.masks.clone());
    batch.scale = setup.scale;
    Ok((indices, batch, CpGroup::new(comm, setup.strategy)?))
}

/// One rank's forward and backward on the direct path: out, lse, dq, dk, dv, flattened.
fn direct_rank(comm: burn_dcp::comm::Comm, setup: &RankSetup) -> Result<Vec<f32>, CpError> {
    let x = &setup.inputs;
    let (indices, batch, group) = rank_call(comm, setup)?;
    let q = token_rows::<B>(&x.q, x.heads, x.head_dim, &indices);
    let k = token_rows::<B>(&x.k, x.kv_heads, x.head_dim, &indices);
    let v = token_rows::<B>(&x.v, x.kv_heads, x.value_dim, &indices);
    let dout = token_rows::<B>(&x.dout, x.heads, x.value_dim, &indices);
    let fwd = cp_attention_forward(&group, &batch, q.clone(), k.clone(), v.clone())?;
    let inputs = BackwardInputs {
        q,
        k,
        v,
        out: fwd.out.clone(),
        lse: fwd.lse.clone(),
        dout,
    };
    let grads = cp_attention_backward(&group, &batch, inputs)?;
    let mut all = host(fwd.out);
    for part in [
        host(fwd.lse),
        host(grads.dq),
        host(grads.dk),
        host(grads.dv),
    ] {
        all.extend(part);
    }
    Ok(all)
}

/// One rank through the decorator: burn's `attention`, then `backward()`.
fn decorated_rank(comm: burn_dcp::comm::Comm, setup: &RankSetup) -> Result<Vec<f32>, CpError> {
    let x = &setup.inputs;
    let (indices, batch, group) = rank_call(comm, setup)?;
    let _context = set_context(CpContext { group, batch });
    let heads_first = |t: Tensor<Cp, 3>| t.swap_dims(0, 1).unsqueeze_dim::<4>(0);
    let q = heads_first(token_rows(&x.q, x.heads, x.head_dim, &indices)).require_grad();
    let k = heads_first(token_rows(&x.k, x.kv_heads, x.head_dim, &indices)).require_grad();
    let v = heads_first(token_rows(&x.v, x.kv_heads, x.value_dim, &indices)).require_grad();
    let dout = heads_first(token_rows(&x.dout, x.heads, x.value_dim, &indices));
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    let out = attention(q.clone(), k.clone(), v.clone(), None, None, options);
    let grads = (out.clone() * dout).sum().backward();
    let mut all = host(out);
    for t in [&q, &k, &v] {
        all.extend(host(t.grad(&grads).expect("gradient")));
    }
    Ok(all)
}

/// The outcome of one run of a world.
struct Outcome {
    results: Vec<Result<Vec<f32>, RankFailure>>,
    first_failure: Option<(usize, String)>,
    summary: Option<String>,
    calls: Vec<u64>,
    elapsed: Duration,
}

/// Runs `setups[rank]` on every rank of a fresh world (with `faults`), on a watchdog thread:
/// panics if the run does not end within `limit` (a hang).
fn run_world(
    setups: Vec<RankSetup>,
    path: Path,
    timeout: Duration,
    faults: Vec<Fault>,
    limit: Duration,
) -> Outcome {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let world = world_with_timeout(setups.len(), timeout);
        world.inject_faults(faults);
        let started = Instant::now();
        let results = world.run(|comm| {
            let setup = &setups[comm.rank()];
            match path {
                Path::Direct => direct_rank(comm, setup),
                Path::Decorator => decorated_rank(comm, setup),
            }
        });
        let elapsed = started.elapsed();
        let _ = sender.send(Outcome {
            summary: world.failure_summary(&results),
            first_failure: world.first_failure(),
            calls: world.calls(),
            results,
            elapsed,
        });
    });
    receiver
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("the run did not end within {limit:?}: a hang"))
}

fn setups(cp: usize, setup: RankSetup) -> Vec<RankSetup> {
    vec![setup; cp]
}

fn base_setup(
    strategy: Strategy,
    layout: Layout,
    seq_lens: &[usize],
    heads: usize,
    kv_heads: usize,
) -> RankSetup {
    RankSetup {
        strategy,
        layout,
        seq_lens: seq_lens.to_vec(),
        masks: vec![MaskSpec::Causal],
        scale: None,
        inputs: random_inputs(seq_lens, heads, kv_heads, 8, 5),
    }
}

/// Every rank must fail with a mismatch naming `field` (and the odd rank), quickly.
fn assert_mismatch(outcome: &Outcome, field: &str, odd_rank: usize, what: &str) {
    assert!(
        outcome.elapsed < Duration::from_secs(5),
        "{what}: caught only after {:?}",
        outcome.elapsed
    );
    for (rank, result) in outcome.results.iter().enumerate() {
        let error = result
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("{what}: rank {rank} returned Ok"));
        assert!(
            error.contains(field) && error.contains(&format!("rank {odd_rank}")),
            "{what}: rank {rank}: {error}"
        );
    }
}

fn mismatch(cp: usize, odd: usize, base: RankSetup, change: impl Fn(&mut RankSetup)) -> Outcome {
    let mut all = setups(cp, base);
    change(&mut all[odd]);
    run_world(
        all,
        Path::Direct,
        Duration::from_secs(30),
        vec![],
        Duration::from_secs(60),
    )
}

#[test]
fn mismatched_ranks_fail_before_data_moves_naming_ranks_and_fields() {
    let ring = base_setup(Strategy::Ring, Layout::Zigzag, &[97, 63, 37], 4, 4);
    // Same token count on every rank, different sequence boundaries.
    let outcome = mismatch(4, 2, ring.clone(), |s| {
        s.seq_lens = vec![96, 64, 37];
    });
    assert_mismatch(
        &outcome,
        "sequence lengths",
        2,
        "lengths 97,63,37 vs 96,64,37",
    );
    let outcome = mismatch(4, 1, ring.clone(), |s| s.masks = vec![MaskSpec::Full]);
    assert_mismatch(&outcome, "masks", 1, "full vs causal");
    let ulysses = base_setup(Strategy::Ulysses, Layout::Zigzag, &[40, 24], 4, 4);
    let outcome = mismatch(4, 3, ulysses.clone(), |s| {
        s.masks = vec![MaskSpec::Sliding { window: 8 }]
    });
    assert_mismatch(&outcome, "masks", 3, "sliding under Ulysses");
    let outcome = mismatch(4, 0, ring.clone(), |s| s.scale = Some(0.5));
    assert_mismatch(&outcome, "scale", 0, "scale 0.5 vs default");
    for (name, base) in [("ring", ring.clone()), ("ulysses", ulysses.clone())] {
        let outcome = mismatch(4, 2, base.clone(), |s| {
            s.inputs = random_inputs(&s.seq_lens, 4, 2, 8, 5);
        });
        assert_mismatch(
            &outcome,
            "kv heads",
            2,
            &format!("4 vs 2 kv heads under {name}"),
        );
    }
    let outcome = mismatch(4, 1, ring.clone(), |s| s.strategy = Strategy::AllGather);
    assert_mismatch(&outcome, "strategy", 1, "all-gather on one rank");
    let outcome = mismatch(4, 1, ring.clone(), |s| s.layout = Layout::Stripe);
    assert_mismatch(&outcome, "placement", 1, "stripe layout on one rank");
}

#[test]
fn a_usp_rank_among_ring_ranks_fails_at_once() {
    // USP splits its group (a collective the ring ranks never call): the messages do not match.
    let ring = base_setup(Strategy::Ring, Layout::Zigzag, &[30, 18], 4, 4);
    let outcome = mismatch(4, 1, ring, |s| s.strategy = USP_2X2);
    assert!(
        outcome.elapsed < Duration::from_secs(5),
        "{:?}",
        outcome.elapsed
    );
    assert!(outcome.results.iter().all(Result::is_err));
    let summary = outcome.summary.unwrap();
    assert!(summary.contains("different operations"), "{summary}");
}

#[test]
fn invalid_inputs_on_one_rank_fail_every_rank_at_once() {
    let ring = base_setup(Strategy::Ring, Layout::Zigzag, &[30, 18], 4, 4);
    let outcome = mismatch(4, 2, ring, |s| s.scale = Some(f64::NAN));
    assert!(outcome.elapsed < Duration::from_secs(5));
    for (rank, result) in outcome.results.iter().enumerate() {
        let error = result.as_ref().unwrap_err();
        assert!(error.contains("softmax scale NaN"), "rank {rank}: {error}");
    }
    assert!(outcome.results[0].as_ref().unwrap_err().contains("rank 2"));
}

#[test]
fn a_rank_that_returns_early_is_named_at_once() {
    let world = world_with_timeout(4, Duration::from_secs(60));
    let started = Instant::now();
    let results = world.run(|comm| -> Result<(), CommError> {
        if comm.rank() == 3 {
            return Ok(()); // leaves without joining the collective
        }
        comm.all_gather(TensorData::new(vec![1.0f32; 4], [4]).into())?;
        Ok(())
    });
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    for result in &results[..3] {
        let error = result.as_ref().unwrap_err();
        assert!(
            error.contains("global rank 3 failed") && error.contains("left group 'world'"),
            "{error}"
        );
    }
    assert!(results[3].is_ok());
}

#[test]
fn the_first_failure_is_blamed_not_a_bystander_that_fails_after_it() {
    let world = InProcessWorld::new(4, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<(), CommError> {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(20));
            panic!("the real cause on rank 2");
        }
        // Bystanders panic on the error they get (as a burn op boundary does).
        if let Err(error) = comm.all_gather(TensorData::new(vec![1.0f32; 4], [4]).into()) {
            panic!("bystander {} gave up: {error}", comm.rank());
        }
        Ok(())
    });
    assert_eq!(world.first_failure().unwrap().0, 2);
    for (rank, result) in results.iter().enumerate() {
        let error = result.as_ref().unwrap_err();
        assert!(
            error.contains("the real cause on rank 2"),
            "rank {rank}: {error}"
        );
    }
    let summary = world.failure_summary(&results).unwrap();
    assert!(
        summary.starts_with("global rank 2 failed first"),
        "{summary}"
    );
    assert!(summary.contains("the real cause on rank 2"), "{summary}");
}

#[test]
fn lost_and_duplicated_messages_never_give_wrong_results() {
    // Equal token counts on every rank: a shifted message has the right shape.
    let setup = base_setup(Strategy::Ring, Layout::Contiguous, &[32, 32], 2, 2);
    let clean = run_world(
        setups(4, setup.clone()),
        Path::Direct,
        Duration::from_secs(30),
        vec![],
        Duration::from_secs(60),
    );
    let want: Vec<Vec<f32>> = clean.results.into_iter().map(Result::unwrap).collect();
    let mut caught = 0;
    for kind in [FaultKind::DropMessage, FaultKind::DuplicateMessage] {
        for rank in 0..4 {
            for at_call in 0..clean.calls[rank] {
                let fault = Fault {
                    rank,
                    at_call,
                    kind: kind.clone(),
                };
                let outcome = run_world(
                    setups(4, setup.clone()),
                    Path::Direct,
                    Duration::from_millis(500),
                    vec![fault.clone()],
                    Duration::from_secs(30),
                );
                for (r, result) in outcome.results.iter().enumerate() {
                    if let Ok(got) = result {
                        assert_eq!(
                            got, &want[r],
                            "{fault:?}: rank {r} returned Ok with a wrong result"
                        );
                    }
                }
                caught += usize::from(outcome.results.iter().any(Result::is_err));
            }
        }
    }
    // A fault at a rank's last calls may touch no message another rank still needs; the others
    // must be caught.
    let trials: u64 = 2 * clean.calls.iter().sum::<u64>();
    eprintln!("{caught} of {trials} runs with a dropped or duplicated message failed; the rest returned correct results");
    assert!(caught as u64 * 2 > trials, "{caught} of {trials}");
}

#[test]
fn a_rank_failure_names_its_rank_how_it_failed_and_reads_as_its_message() {
    let world = InProcessWorld::new(3, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<usize, CommError> {
        match comm.rank() {
            1 => Err(CommError::Invalid {
                group: "world".into(),
                message: "the task's own words".into(),
            }),
            2 => panic!("a panic on rank 2"),
            rank => Ok(rank),
        }
    });
    assert_eq!(results[0], Ok(0));
    let error = results[1].as_ref().unwrap_err();
    assert_eq!((error.rank(), error.kind()), (1, RankFailureKind::Error));
    assert!(error.detail().contains("the task's own words"), "{error}");
    assert!(error.starts_with("rank 1 returned an error: "), "{error}");
    assert_eq!(error.to_string(), error.as_str());
    let panic = results[2].as_ref().unwrap_err();
    assert_eq!((panic.rank(), panic.kind()), (2, RankFailureKind::Panic));
    assert_eq!(panic.detail(), "a panic on rank 2");
    assert_eq!(*panic, "rank 2 panicked: a panic on rank 2");

    // Code written when a rank's result was `Result<T, String>` still builds: `?` turns the
    // failure into its message.
    let first_error = || -> Result<Vec<usize>, String> {
        let values = results.iter().cloned().collect::<Result<Vec<_>, _>>()?;
        Ok(values)
    };
    assert_eq!(first_error().unwrap_err(), error.as_str());

    // An injected exit (nobody has failed, so the fault fires at rank 1's first call).
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    world.inject_faults([Fault {
        rank: 1,
        at_call: 0,
        kind: FaultKind::Exit,
    }]);
    let results = world.run(|comm| -> Result<(), CommError> {
        if comm.rank() == 1 {
            comm.barrier()?;
        }
        Ok(())
    });
    assert!(results[0].is_ok());
    let exit = results[1].as_ref().unwrap_err();
    assert_eq!((exit.rank(), exit.kind()), (1, RankFailureKind::Exit));
    assert_eq!(*exit, "rank 1 left the world early (injected fault)");
}

#[path = "failures/injection.rs"]
mod injection;
