//! The kernel driver (kernel-driver/, `virtio_dmlc.ko`) in real guests:
//! its own tool `dmlc-ktest` on buffers from plain malloc on 2 and 4 VMs, a
//! non-root user through the group-accessible /dev/dmlc0, a process killed
//! mid-collective (nothing stays pinned, by the module's own counters, and
//! the group recovers), and `dmlc-guest --kernel` (the driver library's
//! kernel transport) running the self-test unchanged, and again on buffers
//! of its own heap handed to the device without a copy (`--caller-memory`).
//!
//! `DMLC_KMOD` and `DMLC_KTEST` name the module and the tool
//! (`eval "$(kernel-driver/build.sh | tail -n 2)"`); without them these
//! tests fail under `CI=true` and print a SKIP line otherwise.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dmlc_vm::{Image, ImageOptions, Options, VmSpec};

use crate::common::{console, progress, setup, vm, wait_console, Backend, Env, Vms};

/// Loads the module and binds the device (the image keeps it unbound).
const LOAD: &str = "guest-load.sh";

/// A user that is not root but in the device node's group, as the udev
/// rule of docs/kernel-driver.md makes it.
const ADD_USER: &str = "echo 'dmlc:x:1000:1000::/tmp:/bin/sh' >>/etc/passwd; \
     echo 'dmlc:x:1000:' >>/etc/group; chgrp dmlc /dev/dmlc0";

fn kernel_files() -> Option<(PathBuf, PathBuf)> {
    let kmod = std::env::var_os("DMLC_KMOD").map(PathBuf::from)?;
    let ktest = std::env::var_os("DMLC_KTEST").map(PathBuf::from)?;
    Some((kmod, ktest))
}

/// The system tests' image plus the module, its tool and the load script.
fn kernel_image(kmod: &Path, ktest: &Path) -> Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let guest = std::env::var_os("DMLC_GUEST_BIN").map(PathBuf::from);
            let load = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../kernel-driver/tools/guest-load.sh");
            let mut files = vec![
                (kmod, "/lib/dmlc/virtio_dmlc.ko"),
                (ktest, "/usr/bin/dmlc-ktest"),
                (load.as_path(), "/usr/bin/guest-load.sh"),
            ];
            if let Some(g) = guest.as_deref() {
                files.push((g, "/usr/bin/dmlc-guest"));
            }
            Image::build(&files, &ImageOptions { strip: true })
                .unwrap_or_else(|e| panic!("cannot build the kernel driver's image: {e}"))
        })
        .clone()
}

/// The environment with the kernel driver's image, or `None` (SKIP).
fn kernel_setup(test: &str) -> Option<Env> {
    let Some((kmod, ktest)) = kernel_files() else {
        let why = "DMLC_KMOD and DMLC_KTEST are not set (kernel-driver/build.sh)";
        if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0") {
            panic!("{test}: cannot run under CI=true: {why}");
        }
        progress(&format!("SKIP {test}: {why}"));
        return None;
    };
    let mut env = setup(test)?;
    env.image = kernel_image(&kmod, &ktest);
    Some(env)
}

fn kernel_vm(command: String, backend: &Backend, rank: usize) -> VmSpec {
    vm(format!("{LOAD} && {command}"), &backend.socket(rank))
}

fn run_group(env: &Env, backend: &Backend, commands: &[String], what: &str) -> Vec<String> {
    let specs: Vec<VmSpec> = commands
        .iter()
        .enumerate()
        .map(|(r, c)| kernel_vm(c.clone(), backend, r))
        .collect();
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    let t = Instant::now();
    let mut vms = Vms::start(env, &specs, &opts);
    let out = vms.wait_ok(what);
    progress(&format!("{what}: {:.1?}", t.elapsed()));
    out.into_iter().map(|o| o.output).collect()
}

/// Rank `r`'s own verdict line, printed by that rank.
fn assert_passed(out: &str, r: usize, what: &str) {
    let line = format!("rank {r}: all collectives ok");
    assert!(
        out.contains(&line),
        "{what}: rank {r} did not print {line:?}:\n{out}"
    );
}

#[test]
fn kernel_driver_selftest_on_malloc_buffers_2_and_4_vms_and_as_non_root() {
    let test = "kernel_driver_selftest_on_malloc_buffers_2_and_4_vms_and_as_non_root";
    let Some(env) = kernel_setup(test) else {
        return;
    };
    {
        let backend = Backend::start(&env, "kdrv2", 2, &[]);
        // The full self-test as root, then the quick one as user dmlc.
        let cmd = format!(
            "dmlc-ktest selftest && {ADD_USER} && su dmlc -c 'echo uid $(id -u); dmlc-ktest selftest --quick'"
        );
        let out = run_group(
            &env,
            &backend,
            &[cmd.clone(), cmd],
            "kernel selftest, 2 VMs",
        );
        for (r, o) in out.iter().enumerate() {
            assert_eq!(
                o.matches(&format!("rank {r}: all collectives ok")).count(),
                2,
                "rank {r} should pass as root and as user dmlc:\n{o}"
            );
            assert!(
                o.contains("uid 1000"),
                "rank {r} did not run as uid 1000:\n{o}"
            );
            assert!(
                o.contains("(8 device requests)"),
                "rank {r}: the large allreduce was not split into device requests:\n{o}"
            );
        }
    }
    let backend = Backend::start(&env, "kdrv4", 4, &[]);
    let cmds: Vec<String> = (0..4)
        .map(|_| "dmlc-ktest selftest --quick && dmlc-ktest bench --iters 50".into())
        .collect();
    let out = run_group(&env, &backend, &cmds, "kernel selftest and bench, 4 VMs");
    for (r, o) in out.iter().enumerate() {
        assert_passed(o, r, "4 VMs");
    }
    assert!(
        out[0].contains("kernel driver, malloc buffers, 4 ranks")
            && out[0].contains("ktest allreduce 64 MiB: median"),
        "rank 0 printed no bench table:\n{}",
        out[0]
    );
}

#[test]
fn kernel_driver_process_killed_mid_collective_leaves_nothing_pinned() {
    let test = "kernel_driver_process_killed_mid_collective_leaves_nothing_pinned";
    let Some(env) = kernel_setup(test) else {
        return;
    };
    // Rank 0 comes late: its selftest starts while rank 1's runs.
    let backend = Backend::start(&env, "kdrvkill", 2, &["--timeout-ms", "120000"]);
    // Rank 1 submits an allreduce that rank 0 does not join and is killed
    // in it, once it has said the request is in (no guess of how long that
    // takes); its last close resets the device. Rank 0's VM starts only
    // after the kill, so its first barrier cannot pair with the held
    // allreduce; then both ranks run the quick self-test.
    // (Braces: the module loads first, and $pid is dmlc-ktest's own.)
    let victim = "{ dmlc-ktest hold > /tmp/hold.log & pid=$!; \
         while kill -0 $pid && ! grep -q 'holding collective' /tmp/hold.log; do sleep 0.1; done; \
         cat /tmp/hold.log; kill -9 $pid; wait $pid; echo killed; \
         dmlc-ktest info; dmlc-ktest selftest --quick; }";
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    let t = Instant::now();
    let mut rank1 = Vms::start(&env, &[kernel_vm(victim.to_owned(), &backend, 1)], &opts);
    assert!(
        wait_console(&rank1, 0, Duration::from_secs(150), |c| c
            .lines()
            .any(|l| l.trim() == "killed")),
        "rank 1 did not get to the kill:\n{}",
        console(&rank1, 0)
    );
    let peer = "dmlc-ktest selftest --quick".to_owned();
    let mut rank0 = Vms::start(&env, &[kernel_vm(peer, &backend, 0)], &opts);
    let mut out = rank0.wait_ok("rank 0 after the kill");
    out.extend(rank1.wait_ok("rank 1, killed mid-collective"));
    progress(&format!("killed mid-collective: {:.1?}", t.elapsed()));
    let out: Vec<String> = out.into_iter().map(|o| o.output).collect();
    let v = &out[1];
    assert!(
        v.contains("holding collective 1"),
        "the held collective was not submitted (the test proves nothing):\n{v}"
    );
    let after = v
        .split("killed")
        .nth(1)
        .unwrap_or_else(|| panic!("rank 1 did not get past the kill:\n{v}"));
    assert!(
        after.contains("pinned_total 0 ") && after.contains("resets 1"),
        "after the kill the module should count no pinned pages and one reset:\n{v}"
    );
    assert!(
        backend
            .log_text()
            .contains("rank 1: device reset, member lost"),
        "the close did not reset the device:\n{}",
        backend.log_text()
    );
    assert_passed(&out[0], 0, "after the kill");
    assert_passed(v, 1, "after the kill");
}

#[test]
fn dmlc_guest_selftest_over_the_kernel_transport() {
    let test = "dmlc_guest_selftest_over_the_kernel_transport";
    let Some(env) = kernel_setup(test) else {
        return;
    };
    let backend = Backend::start(&env, "kdrvguest", 2, &[]);
    let cmd = format!(
        "dmlc-guest selftest --quick --kernel && \
         dmlc-guest selftest --quick --kernel --caller-memory --max-count 1025 && \
         dmlc-guest bench --kernel -b 4 -e 1M -f 512 -n 5 -w 1 && {ADD_USER} && \
         su dmlc -c 'dmlc-guest info --kernel'"
    );
    let out = run_group(&env, &backend, &[cmd.clone(), cmd], "dmlc-guest --kernel");
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.matches("selftest PASS: ").count() == 2 && o.contains(&format!("rank {r} of 2")),
            "rank {r}: dmlc-guest selftest over the kernel driver did not pass twice:\n{o}"
        );
        assert!(
            o.contains("buffers in the caller's memory"),
            "rank {r}: the selftest on the caller's own memory did not run:\n{o}"
        );
        assert!(
            o.contains(&format!("# rank {r} of 2: ok, #wrong 0")),
            "rank {r}: dmlc-guest bench over the kernel driver did not pass:\n{o}"
        );
        assert!(
            o.contains("transport     kernel (/dev/dmlc0)")
                && o.contains(&format!("rank          {r}\n")),
            "rank {r}: dmlc-guest info as user dmlc did not show the kernel transport:\n{o}"
        );
    }
}
