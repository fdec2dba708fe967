//! The rabit-style C API end to end: compiles tests/c/rabit.c against
//! include/dmlc_rabit.h and the built libdmlc_guest, checks the header's
//! numbers against ffi_rabit.rs, and runs C workers configured only by the
//! DMLC environment: two through the backend, two over TCP, one alone.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use dmlc_guest::ffi_rabit as fr;
use dmlc_test_support::{build_c_program, c_command, serial, temp_dir, Backend, Proc};

/// Variables a developer's shell might set; every run starts without them.
const DMLC_VARS: &[&str] = &[
    "DMLC_ROLE",
    "DMLC_TASK_ID",
    "DMLC_NUM_WORKER",
    "DMLC_TRANSPORT",
    "DMLC_DEVICE",
    "DMLC_SOCKET",
    "DMLC_DMA_BYTES",
    "DMLC_POLL",
    "DMLC_TCP_PEERS",
    "DMLC_TCP_CONNECT_TIMEOUT_S",
    "DMLC_TCP_IO_TIMEOUT_S",
];

/// A command for the C program with a clean DMLC environment plus `env`.
fn worker(exe: &Path, args: &[&str], env: &[(&str, String)]) -> Command {
    let mut cmd = c_command(exe);
    cmd.args(args);
    for v in DMLC_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the workers to completion; returns them with their exit statuses.
fn run_all(cmds: Vec<(String, Command)>, limit: Duration) -> Vec<(Proc, ExitStatus)> {
    let mut procs: Vec<Proc> = cmds
        .into_iter()
        .map(|(name, mut cmd)| Proc::spawn(&name, &mut cmd))
        .collect();
    let statuses: Vec<ExitStatus> = procs.iter_mut().map(|p| p.finish(limit)).collect();
    procs.into_iter().zip(statuses).collect()
}

/// Every worker exited 0 and says PASS, and its tracker lines reached
/// stderr whole.
fn check_passed(results: &[(Proc, ExitStatus)], world: usize) {
    for (r, (p, st)) in results.iter().enumerate() {
        assert!(st.success(), "worker {r} failed ({st}):\n{}", p.dump());
        assert!(
            p.stdout().contains(&format!("PASS rank {r} of {world}")),
            "{}",
            p.dump()
        );
        let err = p.stderr();
        assert!(
            err.contains(&format!(
                "tracker: rank {r} of {world} says hello\nsecond line"
            )),
            "tracker lines missing:\n{}",
            p.dump()
        );
    }
}

#[test]
fn header_numbers_match_the_library() {
    let dir = temp_dir("crabit-const");
    let exe = c_program(&dir, "rabit");
    let out = worker(&exe, &["--constants"], &[])
        .output()
        .expect("run the C program");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let got: HashMap<String, i64> = text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k.to_string(), v.parse().expect("number")))
        .collect();
    let check = |name: &str, want: i64| {
        assert_eq!(
            got.get(name),
            Some(&want),
            "{name} in dmlc_rabit.h differs from ffi_rabit.rs"
        );
    };
    let statuses = [
        ("RABIT_OK", fr::RABIT_OK),
        ("RABIT_ERR_INVALID_ARGUMENT", fr::RABIT_ERR_INVALID_ARGUMENT),
        ("RABIT_ERR_NOT_INITIALIZED", fr::RABIT_ERR_NOT_INITIALIZED),
        (
            "RABIT_ERR_ALREADY_INITIALIZED",
            fr::RABIT_ERR_ALREADY_INITIALIZED,
        ),
        ("RABIT_ERR_ENVIRONMENT", fr::RABIT_ERR_ENVIRONMENT),
        ("RABIT_ERR_CONNECT", fr::RABIT_ERR_CONNECT),
        ("RABIT_ERR_UNSUPPORTED", fr::RABIT_ERR_UNSUPPORTED),
        ("RABIT_ERR_MISMATCH", fr::RABIT_ERR_MISMATCH),
        ("RABIT_ERR_PEER_LOST", fr::RABIT_ERR_PEER_LOST),
        ("RABIT_ERR_TIMEOUT", fr::RABIT_ERR_TIMEOUT),
        ("RABIT_ERR_COLLECTIVE", fr::RABIT_ERR_COLLECTIVE),
        ("RABIT_ERR_INTERNAL", fr::RABIT_ERR_INTERNAL),
    ];
    let dtypes = [
        ("RABIT_CHAR", fr::RABIT_CHAR),
        ("RABIT_UCHAR", fr::RABIT_UCHAR),
        ("RABIT_INT", fr::RABIT_INT),
        ("RABIT_UINT", fr::RABIT_UINT),
        ("RABIT_LONG", fr::RABIT_LONG),
        ("RABIT_ULONG", fr::RABIT_ULONG),
        ("RABIT_FLOAT", fr::RABIT_FLOAT),
        ("RABIT_DOUBLE", fr::RABIT_DOUBLE),
        ("RABIT_LONGLONG", fr::RABIT_LONGLONG),
        ("RABIT_ULONGLONG", fr::RABIT_ULONGLONG),
        ("RABIT_HALF", fr::RABIT_HALF),
        ("RABIT_BFLOAT16", fr::RABIT_BFLOAT16),
    ];
    let ops = [
        ("RABIT_MAX", fr::RABIT_MAX),
        ("RABIT_MIN", fr::RABIT_MIN),
        ("RABIT_SUM", fr::RABIT_SUM),
        ("RABIT_BITOR", fr::RABIT_BITOR),
        ("RABIT_BITAND", fr::RABIT_BITAND),
        ("RABIT_BITXOR", fr::RABIT_BITXOR),
        ("RABIT_PROD", fr::RABIT_PROD),
        ("RABIT_AVG", fr::RABIT_AVG),
    ];
    for (name, v) in statuses.iter().chain(&dtypes).chain(&ops) {
        check(name, i64::from(*v));
    }
    // rabit's own numbers for the names it has.
    for (name, want) in [
        ("RABIT_CHAR", 0),
        ("RABIT_UCHAR", 1),
        ("RABIT_INT", 2),
        ("RABIT_UINT", 3),
        ("RABIT_LONG", 4),
        ("RABIT_ULONG", 5),
        ("RABIT_FLOAT", 6),
        ("RABIT_DOUBLE", 7),
        ("RABIT_LONGLONG", 8),
        ("RABIT_ULONGLONG", 9),
        ("RABIT_MAX", 0),
        ("RABIT_MIN", 1),
        ("RABIT_SUM", 2),
        ("RABIT_BITOR", 3),
    ] {
        check(name, want);
    }
    // The C type of every dtype number has the size the library reduces.
    for (name, v) in dtypes {
        let dtype = fr::dtype_of(v).expect("known dtype");
        check(&format!("size({name})"), dtype.size() as i64);
    }
    check(
        "sizeof(rbt_ulong)",
        std::mem::size_of::<std::ffi::c_ulong>() as i64,
    );
}

#[test]
fn two_c_workers_through_the_device() {
    let _g = serial();
    let dir = temp_dir("crabit-dev");
    let exe = c_program(&dir, "rabit");
    let backend = Backend::start("crabit", 2, &["--log-level", "warn"]);
    let cmds = (0..2u32)
        .map(|r| {
            let env = [
                ("DMLC_ROLE", "worker".to_string()),
                ("DMLC_TASK_ID", r.to_string()),
                ("DMLC_NUM_WORKER", "2".to_string()),
                ("DMLC_SOCKET", backend.socket(r).display().to_string()),
                ("DMLC_DMA_BYTES", "8M".to_string()),
                // One worker sleeps on interrupts, the other polls.
                ("DMLC_POLL", (r % 2).to_string()),
            ];
            (format!("c worker {r}"), worker(&exe, &["run"], &env))
        })
        .collect();
    let results = run_all(cmds, Duration::from_secs(120));
    check_passed(&results, 2);
}

#[test]
fn two_c_workers_over_tcp() {
    let _g = serial();
    let dir = temp_dir("crabit-tcp");
    let exe = c_program(&dir, "rabit");
    // Free ports now; the workers bind them a moment later.
    let peers: Vec<String> = (0..2)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        })
        .collect();
    let cmds = (0..2u32)
        .map(|r| {
            let env = [
                ("DMLC_TRANSPORT", "tcp".to_string()),
                ("DMLC_TASK_ID", r.to_string()),
                ("DMLC_NUM_WORKER", "2".to_string()),
                ("DMLC_TCP_PEERS", peers.join(",")),
                ("DMLC_TCP_CONNECT_TIMEOUT_S", "30".to_string()),
            ];
            (format!("c tcp worker {r}"), worker(&exe, &["run"], &env))
        })
        .collect();
    let results = run_all(cmds, Duration::from_secs(120));
    check_passed(&results, 2);
}

#[test]
fn one_c_worker_alone() {
    let dir = temp_dir("crabit-alone");
    let exe = c_program(&dir, "rabit");
    let results = run_all(
        vec![("c worker alone".into(), worker(&exe, &["run"], &[]))],
        Duration::from_secs(60),
    );
    check_passed(&results, 1);
}

/// "init STATUS MESSAGE" of one RabitInit.
fn init_result(exe: &Path, args: &[&str], env: &[(&str, String)]) -> (i32, String) {
    let mut all = vec!["init"];
    all.extend_from_slice(args);
    let mut cmd = worker(exe, &all, env);
    let mut p = Proc::spawn("c init", &mut cmd);
    let st = p.finish(Duration::from_secs(30));
    assert!(st.success(), "init run failed ({st}):\n{}", p.dump());
    let out = p.stdout();
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("init "))
        .unwrap_or_else(|| panic!("no init line:\n{}", p.dump()));
    let (code, msg) = line.split_once(' ').unwrap_or((line, ""));
    (code.parse().expect("status"), msg.to_string())
}

#[test]
fn init_reports_bad_settings_from_the_environment_and_argv() {
    let dir = temp_dir("crabit-init");
    let exe = c_program(&dir, "rabit");
    // Two workers but nothing to reach the other with; set through argv.
    let (code, msg) = init_result(&exe, &["DMLC_NUM_WORKER=2"], &[]);
    assert_eq!(code, fr::RABIT_ERR_ENVIRONMENT, "{msg}");
    assert!(msg.starts_with("no device for a job of 2 workers"), "{msg}");
    // argv wins over the environment.
    let (code, msg) = init_result(
        &exe,
        &["DMLC_NUM_WORKER=1"],
        &[("DMLC_NUM_WORKER", "2".into())],
    );
    assert_eq!(code, fr::RABIT_OK, "{msg}");
    let (code, msg) = init_result(&exe, &[], &[("DMLC_ROLE", "server".into())]);
    assert_eq!(code, fr::RABIT_ERR_ENVIRONMENT, "{msg}");
    assert!(msg.contains("DMLC_ROLE"), "{msg}");
    let (code, msg) = init_result(
        &exe,
        &[],
        &[("DMLC_SOCKET", "/nonexistent/dmlc.sock".into())],
    );
    assert_eq!(code, fr::RABIT_ERR_CONNECT, "{msg}");
    assert!(
        msg.starts_with("cannot open the device (socket /nonexistent/dmlc.sock): "),
        "{msg}"
    );
}

#[test]
fn device_rank_must_match_the_environment() {
    let _g = serial();
    let dir = temp_dir("crabit-agree");
    let exe = c_program(&dir, "rabit");
    let backend = Backend::start("crabit-agree", 1, &["--log-level", "warn"]);
    let socket = backend.socket(0).display().to_string();
    let (code, msg) = init_result(
        &exe,
        &[],
        &[
            ("DMLC_SOCKET", socket.clone()),
            ("DMLC_NUM_WORKER", "2".into()),
        ],
    );
    assert_eq!(code, fr::RABIT_ERR_ENVIRONMENT, "{msg}");
    assert_eq!(
        msg,
        "the device says world size 1, but DMLC_NUM_WORKER is 2"
    );
}

#[test]
fn a_worker_that_leaves_fails_the_others_collective() {
    let _g = serial();
    let dir = temp_dir("crabit-lost");
    let exe = c_program(&dir, "rabit");
    let backend = Backend::start(
        "crabit-lost",
        2,
        &["--log-level", "warn", "--timeout-ms", "3000"],
    );
    let cmds = (0..2u32)
        .map(|r| {
            let env = [
                ("DMLC_TASK_ID", r.to_string()),
                ("DMLC_NUM_WORKER", "2".to_string()),
                ("DMLC_SOCKET", backend.socket(r).display().to_string()),
                ("DMLC_DMA_BYTES", "8M".to_string()),
            ];
            (format!("c worker {r}"), worker(&exe, &["lost"], &env))
        })
        .collect();
    let results = run_all(cmds, Duration::from_secs(60));
    for (p, st) in &results {
        assert!(st.success(), "{} failed ({st}):\n{}", p.name, p.dump());
    }
    assert!(results[1].0.stdout().contains("rank 1 leaving"));
    let out = results[0].0.stdout();
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("lost "))
        .unwrap_or_else(|| panic!("no result line:\n{}", results[0].0.dump()));
    let (code, msg) = line.split_once(' ').expect("status and message");
    let code: i32 = code.parse().expect("status");
    // Lost while the collective waited, or the device had already moved to
    // a new generation and the collective timed out waiting for rank 1.
    assert!(
        (code == fr::RABIT_ERR_PEER_LOST && msg.contains("rank 1 was lost"))
            || (code == fr::RABIT_ERR_TIMEOUT && msg.contains("rank 1")),
        "unexpected status {code}: {msg}"
    );
    let fin = out
        .lines()
        .find_map(|l| l.strip_prefix("finalize "))
        .expect("finalize line");
    assert_ne!(fin, "0", "finalize succeeded without rank 1");
}

/// Builds `tests/c/{name}.c` of this crate against its headers.
fn c_program(dir: &dmlc_test_support::TempDir, name: &str) -> std::path::PathBuf {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    build_c_program(
        dir.path(),
        &here.join("include"),
        &here.join("tests/c"),
        name,
    )
}
