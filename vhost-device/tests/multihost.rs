//! One group across two "hosts" (network namespaces) with MPI between the
//! daemons: vhost-device/tests/multihost.sh, one case per test. Built only
//! with the `mpi` feature (`cargo test -p vhost-device-dmlc --features mpi
//! --test multihost -- --test-threads=1`). Needs root, iproute2 and Open
//! MPI's mpirun: without them the tests skip with a message, except under
//! CI (`CI` set and not "", "false" or "0"), where they fail.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;

use dmlc_test_support::{missing_for_namespaces as missing, under_ci};

/// A folder with links to both binaries: vhost-device-dmlc of this build
/// (with the feature) and dmlc-guest.
fn bin_dir() -> dmlc_test_support::TempDir {
    let dir = dmlc_test_support::temp_dir("multihost-bin");
    let daemon = PathBuf::from(env!("CARGO_BIN_EXE_vhost-device-dmlc"));
    std::os::unix::fs::symlink(daemon, dir.path().join("vhost-device-dmlc")).expect("link");
    std::os::unix::fs::symlink(
        dmlc_test_support::guest_bin(),
        dir.path().join("dmlc-guest"),
    )
    .expect("link");
    dir
}

fn run(case: &str) {
    if let Some(what) = missing() {
        assert!(
            !under_ci(),
            "multi-host test {case} needs {what} (under CI it must run)"
        );
        eprintln!("SKIP multi-host test {case}: needs {what}");
        return;
    }
    let bins = bin_dir();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/multihost.sh");
    let out = Command::new("timeout")
        // TERM first, so that the script removes its namespaces.
        .args(["-k", "20", "240"])
        .arg(&script)
        .arg(bins.path())
        .arg(case)
        .output()
        .expect("run multihost.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "case {case} failed ({}):\n{text}",
        out.status
    );
    assert!(text.contains(&format!("case {case} passed")), "{text}");
}

#[test]
fn every_opcode_one_member_per_host() {
    run("selftest-l1");
}

#[test]
fn every_opcode_two_members_per_host_against_the_hierarchical_reference() {
    run("selftest-l2");
}

#[test]
fn reductions_in_many_pieces_match_the_hierarchical_reference() {
    run("pipelined");
}

#[test]
fn mismatch_on_one_host_fails_both() {
    run("mismatch");
}

#[test]
fn killed_member_gives_peer_lost_on_every_host_and_the_group_serves_again() {
    run("kill-member");
}

#[test]
fn killed_daemon_gives_the_other_hosts_members_reset_and_the_job_ends() {
    run("kill-daemon");
}
