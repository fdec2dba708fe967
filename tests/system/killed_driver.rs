//! A guest driver killed with SIGKILL while its collective is pending must
//! not leave the device able to write into its memory later: the pages go
//! back to the guest kernel and another process may own them by the time
//! the peer arrives.
//!
//! The driver holds uio_pci_generic's file whatever its wait mode, so the
//! kernel's release of that file turns bus mastering off, the patched QEMU
//! resets the backend's device (RESET_DEVICE), and the backend drops the
//! member's request before answering.

use std::time::{Duration, Instant};

use dmlc_vm::Options;

use crate::common::{console, guest, metric, progress, setup, vm, wait_console, Backend, Vms};

#[test]
fn killed_driver_leaves_no_dma_into_its_freed_hugepages() {
    let test = "killed_driver_leaves_no_dma_into_its_freed_hugepages";
    let Some(env) = setup(test) else {
        return;
    };
    // The peer's collective ends by this timeout once rank 1 is gone.
    let mut backend = Backend::start(&env, "killdrv", 2, &["--timeout-ms", "15000"]);
    let opts = Options {
        timeout: Duration::from_secs(240),
        ..env.opts.clone()
    };
    // Rank 1 posts a 256 KiB allreduce (polling: no interrupt file of its
    // own) and is killed while it waits for rank 0; then another process
    // takes every free hugepage and watches it for 60 s.
    let driver = guest("--poll debug allreduce --count 65536 --iters 1");
    let victim = format!(
        "{driver} & pid=$!; sleep 8; kill -9 $pid; wait $pid; \
         echo driver killed; pci_probe --hugefill 60"
    );
    let mut spec = vm(victim, &backend.socket(1));
    spec.bind = Some("uio_pci_generic".to_owned());
    let t = Instant::now();
    let mut rank1 = Vms::start(&env, &[spec], &opts);
    assert!(
        wait_console(&rank1, 0, Duration::from_secs(150), |c| c
            .contains("hugefill ready")),
        "rank 1 did not get to take the hugepages:\n{}",
        console(&rank1, 0)
    );
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()));
    assert_eq!(
        metric(&m, "dmlc_requests_total{opcode=\"allreduce\"}"),
        Some(1.0),
        "rank 1's allreduce was not posted before the kill (the test proves nothing):\n{m}"
    );
    let log = backend.log_text();
    assert!(
        log.contains("rank 1: device reset, member lost"),
        "the driver's death did not reset the device:\n{log}"
    );

    // Rank 0 arrives: the collective must not run with rank 1's old
    // buffers (it can only time out).
    let rank0 = guest("debug allreduce --count 65536 --iters 1");
    let mut peer = Vms::start(&env, &[vm(rank0, &backend.socket(0))], &opts);
    let peer_out = peer.wait().unwrap_or_else(|e| panic!("rank 0: {e}"));
    let text0 = console(&peer, 0);
    assert_ne!(
        peer_out[0].status, 0,
        "rank 0's allreduce succeeded:\n{text0}"
    );
    assert!(
        text0.contains("iter 0 error: timeout"),
        "rank 0 should time out waiting for the lost rank 1:\n{text0}"
    );

    let out1 = rank1.wait().unwrap_or_else(|e| panic!("rank 1: {e}"));
    let text1 = console(&rank1, 0);
    assert!(
        text1.contains("hugefill clean"),
        "the killed driver's pages were written after its death:\n{text1}"
    );
    assert_eq!(out1[0].status, 0, "rank 1's job failed:\n{text1}");
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    progress(&format!(
        "{test}: rank 1 killed mid-collective, its hugepages stayed clean, in {:.1?}",
        t.elapsed()
    ));
}

/// A device reset the driver did not ask for (here: bus mastering turned
/// off through sysfs, which makes the patched QEMU send RESET_DEVICE) while
/// its collective waits: the backend drops the member's request and bumps
/// the generation, and the driver's wait ends at once with an error that
/// says so (DRIVER_OK cleared, or the request dropped: spec 5.X.7.4,
/// whichever look at the device comes first) instead of lasting until its
/// bound.
#[test]
fn a_reset_behind_the_drivers_back_ends_its_wait_at_once() {
    let test = "a_reset_behind_the_drivers_back_ends_its_wait_at_once";
    let Some(env) = setup(test) else {
        return;
    };
    // Rank 1 never comes: without the drop, rank 0 would wait 120 s.
    let backend = Backend::start(&env, "dropped", 2, &["--timeout-ms", "120000"]);
    let driver = guest("debug allreduce --count 4 --iters 1");
    let job = format!(
        "{driver} > /tmp/driver.log 2>&1 & pid=$!; sleep 5; \
         printf '\\002' | dd of=/sys/bus/pci/devices/0000:00:01.0/config bs=1 seek=4 \
         conv=notrunc 2>/dev/null; echo bus mastering off; \
         wait $pid; echo \"driver exit $?\"; cat /tmp/driver.log"
    );
    let mut spec = vm(job, &backend.socket(0));
    spec.bind = Some("uio_pci_generic".to_owned());
    let t = Instant::now();
    let mut vms = Vms::start(&env, &[spec], &env.opts);
    let out = vms.wait_ok("1 VM");
    let text = &out[0].output;
    let log = backend.log_text();
    assert!(
        log.contains("rank 0: device reset, member lost"),
        "turning bus mastering off did not reset the device:\n{log}"
    );
    assert!(
        text.contains("generation changed from 1 to 2 while the request was in flight")
            || text.contains("the device was reset behind the driver: DRIVER_OK cleared"),
        "the driver did not report the reset:\n{text}"
    );
    let exit = text.lines().find_map(|l| l.strip_prefix("driver exit "));
    assert!(
        exit.is_some_and(|c| c != "0"),
        "the driver must fail: {exit:?}\n{text}"
    );
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(100),
        "the wait lasted until some other bound ({took:?}):\n{text}"
    );
    progress(&format!("{test}: the driver failed at once, in {took:.1?}"));
}
