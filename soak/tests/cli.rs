//! Runs the dmlc-soak binary: a tiny soak passes with every figure in its
//! output and JSON (the communicator part's counts too, also with an odd
//! number of ranks, and none with --comm-ops 0), --kill-one closes a rank
//! of group B only, --kill-daemon kills group B's daemon only, and bad
//! options fail with a clear message.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn soak() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmlc-soak"))
}

/// The daemon (another package: built on demand if missing).
fn backend() -> PathBuf {
    dmlc_test_support::backend_bin()
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("dmlc-soak-test-{}-{name}.json", std::process::id()))
}

/// Runs a soak with `args` (split at spaces) against the built daemon;
/// returns its output and the JSON it wrote (empty if none).
fn run_soak(name: &str, args: &str) -> (Output, String) {
    let json = json_path(name);
    let out = soak()
        .args(args.split_whitespace())
        .arg("--backend")
        .arg(backend())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let j = std::fs::read_to_string(&json).unwrap_or_default();
    let _ = std::fs::remove_file(&json);
    (out, j)
}

/// The JSON report `j`, parsed.
fn parse(j: &str) -> Value {
    serde_json::from_str(j).unwrap_or_else(|e| panic!("not a JSON report ({e}): {j:?}"))
}

/// Group `name` of the report `doc`.
fn group<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["groups"]
        .as_array()
        .and_then(|gs| gs.iter().find(|g| g["name"] == name))
        .unwrap_or_else(|| panic!("no group {name} in {doc}"))
}

#[test]
fn tiny_soak_passes_and_reports_every_figure() {
    let (out, j) = run_soak(
        "tiny",
        "--small 3000 --large 4 --large-bytes 256K --window 8 --rounds 5 --comm-ops 3 \
         --progress-secs 0",
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for col in [
        "comm",
        "checked",
        "lost",
        "dup",
        "wrong",
        "p99 us",
        "large GB/s",
        "RssAnon",
        "fds",
    ] {
        assert!(stdout.contains(col), "no column {col}: {t}");
    }
    let passed = stdout.lines().filter(|l| l.ends_with(" PASS")).count();
    assert_eq!(passed, 2, "{t}");
    assert!(stdout.contains("dmlc-soak: PASSED"), "{t}");
    assert!(
        stdout.contains("communicator part: 15 cycles; requests checked (all ranks):"),
        "{t}"
    );
    let doc = parse(&j);
    assert_eq!(doc["passed"], true, "{j}");
    assert_eq!(doc["config"]["small"], 3000, "{j}");
    assert_eq!(doc["config"]["comm_ops"], 3, "{j}");
    for name in ["A", "B"] {
        let g = group(&doc, name);
        assert_eq!(g["small_collectives"], 3000, "{j}");
        assert_eq!(g["large_collectives"], 4, "{j}");
        // 3 cycles in each of 5 rounds; per cycle, all 4 ranks: a split, a
        // create, 3 ring shifts (the group, the half and the pair have 2
        // ranks or more), an all-to-all, an allreduce, 2 frees.
        assert_eq!(g["comm_cycles"], 15, "{j}");
        assert_eq!(
            g["comm_ops"],
            serde_json::json!({
                "comm_split": 60, "comm_create": 60, "send": 180, "recv": 180,
                "alltoall": 60, "allreduce": 60, "comm_free": 120
            }),
            "{j}"
        );
        // 4 ranks checked every completion: 3004 allreduces and 180
        // requests of the communicator part each.
        assert_eq!(g["completions_checked"], 12736, "{j}");
        assert_eq!(g["submitted"], 12736, "{j}");
        for zero in [
            "lost",
            "duplicated",
            "wrong",
            "failed",
            "generation_changes",
        ] {
            assert_eq!(g[zero], 0, "{zero} in {j}");
        }
        assert_eq!(g["passed"], true, "{j}");
        assert!(g["warm_up"]["rss_anon_kib"].as_u64() > Some(0), "{j}");
        assert!(g["small_latency_us"]["p99"].as_f64() > Some(0.0), "{j}");
    }
    assert_ne!(group(&doc, "A")["group_id"], group(&doc, "B")["group_id"]);
}

/// With 3 ranks, rank 1 is alone in its half and rank 2 in its pair: no
/// ring shift there, the rest as with 4. --comm-ops 0 runs none of it.
#[test]
fn the_communicator_part_runs_on_odd_ranks_and_can_be_left_out() {
    let common = "--small 200 --large 0 --groups 1 --ranks 3 --rounds 2 --progress-secs 0";
    let (out, j) = run_soak("odd", &format!("{common} --comm-ops 2"));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let a = group(&parse(&j), "A").clone();
    assert_eq!(a["passed"], true, "{j}");
    assert_eq!(a["comm_cycles"], 4, "{j}");
    // Per cycle: 3 splits, creates, all-to-alls and allreduces, 6 frees,
    // and 7 sends and receives (the group's 3, the even half's 2, the
    // first pair's 2).
    assert_eq!(
        a["comm_ops"],
        serde_json::json!({
            "comm_split": 12, "comm_create": 12, "send": 28, "recv": 28,
            "alltoall": 12, "allreduce": 12, "comm_free": 24
        }),
        "{j}"
    );
    for zero in ["lost", "duplicated", "wrong", "failed"] {
        assert_eq!(a[zero], 0, "{zero} in {j}");
    }
    assert_eq!(a["completions_checked"], 3 * 200 + 128, "{j}");

    let (out, j) = run_soak("none", &format!("{common} --comm-ops 0"));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let a = group(&parse(&j), "A").clone();
    assert_eq!(a["comm_cycles"], 0, "{j}");
    assert_eq!(a["comm_ops"]["send"], 0, "{j}");
    assert_eq!(a["completions_checked"], 3 * 200, "{j}");
    assert!(!t.contains("communicator part:"), "{t}");
}

#[test]
fn kill_one_closes_a_rank_of_b_and_a_still_passes() {
    let (out, j) = run_soak(
        "kill",
        "--small 4000 --large 2 --large-bytes 64K --rounds 4 --progress-secs 0 --kill-one",
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let doc = parse(&j);
    let (a, b) = (group(&doc, "A"), group(&doc, "B"));
    assert_eq!(a["killed_rank"], false, "{j}");
    assert_eq!(a["passed"], true, "{j}");
    assert_eq!(a["small_collectives"], 4000, "{j}");
    assert_eq!(b["killed_rank"], true, "{j}");
    // B stopped near the middle (the close follows small collective 2500).
    let small = b["small_collectives"].as_u64().expect("a count");
    assert!((2400..=2501).contains(&small), "{j}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("KILLED"),
        "{t}"
    );
}

#[test]
fn kill_daemon_kills_b_s_daemon_and_a_still_passes() {
    let json = json_path("kill-daemon");
    let child = soak()
        .args(["--small", "4000", "--large", "2", "--large-bytes", "64K"])
        .args(["--rounds", "4", "--progress-secs", "0", "--kill-daemon"])
        .arg("--backend")
        .arg(backend())
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The socket folder and the daemons' command lines carry this pid.
    let tag = format!("dmlc-soak-{}-", child.id());
    let out = child.wait_with_output().unwrap();
    let j = std::fs::read_to_string(&json).unwrap_or_default();
    let _ = std::fs::remove_file(&json);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let doc = parse(&j);
    let (a, b) = (group(&doc, "A"), group(&doc, "B"));
    // A did all its work, every check passing.
    assert_eq!(a["killed_daemon"], false, "{j}");
    assert_eq!(a["passed"], true, "{j}");
    assert_eq!(a["small_collectives"], 4000, "{j}");
    assert_eq!(a["large_collectives"], 2, "{j}");
    // The default --comm-ops 25 in each of 4 rounds, 12 requests a cycle
    // on each of 4 ranks.
    assert_eq!(a["comm_cycles"], 100, "{j}");
    assert_eq!(a["completions_checked"], 16008 + 4800, "{j}");
    for zero in [
        "lost",
        "duplicated",
        "wrong",
        "failed",
        "generation_changes",
    ] {
        assert_eq!(a[zero], 0, "{zero} in {j}");
    }
    assert!(!a["end"].is_null(), "{j}");
    // B's daemon died of the kill, near the middle (after small
    // collective 2500), and all 4 ranks saw the transport error in time.
    assert_eq!(b["killed_daemon"], true, "{j}");
    assert_eq!(b["passed"], true, "{j}");
    assert_eq!(b["kill_round"], 2, "{j}");
    assert_eq!(b["daemon_exit"], "signal: 9 (SIGKILL)", "{j}");
    assert_eq!(b["after_kill"]["disconnected"], 4, "{j}");
    assert_eq!(b["after_kill"]["other"], 0, "{j}");
    let small = b["small_collectives"].as_u64().expect("a count");
    assert!((2400..=2501).contains(&small), "{j}");
    assert_eq!(b["noticed_ms"].as_array().map(Vec::len), Some(4), "{j}");
    let noticed = b["noticed_max_ms"].as_f64().expect("every rank noticed");
    assert!(noticed <= 2000.0, "{j}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("B: daemon killed (SIGKILL) at round 2")
            && stdout.contains("4 of 4 ranks saw 'device backend disconnected' within"),
        "{t}"
    );
    assert!(
        stdout.contains(" KILLED\n") && stdout.contains("dmlc-soak: PASSED"),
        "{t}"
    );
    // Group A's daemon was stopped and the socket folder removed.
    let pid = &a["daemon_pid"];
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&tag),
        "group A's daemon {pid} still runs"
    );
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&tag))
        .collect();
    assert!(left.is_empty(), "socket folder left: {left:?}");
}

#[test]
fn bad_options_fail_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--frobnicate"], "unexpected argument '--frobnicate'"),
        (&["--small", "ten"], "\"ten\" is not a count"),
        (
            &["--small-bytes", "12"],
            "--small-bytes must be a positive multiple of 8",
        ),
        (&["--window", "100"], "--window must be between 1 and 64"),
        (
            &["--small", "0", "--large", "0", "--comm-ops", "0"],
            "nothing to do: --small, --large and --comm-ops are all 0",
        ),
        (
            &["--kill-one", "--groups", "1"],
            "--kill-one needs at least 2 groups",
        ),
        (
            &["--kill-one", "--kill-daemon"],
            "--kill-one and --kill-daemon both stop group B half way: give one of them",
        ),
        (
            &["--kill-daemon", "--groups", "1"],
            "--kill-daemon needs at least 2 groups",
        ),
    ];
    for (args, want) in cases {
        let out = soak().args(*args).output().unwrap();
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(want), "{args:?}: want {want:?} in {t}");
    }
}

#[test]
fn a_missing_daemon_binary_is_named() {
    let out = soak()
        .args([
            "--small",
            "10",
            "--large",
            "0",
            "--backend",
            "/nonexistent/dmlcd",
        ])
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("daemon binary /nonexistent/dmlcd not found"),
        "{t}"
    );
}

#[test]
fn help_gives_defaults_and_an_example() {
    let out = soak().arg("--help").output().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for want in [
        "[default: 1_000_000]",
        "[default: 16M]",
        "[default: 4M]",
        "--comm-ops <N>",
        "[default: 25]",
        "Examples:",
        "--kill-one",
        "--kill-daemon",
    ] {
        assert!(t.contains(want), "no {want:?} in {t}");
    }
}

#[test]
fn a_failed_check_gives_exit_status_1_and_says_why() {
    // Every collective takes longer than 0 ms.
    let out = soak()
        .args([
            "--small", "200", "--large", "0", "--groups", "1", "--ranks", "2",
        ])
        .args([
            "--rounds",
            "2",
            "--progress-secs",
            "0",
            "--max-stall-ms",
            "0",
        ])
        .arg("--backend")
        .arg(backend())
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("over --max-stall-ms 0"), "{t}");
    assert!(
        t.contains(" FAIL\n") && t.contains("dmlc-soak: FAILED"),
        "{t}"
    );
}
