//! Checkpoints on the command line: they never move backwards, and runs killed at random moments
//! (threads, mpirun) or a custom model's run resume to the same losses.

use super::*;

#[test]
fn gpt_longctx_checkpoints_never_move_backwards() {
    let dir = temp_dir("resume");
    let path = dir.to_str().unwrap();
    let args = gpt(&["--steps", "2", "--out", path]);
    succeeded(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let state = std::fs::read_to_string(dir.join("checkpoint/state.json")).unwrap();
    refused(
        "gpt_longctx",
        &["--resume", path, "--steps", "1"],
        "never moves backwards",
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("checkpoint/state.json")).unwrap(),
        state
    );
    // Equal: nothing to train, nothing written.
    let before = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let out = succeeded("gpt_longctx", &["--resume", path, "--steps", "2"]);
    assert!(out.contains("0 steps"), "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap(),
        before
    );
    // A second run into the same --out is refused (it would reset the checkpoint to step 1).
    let args = gpt(&["--steps", "1", "--out", path]);
    refused(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "already holds a run",
    );
    // config.json edited to another model size.
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"tiny\"", "\"small\""),
    )
    .unwrap();
    refused(
        "gpt_longctx",
        &["--resume", path, "--steps", "3"],
        "d_model: checkpoint 64, configuration 128",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The losses of a run directory's `metrics.jsonl`, by step.
fn metrics_losses(dir: &std::path::Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let step: serde_json::Value = serde_json::from_str(line).unwrap();
            (step["step"].as_u64().unwrap(), step["loss"].to_string())
        })
        .collect()
}

/// `--checkpoint-every 1`: a run killed with SIGKILL at random moments (seeded; over its whole
/// length, so during steps, plans and checkpoint writes) and resumed each time from its latest
/// complete checkpoint — started afresh when none was written yet — ends with the uninterrupted
/// run's losses, step for step, bit for bit; the kept checkpoints are complete.
#[test]
fn a_run_killed_at_random_moments_resumes_to_the_same_losses() {
    killed_and_resumed(&[], "killed", 24);
}

/// The same under `mpirun -n 2` (one process per rank; the whole job killed: `mpirun`, then
/// every rank), with checkpoint shards in chunks of 2 KiB. Skipped, saying so,
/// where `mpirun` is missing (CI installs OpenMPI).
#[test]
fn a_job_killed_under_mpirun_resumes_to_the_same_losses() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("mpirun not found: the MPI kill test did not run");
        return;
    }
    let mpirun = [
        "mpirun",
        "--oversubscribe",
        "--allow-run-as-root",
        "-n",
        "2",
    ];
    // More steps: each launch also starts MPI, and a kill is drawn over the whole run.
    killed_and_resumed(&mpirun, "killed-mpi", 64);
}

/// OpenMPI starts each rank in a process group of its own: SIGKILL every process whose command
/// line names `dir` (this run's ranks), and wait until none is left.
fn kill_ranks(dir: &std::path::Path) {
    let pattern = dir.to_str().unwrap();
    for _ in 0..100 {
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", pattern])
            .status();
        let left = Command::new("pgrep")
            .args(["-f", pattern])
            .output()
            .expect("pgrep (procps) finds mpirun's ranks");
        if left.stdout.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("ranks of {pattern} still running after SIGKILL");
}

/// Runs gpt_longctx (under `launcher`, or alone), kills it at random moments, resumes it, and
/// checks the losses against an uninterrupted run.
fn killed_and_resumed(launcher: &[&str], name: &str, steps: u64) {
    let command = |args: &[String]| {
        let mut command = match launcher.split_first() {
            None => Command::new(example("gpt_longctx")),
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(example("gpt_longctx"));
                command
            }
        };
        command.args(args);
        // Its own process group: a kill reaches mpirun's ranks too.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command
    };
    let chunks = ["--checkpoint-chunk-bytes", "2048"];
    let steps_flag = steps.to_string();
    let flags = [
        "--cp",
        "2",
        "--steps",
        &steps_flag,
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
    ];
    let base = gpt(&flags);
    let with = |extra: &[&str]| -> Vec<String> {
        let mut args = base.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        if !launcher.is_empty() {
            args.extend(chunks.iter().map(|s| s.to_string()));
        }
        args
    };
    let reference = temp_dir(&format!("{name}-reference"));
    let started = std::time::Instant::now();
    let output = command(&with(&["--out", reference.to_str().unwrap()]))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let length = started.elapsed();
    let want = metrics_losses(&reference);
    assert_eq!(want.len(), steps as usize);
    let dir = temp_dir(name);
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let (mut attempts, mut killed_runs) = (0, 0);
    loop {
        let saved = ["checkpoint", "checkpoint.old"]
            .iter()
            .find_map(|name| std::fs::read_to_string(dir.join(name).join("state.json")).ok())
            .map(|text| {
                serde_json::from_str::<serde_json::Value>(&text).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            });
        let resumable = saved.is_some();
        let args = match resumable {
            true => with(&["--resume", dir.to_str().unwrap()]),
            false => {
                let _ = std::fs::remove_dir_all(&dir);
                with(&["--out", dir.to_str().unwrap()])
            }
        };
        let mut child = command(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Five runs killed, each at a moment drawn over what it has left to run.
        if killed_runs < 5 && attempts < 40 {
            attempts += 1;
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let fraction = (seed >> 11) as f64 / (1u64 << 53) as f64;
            let left = (steps - saved.unwrap_or(0)) as f64 / steps as f64;
            std::thread::sleep(length.mul_f64(fraction * left));
            if child.try_wait().unwrap().is_none() {
                // SIGKILL to the whole process group.
                let group = format!("-{}", child.id());
                let killed = Command::new("kill").args(["-KILL", "--", &group]).status();
                assert!(killed.unwrap().success(), "kill -KILL {group}");
                child.wait().unwrap();
                if !launcher.is_empty() {
                    kill_ranks(&dir);
                }
                killed_runs += 1;
                continue;
            }
        }
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
        if dir.join("checkpoint/state.json").exists()
            && metrics_losses(&dir).len() == steps as usize
        {
            // Every chain of kills and resumes that reaches the end has the same losses.
            assert_eq!(metrics_losses(&dir), want, "after {killed_runs} kills");
            // A run can finish before its kill moment (the reference run's length was measured
            // beside other tests, so a later run may be faster): then a fresh chain starts,
            // until enough runs were killed.
            if killed_runs >= 5 || attempts >= 40 {
                break;
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
    eprintln!("{killed_runs} runs killed in {attempts} attempts");
    assert!(
        killed_runs >= 3,
        "only {killed_runs} runs killed mid-way in {attempts} attempts"
    );
    // The checkpoint and the one archived beside it: the last two steps.
    let archived = format!("checkpoint-{:08}", steps - 1);
    for (name, step) in [("checkpoint", steps), (archived.as_str(), steps - 1)] {
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(name).join("state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(state["step"], step, "{name}");
        assert!(dir.join(name).join("model.mpk").exists());
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&reference).ok();
}

/// custom_model checkpoints (`--out`, `--checkpoint-every`) and resumes (`--resume`): a run of 2
/// steps resumed to 4 gives the uninterrupted run's losses bit for bit; a resume whose flags give
/// another model is refused naming the difference.
#[test]
fn custom_model_checkpoints_and_resumes_exactly() {
    let base = words("--corpus builtin --seq-len 64 --cp 2 --d-model 32 --heads 4");
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        succeeded("custom_model", &args)
    };
    let whole = temp_dir("custom-whole");
    run(&["--steps", "4", "--out", whole.to_str().unwrap()]);
    let parts = temp_dir("custom-parts");
    run(&[
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--out",
        parts.to_str().unwrap(),
    ]);
    assert!(parts.join("checkpoint/state.json").exists());
    run(&["--steps", "4", "--resume", parts.to_str().unwrap()]);
    assert_eq!(metrics_losses(&parts), metrics_losses(&whole));
    assert_eq!(metrics_losses(&whole).len(), 4);
    let wider: Vec<&str> = base
        .iter()
        .copied()
        .map(|flag| if flag == "32" { "48" } else { flag })
        .chain(["--steps", "5", "--resume", parts.to_str().unwrap()])
        .collect();
    let output = Command::new(example("custom_model"))
        .args(&wider)
        .output()
        .unwrap();
    let text = stderr(&output);
    assert!(
        !output.status.success() && text.contains("holds a different model"),
        "{text}"
    );
    std::fs::remove_dir_all(&whole).ok();
    std::fs::remove_dir_all(&parts).ok();
}
