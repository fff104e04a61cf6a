//! The TCP world (torchrun-style launch): ranks are threads here, each with its own `TcpWorld`
//! connected over localhost sockets exactly as separate processes would be. The processes'
//! version (loss parity of `gpt_longctx`, a SIGKILLed rank) is `scripts/check_mpi.py --launcher
//! tcp` and `scripts/check_mpi_fault.py --launcher tcp`.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_dcp::comm::{
    Comm, CommError, CommStats, InProcessWorld, Payload, Rendezvous, TcpWorld, WorldConfig,
};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(timeout: Duration) -> WorldConfig {
    WorldConfig {
        timeout,
        ranks_per_node: None,
    }
}

/// Two ranks per node when the size allows (bytes are counted by link class).
fn config_of(size: usize, timeout: Duration) -> WorldConfig {
    WorldConfig {
        timeout,
        ranks_per_node: size.is_multiple_of(2).then_some(2),
    }
}

fn rendezvous(port: u16, rank: usize, world_size: usize) -> Rendezvous {
    Rendezvous {
        master_addr: "127.0.0.1".into(),
        master_port: port,
        rank,
        world_size,
        local_rank: rank % 2,
    }
}

/// Runs `task` on every rank of a TCP world of `size` (one thread per rank, each with its own
/// world), returning each rank's result.
fn run_tcp<T: Send>(
    size: usize,
    timeout: Duration,
    task: impl Fn(Comm) -> Result<T, CommError> + Sync,
) -> Vec<Result<T, CommError>> {
    let port = free_port();
    let task = &task;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                scope.spawn(move || {
                    let config = config_of(size, timeout);
                    let world = TcpWorld::connect(&rendezvous(port, rank, size), config)?;
                    assert_eq!((world.rank(), world.size()), (rank, size));
                    assert_eq!(world.local_rank(), rank % 2);
                    task(world.comm())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn floats(data: &Payload) -> Vec<f32> {
    data.clone().into_host().unwrap().to_vec::<f32>().unwrap()
}

/// One of every operation: the values each rank ends with, and its byte counts.
fn every_operation(comm: Comm) -> Result<(Vec<Vec<f32>>, CommStats), CommError> {
    let (rank, size) = (comm.rank(), comm.size());
    let values = |salt: usize, len: usize| -> Payload {
        let v: Vec<f32> = (0..len)
            .map(|i| ((rank * 31 + salt * 7 + i) as f32 * 0.37).sin())
            .collect();
        TensorData::new(v, [len]).into()
    };
    let mut seen = Vec::new();
    let parts = (0..size).map(|p| values(p, 5 + p)).collect();
    seen.extend(comm.all_to_all(parts)?.iter().map(floats));
    seen.extend(comm.all_gather(values(9, 4))?.iter().map(floats));
    let parts = (0..size).map(|p| values(p, 6)).collect();
    seen.push(floats(&comm.reduce_scatter(parts)?));
    seen.push(floats(&comm.all_reduce(values(3, 1001))?));
    // A ring step: post the receive, send, then wait — also out of posting order.
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let first = comm.irecv(prev)?;
    let second = comm.irecv(prev)?;
    let sent = [
        comm.isend(next, values(11, 3))?,
        comm.isend(next, values(12, 2))?,
    ];
    seen.push(floats(&second.wait()?));
    seen.push(floats(&first.wait()?));
    for send in sent {
        send.wait()?;
    }
    comm.barrier()?;
    let sub = comm.split_labeled(rank % 2, size - rank, "cp")?;
    seen.push(vec![sub.rank() as f32, sub.size() as f32]);
    seen.push(floats(&sub.all_reduce(values(5, 17))?));
    let control = comm.all_gather_control("test", vec![rank as u8; rank + 1])?;
    seen.push(control.concat().into_iter().map(f32::from).collect());
    Ok((seen, comm.stats()))
}

#[test]
fn every_operation_matches_the_in_process_world() {
    for size in [1, 2, 3, 4] {
        let tcp = run_tcp(size, Duration::from_secs(30), every_operation);
        let world = InProcessWorld::new(size, config_of(size, Duration::from_secs(30))).unwrap();
        let threads = world.run(every_operation);
        for (rank, (tcp, threads)) in tcp.into_iter().zip(threads).enumerate() {
            let (tcp_values, tcp_stats) = tcp.unwrap();
            let (values, stats) = threads.unwrap();
            assert_eq!(tcp_values, values, "size {size} rank {rank}");
            assert_eq!(tcp_stats, stats, "size {size} rank {rank}");
            assert!(stats.total_bytes() > 0 || size == 1);
        }
    }
}

/// Both ranks send 16 MiB to each other before either receives: the reader threads take the
/// data in, so neither send waits on the other's receive.
#[test]
fn large_crossing_sends_do_not_deadlock() {
    let results = run_tcp(2, Duration::from_secs(60), |comm| {
        let peer = 1 - comm.rank();
        let len = 4 << 20;
        let data: Vec<f32> = (0..len).map(|i| (i + comm.rank()) as f32).collect();
        let sent = comm.isend(peer, TensorData::new(data, [len]).into())?;
        sent.wait()?;
        let received = floats(&comm.irecv(peer)?.wait()?);
        Ok((received.len(), received[0], received[len - 1]))
    });
    let len = 4 << 20;
    assert_eq!(results[0].as_ref().unwrap(), &(len, 1.0, len as f32));
    assert_eq!(results[1].as_ref().unwrap(), &(len, 0.0, (len - 1) as f32));
}

#[test]
fn a_failed_rank_fails_its_peers_naming_it() {
    let results = run_tcp(3, Duration::from_secs(30), |comm| {
        if comm.rank() == 2 {
            comm.abort("injected: rank 2 gives up");
            return Ok(());
        }
        comm.all_reduce(TensorData::new(vec![1.0f32; 8], [8]).into())
            .map(|_| ())
    });
    assert!(results[2].is_ok());
    for result in &results[..2] {
        assert_peer_failed(result, 2, "rank 2 gives up");
    }
}

/// `result` is a `PeerFailed` naming global rank `failed` with a reason containing `reason`.
fn assert_peer_failed(result: &Result<(), CommError>, failed: usize, reason: &str) {
    match result {
        Err(CommError::PeerFailed {
            failed_global,
            reason: given,
            ..
        }) => {
            assert_eq!(*failed_global, failed);
            assert!(given.contains(reason), "{given}");
        }
        other => panic!("expected PeerFailed naming rank {failed}, got {other:?}"),
    }
}

/// A rank whose task returns early (its world dropped: goodbye, links closed) makes a peer that
/// waits on it fail at once, naming it — not at the timeout.
#[test]
fn a_rank_that_leaves_early_is_named_at_once() {
    let started = Instant::now();
    let results = run_tcp(2, Duration::from_secs(60), |comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.irecv(1)?.wait().map(|_| ())
    });
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_peer_failed(&results[0], 1, "left the job");
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let results = run_tcp(2, Duration::from_millis(500), |comm| {
        if comm.rank() == 1 {
            // Alive but never sends: rank 0 times out first.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        comm.irecv(1)?.wait().map(|_| ())
    });
    match &results[0] {
        Err(CommError::Timeout {
            peer, peer_global, ..
        }) => assert_eq!((*peer, *peer_global), (1, 1)),
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
}

#[test]
fn ranks_that_call_different_operations_get_a_protocol_error() {
    let results = run_tcp(2, Duration::from_secs(10), |comm| {
        let data: Payload = TensorData::new(vec![1.0f32; 4], [4]).into();
        match comm.rank() {
            0 => comm.all_gather(data).map(|_| ()),
            _ => comm.all_to_all(vec![data.clone(), data]).map(|_| ()),
        }
    });
    for result in results {
        match result {
            Err(CommError::Protocol { message, .. }) => {
                assert!(message.contains("different operations"), "{message}")
            }
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }
}

fn connect_errors(ranks: &[(usize, usize)], timeout: Duration) -> Vec<Result<(), CommError>> {
    let port = free_port();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&(rank, size)| {
                scope.spawn(move || {
                    TcpWorld::connect(&rendezvous(port, rank, size), config(timeout)).map(|_| ())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn message(result: &Result<(), CommError>) -> String {
    result
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

#[test]
fn rendezvous_rejects_a_wrong_world_size() {
    let results = connect_errors(&[(0, 2), (1, 3)], Duration::from_secs(10));
    let rank0 = message(&results[0]);
    assert!(
        rank0.contains("rank 1 was started with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2"),
        "{rank0}"
    );
    let rank1 = message(&results[1]);
    assert!(rank1.contains("WORLD_SIZE=3"), "{rank1}");
}

#[test]
fn rendezvous_rejects_a_duplicate_rank() {
    let results = connect_errors(&[(0, 3), (1, 3), (1, 3)], Duration::from_secs(5));
    let rank0 = message(&results[0]);
    assert!(
        rank0.contains("two processes were started with RANK=1"),
        "{rank0}"
    );
    assert!(results.iter().all(Result::is_err), "{results:?}");
}

#[test]
fn rendezvous_names_missing_ranks_at_the_timeout() {
    let results = connect_errors(&[(0, 4), (2, 4)], Duration::from_millis(700));
    let rank0 = message(&results[0]);
    assert!(rank0.contains("ranks [1, 3] had not connected"), "{rank0}");
    assert!(results[1].is_err());
}

#[test]
fn environment_is_read_with_torchrun_names() {
    let vars = |pairs: &[(&str, &str)]| {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    };
    assert_eq!(Rendezvous::from_vars(vars(&[])), Ok(None));
    let full = [
        ("MASTER_ADDR", "node1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
    ];
    assert_eq!(
        Rendezvous::from_vars(vars(&full)),
        Ok(Some(Rendezvous {
            master_addr: "node1".into(),
            master_port: 29500,
            rank: 3,
            world_size: 8,
            local_rank: 1,
        }))
    );
    let error = |pairs: &[(&str, &str)]| Rendezvous::from_vars(vars(pairs)).unwrap_err();
    assert!(error(&full[1..]).contains("MASTER_ADDR is not set"));
    let mut bad = full;
    bad[2] = ("RANK", "8");
    assert!(error(&bad).contains("RANK=8 is not a rank of a world of WORLD_SIZE=8"));
    bad = full;
    bad[1] = ("MASTER_PORT", "0");
    assert!(error(&bad).contains("MASTER_PORT=0"));
    bad[1] = ("MASTER_PORT", "http");
    assert!(error(&bad).contains("MASTER_PORT=\"http\" is not a port number"));
    bad = full;
    bad[4] = ("LOCAL_RANK", "-1");
    assert!(error(&bad).contains("LOCAL_RANK=\"-1\""));
    bad = full;
    bad[3] = ("WORLD_SIZE", "0");
    assert!(error(&bad).contains("WORLD_SIZE=0"));
}
