//! A job frozen at a consistent cut (docs/debugging.md): `submit
//! --freeze-at N` holds collective N once both ranks have arrived, the
//! launcher stops both VMs (checked here through their QMP sockets), the
//! backend says both ranks sit in collective N with nothing completed
//! past it, and after 30 s more than the collective timeout a `thaw`
//! resumes the job, which ends with no TIMEOUT and the same weights as the
//! same job unfrozen; the guests' own clocks did not count the freeze.

use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::control_request;
use dmlc_vm::qmp::Qmp;

use super::{digits, progress, rank_value, setup, Running};

/// The collective timeout of both runs (the daemon's --timeout-ms).
const TIMEOUT_MS: u64 = 5000;
/// The collective the job freezes at.
const AT: u64 = 10;

/// The model fingerprint each of the 2 ranks printed.
pub(super) fn fingerprints(out: &str) -> Vec<String> {
    (0..2)
        .map(|r| rank_value(out, r, &format!("rank {r} model fingerprint ")).to_owned())
        .collect()
}

/// Waits until the launcher says the job is frozen (every VM stopped and
/// the QMP socket of each rank printed); returns its stderr so far.
pub(super) fn wait_frozen(run: &mut Running) -> String {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let err = run.stderr.lock().unwrap().clone();
        if err.contains("frozen (freeze 1)") && err.contains("rank 1: QMP ") {
            return err;
        }
        assert!(
            Instant::now() < deadline && run.child.try_wait().unwrap().is_none(),
            "the job did not freeze:\n{err}\n{}",
            run.stdout.lock().unwrap()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_frozen_job_outlives_the_timeout_and_ends_as_an_unfrozen_one() {
    let Some(env) = setup("freeze") else { return };
    let (trainer, files) = digits();
    let timeout = format!("--backend-arg=--timeout-ms={TIMEOUT_MS}");
    let job = |extra: &[&str]| {
        let mut args = vec!["submit", "-n", "2", "--timeout", "400", &timeout];
        args.extend_from_slice(extra);
        args.extend([
            "--files",
            &files,
            "--",
            trainer.to_str().unwrap(),
            "--steps",
            "20",
        ]);
        env.command(&args)
    };

    let (code, plain, _, took) = Running::start(job(&[])).finish(Duration::from_secs(400));
    assert_eq!(code, Some(0), "the unfrozen run failed");
    progress(&format!("freeze: the unfrozen run took {took:.1?}"));
    let want = fingerprints(&plain);

    let ctl = env.tmp.path().join("ctl.sock");
    let at = AT.to_string();
    let mut run = Running::start(job(&[
        "--control-socket",
        ctl.to_str().unwrap(),
        "--freeze-at",
        &at,
    ]));
    // The launcher says so on stderr once both VMs are stopped.
    let err = wait_frozen(&mut run);
    let frozen_at = Instant::now();
    let qmp: Vec<PathBuf> = (0..2)
        .map(|r| {
            let head = format!("  rank {r}: QMP ");
            let line = err.lines().find_map(|l| l.strip_prefix(&head)).unwrap();
            PathBuf::from(line.split(';').next().unwrap().trim())
        })
        .collect();
    let paused = |when: &str| {
        for (r, path) in qmp.iter().enumerate() {
            let status = Qmp::connect(path, Duration::from_secs(30))
                .and_then(|mut q| q.status())
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(status, "paused", "rank {r}'s VM {when}");
        }
    };
    paused("once frozen");

    let ask = |what: &str| {
        control_request(&ctl, what, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let state: serde_json::Value = serde_json::from_str(&ask("state")).unwrap();
    let held = &state["freeze"]["held"];
    assert_eq!(held["phase"], "frozen", "{state:#}");
    assert_eq!(
        (held["queue"].as_u64(), held["seq"].as_u64()),
        (Some(0), Some(AT))
    );
    // Both ranks posted collective AT and nothing after it, and both of
    // their requests are still pending: no rank's collective AT completed.
    for m in state["members"].as_array().unwrap() {
        assert_eq!(m["next_seq"][0].as_u64(), Some(AT + 1), "{state:#}");
    }
    assert_eq!(state["requests_pending"].as_u64(), Some(2), "{state:#}");
    let inspect: serde_json::Value = serde_json::from_str(&ask("inspect")).unwrap();
    for m in inspect["members"].as_array().unwrap() {
        assert_eq!(m["header"]["opcode"], "allreduce", "{inspect:#}");
        assert_eq!(m["input"]["nan"], 0, "{inspect:#}");
    }

    let hold = Duration::from_millis(TIMEOUT_MS) + Duration::from_secs(30);
    thread::sleep(hold.saturating_sub(frozen_at.elapsed()));
    paused("after the hold");
    assert!(ask("thaw").contains("thawing"));
    let (code, out, err, took) = run.finish(Duration::from_secs(300));
    progress(&format!("freeze: the frozen run took {took:.1?}"));
    assert_eq!(code, Some(0), "the frozen run failed");
    assert!(err.contains("thawed (freeze 1)"), "no thaw line");
    for word in ["TIMEOUT", "timed out", "FAIL"] {
        assert!(!out.contains(word), "{word} in the output");
    }
    assert_eq!(fingerprints(&out), want, "the frozen run's weights differ");
    // The guests' CLOCK_MONOTONIC stopped with their VMs: each rank's own
    // time for the whole training (the frozen collective in it) is less
    // than the time the VMs were stopped (spec 5.X.6.15, "Frozen time").
    for r in 0..2 {
        let ms: f64 = rank_value(&out, r, "time total_ms ").parse().unwrap();
        assert!(
            ms < hold.as_secs_f64() * 1e3 - 1e3,
            "rank {r}: the guest counted {ms} ms of training across a {hold:?} freeze"
        );
    }
    env.assert_nothing_left();
}

/// A NaN that rank 1 puts in element 5 of its gradient at step 7 (the
/// trainer's `--inject-nan 1:7:5`), with the device's check on
/// (`DMLC_CHECK_FINITE=1`) and `--freeze-on-error`: the job freezes at that
/// step's allreduce (collective 9: two before the first step) before
/// anything is summed, `inspect` finds the NaN in rank 1's input at element
/// 5 and none in rank 0's, and once thawed the allreduce fails on both
/// ranks with an error naming step 7, rank 1 and element 5.
#[test]
fn a_nan_freezes_the_job_at_its_step_and_names_rank_and_element() {
    let Some(env) = setup("freeze-nan") else {
        return;
    };
    let (trainer, files) = digits();
    let ctl = env.tmp.path().join("ctl.sock");
    let args = [
        "submit",
        "-n",
        "2",
        "--timeout",
        "400",
        "--env",
        "DMLC_CHECK_FINITE=1",
        "--freeze-on-error",
        "--control-socket",
        ctl.to_str().unwrap(),
        "--files",
        &files,
        "--",
        trainer.to_str().unwrap(),
        "--steps",
        "20",
        "--inject-nan",
        "1:7:5",
    ];
    let mut run = Running::start(env.command(&args));
    wait_frozen(&mut run);
    let ask = |what: &str| {
        control_request(&ctl, what, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let j: serde_json::Value = serde_json::from_str(&ask("inspect")).unwrap();
    assert_eq!(j["seq"].as_u64(), Some(9), "{j:#}");
    assert!(
        j["reason"]
            .as_str()
            .unwrap()
            .contains("NONFINITE (rank 1, element 5)"),
        "{j:#}"
    );
    let input = |r: usize| &j["members"][r]["input"];
    assert_eq!(input(1)["nan"].as_u64(), Some(1), "{j:#}");
    assert_eq!(input(1)["first_non_finite"].as_u64(), Some(5), "{j:#}");
    assert_eq!(input(0)["nan"].as_u64(), Some(0), "{j:#}");
    ask("thaw");
    let (code, out, _, _) = run.finish(Duration::from_secs(300));
    assert_eq!(code, Some(2), "the trainer's status for a failed step");
    for r in 0..2 {
        let want = format!(
            "[rank {r}] dmlc-train-digits: training failed: step 7: the gradient allreduce \
             failed: non-finite input: rank 1's input holds a NaN or an infinity at element 5"
        );
        assert!(
            out.contains(&want),
            "rank {r} did not name rank 1 and element 5"
        );
    }
    env.assert_nothing_left();
}

/// Rank 1 crashes before step 7's allreduce (the trainer's `--crash 1:7`)
/// with `--freeze-on-error`: rank 0 is held in that allreduce instead of
/// failing, the job waits for the thaw instead of stopping it after its
/// grace time, `inspect` shows rank 1 lost, and once thawed rank 0 fails
/// with PEER_LOST naming rank 1; the job's status is rank 1's.
#[test]
fn a_crashed_rank_freezes_the_others_until_the_thaw() {
    let Some(env) = setup("freeze-lost") else {
        return;
    };
    let (trainer, files) = digits();
    let ctl = env.tmp.path().join("ctl.sock");
    let args = [
        "submit",
        "-n",
        "2",
        "--timeout",
        "400",
        "--freeze-on-error",
        "--control-socket",
        ctl.to_str().unwrap(),
        "--files",
        &files,
        "--",
        trainer.to_str().unwrap(),
        "--steps",
        "20",
        "--crash",
        "1:7",
    ];
    let mut run = Running::start(env.command(&args));
    wait_frozen(&mut run);
    let ask = |what: &str| {
        control_request(&ctl, what, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let j: serde_json::Value = serde_json::from_str(&ask("inspect")).unwrap();
    assert!(
        j["reason"]
            .as_str()
            .unwrap()
            .contains("PEER_LOST (rank 1 was lost)"),
        "{j:#}"
    );
    assert_eq!(j["members"][0]["arrived"], true, "{j:#}");
    assert_eq!(j["members"][1]["lost"], true, "{j:#}");
    // Held past the launcher's 5 s grace after rank 1's exit.
    thread::sleep(Duration::from_secs(8));
    assert!(
        run.child.try_wait().unwrap().is_none(),
        "the job ended while frozen"
    );
    ask("thaw");
    let (code, out, _, _) = run.finish(Duration::from_secs(300));
    assert_eq!(code, Some(3), "the job's status is the crashed rank's");
    assert!(
        out.contains(
            "[rank 0] dmlc-train-digits: training failed: step 7: the gradient allreduce \
             failed: collective failed: rank 1 was lost"
        ),
        "rank 0 did not fail at step 7 naming rank 1"
    );
    env.assert_nothing_left();
}
