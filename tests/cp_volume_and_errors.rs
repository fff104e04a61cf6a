//! Bytes sent per rank against the analytic volume of each strategy; validation errors; a failing
//! rank makes its peers fail (no hang).

use crate::common;

use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dcp::comm::{CommError, InProcessWorld, Payload, WorldConfig};
use burn_dcp::diagnostics::harness::run_context_parallel;
use burn_dcp::diagnostics::volume::analytic_volume;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::{CpError, Layout, Placement, Strategy};
use common::*;

#[test]
fn bytes_sent_match_the_analytic_volume() {
    let device = Default::default();
    let strategies = [
        (Strategy::Ulysses, 4),
        (Strategy::Ring, 4),
        (Strategy::AllGather, 4),
        (USP_2X2, 4),
        (
            Strategy::Usp {
                ulysses_degree: 4,
                ring_degree: 2,
            },
            8,
        ),
    ];
    for (heads, kv_heads) in [(8, 8), (8, 2), (8, 1)] {
        let inputs = random_inputs(&[37, 5, 22], heads, kv_heads, 8, 11);
        for (strategy, cp) in strategies {
            for layout in layouts() {
                let report = run_context_parallel::<B>(
                    &device,
                    &inputs,
                    &spec(cp, strategy, layout, &MaskSpec::Causal),
                )
                .unwrap();
                let placement = Placement::of_layout(&inputs.seq_lens, cp, layout).unwrap();
                let shape = f32_volume_shape(heads, kv_heads, 8);
                let expected = analytic_volume(strategy, &placement, &shape);
                for (rank, expected) in expected.iter().enumerate() {
                    let what = format!("{strategy} {layout} H{heads} K{kv_heads} rank {rank}");
                    assert!(
                        report.bytes_forward[rank] > 0,
                        "{what}: no forward communication"
                    );
                    assert_eq!(
                        report.bytes_forward[rank], expected.forward,
                        "{what} forward"
                    );
                    assert_eq!(
                        report.bytes_backward[rank], expected.backward,
                        "{what} backward"
                    );
                }
            }
        }
    }
}

/// Ulysses exchanges q, k and v in one all-to-all (one message per peer, one latency), the output
/// and the LSE in one each, and in the backward q, k, v, out and dout in one, the LSE in one and
/// dq, dk, dv in one: 6 all-to-alls, 6 · (P − 1) messages per rank over a forward and backward
/// (bytes as the analytic volume, tested above).
#[test]
fn ulysses_sends_one_message_per_peer_per_exchange() {
    let device = Default::default();
    for (heads, kv_heads) in [(8, 8), (8, 2), (4, 1)] {
        let inputs = random_inputs(&[37, 5, 22], heads, kv_heads, 8, 11);
        let cp = 4;
        let report = run_context_parallel::<B>(
            &device,
            &inputs,
            &spec(cp, Strategy::Ulysses, Layout::Zigzag, &MaskSpec::Causal),
        )
        .unwrap();
        for (rank, stats) in report.stats.iter().enumerate() {
            assert_eq!(
                stats.messages,
                6 * (cp as u64 - 1),
                "H{heads} K{kv_heads} rank {rank}: {stats:?}"
            );
        }
    }
}

fn config_error(result: Result<impl std::fmt::Debug, CpError>) -> String {
    match result {
        Err(error) => error.to_string(),
        Ok(value) => panic!("expected an error, got {value:?}"),
    }
}

#[test]
fn invalid_configurations_are_rejected_with_the_rule() {
    let device = Default::default();
    let inputs = random_inputs(&[8, 4], 6, 2, 8, 1);
    let run = |cp, strategy| {
        run_context_parallel::<B>(
            &device,
            &inputs,
            &spec(cp, strategy, Layout::Zigzag, &MaskSpec::Causal),
        )
        .map(|_| ())
    };
    let err = config_error(run(
        4,
        Strategy::Usp {
            ulysses_degree: 2,
            ring_degree: 3,
        },
    ));
    assert!(
        err.contains("ulysses_degree 2 × ring_degree 3 = 6 does not equal the cp size 4"),
        "{err}"
    );
    let err = config_error(run(4, Strategy::Ulysses));
    assert!(
        err.contains("the ulysses degree 4 must divide the 6 query heads"),
        "{err}"
    );
    let err = config_error(Strategy::parse("usp", None, 4));
    assert!(err.contains("needs the ulysses degree"), "{err}");
    let err = config_error(Strategy::parse("usp", Some(3), 4));
    assert!(
        err.contains("cp size 4 is not divisible by ulysses degree 3"),
        "{err}"
    );
    let err = config_error(Strategy::parse("ring", Some(2), 4));
    assert!(err.contains("only applies to strategy usp"), "{err}");
    let err = config_error(Strategy::parse("a2a+p2p", None, 4));
    assert!(err.contains("unknown strategy 'a2a+p2p'"), "{err}");
    let err = config_error("diagonal".parse::<Layout>());
    assert!(err.contains("unknown layout 'diagonal'"), "{err}");

    let gqa = random_inputs(&[8, 4], 6, 4, 8, 1);
    let err = config_error(run_context_parallel::<B>(
        &device,
        &gqa,
        &spec(2, Strategy::Ring, Layout::Zigzag, &MaskSpec::Causal),
    ));
    assert!(err.contains("kv heads 4 must divide q heads 6"), "{err}");

    let mut short = random_inputs(&[8, 4], 4, 2, 8, 1);
    short.q.pop();
    let err = config_error(run_context_parallel::<B>(
        &device,
        &short,
        &spec(2, Strategy::Ring, Layout::Zigzag, &MaskSpec::Causal),
    ));
    assert!(err.contains("q holds"), "{err}");

    let err = burn_dcp::kernels::validate_cu_seqlens(&[0, 5, 3, 12], 12)
        .unwrap_err()
        .to_string();
    assert!(err.contains("non-decreasing"), "{err}");
    let err = burn_dcp::kernels::validate_cu_seqlens(&[0, 5, 11], 12)
        .unwrap_err()
        .to_string();
    assert!(err.contains("must end at the token count 12"), "{err}");

    let masks = vec![MaskSpec::Causal; 3];
    let mut bad = spec(2, Strategy::Ring, Layout::Zigzag, &MaskSpec::Causal);
    bad.masks = masks;
    let err = config_error(
        run_context_parallel::<B>(&device, &random_inputs(&[8, 4], 4, 2, 8, 1), &bad).map(|_| ()),
    );
    assert!(err.contains("3 masks for 2 sequences"), "{err}");
}

#[test]
fn a_world_of_the_wrong_size_is_rejected() {
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    let results = world.run(|comm| {
        let placement = Placement::of_layout(&[8], 4, Layout::Contiguous)?;
        let group = burn_dcp::CpGroup::new(comm, Strategy::Ring)?;
        let batch = burn_dcp::CpBatch::new(placement, vec![MaskSpec::Causal]);
        let device = Default::default();
        let q = burn::tensor::Tensor::<B, 3>::zeros([2, 2, 4], &device);
        burn_dcp::cp_attention_forward(&group, &batch, q.clone(), q.clone(), q).map(|_| ())
    });
    for result in results {
        let err = result.unwrap_err();
        assert!(
            err.contains("sharded over 4 ranks but the CP group has 2"),
            "{err}"
        );
    }
}

#[test]
fn a_failing_rank_makes_its_peers_fail_instead_of_hanging() {
    let timeout = Duration::from_secs(20);
    let world = world_with_timeout(4, timeout);
    let started = Instant::now();
    let results = world.run(|comm| -> Result<(), CommError> {
        if comm.rank() == 2 {
            panic!("simulated failure on rank 2");
        }
        // Rank 2 never joins: the others would wait forever without failure propagation.
        comm.all_gather(TensorData::new(vec![1.0f32; 4], [4]).into())?;
        Ok(())
    });
    assert!(
        started.elapsed() < timeout,
        "peers waited for the timeout instead of the failure"
    );
    for (rank, result) in results.iter().enumerate() {
        let err = result.as_ref().unwrap_err();
        if rank == 2 {
            assert!(err.contains("simulated failure"), "{err}");
        } else {
            assert!(err.contains("global rank 2 failed"), "rank {rank}: {err}");
        }
    }
}

#[test]
fn an_erroring_rank_fails_pending_receives_of_its_peers() {
    let world = world_with_timeout(3, Duration::from_secs(20));
    let started = Instant::now();
    let results = world.run(|comm| -> Result<(), String> {
        match comm.rank() {
            0 => Err("bad batch on rank 0".into()),
            rank => {
                let pending = comm.irecv(0).map_err(|e| e.to_string())?;
                std::thread::sleep(Duration::from_millis(50 * rank as u64));
                pending.wait().map(|_| ()).map_err(|e| e.to_string())
            }
        }
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(results[1]
        .as_ref()
        .unwrap_err()
        .contains("global rank 0 failed"));
    assert!(results[2]
        .as_ref()
        .unwrap_err()
        .contains("bad batch on rank 0"));
}

#[test]
fn a_missing_peer_times_out_with_an_error_naming_it() {
    let world = world_with_timeout(2, Duration::from_millis(200));
    let comms = world.communicators();
    let err = comms[0].irecv(1).unwrap().wait().unwrap_err().to_string();
    assert!(
        err.contains("from peer rank 1") && err.contains("timed out"),
        "{err}"
    );
}

/// A payload of `values`: host bytes, or a Flex tensor kept on its device.
fn payload(values: Vec<f32>, on_device: bool) -> Payload {
    let n = values.len();
    let data = TensorData::new(values, [n]);
    match on_device {
        true => Payload::device(Tensor::<Flex, 1>::from_data(data, &Default::default())),
        false => data.into(),
    }
}

fn values(payload: &Payload) -> Vec<f32> {
    payload
        .clone()
        .into_host()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// Every collective gives the right values, from host bytes and from device tensors alike; the
/// in-process world hands device tensors over as they are (never through the host).
fn check_collectives(on_device: bool) {
    let world = InProcessWorld::new(3, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<_, CommError> {
        let r = comm.rank() as f32;
        let reduced = comm.all_reduce(payload(vec![r, 2.0 * r, 1.0, 5.0, r], on_device))?;
        let parts = (0..3)
            .map(|p| payload(vec![r * 10.0 + p as f32], on_device))
            .collect();
        let scattered = comm.reduce_scatter(parts)?;
        let swapped = comm.all_to_all(
            (0..3)
                .map(|p| payload(vec![r, p as f32], on_device))
                .collect(),
        )?;
        let sub = comm.split(comm.rank() % 2, comm.rank())?;
        let gathered = sub.all_gather(payload(vec![r], on_device))?;
        let peer = (comm.rank() + 1) % 3;
        let from = (comm.rank() + 2) % 3;
        let pending = comm.irecv(from)?;
        let sent = comm.isend(peer, payload(vec![r; 2], on_device))?;
        let received = pending.wait()?;
        sent.wait()?;
        comm.barrier()?;
        Ok((reduced, scattered, swapped, gathered, received))
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (reduced, scattered, swapped, gathered, received) = result.unwrap();
        let all = [&reduced, &scattered, &received]
            .into_iter()
            .chain(&swapped)
            .chain(&gathered);
        for payload in all {
            assert_eq!(payload.is_device(), on_device, "{payload:?}");
        }
        assert_eq!(values(&reduced), vec![3.0, 6.0, 3.0, 15.0, 3.0]);
        assert_eq!(reduced.shape(), vec![5]);
        assert_eq!(values(&scattered), vec![30.0 + 3.0 * rank as f32]);
        for (p, data) in swapped.iter().enumerate() {
            assert_eq!(values(data), vec![p as f32, rank as f32]);
        }
        let members: Vec<f32> = gathered.iter().map(|d| values(d)[0]).collect();
        assert_eq!(
            members,
            if rank % 2 == 0 {
                vec![0.0, 2.0]
            } else {
                vec![1.0]
            }
        );
        assert_eq!(values(&received), vec![((rank + 2) % 3) as f32; 2]);
    }
}

#[test]
fn collectives_compute_the_right_values() {
    check_collectives(false);
}

#[test]
fn collectives_move_device_tensors_without_host_copies() {
    check_collectives(true);
}

/// wgpu gives every thread its own stream and memory pool: tensors handed between rank threads
/// must stay correct while both sides keep allocating (the receiver copies them into its own
/// memory and drains its queue before letting the sender's buffer go). Without that, buffers were
/// reused under pending reads and some ranks summed wrong values.
#[cfg(feature = "wgpu")]
#[test]
fn device_payloads_stay_correct_across_wgpu_threads() {
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    let (ranks, n, rounds) = (4usize, 3000usize, 40usize);
    let world = InProcessWorld::new(ranks, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<_, CommError> {
        let device = WgpuDevice::default();
        let mut sums = Vec::new();
        for round in 0..rounds {
            let fill = |rank: usize| (round * 7 + rank * 3) as f32;
            let mine = Tensor::<Wgpu, 1>::full([n], fill(comm.rank()), &device);
            // Busy work on this thread's stream, allocating and dropping while messages fly.
            let noise = Tensor::<Wgpu, 1>::full([n], 1.0, &device) * 3.0 + 1.0;
            let reduced = comm.all_reduce(Payload::device(mine))?;
            let reduced = reduced.into_tensor::<Wgpu, 1>(&device).unwrap();
            let scratch = (noise.clone() * 2.0).exp();
            let want: f32 = (0..ranks).map(fill).sum();
            sums.push((reduced.into_data().to_vec::<f32>().unwrap(), want));
            drop((noise, scratch));
        }
        Ok(sums)
    });
    for (rank, result) in results.into_iter().enumerate() {
        for (round, (got, want)) in result.unwrap().into_iter().enumerate() {
            let wrong = got.iter().filter(|&&v| v != want).count();
            assert_eq!(
                wrong, 0,
                "rank {rank} round {round}: {wrong} of {n} elements are not {want}"
            );
        }
    }
}

#[test]
fn emulated_links_delay_messages_by_latency_and_bandwidth_and_keep_the_bytes() {
    use burn_dcp::comm::LinkEmulation;
    // 4 ranks on 2 nodes: 100 kB/s between nodes (shared by a node's ranks), 10 MB/s inside.
    let world = InProcessWorld::new(
        4,
        WorldConfig {
            ranks_per_node: Some(2),
            ..WorldConfig::default()
        },
    )
    .unwrap();
    let plain = InProcessWorld::new(4, WorldConfig::default()).unwrap();
    world
        .emulate_links(LinkEmulation {
            intra_node_bandwidth: 1e7,
            inter_node_bandwidth: 1e5,
            intra_node_latency: Duration::from_millis(1),
            inter_node_latency: Duration::from_millis(20),
        })
        .unwrap();
    // Measured from one instant before any rank starts, so that a late thread cannot hide the
    // wait.
    let started = Instant::now();
    let exchange = |comm: burn_dcp::comm::Comm| -> Result<Duration, CommError> {
        // Ranks 0 and 1 (node 0) each send 4 kB to ranks 2 and 3 (node 1): 8 kB through node
        // 0's inter-node link, 80 ms, + 20 ms latency; the last arrives after ~100 ms.
        let data = || Payload::from(TensorData::new(vec![0u8; 4000], [4000]));
        match comm.rank() {
            0 | 1 => {
                comm.isend(comm.rank() + 2, data())?.wait()?;
            }
            _ => {
                comm.irecv(comm.rank() - 2)?.wait()?;
            }
        }
        Ok(started.elapsed())
    };
    let times: Vec<Duration> = world
        .run(exchange)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let slowest = times[2].max(times[3]);
    assert!(
        slowest >= Duration::from_millis(95),
        "the second message shares node 0's link: {times:?}"
    );
    assert!(slowest < Duration::from_secs(5), "{times:?}");
    plain.run(exchange).into_iter().for_each(|r| {
        r.unwrap();
    });
    let bytes = |w: &InProcessWorld| w.stats().iter().map(|s| s.total_bytes()).sum::<u64>();
    assert_eq!(bytes(&world), bytes(&plain), "emulation changes no byte");
    let bad = LinkEmulation {
        inter_node_bandwidth: 0.0,
        ..LinkEmulation::of_topology(
            &burn_dcp::planner::topology::Topology::preset("a100-p4d", 2).unwrap(),
            1.0,
        )
        .unwrap()
    };
    let error = world.emulate_links(bad).unwrap_err().to_string();
    assert!(error.contains("inter-node bandwidth"), "{error}");
}

/// While a world's ranks run as threads, the portable kernels count them, so their default
/// threads per call share the process's cores (other tests' worlds may run beside this one).
#[test]
fn running_ranks_share_the_cores() {
    use burn_dcp::kernels::portable::RankThreads;
    let world = InProcessWorld::new(3, WorldConfig::default()).unwrap();
    let seen = world.run(|_| Ok::<_, CpError>(RankThreads::current()));
    for count in seen {
        assert!(count.unwrap() >= 3);
    }
}
