//! Guests of other instruction sets (`submit --arch`): the device's
//! self-test (every opcode, dtype and op, each rank checking every result
//! against its own scalar reference) on 2 aarch64 VMs, on 2 riscv64 VMs,
//! and on one group of an x86_64, an aarch64 and a riscv64 VM; DDP across
//! that group, each VM on Debian's root of its architecture; and the
//! launcher's refusals (an unknown architecture, a program without a build
//! for the architecture asked, KVM for another architecture).
//!
//! The other architectures' programs are the cross-builds of
//! tests/image/cross-build.sh, beside the host's release build that
//! `DMLC_GUEST_BIN` names (target/TRIPLE/release/dmlc-guest).

use std::path::PathBuf;
use std::time::Duration;

use dmlc_test_support::{env_or_workspace_file, Built};
use dmlc_vm::Arch;

use super::{progress, rank_value, setup, Running, MAX_REFERENCE_ERROR};

/// The host's dmlc-guest; the launcher finds each architecture's build
/// from it.
fn guest_bin() -> PathBuf {
    env_or_workspace_file("DMLC_GUEST_BIN", "dmlc-guest", Built::Bin("dmlc-guest"))
}

/// `dmlc-qemu submit -n N --arch LIST -- dmlc-guest selftest --quick`
/// passes (every opcode, dtype and op; counts up to 4099: the full run's
/// counts up to 1048577 take minutes under TCG), and each rank says which
/// architecture it ran on.
fn selftest(name: &str, arches: &[Arch]) {
    let Some(env) = setup(name) else {
        return;
    };
    let list: Vec<&str> = arches.iter().map(|a| a.name()).collect();
    let list = list.join(",");
    let n = arches.len().max(2);
    let each: Vec<Arch> = (0..n).map(|r| arches[r % arches.len()]).collect();
    let bin = guest_bin();
    let n_str = n.to_string();
    let args = [
        "submit",
        "-n",
        &n_str,
        "--arch",
        &list,
        "--timeout",
        "900",
        "--",
        bin.to_str().unwrap(),
        "selftest",
        "--quick",
    ];
    let (code, out, err, took) =
        Running::start(env.command(&args)).finish(Duration::from_secs(1000));
    progress(&format!("{name}: selftest on {list} in {took:.1?}"));
    assert_eq!(code, Some(0), "the self-test failed:\n{out}\n{err}");
    for (rank, arch) in each.iter().enumerate() {
        let head = format!("[rank {rank}] # selftest: rank {rank} of {n} on {arch},");
        assert!(out.contains(&head), "no {head:?} line:\n{out}");
        let pass = format!("[rank {rank}] selftest PASS: ");
        let line = out
            .lines()
            .find(|l| l.starts_with(&pass))
            .unwrap_or_else(|| panic!("rank {rank} printed no PASS line:\n{out}"));
        assert!(line.contains(" 0 failed "), "{line}");
    }
    env.assert_nothing_left();
}

#[test]
fn selftest_on_two_aarch64_vms() {
    selftest("arch-aarch64", &[Arch::Aarch64]);
}

#[test]
fn selftest_on_two_riscv64_vms() {
    selftest("arch-riscv64", &[Arch::Riscv64]);
}

#[test]
fn selftest_across_three_instruction_sets() {
    selftest("arch-mixed", &[Arch::X86_64, Arch::Aarch64, Arch::Riscv64]);
}

#[test]
fn wrong_architectures_are_refused_before_anything_boots() {
    let Some(env) = setup("arch-refusals") else {
        return;
    };
    let bin = guest_bin();
    let bin = bin.to_str().unwrap();
    let run = |args: &[&str]| {
        let (code, _, err, _) = Running::start(env.command(args)).finish(Duration::from_secs(60));
        (code, err)
    };
    let (code, err) = run(&["submit", "-n", "2", "--arch", "sparc64", "--", bin]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unknown architecture \"sparc64\""), "{err}");
    let (code, err) = run(&["submit", "-n", "3", "--arch", "x86_64,aarch64", "--", bin]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--arch names 2 architectures for 3 workers"),
        "{err}"
    );
    let (code, err) = run(&[
        "submit", "-n", "2", "--arch", "aarch64", "--accel", "kvm", "--", bin,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--accel kvm runs only"), "{err}");
    // A host program with no build for the architecture: the launcher's
    // own binary has none under target/TRIPLE/.
    let launcher = env!("CARGO_BIN_EXE_dmlc-qemu");
    let (code, err) = run(&["submit", "-n", "2", "--arch", "riscv64", "--", launcher]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("is built for x86_64, and there is no riscv64 build of it"),
        "{err}"
    );
    assert!(err.contains("tests/image/cross-build.sh riscv64"), "{err}");
    env.assert_nothing_left();
}

/// DDP (examples/torch/train.py) on one group of an x86_64, an aarch64 and a
/// riscv64 VM, each on Debian trixie's root of its own architecture
/// (`--rootfs debian`: one PyTorch version, 2.6, on every rank) with the
/// dmlc package and that architecture's libdmlc_guest.so bound in. Every
/// rank gets the same averaged gradient from the device, but each computes
/// its own forward, backward and update, and the CPUs may round them
/// differently: the ranks print their drift from rank 0 at step 10
/// (then take rank 0's parameters) and after the last step, and each rank's
/// parameters are compared with its own single-process replay of the same
/// steps (`--reference`; rank 0's is an x86_64 run). All of these must stay
/// within the bound of the x86_64 DDP tests ([`MAX_REFERENCE_ERROR`]: a
/// device that drops one rank's gradient moves them by 4e-3); the measured
/// values go to the docs.
#[test]
fn ddp_trains_across_three_instruction_sets() {
    let Some(env) = setup("arch-ddp") else {
        return;
    };
    let repo = dmlc_vm::repo_root().unwrap();
    let library =
        env_or_workspace_file("DMLC_LIBRARY", "dmlc-capi", Built::Lib("libdmlc_guest.so"));
    let (_, data) = super::digits();
    let data_dir = PathBuf::from(data.split(':').next().unwrap())
        .parent()
        .unwrap()
        .to_owned();
    let n = ARCHES.len().to_string();
    let list = ARCHES.map(Arch::name).join(",");
    let args = [
        "submit",
        "-n",
        &n,
        "--arch",
        &list,
        "--host-root",
        "--rootfs",
        "debian",
        "--memory",
        "2G",
        "--bind",
        data_dir.to_str().unwrap(),
        "--timeout",
        "1500",
        // Under TCG the ranks finish `import torch` minutes apart (aarch64
        // last): the first collective waits for them past the backend's
        // default 30 s.
        "--backend-arg=--timeout-ms=900000",
        "--",
        "python3",
        "examples/torch/train.py",
        "--backend",
        "dmlc",
        "--hidden",
        "64",
        "--steps",
        "12",
        "--resync-every",
        "10",
        "--eval-samples",
        "100",
        "--data",
        data.split(':').next().unwrap(),
        "--reference",
    ];
    let mut cmd = env.command(&args);
    cmd.env("DMLC_LIBRARY", &library)
        .env("PYTHONPATH", repo.join("python/src"))
        .current_dir(&repo);
    let (code, out, err, took) = Running::start(cmd).finish(Duration::from_secs(1600));
    progress(&format!("arch-ddp: 3 VMs in {took:.0?}"));
    assert_eq!(code, Some(0), "DDP across {list} failed:\n{out}\n{err}");
    for (r, arch) in ARCHES.iter().enumerate() {
        let r = r as u32;
        let number = |prefix: &str| -> f64 {
            let v = rank_value(&out, r, &format!("rank {r}: {prefix}"));
            v.trim_end_matches(';').parse().unwrap()
        };
        for (what, v) in [
            ("drift at step 10", number("step 10: drift from rank 0")),
            ("drift at step 12", number("step 12: drift from rank 0")),
            ("replay error", number("max |params - single process|")),
        ] {
            assert!(
                v <= MAX_REFERENCE_ERROR,
                "rank {r} ({arch}): {what} {v:e} > {MAX_REFERENCE_ERROR:e}:\n{out}"
            );
            progress(&format!("arch-ddp: rank {r} ({arch}): {what} {v:.3e}"));
        }
    }
    assert!(out.contains("[rank 0] dmlc: 3 ranks"), "{out}");
    env.assert_nothing_left();
}

/// One VM of each instruction set.
const ARCHES: [Arch; 3] = [Arch::X86_64, Arch::Aarch64, Arch::Riscv64];
