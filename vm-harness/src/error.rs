//! The harness's errors.

use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot find the repository root (set DMLC_REPO)")]
    NoRepoRoot,
    #[error("cannot run {what}")]
    Spawn {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{script} failed ({status}):\n{stderr}")]
    Script {
        script: PathBuf,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{script} printed no {key} line")]
    ScriptOutput { script: PathBuf, key: &'static str },
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "no QEMU for {arch} guests at {path} (qemu-patches/build-qemu.sh builds \
         x86_64, aarch64 and riscv64; with DMLC_QEMU, put qemu-system-{arch} beside it)"
    )]
    NoQemuFor { arch: crate::Arch, path: PathBuf },
    #[error("KVM runs only {host} guests here; vm {vm} is {arch} (use TCG: unset DMLC_ACCEL)")]
    KvmForeign {
        vm: usize,
        arch: crate::Arch,
        host: crate::Arch,
    },
    #[error("KVM was asked for but /dev/kvm cannot be opened")]
    NoKvm(#[source] io::Error),
    #[error("unknown DMLC_ACCEL value {0:?} (tcg or kvm)")]
    BadAccel(String),
    #[error("virtio-net needs at most 254 VMs, got {0}")]
    TooManyVms(usize),
    #[error("no saved state for vm {0} to resume")]
    NoSavedState(usize),
    #[error("vm {vm} exited ({status}) without printing its exit line")]
    EarlyExit { vm: usize, status: ExitStatus },
    #[error("vms {vms:?} printed no exit line within {after:?}")]
    Timeout { vms: Vec<usize>, after: Duration },
    #[error(
        "virtiofsd not found at {0}: build it once with vm-harness/build-virtiofsd.sh \
         (about 5 minutes; `build-virtiofsd.sh --env` prints DMLC_VIRTIOFSD=...) \
         or set DMLC_VIRTIOFSD to a virtiofsd binary"
    )]
    NoVirtiofsd(PathBuf),
    #[error("virtiofsd for vm {vm} did not start ({why}); its output:\n{output}")]
    VirtiofsdStart {
        vm: usize,
        why: String,
        output: String,
    },
    #[error("virtiofsd of vm {vm} exited ({status}) before the job's exit line")]
    VirtiofsdExit { vm: usize, status: ExitStatus },
    #[error("jobs failed: {0}")]
    JobFailed(String),
}

/// Creates an [`Error::Io`] for `path`.
pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}
