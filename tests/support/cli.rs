//! What the command-line tests share: finding a program of the workspace, running it, and
//! checking that a bad input is a one-line error (exit 2, no panic). Included by
//! `tests/cli_errors.rs` (the examples) and `tools/tests/cli.rs` (the tools).

use std::path::PathBuf;
use std::process::{Command, Output};

/// The program `name`, built by `cargo test --workspace` next to this test's executable:
/// `target/<profile>/examples/NAME` (the root package's examples) or `target/<profile>/NAME`
/// (burn-dcp-tools' binaries).
pub fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let profile = deps.parent().unwrap().parent().unwrap();
    let found = [profile.join("examples").join(name), profile.join(name)]
        .into_iter()
        .find(|path| path.exists());
    found.unwrap_or_else(|| {
        panic!(
            "{name} is not built in {} (cargo test --workspace builds the examples and the tools)",
            profile.display()
        )
    })
}

pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(example(name)).args(args).output().unwrap()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `name args` must exit 2 with an `error:` line containing `expected`, and never panic.
pub fn refused(name: &str, args: &[&str], expected: &str) {
    let output = run(name, args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{name} {args:?}: {text}");
    assert!(
        !text.contains("panicked"),
        "{name} {args:?} panicked: {text}"
    );
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        line.contains(expected),
        "{name} {args:?}: expected '{expected}' in: {text}"
    );
}

/// A command line's words: `line` split at whitespace.
pub fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// Each `(args, expected)` of `cases` is [`refused`]: `name base args`, with `args` split at
/// whitespace (so a case reads as its command line does).
pub fn refused_each(name: &str, base: &[&str], cases: &[(&str, &str)]) {
    for (args, expected) in cases {
        let args: Vec<&str> = base.iter().copied().chain(words(args)).collect();
        refused(name, &args, expected);
    }
}

pub fn succeeded(name: &str, args: &[&str]) -> String {
    let output = run(name, args);
    assert!(
        output.status.success(),
        "{name} {args:?}: {}",
        stderr(&output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bdcp-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
