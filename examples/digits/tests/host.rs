//! End to end on the host: the backend daemon with two sockets and two
//! trainer processes that play the VMs (the rabit host transport), then the
//! same job over TCP. Both must pass their checks, and the two transports
//! must give bitwise the same model (both reduce in rank order).

mod common;

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use dmlc_test_support::{temp_dir, Backend, Proc};

const RANKS: u32 = 2;
/// Generous: debug builds, a 2-core machine shared with other tests.
const LIMIT: Duration = Duration::from_secs(240);

fn trainer_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dmlc-train-digits"))
}

/// The backend daemon with one socket per rank (built if missing: it is
/// another crate of the workspace).
fn start_backend() -> Backend {
    Backend::start("digits", RANKS, &["--timeout-ms", "60000"])
}

/// Waits until every process has exited, or panics after `limit`.
fn wait_all(procs: &mut [Proc], limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        if procs
            .iter_mut()
            .all(|p| p.wait_timeout(Duration::ZERO).is_some())
        {
            return;
        }
        if Instant::now() >= deadline {
            let running: Vec<&str> = procs
                .iter_mut()
                .filter_map(|p| {
                    p.wait_timeout(Duration::ZERO)
                        .is_none()
                        .then_some(p.name.as_str())
                })
                .collect();
            panic!("still running after {limit:?}: {running:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
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

/// Starts one trainer per rank with `args`, and the DMLC environment plus
/// `env(rank)`.
fn start_trainers(
    dir: &Path,
    tag: &str,
    data: &Path,
    args: &[&str],
    env: impl Fn(u32) -> Vec<(&'static str, String)>,
) -> Vec<Proc> {
    (0..RANKS)
        .map(|rank| {
            let mut cmd = trainer();
            cmd.args(args)
                .arg("--data")
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
            Proc::spawn(&format!("{tag}-rank{rank}"), &mut cmd)
        })
        .collect()
}

/// What a job must show: its step count and the least test accuracy.
struct Expect {
    steps: usize,
    accuracy: f64,
}

/// The softmax model's 100 default steps.
const SOFTMAX: Expect = Expect {
    steps: 100,
    accuracy: 0.85,
};

/// Checks every rank's exit status, output and JSON; returns the common
/// model fingerprint.
fn check_job(
    dir: &Path,
    tag: &str,
    transport: &str,
    ranks: &mut [Proc],
    expect: &Expect,
) -> String {
    let last = expect.steps - 1;
    let started = Instant::now();
    wait_all(ranks, LIMIT);
    println!("{tag}: {RANKS} ranks finished in {:?}", started.elapsed());
    let mut fingerprints = Vec::new();
    for (rank, p) in ranks.iter_mut().enumerate() {
        let st = p.wait_timeout(Duration::ZERO).expect("exited");
        assert!(st.success(), "{} failed ({st}):\n{}", p.name, p.dump());
        let out = p.stdout();
        assert!(
            out.contains(&format!("rank {rank} of {RANKS} transport {transport} ")),
            "{}: no start line:\n{out}",
            p.name
        );
        assert!(out.contains("step 0 loss 2.30"), "{}:\n{out}", p.name);
        assert!(
            out.contains(&format!("step {last} loss ")),
            "{}:\n{out}",
            p.name
        );
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
        assert!(acc >= expect.accuracy, "{}: accuracy {acc}", p.name);
        let json = fs::read_to_string(dir.join(format!("{tag}-{rank}.json")))
            .unwrap_or_else(|e| panic!("{}: no JSON report: {e}", p.name));
        let doc: serde_json::Value = serde_json::from_str(&json)
            .unwrap_or_else(|e| panic!("{}: JSON report not valid ({e}): {json}", p.name));
        assert_eq!(doc["rank"], rank, "{}: {json}", p.name);
        assert_eq!(doc["world_size"], RANKS, "{}: {json}", p.name);
        assert_eq!(doc["transport"], transport, "{}: {json}", p.name);
        assert_eq!(doc["pass"], true, "{}: {json}", p.name);
        assert_eq!(doc["identical_weights"]["pass"], true, "{}: {json}", p.name);
        assert_eq!(doc["single_process"]["pass"], true, "{}: {json}", p.name);
        let steps = doc["steps"].as_array().expect("steps");
        assert_eq!(steps.len(), expect.steps, "{}: {json}", p.name);
        assert_eq!(steps[last]["step"], last, "{}: {json}", p.name);
        assert!(
            doc["test_accuracy"].as_f64() >= Some(expect.accuracy),
            "{}: {json}",
            p.name
        );
        assert!(
            steps[last]["update_ms"].as_f64() > Some(0.0),
            "{}: {json}",
            p.name
        );
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
    let dir = temp_dir("digits-host");
    let dir = dir.path();

    let mut backend = start_backend();
    let mut ranks = start_trainers(dir, "device", &data, &[], |rank| {
        vec![
            ("DMLC_TRANSPORT", "device".to_string()),
            ("DMLC_SOCKET", backend.socket(rank).display().to_string()),
            ("DMLC_DMA_BYTES", "4M".to_string()),
        ]
    });
    let device_fp = check_job(dir, "device", "device", &mut ranks, &SOFTMAX);
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());
    drop(backend);

    // Free loopback ports for the TCP group (released just before use).
    let peers: Vec<String> = (0..RANKS)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
            l.local_addr().expect("local address").to_string()
        })
        .collect();
    let peers = peers.join(",");
    let mut ranks = start_trainers(dir, "tcp", &data, &[], |_| {
        vec![
            ("DMLC_TRANSPORT", "tcp".to_string()),
            ("DMLC_TCP_PEERS", peers.clone()),
            ("DMLC_TCP_CONNECT_TIMEOUT_S", "60".to_string()),
        ]
    });
    let tcp_fp = check_job(dir, "tcp", "tcp", &mut ranks, &SOFTMAX);
    assert_eq!(
        device_fp, tcp_fp,
        "the device and TCP gave different models (both must reduce in rank order)"
    );
}

/// The demo's large model through the device: a 4.5 MB allreduce a step,
/// bitwise the same weights on both ranks, the single-process check
/// passed, and the report names the model.
#[test]
fn the_mlp_of_a_million_parameters_passes_over_the_device() {
    let data = common::data_path();
    let dir = temp_dir("digits-mlp");
    let dir = dir.path();
    let backend = start_backend();
    let args = ["--model", "mlp", "--batch", "4", "--steps", "6"];
    let mut ranks = start_trainers(dir, "mlp", &data, &args, |rank| {
        vec![
            ("DMLC_TRANSPORT", "device".to_string()),
            ("DMLC_SOCKET", backend.socket(rank).display().to_string()),
            ("DMLC_DMA_BYTES", "16M".to_string()),
        ]
    });
    // Six steps from the same start barely learn: the accuracy is not
    // checked, the rest is.
    let expect = Expect {
        steps: 6,
        accuracy: 0.0,
    };
    check_job(dir, "mlp", "device", &mut ranks, &expect);
    for rank in 0..RANKS {
        let out = ranks[rank as usize].stdout();
        assert!(
            out.contains("model mlp 64-1024-1024-10 (1126410 parameters)"),
            "{out}"
        );
        let json = fs::read_to_string(dir.join(format!("mlp-{rank}.json"))).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(doc["model"]["params"], 1_126_410, "{json}");
        assert_eq!(doc["settings"]["batch"], 4, "{json}");
    }
}

#[test]
fn a_missing_data_file_fails_clearly() {
    let dir = temp_dir("digits-missing");
    let out = trainer()
        .arg("--data")
        .arg(dir.path().join("nothing.csv.gz"))
        .output()
        .expect("run the trainer");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot load the data") && err.contains("nothing.csv.gz"),
        "{err}"
    );
}
