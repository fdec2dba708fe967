//! End-to-end tests: the backend daemon and N `dmlc-guest` rank processes
//! over real vhost-user sockets.

use std::process::Command;
use std::time::{Duration, Instant};

use dmlc_test_support::{
    free_local_addr, guest_bin, run_guest, serial, temp_dir, wait_metric_at_least, Backend, Proc,
};

const LIMIT: Duration = Duration::from_secs(300);

fn assert_ok(p: &Proc, st_ok: bool) {
    assert!(st_ok, "{} failed:\n{}", p.name, p.dump());
}

#[test]
fn selftest_quick_two_ranks() {
    let _g = serial();
    let mut p = run_guest(
        "local",
        &["local", "--ranks", "2", "--", "selftest", "--quick"],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    let out = p.stdout();
    assert!(out.contains("selftest PASS"), "{}", p.dump());
    for opcode in [
        "allreduce",
        "broadcast",
        "reduce",
        "allgather",
        "reduce_scatter",
        "barrier",
        "nop",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(opcode) && l.ends_with("PASS")),
            "no PASS line for {opcode}:\n{out}"
        );
    }
    // The communicator part runs by default when the device offers it.
    assert!(
        out.lines()
            .any(|l| l.starts_with("comm_split ") && l.ends_with("PASS")),
        "no communicator part:\n{out}"
    );
}

/// Every opcode of feature bits 1 to 3, and allreduce, which also runs on
/// the communicators.
const COMM_OPCODES: [&str; 12] = [
    "allreduce",
    "send",
    "recv",
    "alltoall",
    "alltoallv",
    "gather",
    "gatherv",
    "scatter",
    "scatterv",
    "comm_split",
    "comm_create",
    "comm_free",
];

/// The communicator part of the self-test (spec 5.X.6.13) on groups of 1
/// to 4 ranks: a group of one (where only the refusals of sends to itself
/// are possible), odd sizes, and a PASS line for every new opcode. Only
/// those opcodes and a sum allreduce are asked for, so that the classic
/// cases add little time.
#[test]
fn selftest_communicators_on_one_to_four_ranks() {
    let _g = serial();
    for n in 1..=4u32 {
        let ranks = n.to_string();
        let mut args = vec![
            "local", "--ranks", &ranks, "--", "selftest", "--quick", "--op", "sum",
        ];
        for o in COMM_OPCODES {
            args.extend(["--opcode", o]);
        }
        let started = Instant::now();
        let mut p = run_guest(&format!("local selftest comms ({n} ranks)"), &args, LIMIT);
        let st = p.finish(LIMIT);
        eprintln!("{n} ranks: {:?}", started.elapsed());
        assert_ok(&p, st.success());
        let out = p.stdout();
        assert!(
            out.contains("selftest PASS") && out.contains(&format!("rank 0 of {n}")),
            "{}",
            p.dump()
        );
        // Each line's first word names its opcode; send/recv names two.
        for opcode in COMM_OPCODES {
            assert!(
                out.lines().any(|l| {
                    let name = l.split_whitespace().next().unwrap_or("");
                    name.split('/').any(|w| w == opcode) && l.ends_with("PASS")
                }),
                "{n} ranks: no PASS line for {opcode}:\n{out}"
            );
        }
        assert!(
            out.lines()
                .any(|l| l.starts_with("allreduce") && l.contains("communicators")),
            "{n} ranks: no allreduce on communicators:\n{out}"
        );
        let ring = if n == 1 {
            "own rank refused"
        } else {
            "truncation"
        };
        assert!(
            out.lines()
                .any(|l| l.starts_with("send/recv") && l.contains(ring)),
            "{n} ranks: no {ring:?}:\n{out}"
        );
        assert!(!out.contains("FAIL"), "{}", p.dump());
    }
}

/// With room for fewer communicators than the self-test makes, the splits
/// and the creation that do not fit are refused with TOO_BIG_COMMS on
/// every member; and `--opcode` naming none of the communicator opcodes
/// skips that part with a line that says why.
#[test]
fn selftest_communicators_beyond_max_comms_and_skipped() {
    let _g = serial();
    let mut p = run_guest(
        "local selftest max-comms",
        &[
            "local",
            "--ranks",
            "4",
            "--backend-arg=--max-comms=5",
            "--",
            "selftest",
            "--quick",
            "--opcode",
            "comm_free",
        ],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    let out = p.stdout();
    for want in [
        "all but the last refused (TOO_BIG_COMMS, max_comms 5)",
        "[3, 0] by those ranks only: refused (TOO_BIG_COMMS, max_comms 5)",
        "selftest PASS",
    ] {
        assert!(out.contains(want), "missing {want:?}:\n{}", p.dump());
    }

    let mut p = run_guest(
        "local selftest nop",
        &["local", "--ranks", "2", "--", "selftest", "--opcode", "nop"],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    assert!(
        p.stdout()
            .contains("# communicators: skipped: --opcode names none of"),
        "{}",
        p.dump()
    );
}

#[test]
fn selftest_quick_three_ranks_interrupt_mode() {
    let _g = serial();
    let mut p = run_guest(
        "local",
        &[
            "--interrupt",
            "local",
            "--ranks",
            "3",
            "--queues",
            "2",
            "--",
            "selftest",
            "--quick",
        ],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    assert!(
        p.stdout().contains("selftest PASS") && p.stdout().contains("rank 0 of 3"),
        "{}",
        p.dump()
    );
}

#[test]
fn several_queues_with_requests_in_flight() {
    let _g = serial();
    let mut p = run_guest(
        "local",
        &[
            "local",
            "--ranks",
            "2",
            "--queues",
            "4",
            "--",
            "debug",
            "multiqueue",
            "--inflight",
            "8",
            "--iters",
            "40",
            "--count",
            "1000",
        ],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    assert!(
        p.stdout()
            .contains("multiqueue ok: 160 requests on 4 queue(s), up to 8 in flight each"),
        "{}",
        p.dump()
    );
}

#[test]
fn mismatched_collectives_fail_on_every_rank_naming_the_field() {
    let _g = serial();
    for field in ["count", "dtype", "op", "root", "tag", "opcode"] {
        let mut p = run_guest(
            &format!("local (mismatch {field})"),
            &[
                "local", "--ranks", "3", "--", "debug", "mismatch", "--field", field,
            ],
            LIMIT,
        );
        let st = p.finish(LIMIT);
        assert!(
            !st.success(),
            "mismatch on {field} did not fail:\n{}",
            p.dump()
        );
        let err = p.stderr();
        let want = format!("collective mismatch: {field} differs on rank 1");
        // Rank 0's stderr comes through as is, the others' prefixed.
        assert!(
            err.lines()
                .any(|l| l.starts_with("dmlc-guest:") && l.contains(&want)),
            "rank 0 did not report {want:?}:\n{}",
            p.dump()
        );
        for r in 1..3 {
            let prefix = format!("[rank {r}] dmlc-guest:");
            assert!(
                err.lines()
                    .any(|l| l.starts_with(&prefix) && l.contains(&want)),
                "rank {r} did not report {want:?}:\n{}",
                p.dump()
            );
        }
    }
}

#[test]
fn killed_rank_is_reported_as_peer_lost_and_can_rejoin() {
    let _g = serial();
    let addr = free_local_addr();
    let mut backend = Backend::start(
        "kill",
        2,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            "20000",
            "--metrics-addr",
            &addr,
        ],
    );
    let sockets = [backend.socket(0), backend.socket(1)];
    let guest = |name: &str, rank: usize, args: &[&str]| {
        let mut cmd = Command::new(guest_bin());
        cmd.arg("--socket").arg(&sockets[rank]).args(args);
        Proc::spawn(name, &mut cmd)
    };
    // Rank 1 takes part in 3 collectives, then holds the device open.
    let mut r1 = guest(
        "rank 1",
        1,
        &["debug", "allreduce", "--iters", "3", "--hold"],
    );
    // Rank 0 wants 4: the 4th waits for rank 1, which never comes.
    let mut r0 = guest(
        "rank 0",
        0,
        &["debug", "allreduce", "--iters", "4", "--retry-secs", "30"],
    );
    assert!(
        r1.wait_stdout("holding", Duration::from_secs(60)).is_some(),
        "rank 1 never got to hold:\n{}\n{}",
        r1.dump(),
        r0.dump()
    );
    assert!(r0
        .wait_stdout("iter 2 ok", Duration::from_secs(10))
        .is_some());
    // Rank 0 blocks on its 4th request once the daemon has taken it (3
    // from each rank before it).
    wait_metric_at_least(
        &addr,
        "dmlc_requests_total{opcode=\"allreduce\"}",
        7.0,
        Duration::from_secs(30),
    );
    assert!(r0.wait_timeout(Duration::ZERO).is_none(), "{}", r0.dump());
    let killed = Instant::now();
    r1.kill9();
    let seen = r0
        .wait_stdout("iter 3 error: peer lost", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("rank 0 was not told about the lost peer:\n{}", r0.dump()));
    let delay = seen.duration_since(killed);
    eprintln!("peer lost reported {delay:?} after the kill");
    assert!(
        delay < Duration::from_secs(1),
        "peer lost reported after {delay:?}"
    );
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());

    // A restarted rank 1 rejoins; rank 0's retry and its first collective
    // form one collective.
    let mut r1b = guest(
        "rank 1 (restarted)",
        1,
        &["debug", "allreduce", "--iters", "1", "--retry-secs", "30"],
    );
    let st = r1b.finish(Duration::from_secs(60));
    assert!(st.success(), "{}\n{}", r1b.dump(), r0.dump());
    let st = r0.finish(Duration::from_secs(60));
    assert!(st.success(), "{}", r0.dump());
    assert!(r0.stdout().contains("iter 3 ok"), "{}", r0.dump());
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());
}

#[test]
fn bench_prints_a_table_and_json_without_wrong_values() {
    let _g = serial();
    let dir = temp_dir("bench");
    let json = dir.path().join("bench.json");
    let json_arg = json.to_str().expect("utf-8 path");
    let mut p = run_guest(
        "local bench",
        &[
            "local", "--ranks", "2", "--", "bench", "-b", "4", "-e", "64K", "-f", "4", "-n", "3",
            "-w", "1", "--rotate", "256K", "--json", json_arg,
        ],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    let out = p.stdout();
    assert!(out.contains("# ok: 8 size(s), #wrong total 0"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 8, "{out}");
    assert!(rows[0]
        .split_whitespace()
        .take(5)
        .eq(["4", "1", "f32", "sum", "-1"]));
    let text = std::fs::read_to_string(&json).expect("json written");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let results = doc["results"].as_array().expect("results");
    assert_eq!(results.len(), 8, "{text}");
    assert_eq!(doc["tool"], "dmlc-guest bench", "{text}");
    assert_eq!(doc["world"], 2, "{text}");
    assert!(doc["device"]["max_bytes"].as_u64() > Some(0), "{text}");
    assert_eq!(results[0]["size"], 4, "{text}");
    for r in results {
        assert_eq!(r["oop"]["wrong"], 0, "{text}");
        assert_eq!(r["ip"]["wrong"], 0, "{text}");
        assert!(r["oop"]["time_us"].as_f64() > Some(0.0), "{text}");
    }

    // Another opcode, dtype and op through the same generic path.
    let mut p = run_guest(
        "local bench reduce_scatter",
        &[
            "local",
            "--ranks",
            "2",
            "--",
            "bench",
            "--opcode",
            "reduce_scatter",
            "-d",
            "bf16",
            "-o",
            "max",
            "-b",
            "64",
            "-e",
            "4K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "0",
            "--rotate",
            "64K",
        ],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    assert!(p.stdout().contains("#wrong total 0"), "{}", p.dump());
}

#[test]
fn info_shows_the_group() {
    let _g = serial();
    let mut p = run_guest(
        "local info",
        &["local", "--ranks", "3", "--", "info"],
        LIMIT,
    );
    let st = p.finish(LIMIT);
    assert_ok(&p, st.success());
    let out = p.stdout();
    for want in [
        "rank          0",
        "world size    3",
        "opcodes       allreduce",
    ] {
        assert!(out.contains(want), "missing {want:?}:\n{out}");
    }
    // Another rank may finish and close its device before rank 0 reads the
    // config, which starts a new generation; so only check it is a number.
    let generation = out
        .lines()
        .find_map(|l| l.strip_prefix("generation"))
        .map(str::trim)
        .and_then(|g| g.parse::<u32>().ok());
    assert!(
        generation.is_some_and(|g| g >= 1),
        "no generation >= 1:\n{out}"
    );
}

#[test]
fn missing_backend_is_explained() {
    let mut p = run_guest(
        "local",
        &[
            "local",
            "--ranks",
            "2",
            "--backend",
            "/nonexistent/backend",
            "--",
            "info",
        ],
        Duration::from_secs(30),
    );
    let st = p.finish(Duration::from_secs(30));
    assert!(!st.success());
    assert!(
        p.stderr()
            .contains("backend not found at /nonexistent/backend"),
        "{}",
        p.dump()
    );
}

#[test]
fn no_socket_is_explained() {
    let mut cmd = Command::new(guest_bin());
    cmd.arg("info").env_remove("DMLC_SOCKET");
    let mut p = Proc::spawn("info", &mut cmd);
    let st = p.finish(Duration::from_secs(30));
    assert!(!st.success());
    assert!(
        {
            let err = p.stderr();
            err.contains("no device: give --socket PATH") && err.contains("DMLC_SOCKET")
        },
        "{}",
        p.dump()
    );
}

/// A rank that waits 50 ms for a late peer on interrupts, or with the
/// hybrid wait, leaves the CPU: its process is on a CPU for well under half
/// of the wait (a sleeping wait is a few percent; the bound is generous for
/// a loaded machine, where a spinning one shares the CPU too). Each rank's
/// result is checked by that rank.
#[test]
fn waiting_for_a_late_peer_leaves_the_cpu_with_interrupts_and_hybrid() {
    let _g = serial();
    for mode in ["--interrupt", "--hybrid"] {
        let mut p = run_guest(
            "local",
            &[
                "local",
                "--ranks",
                "2",
                "--all-output",
                "--",
                mode,
                "debug",
                "late-peer",
                "--rounds",
                "6",
            ],
            LIMIT,
        );
        let st = p.finish(LIMIT);
        assert_ok(&p, st.success());
        let out = p.stdout();
        let line = out
            .lines()
            .find(|l| l.starts_with("late-peer: rank 0 of 2"))
            .unwrap_or_else(|| panic!("no line of rank 0:\n{}", p.dump()));
        assert!(out.contains("rank 1 of 2 is the late peer"), "{}", p.dump());
        let busy: f64 = line
            .split("CPU busy ")
            .nth(1)
            .and_then(|r| r.split('%').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no busy figure in {line}"));
        let waited: f64 = line
            .split("waited ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no wait figure in {line}"));
        assert!(
            waited >= 25.0,
            "{mode}: the wait ({waited} ms) did not wait for the peer"
        );
        assert!(busy < 50.0, "{mode}: busy {busy}% of the wait: {line}");
    }
}
