//! A VM paused through the QEMU monitor in the middle of a loop of
//! collectives: its requests stay pending (docs/spec.md 5.X.6.12), its peer
//! waits, and once the VM runs again both finish every collective and the
//! group goes on, with no loss and no generation change. Saving the
//! running VM (QMP `migrate`) is refused with a message that says how to
//! freeze the job first (docs/debugging.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dmlc_vm::qmp::Qmp;
use dmlc_vm::Options;
use serde_json::json;

use crate::common::{console, guest, metric, progress, setup, vm, wait_console, Backend, Vms};

/// `iter K ok` lines in a console.
fn ok_iters(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("iter ") && l.trim_end().ends_with(" ok"))
        .count()
}

fn qmp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("dmlc-qmp-{}-{name}.sock", std::process::id()))
}

#[test]
fn paused_vm_keeps_its_requests_and_the_group_goes_on() {
    let test = "paused_vm_keeps_its_requests_and_the_group_goes_on";
    let Some(env) = setup(test) else {
        return;
    };
    const ITERS: usize = 60;
    const PAUSE: Duration = Duration::from_secs(4);
    // A collective timeout far longer than the pause: only a device that
    // lost the paused member's requests could fail them.
    let mut backend = Backend::start(&env, "pause", 2, &["--timeout-ms", "120000"]);
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    // `--hold` keeps each device open after the loop, so that the checks
    // below see the group before the guests' own exit resets the devices.
    let job = guest(&format!(
        "debug allreduce --count 4096 --iters {ITERS} --hold"
    ));
    let qmp_sock = qmp_path("rank1");
    let _ = std::fs::remove_file(&qmp_sock);
    let mut specs = vec![
        vm(job.clone(), &backend.socket(0)),
        vm(job, &backend.socket(1)),
    ];
    specs[1].qemu_args.extend([
        "-qmp".to_owned(),
        format!("unix:{},server=on,wait=off", qmp_sock.display()),
    ]);
    let t = Instant::now();
    let group = Vms::start(&env, &specs, &opts);
    let mut qmp =
        Qmp::connect(&qmp_sock, Duration::from_secs(30)).unwrap_or_else(|e| panic!("QMP: {e}"));

    // A running VM is not saved (migration, snapshots): QEMU refuses and
    // says how to freeze the job first.
    let refused = qmp
        .execute("migrate", json!({ "uri": "exec:cat > /dev/null" }))
        .expect_err("migration of a running VM with the dmlc device must be refused")
        .to_string();
    assert!(
        refused.contains(
            "vhost-user-dmlc: a VM with vhost-user-dmlc migrates only while its job is frozen"
        ),
        "the refusal does not say how to freeze: {refused}"
    );
    progress(&format!("{test}: migrate refused: {refused}"));

    assert!(
        wait_console(&group, 1, Duration::from_secs(150), |c| ok_iters(c) >= 10),
        "rank 1 did not finish 10 allreduces:\n{}",
        console(&group, 1)
    );
    qmp.execute("stop", json!({}))
        .unwrap_or_else(|e| panic!("stop: {e}"));
    assert_eq!(qmp.status().unwrap_or_else(|e| panic!("{e}")), "paused");
    let paused_at = ok_iters(&console(&group, 0));
    std::thread::sleep(PAUSE);
    let during = ok_iters(&console(&group, 0));
    // Rank 0 can finish at most the collective rank 1 had already joined.
    assert!(
        during <= paused_at + 1,
        "rank 0 went on from {paused_at} to {during} allreduces without its peer"
    );
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()));
    assert_eq!(metric(&m, "dmlc_generation"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "dmlc_members_connected"), Some(2.0), "{m}");
    qmp.execute("cont", json!({}))
        .unwrap_or_else(|e| panic!("cont: {e}"));
    assert_eq!(qmp.status().unwrap_or_else(|e| panic!("{e}")), "running");

    for i in 0..2 {
        assert!(
            wait_console(&group, i, Duration::from_secs(200), |c| c
                .contains("\nholding")),
            "rank {i} did not finish its allreduces after the pause:\n{}",
            console(&group, i)
        );
        let text = console(&group, i);
        assert_eq!(
            ok_iters(&text),
            ITERS,
            "rank {i} did not finish every allreduce:\n{text}"
        );
        assert!(!text.contains(" error: "), "rank {i}:\n{text}");
    }
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    let log = backend.log_text();
    assert!(log.contains("rank 1: queue 0 stopped"), "{log}");
    assert!(
        !log.contains("member lost"),
        "a pause was taken for a loss:\n{log}"
    );
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()));
    assert_eq!(metric(&m, "dmlc_generation"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "dmlc_members_connected"), Some(2.0), "{m}");
    for status in ["peer_lost", "timeout", "reset"] {
        assert_eq!(
            metric(&m, &format!("dmlc_errors_total{{status=\"{status}\"}}")),
            Some(0.0),
            "{m}"
        );
    }
    // The jobs hold their devices until the VMs are killed (drop).
    drop(group);
    let _ = std::fs::remove_file(&qmp_sock);
    progress(&format!(
        "{test}: {ITERS} allreduces on 2 VMs, rank 1 paused {PAUSE:?} after 10, in {:.1?}",
        t.elapsed()
    ));
}
