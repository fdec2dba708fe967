//! The daemon's `--timing`, `--trace-out` and `--trace-capacity` as a
//! process: the file's errors, a modelled collective through real sockets,
//! an injected straggler in the metrics, and the trace written on SIGUSR1
//! and at exit.

use std::time::{Duration, Instant};

use dmlc_test_support::frontend::Member;
use dmlc_test_support::{free_local_addr, metric, run_backend, temp_dir, Backend, PATIENCE};
use serde_json::Value;
use vhost::vhost_user::VhostUserVirtioFeatures;
use virtio_dmlc::{Status, VIRTIO_F_VERSION_1};

/// Connects one member per socket, each with one queue.
fn members(daemon: &Backend) -> Vec<Member> {
    let features = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() | 1 << VIRTIO_F_VERSION_1;
    (0..daemon.ranks())
        .map(|r| {
            let mut m = Member::connect(&daemon.socket(r));
            m.start(features, 1, 64);
            m
        })
        .collect()
}

#[test]
fn bad_timing_options_fail_with_the_field_named() {
    let dir = temp_dir("timing-bad");
    let base = dir.path().join("d.sock");
    let base = base.to_str().unwrap();
    let file = dir.path().join("t.toml");
    std::fs::write(&file, "[model]\nkind = \"ring\"\nalpha_us = 10\n").unwrap();
    let file = file.to_str().unwrap();
    let missing = dir.path().join("none.toml");
    let missing = missing.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&["--timing", file], "model.bandwidth_gbs is required"),
        (&["--timing", missing], "cannot read the timing file"),
        (
            &["--trace-capacity", "5"],
            "--trace-capacity needs --trace-out",
        ),
        (
            &["--trace-out", "/tmp/x.json", "--trace-capacity", "0"],
            "--trace-capacity must be at least 1",
        ),
    ];
    for (extra, message) in cases {
        let mut args = vec!["--socket-path", base, "--socket-count", "2"];
        args.extend_from_slice(extra);
        let out = run_backend(&args, PATIENCE);
        assert!(!out.exit_status().success(), "{extra:?}");
        let err = out.stderr();
        assert!(err.contains(message), "{extra:?}: {err}");
    }
}

#[test]
fn a_modelled_straggler_through_the_sockets_and_its_trace() {
    let dir = temp_dir("timing-run");
    let timing = dir.path().join("t.toml");
    // 2 real members for 8 modelled ranks: 14 * 5 ms = 70 ms per barrier;
    // rank 1 arrives 30 ms late on purpose.
    std::fs::write(
        &timing,
        "seed = 1\n[model]\nkind = \"ring\"\nworld = 8\nalpha_us = 5000\nbandwidth_gbs = 1\n\
         [[delay]]\nranks = [1]\ndist = \"constant\"\nus = 30000\n",
    )
    .unwrap();
    let trace = dir.path().join("trace.json");
    let addr = free_local_addr();
    let mut daemon = Backend::start_in(
        dir,
        2,
        &[
            "--timing",
            timing.to_str().unwrap(),
            "--trace-out",
            trace.to_str().unwrap(),
            "--metrics-addr",
            &addr,
        ],
    );
    let mut ms = members(&daemon);
    for _ in 0..2 {
        let took = barrier_round(&mut ms);
        assert!(took >= Duration::from_millis(100), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
    assert_eq!(metric(&addr, "dmlc_injected_delays_total"), 2.0);
    assert_eq!(
        metric(&addr, "dmlc_straggler_skew_seconds_bucket{le=\"0.01\"}"),
        0.0
    );
    // One observation per member and collective.
    assert_eq!(metric(&addr, "dmlc_model_error_seconds_count"), 4.0);

    daemon.proc.signal(libc::SIGUSR1);
    daemon.wait_for_log("trace written to");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let delays: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "injected delay")
        .collect();
    assert_eq!(delays.len(), 2);
    // On rank 1's track (pid 2), 30 ms long.
    for e in &delays {
        assert_eq!(e["pid"], 2);
        assert!((e["dur"].as_f64().unwrap() - 30_000.0).abs() < 1.0, "{e}");
    }
    for e in events {
        assert!(e["ph"].is_string() && e["pid"].is_u64() && e["tid"].is_u64());
        assert!(e["name"].is_string());
    }

    // At exit the trace is written again (a fresh file).
    std::fs::remove_file(&trace).unwrap();
    assert!(daemon.terminate(PATIENCE).success());
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(doc["otherData"]["records"], 2);
}

/// Runs dmlc-ctl with `args` against `socket`: (success, stdout, stderr).
fn ctl(socket: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dmlc-ctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One barrier on every member; the time it took.
fn barrier_round(ms: &mut [Member]) -> Duration {
    let t = Instant::now();
    let pend: Vec<(u16, u64)> = ms.iter_mut().map(|m| m.barrier(0, 0)).collect();
    for (m, (head, resp)) in ms.iter_mut().zip(&pend) {
        let (h, _) = m.wait_used(0);
        assert_eq!(h, *head);
        assert_eq!(m.read_resp(*resp).status.get(), Status::Ok.raw());
    }
    t.elapsed()
}

#[test]
fn live_control_changes_the_timing_while_the_group_runs() {
    let dir = temp_dir("timing-ctl");
    let sock = dir.path().join("ctl.sock");
    let trace = dir.path().join("trace.json");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[model]\nkind = \"ring\"\nalpha_us = 1\n").unwrap();
    let ring = dir.path().join("ring.toml");
    // 2 modelled ranks: 2 * 1 * 20 ms per barrier.
    std::fs::write(
        &ring,
        "[model]\nkind = \"ring\"\nalpha_us = 20000\nbandwidth_gbs = 1\n",
    )
    .unwrap();
    let daemon = Backend::start_in(
        dir,
        2,
        &[
            "--control-socket",
            sock.to_str().unwrap(),
            "--trace-out",
            trace.to_str().unwrap(),
        ],
    );
    let mut ms = members(&daemon);
    // The control socket has the vhost-user sockets' mode (0600).
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let (ok, out, err) = ctl(&sock, &["state"]);
    assert!(ok, "{err}");
    let state: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(state["world_size"], 2);
    assert_eq!(state["generation"], 1);
    assert_eq!(state["timing"]["model"], "Ideal");
    assert_eq!(state["members"][1]["connected"], true);
    barrier_round(&mut ms);

    let (ok, _, err) = ctl(&sock, &["delay", "1", "50000"]);
    assert!(ok, "{err}");
    let took = barrier_round(&mut ms);
    assert!(took >= Duration::from_millis(50), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    let (ok, _, err) = ctl(&sock, &["load", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("model.bandwidth_gbs is required"), "{err}");
    let (ok, _, err) = ctl(&sock, &["load", ring.to_str().unwrap()]);
    assert!(ok, "{err}");
    let took = barrier_round(&mut ms);
    assert!(took >= Duration::from_millis(40), "{took:?}");
    let (ok, out, _) = ctl(&sock, &["metrics"]);
    assert!(ok);
    // The live delay applied once; the loaded file has none.
    assert!(out.contains("dmlc_injected_delays_total 1\n"), "{out}");

    let (ok, out, err) = ctl(&sock, &["trace"]);
    assert!(ok, "{err}");
    let doc: Value = serde_json::from_str(&out).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e["name"] == "injected delay" && e["pid"] == 2)
            .count(),
        1
    );
    let (ok, out, err) = ctl(&sock, &["summary", "60000"]);
    assert!(ok, "{err}");
    // Of the 3 barrier rounds, rank 1 arrived last in the delayed one.
    assert!(
        out.lines().nth(1).is_some_and(|l| l.contains("rank")),
        "{out}"
    );
    let (ok, out, _) = ctl(&sock, &["dump"]);
    assert!(ok && out.contains("trace.json"), "{out}");
    assert!(trace.exists());

    for (args, want) in [
        (&["explode"][..], "unknown request"),
        (&["delay", "2", "10"][..], "RANK must be a rank below 2"),
        (&["delay", "1", "-3"][..], "US must be a number"),
    ] {
        let (ok, _, err) = ctl(&sock, args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
}
