//! `dmlc-qemu submit --hosts` across two "hosts" (network namespaces), TCG
//! VMs in each, MPI between the two backends: tests/multihost-vms.sh, one
//! case per test.
//!
//! Run: `cargo test -p dmlc-qemu --test multihost -- --test-threads=1` with
//! `DMLC_BACKEND_BIN` naming an mpi build of the backend (`cargo build
//! --release -p vhost-device-dmlc --features mpi`), `DMLC_GUEST_BIN` a
//! dmlc-guest (release: it runs emulated), and the patched QEMU
//! (`DMLC_QEMU`, `DMLC_QEMU_FIRMWARE`, or qemu-patches/build-qemu.sh's
//! cache). Needs root, iproute2 and Open MPI's mpirun: without one of
//! these the tests print a SKIP line, except under CI (`CI` set and not
//! "", "false" or "0"), where they fail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use dmlc_vm as vm;

use dmlc_test_support::{env_or_workspace_file, missing_for_namespaces, under_ci, Built};

/// What is missing to run the cases here, if anything.
fn missing(backend: &Path, guest: &Path) -> Option<String> {
    if let Some(what) = missing_for_namespaces() {
        return Some(what);
    }
    if let Err(e) = vm::Qemu::from_env().and_then(|q| {
        std::fs::metadata(&q.binary).map_err(|source| vm::Error::Io {
            path: q.binary,
            source,
        })
    }) {
        return Some(format!(
            "the patched QEMU ({e}; set DMLC_QEMU or run qemu-patches/build-qemu.sh)"
        ));
    }
    if !guest.is_file() {
        return Some(format!(
            "dmlc-guest at {} (cargo build --release -p dmlc-guest; set DMLC_GUEST_BIN)",
            guest.display()
        ));
    }
    // An mpi build refuses `--mpi --queues 2`; one without the feature
    // says that it lacks MPI.
    let probe = Command::new(backend)
        .args([
            "--mpi",
            "--queues",
            "2",
            "--socket-path",
            "/nonexistent/p.sock",
        ])
        .output();
    let text = probe
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .unwrap_or_else(|e| e.to_string());
    if !text.contains("one request queue per member") {
        return Some(format!(
            "an mpi build of the backend at {} (cargo build --release -p vhost-device-dmlc \
             --features mpi; set DMLC_BACKEND_BIN); it said: {}",
            backend.display(),
            text.trim()
        ));
    }
    None
}

fn run(case: &str, local: usize) {
    let backend = env_or_workspace_file(
        "DMLC_BACKEND_BIN",
        "vhost-device-dmlc",
        Built::Bin("vhost-device-dmlc"),
    );
    let guest = env_or_workspace_file("DMLC_GUEST_BIN", "dmlc-guest", Built::Bin("dmlc-guest"));
    let test = format!("{case} with {local} VM(s) per host");
    if let Some(what) = missing(&backend, &guest) {
        assert!(
            !under_ci(),
            "launcher multi-host test {test} needs {what} (under CI it must run)"
        );
        let _ = writeln!(
            std::io::stderr(),
            "SKIP launcher multi-host test {test}: needs {what}"
        );
        return;
    }
    let bins = tempfile::Builder::new()
        .prefix("launcher-multihost-bin-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir");
    for (name, path) in [
        ("dmlc-qemu", PathBuf::from(env!("CARGO_BIN_EXE_dmlc-qemu"))),
        ("vhost-device-dmlc", backend),
        ("dmlc-guest", guest),
    ] {
        std::os::unix::fs::symlink(&path, bins.path().join(name)).expect("link");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/multihost-vms.sh");
    let out = Command::new("timeout")
        // TERM first, so that the script removes its namespaces.
        .args(["-k", "30", "900"])
        .arg(&script)
        .arg(bins.path())
        .arg(case)
        .arg(local.to_string())
        .output()
        .expect("run multihost-vms.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = writeln!(std::io::stderr(), "{text}");
    assert!(
        out.status.success(),
        "{test} failed ({}):\n{text}",
        out.status
    );
    assert!(
        text.contains(&format!("case {case} (L={local}) passed")),
        "{text}"
    );
}

#[test]
fn selftest_in_two_vms_per_host_on_two_hosts() {
    run("selftest", 2);
}

#[test]
fn a_failed_worker_on_one_host_stops_the_other_host() {
    run("fail", 1);
}

#[test]
fn ctrl_c_stops_every_host() {
    run("interrupt", 1);
}
