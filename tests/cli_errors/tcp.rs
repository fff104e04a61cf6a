//! gpt_longctx as TCP processes (torchrun's variables): the threads' losses and bytes, the launch
//! variables checked, a missing rank failing the start on every rank.

use super::*;

/// Starts `name args` as the ranks `ranks` of a TCP launch of `world_size` processes
/// (torchrun's variables, as `scripts/launch_tcp.py` sets them) and returns each one's output.
fn launch_tcp(name: &str, args: &[String], ranks: &[usize], world_size: usize) -> Vec<Output> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = ranks
        .iter()
        .map(|rank| {
            Command::new(example(name))
                .args(args)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|child| child.wait_with_output().unwrap())
        .collect()
}

#[test]
fn gpt_longctx_as_tcp_processes_gives_the_threads_losses_and_bytes() {
    for extra in [
        vec!["--cp", "2", "--dp", "2"],
        vec!["--cp", "4", "--strategy", "usp", "--ulysses-degree", "2"],
    ] {
        let mut extra = extra;
        extra.extend(["--steps", "2", "--json"]);
        let args = gpt(&extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let threads: serde_json::Value =
            serde_json::from_str(&succeeded("gpt_longctx", &refs)).unwrap();
        let outputs = launch_tcp("gpt_longctx", &args, &[0, 1, 2, 3], 4);
        for (rank, output) in outputs.iter().enumerate() {
            assert!(output.status.success(), "rank {rank}: {}", stderr(output));
            if rank > 0 {
                assert!(output.stdout.is_empty(), "rank {rank} printed a report");
            }
        }
        let tcp: serde_json::Value = serde_json::from_slice(&outputs[0].stdout).unwrap();
        assert_eq!(tcp["losses"], threads["losses"], "{extra:?}");
        assert_eq!(tcp["bytes_by_axis"], threads["bytes_by_axis"], "{extra:?}");
        assert!(
            stderr(&outputs[0]).contains("4 TCP processes"),
            "{}",
            stderr(&outputs[0])
        );
    }
}

#[test]
fn tcp_launch_variables_are_checked() {
    let args = gpt(&["--steps", "1", "--cp", "2"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let with_env = |env: &[(&str, &str)]| {
        let mut command = Command::new(example("gpt_longctx"));
        command.args(&refs);
        for (key, value) in env {
            command.env(key, value);
        }
        command.output().unwrap()
    };
    let cases: [(&[(&str, &str)], &str); 3] = [
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2")],
            "MASTER_ADDR is not set",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29511"),
            ],
            "WORLD_SIZE=3 but the configuration needs 2 ranks",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "99999"),
            ],
            "MASTER_PORT=\"99999\" is not a port number",
        ),
    ];
    for (env, expected) in cases {
        let output = with_env(env);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{env:?}: {text}");
        assert!(!text.contains("panicked"), "{env:?}: {text}");
        assert!(
            text.contains(expected),
            "{env:?}: expected '{expected}' in {text}"
        );
    }
}

/// Ranks 2 and 3 of 4 never start: ranks 0 and 1 both exit non-zero, each printing why, within
/// the timeout.
#[test]
fn a_missing_tcp_rank_fails_the_start_on_every_rank() {
    let args = gpt(&["--steps", "1", "--cp", "4", "--timeout-secs", "2"]);
    let started = std::time::Instant::now();
    let outputs = launch_tcp("gpt_longctx", &args, &[0, 1], 4);
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    let rank0 = stderr(&outputs[0]);
    assert_eq!(outputs[0].status.code(), Some(2), "{rank0}");
    assert!(rank0.contains("ranks [2, 3] had not connected"), "{rank0}");
    let rank1 = stderr(&outputs[1]);
    assert_eq!(outputs[1].status.code(), Some(2), "{rank1}");
    assert!(rank1.contains("rank 1 of the TCP launch"), "{rank1}");
    assert!(rank1.contains("ranks [2, 3] had not connected"), "{rank1}");
}
