//! An MPI rank whose wait times out on a rank that is itself waiting names the rank at the end
//! of the chain — the one that made no progress — not the peer it waited for. Runs itself under
//! `mpirun -n 3` (OpenMPI, as CI installs it): rank 2 stops communicating (it sleeps past the
//! timeout without polling, as a stopped or hung process does), rank 1 waits for rank 2, rank 0
//! for rank 1.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::Duration;

use burn_dcp::comm::mpi::MpiWorld;
use burn_dcp::comm::{CommError, WorldConfig};

const TIMEOUT: Duration = Duration::from_secs(1);

/// One rank of the job: prints `RANK r: <its error>` (or `RANK r: ok`).
fn rank_main() {
    let world = MpiWorld::init(WorldConfig {
        timeout: TIMEOUT,
        ranks_per_node: None,
    })
    .expect("MPI initialises");
    let comm = world.comm();
    comm.barrier().expect("every rank arrives");
    let result: Result<(), CommError> = match world.rank() {
        // stalled: no message, no poll, for three timeouts
        2 => {
            std::thread::sleep(3 * TIMEOUT);
            Ok(())
        }
        // waits for rank 2, then for rank 1
        rank => comm.irecv(rank + 1).and_then(|r| r.wait()).map(|_| ()),
    };
    match result {
        Ok(()) => println!("RANK {}: ok", world.rank()),
        Err(error) => println!("RANK {}: {error}", world.rank()),
    }
}

#[test]
fn an_mpi_rank_waiting_on_a_waiting_rank_names_the_stalled_one() {
    if std::env::var_os("OMPI_COMM_WORLD_RANK").is_some() {
        return rank_main();
    }
    let exe = std::env::current_exe().unwrap();
    let output = Command::new("mpirun")
        .args(["--oversubscribe", "--allow-run-as-root", "-n", "3"])
        .arg(exe)
        .args([
            "--exact",
            "an_mpi_rank_waiting_on_a_waiting_rank_names_the_stalled_one",
            "--nocapture",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs (OpenMPI: Debian's openmpi-bin, as .ci/run installs it)");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{text}");
    let line = |rank: usize| -> String {
        let prefix = format!("RANK {rank}: ");
        text.lines()
            .find_map(|l| l.find(&prefix).map(|at| l[at + prefix.len()..].to_string()))
            .unwrap_or_else(|| panic!("no line of rank {rank}:\n{text}"))
    };
    // rank 0 waited for rank 1, which waited for rank 2: rank 2 is named first, as stalled
    let first = line(0);
    assert!(
        first.contains("global rank 2 failed (global rank 2 made no progress for 1s")
            && first.contains("it does not answer: the process is stopped or hung")
            && first.contains("global rank 0 timed out waiting for")
            && first.contains("from global rank 1"),
        "{first}"
    );
    // rank 1 waited for rank 2 itself: its timeout names rank 2
    let second = line(1);
    assert!(
        second.contains("waited 1s for") && second.contains("(global rank 2) and timed out"),
        "{second}"
    );
    assert_eq!(line(2), "ok");
}
