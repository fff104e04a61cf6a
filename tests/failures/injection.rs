//! Random faults injected into one rank (a panic, an error, a delay past the timeout, an early
//! exit, a lost or a duplicated message) under every strategy: never a hang, never a wrong
//! result, and the first failed rank is always the one named.

use super::*;

/// One random trial of the fault-injection suite (its fields are printed when a check fails).
#[derive(Clone, Debug)]
#[allow(dead_code)]
struct Trial {
    strategy: Strategy,
    layout: Layout,
    cp: usize,
    path: Path,
    fault: Fault,
}

fn strategies(cp: usize) -> Vec<Strategy> {
    let mut all = vec![Strategy::Ring, Strategy::Ulysses, Strategy::AllGather];
    if cp == 4 {
        all.push(USP_2X2);
    }
    all
}

fn fault_kind(rng: &mut SmallRng, timeout: Duration) -> FaultKind {
    match rng.random_range(0..6) {
        0 => FaultKind::Panic,
        1 => FaultKind::Error,
        2 => FaultKind::Delay(timeout + timeout / 2),
        3 => FaultKind::Exit,
        4 => FaultKind::DropMessage,
        _ => FaultKind::DuplicateMessage,
    }
}

/// Checks one faulty run against the clean one.
fn check_trial(trial: &Trial, outcome: &Outcome, want: &[Vec<f32>], timeout: Duration) {
    let mut failed = Vec::new();
    for (rank, result) in outcome.results.iter().enumerate() {
        match result {
            Ok(got) => assert_eq!(
                got, &want[rank],
                "{trial:?}: rank {rank} returned Ok with a wrong result"
            ),
            Err(error) => failed.push((rank, error)),
        }
    }
    let prompt = matches!(
        trial.fault.kind,
        FaultKind::Panic | FaultKind::Error | FaultKind::Exit
    );
    if prompt {
        assert!(
            outcome.elapsed < timeout,
            "{trial:?}: took {:?}, the timeout is {timeout:?}",
            outcome.elapsed
        );
    }
    let Some((first, reason)) = &outcome.first_failure else {
        // Nobody failed but (possibly) the rank that left early after its last needed message.
        for (rank, error) in &failed {
            assert!(
                trial.fault.kind == FaultKind::Exit && *rank == trial.fault.rank,
                "{trial:?}: rank {rank} failed with no failure recorded: {error}"
            );
        }
        return;
    };
    if matches!(trial.fault.kind, FaultKind::Panic | FaultKind::Error) {
        assert_eq!(
            *first, trial.fault.rank,
            "{trial:?}: blamed {first}: {reason}"
        );
        assert!(reason.contains("injected fault"), "{trial:?}: {reason}");
    }
    // A rank that stalls past the timeout is named first, not the first rank to time out
    // waiting (directly or through a chain of waiting ranks) for it.
    if matches!(trial.fault.kind, FaultKind::Delay(_)) {
        assert_eq!(
            *first, trial.fault.rank,
            "{trial:?}: blamed {first}, not the stalled rank: {reason}"
        );
        assert!(reason.contains("made no progress"), "{trial:?}: {reason}");
    }
    for (rank, error) in &failed {
        if rank != first && !(trial.fault.kind == FaultKind::Exit && *rank == trial.fault.rank) {
            assert!(
                error.contains(&format!("global rank {first}")),
                "{trial:?}: rank {rank} does not name the first failed rank {first}: {error}"
            );
        }
    }
    let summary = outcome.summary.as_ref().expect("a summary");
    assert!(
        summary.starts_with(&format!("global rank {first} failed first")),
        "{trial:?}: {summary}"
    );
}

#[test]
fn fault_injection_never_hangs_and_always_names_the_first_failed_rank() {
    const TRIALS: usize = 120;
    let timeout = Duration::from_millis(800);
    let mut rng = SmallRng::seed_from_u64(2026);
    let started = Instant::now();
    let mut clean_runs = std::collections::HashMap::new();
    let mut tally = std::collections::BTreeMap::new();
    for index in 0..TRIALS {
        let cp = if rng.random_bool(0.5) { 2 } else { 4 };
        let all = strategies(cp);
        let strategy = all[rng.random_range(0..all.len())];
        let layout = layouts()[rng.random_range(0..3)];
        let path = if index % 3 == 0 {
            Path::Decorator
        } else {
            Path::Direct
        };
        let setup = base_setup(strategy, layout, &[21, 9, 14], 4, 2);
        let key = format!("{strategy} {layout} {cp} {path:?}");
        let clean = clean_runs.entry(key).or_insert_with(|| {
            let outcome = run_world(
                setups(cp, setup.clone()),
                path,
                Duration::from_secs(30),
                vec![],
                Duration::from_secs(60),
            );
            let want: Vec<Vec<f32>> = outcome.results.into_iter().map(Result::unwrap).collect();
            (want, outcome.calls)
        });
        let rank = rng.random_range(0..cp);
        let fault = Fault {
            rank,
            at_call: rng.random_range(0..clean.1[rank]),
            kind: fault_kind(&mut rng, timeout),
        };
        let trial = Trial {
            strategy,
            layout,
            cp,
            path,
            fault: fault.clone(),
        };
        let outcome = run_world(
            setups(cp, setup),
            path,
            timeout,
            vec![fault],
            Duration::from_secs(30),
        );
        check_trial(&trial, &outcome, &clean.0, timeout);
        let kind = format!("{:?}", trial.fault.kind);
        let kind = kind.split('(').next().unwrap_or_default().to_string();
        let entry = tally.entry(kind).or_insert((0, 0));
        entry.0 += 1;
        entry.1 += usize::from(outcome.results.iter().any(Result::is_err));
    }
    eprintln!(
        "{TRIALS} fault-injection trials in {:?}; (trials, trials with a failure) per fault: {tally:?}",
        started.elapsed()
    );
    // Every kind of fault was drawn, and the faults that always break the protocol did.
    assert_eq!(tally.len(), 6, "{tally:?}");
    for kind in ["Panic", "Error"] {
        assert_eq!(tally[kind].0, tally[kind].1, "{kind}: {tally:?}");
    }
}
