//! The kernel driver (kernel-driver/, `virtio_dmlc.ko`) in real guests:
//! its own tool `dmlc-ktest` on buffers from plain malloc on 2 and 4 VMs
//! (on 2 with feature bits 1 to 3: the ABI's communicator fields and
//! replies, callers of the first ABI version, all-to-all, gather and
//! scatter split by the module; on 4 with the module's `comm=0`: the
//! headers of 5.X.6.1 and the fields refused), a non-root user through the
//! group-accessible /dev/dmlc0, a process killed mid-collective (nothing
//! stays pinned, by the module's own counters, and the group recovers),
//! `dmlc-guest --kernel` (the driver library's kernel transport) running
//! the self-test unchanged, and again on buffers of its own heap handed to
//! the device without a copy (`--caller-memory`), and the library's
//! communicators, send and receive, all-to-all, gather and scatter through
//! the module on 3 VMs; and the module cross-built for aarch64 and riscv64
//! guests, its collectives and the self-test through it on 2 VMs of each.
//!
//! `DMLC_KMOD` and `DMLC_KTEST` name the module and the tool
//! (`eval "$(kernel-driver/build.sh | tail -n 2)"`); without them these
//! tests fail under `CI=true` and print a SKIP line otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dmlc_vm::{program_for, Arch, Image, ImageOptions, Options, VmSpec};

use crate::common::{
    console, metric, metric_sum, progress, setup, vm, wait_console, Backend, Env, Vms,
};

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
            Image::build(
                &files,
                &ImageOptions {
                    strip: true,
                    ..ImageOptions::default()
                },
            )
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
    run_group_loaded(env, backend, commands, "", what)
}

/// Runs `commands[r]` in VM `r` once the module is loaded with `params`
/// (module parameters, e.g. `comm=0`; empty: the defaults).
fn run_group_loaded(
    env: &Env,
    backend: &Backend,
    commands: &[String],
    params: &str,
    what: &str,
) -> Vec<String> {
    let specs: Vec<VmSpec> = commands
        .iter()
        .enumerate()
        .map(|(r, c)| vm(format!("{LOAD} {params} && {c}"), &backend.socket(r)))
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

/// The most device requests dmlc-ktest reported for `opcode` in rank
/// `r`'s lines "rank R: OPCODE of N f32 ok (K device requests)".
fn most_requests(out: &str, r: usize, opcode: &str) -> u32 {
    let head = format!("rank {r}: {opcode} of ");
    out.lines()
        .filter(|l| l.starts_with(&head))
        .filter_map(|l| {
            let k = l
                .rsplit_once(" ok (")?
                .1
                .strip_suffix(" device requests)")?;
            k.parse().ok()
        })
        .max()
        .unwrap_or_else(|| panic!("rank {r} printed no {opcode} line:\n{out}"))
}

/// The lines of dmlc-guest selftest's communicator part (feature bits 1
/// to 3) that must have run and passed: those that make and free the
/// communicators (one line a run), then one line a dtype for each opcode
/// that moves data.
const COMM_SHAPE_LINES: [&str; 3] = ["comm_split", "comm_create", "comm_free"];
const COMM_DATA_LINES: [&str; 7] = [
    "send/recv",
    "alltoall ",
    "alltoallv",
    "gather ",
    "gatherv",
    "scatter ",
    "scatterv",
];

/// Checks that rank `r`'s output holds `runs` dmlc-guest selftests whose
/// communicator part ran and passed every line, on `dtypes` dtypes each.
fn assert_comm_part_passed(out: &str, r: usize, runs: usize, dtypes: usize) {
    assert!(
        !out.contains("# communicators: skipped")
            && !out.contains("# communicators: stopped")
            && !out.lines().any(|l| l.ends_with(" FAIL")),
        "rank {r}: the communicator part did not run, or failed:\n{out}"
    );
    let lines = COMM_SHAPE_LINES
        .iter()
        .map(|&name| (name, runs))
        .chain(COMM_DATA_LINES.iter().map(|&name| (name, runs * dtypes)));
    for (name, want) in lines {
        let passed = out
            .lines()
            .filter(|l| l.starts_with(name) && l.ends_with("PASS"))
            .count();
        assert_eq!(
            passed, want,
            "rank {r}: {passed} passing {name:?} lines, expected {want}:\n{out}"
        );
    }
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
            let twice = |line: &str| {
                assert_eq!(
                    o.matches(line).count(),
                    2,
                    "rank {r} should print {line:?} as root and as user dmlc:\n{o}"
                );
            };
            twice(&format!("rank {r}: all collectives ok"));
            // Feature bits 1 to 3 on the raw ABI: the module negotiated
            // them (the reference daemon offers them on one host).
            twice(&format!(
                "rank {r}: callers of the first ABI version (argsz 104, 136, 72): ok"
            ));
            // The split reverses the ranks: rank r is 1 - r in the new
            // communicator, whose id the device chose.
            let split = o
                .lines()
                .filter(|l| {
                    l.starts_with(&format!("rank {r}: comm_split: comm "))
                        && l.ends_with(&format!(" rank {} of 2, allreduce, comm_free: ok", 1 - r))
                })
                .count();
            assert_eq!(
                split, 2,
                "rank {r}: the raw comm_split did not pass twice:\n{o}"
            );
            twice(if r == 0 {
                "rank 0: sent 160 bytes to rank 1: ok"
            } else {
                "rank 1: received 160 bytes from any source (rank 0), room 200: ok"
            });
            assert!(
                o.contains("uid 1000"),
                "rank {r} did not run as uid 1000:\n{o}"
            );
            assert!(
                o.contains("(8 device requests)"),
                "rank {r}: the large allreduce was not split into device requests:\n{o}"
            );
            for opcode in ["alltoall", "gather", "scatter"] {
                let k = most_requests(o, r, opcode);
                assert!(
                    k >= 2,
                    "rank {r}: the large {opcode} was not split into device requests ({k}):\n{o}"
                );
            }
        }
    }
    // With comm=0 the module negotiates none of bits 1 to 3: 32-byte
    // headers and 16-byte responses, and the ABI's communicator fields
    // refused with EOPNOTSUPP.
    let backend = Backend::start(&env, "kdrv4", 4, &[]);
    let cmds: Vec<String> = (0..4)
        .map(|_| "dmlc-ktest selftest --quick && dmlc-ktest bench --iters 50".into())
        .collect();
    let out = run_group_loaded(
        &env,
        &backend,
        &cmds,
        "comm=0",
        "kernel selftest and bench, 4 VMs, comm=0",
    );
    for (r, o) in out.iter().enumerate() {
        assert_passed(o, r, "4 VMs");
        assert!(
            o.contains(&format!("rank {r}: no feature bit 1 (0x"))
                && o.contains("comm fields refused (EOPNOTSUPP): ok")
                && o.contains(&format!(
                    "rank {r}: callers of the first ABI version (argsz 104, 136, 72): ok"
                ))
                && !o.contains("comm_split"),
            "rank {r}: with comm=0 the module should negotiate no bit 1 and refuse the \
             communicator fields:\n{o}"
        );
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
        // The module negotiated feature bits 1 to 3: both runs went on to
        // the communicator part.
        assert_comm_part_passed(o, r, 2, 10);
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

/// The driver library's communicators through the module (feature bits 1
/// to 3 in `DMLC_IOC_SUBMIT`'s added fields and replies) on 3 VMs, an odd
/// group: `dmlc-guest selftest --kernel` makes communicators by
/// comm_split (ids, ranks and sizes checked against the formulas that
/// made them) and comm_create, runs a ring of sends and receives (from
/// any source on half the cases, and truncated), all-to-all(v),
/// gather(v) and scatter(v) on each, every rank checking its own output
/// against values it computes, and frees them; then `dmlc-guest bench`'s
/// send/receive ring (a receive and a send posted before either is waited
/// for: replies reaped by `DMLC_IOC_WAIT`) and all-to-all, checked the same
/// way.
#[test]
fn kernel_transport_runs_communicators_send_recv_and_block_collectives() {
    let test = "kernel_transport_runs_communicators_send_recv_and_block_collectives";
    let Some(env) = kernel_setup(test) else {
        return;
    };
    let n = 3;
    let backend = Backend::start(&env, "kdrvcomm", n, &[]);
    // Only the communicator part, on one dtype of each element size (the
    // 2-VM test above runs every dtype).
    let opcodes: String = [
        "send",
        "alltoall",
        "alltoallv",
        "gather",
        "gatherv",
        "scatter",
        "scatterv",
        "comm_split",
    ]
    .iter()
    .map(|o| format!(" --opcode {o}"))
    .collect();
    let cmd = format!(
        "dmlc-guest info --kernel && \
         dmlc-guest selftest --quick --kernel{opcodes} --dtype u8 --dtype f16 --dtype f32 --dtype f64 && \
         dmlc-guest bench --kernel --opcode sendrecv -b 4 -e 64K -f 16 -n 5 -w 1 && \
         dmlc-guest bench --kernel --opcode alltoall -b 4 -e 64K -f 16 -n 5 -w 1"
    );
    let cmds = vec![cmd; n];
    let out = run_group(
        &env,
        &backend,
        &cmds,
        "dmlc-guest --kernel communicators, 3 VMs",
    );
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.contains("transport     kernel (/dev/dmlc0)"),
            "rank {r}: not on the kernel transport:\n{o}"
        );
        assert!(
            o.lines()
                .any(|l| l.starts_with("selftest PASS: ")
                    && l.ends_with(&format!(", rank {r} of {n}"))),
            "rank {r}: the selftest did not pass:\n{o}"
        );
        assert_comm_part_passed(o, r, 1, 4);
        assert_eq!(
            o.matches(&format!("# rank {r} of {n}: ok, #wrong 0"))
                .count(),
            2,
            "rank {r}: the send/receive and all-to-all benches did not both pass:\n{o}"
        );
    }
    // The device served every opcode (the guests had no other way to it
    // than the module), and the only errors were the truncations the
    // self-test makes on purpose.
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics after the run: {e}"));
    for opcode in [
        "send",
        "recv",
        "alltoall",
        "alltoallv",
        "gather",
        "gatherv",
        "scatter",
        "scatterv",
        "comm_split",
        "comm_create",
        "comm_free",
    ] {
        let name = format!("dmlc_requests_total{{opcode=\"{opcode}\"}}");
        assert!(
            metric(&m, &name).is_some_and(|v| v > 0.0),
            "the device served no {opcode}:\n{m}"
        );
    }
    let truncated = metric(&m, "dmlc_errors_total{status=\"truncate\"}").unwrap_or(0.0);
    assert!(
        truncated > 0.0,
        "no truncated message reached the device:\n{m}"
    );
    assert_eq!(
        metric_sum(&m, "dmlc_errors_total") - truncated,
        0.0,
        "errors other than the truncations the self-test makes:\n{m}"
    );
}

/// The module and dmlc-ktest of `arch`, cross-built by
/// `kernel-driver/build.sh --arch ARCH` (cached after the first run).
fn cross_kernel_files(arch: Arch) -> (PathBuf, PathBuf) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kernel-driver/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args(["--arch", arch.name()])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kernel-driver/build.sh --arch {arch} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("kernel-driver/build.sh printed no {key}:\n{stdout}"))
    };
    (value("DMLC_KMOD="), value("DMLC_KTEST="))
}

/// The module cross-built for aarch64 and riscv64 guests (6.1 and 6.12
/// kernels) in 2 VMs of each: dmlc-ktest's collectives on malloc buffers
/// and `dmlc-guest selftest --quick --kernel` (every opcode, dtype and op
/// through the module), each rank checking its own results.
#[test]
fn kernel_driver_on_aarch64_and_riscv64_guests() {
    let test = "kernel_driver_on_aarch64_and_riscv64_guests";
    for arch in [Arch::Aarch64, Arch::Riscv64] {
        let Some(mut env) = setup(test) else {
            return;
        };
        let (kmod, ktest) = cross_kernel_files(arch);
        let host_guest = std::env::var_os("DMLC_GUEST_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{test}: DMLC_GUEST_BIN names no host dmlc-guest"));
        let guest = program_for(&host_guest, arch).unwrap_or_else(|e| panic!("{test}: {e}"));
        let load =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kernel-driver/tools/guest-load.sh");
        let files = [
            (kmod.as_path(), "/lib/dmlc/virtio_dmlc.ko"),
            (ktest.as_path(), "/usr/bin/dmlc-ktest"),
            (load.as_path(), "/usr/bin/guest-load.sh"),
            (guest.as_path(), "/usr/bin/dmlc-guest"),
        ];
        let opts = ImageOptions { strip: true, arch };
        env.image = Image::build(&files, &opts)
            .unwrap_or_else(|e| panic!("cannot build the {arch} kernel driver image: {e}"));
        let backend = Backend::start(&env, &format!("kdrv-{arch}"), 2, &[]);
        let cmd = "dmlc-ktest selftest && dmlc-guest selftest --quick --kernel".to_owned();
        let out = run_group(
            &env,
            &backend,
            &[cmd.clone(), cmd],
            &format!("kernel driver on 2 {arch} VMs"),
        );
        for (r, o) in out.iter().enumerate() {
            assert_passed(o, r, arch.name());
            assert!(
                o.contains(&format!("# selftest: rank {r} of 2 on {arch},"))
                    && o.contains("selftest PASS: "),
                "rank {r}: dmlc-guest --kernel on {arch} did not pass:\n{o}"
            );
        }
    }
}
