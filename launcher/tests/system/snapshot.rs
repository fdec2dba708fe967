//! Snapshot and restore of a frozen job (docs/debugging.md, spec
//! 5.X.6.15): the digits MLP frozen at step 5 (collective 7), every VM
//! saved with `snapshot`, every process of the job killed, and `dmlc-qemu
//! restore` continues it on a new backend and new QEMUs: it finishes with
//! the weights of an uninterrupted run, bit for bit (the fingerprints the
//! ranks print). Outside a frozen point QEMU refuses to save a VM, saying
//! how to freeze first (`tests/system/pause.rs`).

use std::fs;
use std::thread;
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::control_request;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::freeze::{fingerprints, wait_frozen};
use super::{digits, progress, setup, Running};

#[test]
fn a_snapshot_restored_after_every_process_died_ends_as_an_uninterrupted_run() {
    let Some(env) = setup("snapshot") else { return };
    let (trainer, files) = digits();
    let job = |sub: &str, extra: &[&str]| {
        let mut args = vec![sub, "-n", "2", "--timeout", "400"];
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
    let (code, plain, _, _) = Running::start(job("submit", &[])).finish(Duration::from_secs(400));
    assert_eq!(code, Some(0), "the uninterrupted run failed");
    let want = fingerprints(&plain);

    let ctl = env.tmp.path().join("ctl.sock");
    let saved = env.tmp.path().with_file_name("launcher-snapshot-saved");
    let _ = fs::remove_dir_all(&saved);
    let mut run = Running::start(job(
        "submit",
        &[
            "--control-socket",
            ctl.to_str().unwrap(),
            "--freeze-at",
            "7",
        ],
    ));
    wait_frozen(&mut run);
    let ask = |what: &str| control_request(&ctl, what, Duration::from_secs(30));
    ask(&format!("snapshot {}", saved.display())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
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
    // its backend and QEMUs with it.
    let pid = Pid::from_raw(i32::try_from(run.child.id()).unwrap());
    kill(pid, Signal::SIGKILL).unwrap();
    let (_, before, _, _) = run.finish(Duration::from_secs(60));
    assert!(
        !before.contains("model fingerprint"),
        "the first job finished"
    );

    let restore = env.command(&["restore", saved.to_str().unwrap(), "--timeout", "300"]);
    let (code, out, err, took) = Running::start(restore).finish(Duration::from_secs(400));
    progress(&format!("snapshot: the restored job ran {took:.1?}"));
    assert_eq!(code, Some(0), "the restored job failed");
    assert!(err.contains("restoring 2 VMs"), "no restore line");
    // It went on from step 5: step 0 is not trained again.
    assert!(
        !out.contains("step 0 loss"),
        "the restored job started over"
    );
    assert_eq!(
        fingerprints(&out),
        want,
        "the restored job's weights differ"
    );
    fs::remove_dir_all(&saved).unwrap();
}
