//! End to end on the host: the backend daemon with two sockets and two
//! trainer processes that play the VMs (the rabit host transport), then the
//! same job over TCP. Both must pass their checks, and the two transports
//! must give bitwise the same model (both reduce in rank order).

mod common;

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::{wait_all, Proc, TempDir};

const RANKS: u32 = 2;
/// Generous: debug builds, a 2-core machine shared with other tests.
const LIMIT: Duration = Duration::from_secs(240);

fn trainer_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dmlc-train-digits"))
}

/// The backend daemon, built by cargo into the same folder (another crate
/// of the workspace, so `cargo test -p dmlc-example-digits` alone does not
/// build it).
fn backend_bin() -> PathBuf {
    let p = trainer_bin()
        .parent()
        .expect("binary has a folder")
        .join("vhost-device-dmlc");
    assert!(
        p.is_file(),
        "backend binary {} is missing: run `cargo build --workspace` (or `cargo test --workspace`) first",
        p.display()
    );
    p
}

fn socket(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("dmlc.sock{rank}"))
}

fn is_socket(p: &Path) -> bool {
    fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

fn start_backend(dir: &Path) -> Proc {
    let mut backend = Proc::spawn(
        "backend",
        dir,
        Command::new(backend_bin())
            .arg("--socket-path")
            .arg(dir.join("dmlc.sock"))
            .arg("--socket-count")
            .arg(RANKS.to_string())
            .args(["--timeout-ms", "60000"]),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(0..RANKS).all(|r| is_socket(&socket(dir, r))) {
        if let Some(st) = backend.poll() {
            panic!("backend exited early ({st}):\n{}", backend.dump());
        }
        assert!(
            Instant::now() < deadline,
            "backend sockets did not appear:\n{}",
            backend.dump()
        );
        thread::sleep(Duration::from_millis(10));
    }
    backend
}

/// The trainer, with no DMLC variables inherited from the test's
/// environment.
fn trainer() -> Command {
    let mut cmd = Command::new(trainer_bin());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DMLC_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Starts one trainer per rank with the DMLC environment plus `env(rank)`.
fn start_trainers(
    dir: &Path,
    tag: &str,
    data: &Path,
    env: impl Fn(u32) -> Vec<(&'static str, String)>,
) -> Vec<Proc> {
    (0..RANKS)
        .map(|rank| {
            let mut cmd = trainer();
            cmd.arg("--data")
                .arg(data)
                .arg("--json")
                .arg(dir.join(format!("{tag}-{{rank}}.json")))
                .env("DMLC_ROLE", "worker")
                .env("DMLC_TASK_ID", rank.to_string())
                .env("DMLC_NUM_WORKER", RANKS.to_string())
                .env("DMLC_JOB_CLUSTER", "local");
            for (k, v) in env(rank) {
                cmd.env(k, v);
            }
            Proc::spawn(&format!("{tag}-rank{rank}"), dir, &mut cmd)
        })
        .collect()
}

/// Checks every rank's exit status, output and JSON; returns the common
/// model fingerprint.
fn check_job(dir: &Path, tag: &str, transport: &str, ranks: &mut [Proc]) -> String {
    let started = Instant::now();
    wait_all(ranks, LIMIT);
    println!("{tag}: {RANKS} ranks finished in {:?}", started.elapsed());
    let mut fingerprints = Vec::new();
    for (rank, p) in ranks.iter_mut().enumerate() {
        let st = p.poll().expect("exited");
        assert!(st.success(), "{} failed ({st}):\n{}", p.name, p.dump());
        let out = p.stdout();
        assert!(
            out.contains(&format!("rank {rank} of {RANKS} transport {transport} ")),
            "{}: no start line:\n{out}",
            p.name
        );
        assert!(out.contains("step 0 loss 2.30"), "{}:\n{out}", p.name);
        assert!(out.contains("step 99 loss "), "{}:\n{out}", p.name);
        let fp = out
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "PASS identical weights on all {RANKS} ranks (fingerprint "
                ))
            })
            .unwrap_or_else(|| panic!("{}: no identical-weights PASS:\n{out}", p.name));
        fingerprints.push(fp.trim_end_matches(')').to_string());
        assert!(
            out.contains("PASS matches single-process run: max abs diff "),
            "{}:\n{out}",
            p.name
        );
        assert!(!out.contains("FAIL"), "{}:\n{out}", p.name);
        let acc: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("test accuracy "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{}: no accuracy line:\n{out}", p.name));
        assert!(acc >= 0.85, "{}: accuracy {acc}", p.name);
        let json = fs::read_to_string(dir.join(format!("{tag}-{rank}.json")))
            .unwrap_or_else(|e| panic!("{}: no JSON report: {e}", p.name));
        for needle in [
            format!("\"rank\":{rank},\"world_size\":{RANKS},\"transport\":\"{transport}\""),
            "\"pass\":true}".to_string(),
            "{\"step\":99,".to_string(),
        ] {
            assert!(json.contains(&needle), "{}: {needle} not in {json}", p.name);
        }
    }
    assert!(
        fingerprints.iter().all(|f| *f == fingerprints[0]),
        "{tag}: {fingerprints:?}"
    );
    fingerprints.remove(0)
}

#[test]
fn two_ranks_pass_over_the_device_and_over_tcp_with_the_same_model() {
    let data = common::data_path();
    let dir = TempDir::new("host");

    let mut backend = start_backend(&dir.0);
    let mut ranks = start_trainers(&dir.0, "device", &data, |rank| {
        vec![
            ("DMLC_TRANSPORT", "device".to_string()),
            ("DMLC_SOCKET", socket(&dir.0, rank).display().to_string()),
            ("DMLC_DMA_BYTES", "4M".to_string()),
        ]
    });
    let device_fp = check_job(&dir.0, "device", "device", &mut ranks);
    assert!(
        backend.poll().is_none(),
        "backend died:\n{}",
        backend.dump()
    );
    drop(backend);

    // Free loopback ports for the TCP group (released just before use).
    let peers: Vec<String> = (0..RANKS)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
            l.local_addr().expect("local address").to_string()
        })
        .collect();
    let peers = peers.join(",");
    let mut ranks = start_trainers(&dir.0, "tcp", &data, |_| {
        vec![
            ("DMLC_TRANSPORT", "tcp".to_string()),
            ("DMLC_TCP_PEERS", peers.clone()),
            ("DMLC_TCP_CONNECT_TIMEOUT_S", "60".to_string()),
        ]
    });
    let tcp_fp = check_job(&dir.0, "tcp", "tcp", &mut ranks);
    assert_eq!(
        device_fp, tcp_fp,
        "the device and TCP gave different models (both must reduce in rank order)"
    );
}

#[test]
fn a_missing_data_file_fails_clearly() {
    let dir = TempDir::new("missing");
    let out = trainer()
        .arg("--data")
        .arg(dir.0.join("nothing.csv.gz"))
        .output()
        .expect("run the trainer");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot load the data") && err.contains("nothing.csv.gz"),
        "{err}"
    );
}
