//! Snapshot and restore of a frozen job (docs/debugging.md, spec
//! 5.X.6.15): a job frozen at one collective, every VM saved with
//! `snapshot`, every process of the job killed, and `dmlc-qemu restore`
//! continues it on a new backend and new QEMUs: it finishes with the
//! weights of an uninterrupted run, bit for bit (the digits MLP's
//! fingerprints; DDP's parameter digests, with the host's userland over
//! virtio-fs, whose virtiofsd moves its state too). While a VM runs, QEMU
//! refuses to save it, saying how to freeze first (`tests/system/pause.rs`).

use std::fs;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::control_request;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::freeze::{fingerprints, wait_frozen};
use super::{ddp_program, digits, progress, python_command, rank_value, setup, Env, Running};

/// Runs `frozen` (a submit that freezes, with control socket `ctl`) until
/// it is frozen, saves it into `saved`, kills it, and restores it; returns
/// the restored job's stdout once it succeeded.
fn snapshot_kill_restore(env: &Env, frozen: Command, ctl: &Path, saved: &Path) -> String {
    let _ = fs::remove_dir_all(saved);
    let mut run = Running::start(frozen);
    wait_frozen(&mut run);
    let ask = |what: &str| control_request(ctl, what, Duration::from_secs(30));
    ask(&format!("snapshot {}", saved.display())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let state: serde_json::Value = serde_json::from_str(&ask("frozen").unwrap()).unwrap();
        let s = &state["held"]["snapshot"];
        match s["state"].as_str() {
            Some("done") => break,
            Some("saving") if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(200));
            }
            _ => panic!(
                "the snapshot did not finish: {state:#}\n{}",
                run.stderr.lock().unwrap()
            ),
        }
    }
    // Everything of the first job dies at once: the launcher by SIGKILL,
    // its backend, QEMUs and virtiofsds with it.
    let pid = Pid::from_raw(i32::try_from(run.child.id()).unwrap());
    kill(pid, Signal::SIGKILL).unwrap();
    let (_, before, _, _) = run.finish(Duration::from_secs(60));
    assert!(!before.contains("PASS"), "the first job finished");

    let restore = env.command(&["restore", saved.to_str().unwrap(), "--timeout", "400"]);
    let (code, out, err, took) = Running::start(restore).finish(Duration::from_secs(500));
    progress(&format!("snapshot: the restored job ran {took:.1?}"));
    assert_eq!(code, Some(0), "the restored job failed");
    assert!(err.contains("restoring 2 VMs"), "no restore line");
    fs::remove_dir_all(saved).unwrap();
    out
}

#[test]
fn a_snapshot_restored_after_every_process_died_ends_as_an_uninterrupted_run() {
    let Some(env) = setup("snapshot") else { return };
    let (trainer, files) = digits();
    let job = |extra: &[&str]| {
        let mut args = vec!["submit", "-n", "2", "--timeout", "400"];
        args.extend_from_slice(extra);
        args.extend([
            "--files",
            &files,
            "--",
            trainer.to_str().unwrap(),
            "--model",
            "mlp",
            "--steps",
            "12",
        ]);
        env.command(&args)
    };
    let (code, plain, _, _) = Running::start(job(&[])).finish(Duration::from_secs(400));
    assert_eq!(code, Some(0), "the uninterrupted run failed");

    let ctl = env.tmp.path().join("ctl.sock");
    let saved = env.tmp.path().with_file_name("launcher-snapshot-saved");
    // Step 5: collective 7 (two come before the first step).
    let frozen = job(&[
        "--control-socket",
        ctl.to_str().unwrap(),
        "--freeze-at",
        "7",
    ]);
    let out = snapshot_kill_restore(&env, frozen, &ctl, &saved);
    // It went on from step 5: step 0 is not trained again.
    assert!(
        !out.contains("step 0 loss"),
        "the restored job started over"
    );
    assert_eq!(
        fingerprints(&out),
        fingerprints(&plain),
        "the restored job's weights differ"
    );
}

/// The same for DDP on the host's userland (`--host-root`): the restored
/// ranks end with the parameter digest of an uninterrupted run, and still
/// match the single-process replay exactly.
#[test]
fn a_ddp_job_restored_from_a_snapshot_ends_as_an_uninterrupted_run() {
    let Some(env) = setup("snapshot-ddp") else {
        return;
    };
    let program = ddp_program();
    let program: Vec<&str> = program.iter().map(String::as_str).collect();
    let name = "snapshot-ddp";
    let Some(plain) = python_command(&env, name, &[], &program, None) else {
        return;
    };
    let (code, plain, _, _) = Running::start(plain).finish(Duration::from_secs(560));
    assert_eq!(code, Some(0), "the uninterrupted DDP run failed");
    let want = rank_value(&plain, 0, "rank 0: params sha256").to_owned();

    let ctl = env.tmp.path().join("ctl.sock");
    let saved = env.tmp.path().with_file_name("launcher-snapshot-ddp-saved");
    let flags = [
        "--control-socket",
        ctl.to_str().unwrap(),
        "--freeze-at",
        "8",
    ];
    let frozen = python_command(&env, name, &flags, &program, None).unwrap();
    let out = snapshot_kill_restore(&env, frozen, &ctl, &saved);
    for r in 0..2 {
        let got = rank_value(&out, r, &format!("rank {r}: params sha256"));
        assert_eq!(
            got, want,
            "rank {r}: the restored DDP job's parameters differ"
        );
        let diff = rank_value(&out, r, &format!("rank {r}: max |params - single process|"));
        assert_eq!(
            diff, "0.000e+00",
            "rank {r}: not the single-process replay's"
        );
    }
}
