//! The slow steps before a job: QEMU (built and cached by
//! qemu-patches/build-qemu.sh), the guest image (tests/image/build-image.sh)
//! and the training data. The scripts' progress lines go straight to the
//! terminal, and a signal stops them.

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use dmlc_vm as vm;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::signals;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Harness(#[from] vm::Error),
    #[error("cannot run {0}")]
    Spawn(PathBuf, #[source] io::Error),
    #[error("{script} failed ({status}); its messages are above")]
    Failed { script: PathBuf, status: ExitStatus },
    #[error("{script} printed no {key} line")]
    Output { script: PathBuf, key: &'static str },
    #[error("no QEMU at {0} (DMLC_QEMU)")]
    NoQemu(PathBuf, #[source] io::Error),
    #[error("stopped by {}", signals::name(*.0))]
    Interrupted(i32),
}

/// Runs `bash SCRIPT ARGS` in its own process group, with stderr on ours
/// (its progress) and stdout captured and returned. On a signal the whole
/// group is killed (the scripts run apt-get, pip and ninja below them).
pub fn run_script(script: &Path, args: &[OsString]) -> Result<String, PrepareError> {
    let mut child = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .map_err(|e| PrepareError::Spawn(script.to_owned(), e))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(sig) = signals::received() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGTERM);
            }
            let _ = child.wait();
            let _ = reader.join();
            return Err(PrepareError::Interrupted(sig));
        }
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(PrepareError::Spawn(script.to_owned(), e)),
        }
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(PrepareError::Failed {
            script: script.to_owned(),
            status,
        });
    }
    Ok(out)
}

/// QEMU with the vhost-user-dmlc device: `DMLC_QEMU` if set, else the
/// patched build (built on the first run, with progress on the terminal).
pub fn qemu() -> Result<vm::Qemu, PrepareError> {
    if std::env::var_os("DMLC_QEMU").is_none() {
        let script = vm::repo_root()?.join("qemu-patches/build-qemu.sh");
        let t = Instant::now();
        crate::progress(&format!(
            "preparing QEMU ({}; only the first run builds it, about 4 minutes on 2 cores)",
            script.display()
        ));
        run_script(&script, &[])?;
        if t.elapsed() > Duration::from_secs(10) {
            crate::progress(&format!(
                "QEMU ready after {:.0} s",
                t.elapsed().as_secs_f64()
            ));
        }
    }
    // Cached now: the harness reads the binary and firmware paths.
    let qemu = vm::Qemu::from_env()?;
    // DMLC_QEMU is taken as it is: check it before booting anything.
    std::fs::metadata(&qemu.binary).map_err(|e| PrepareError::NoQemu(qemu.binary.clone(), e))?;
    Ok(qemu)
}

/// The guest image of `arch` with `extra` files (host path, absolute guest
/// path), debug info stripped from ELF files.
pub fn image(extra: &[(PathBuf, String)], arch: vm::Arch) -> Result<vm::Image, PrepareError> {
    let script = vm::Image::script()?;
    let files: Vec<(&Path, &str)> = extra
        .iter()
        .map(|(host, guest)| (host.as_path(), guest.as_str()))
        .collect();
    let opts = vm::ImageOptions { strip: true, arch };
    let args = vm::Image::script_args(&files, &opts);
    crate::progress(&format!(
        "preparing the {arch} guest image (tests/image/build-image.sh)"
    ));
    let out = run_script(&script, &args)?;
    Ok(vm::Image::from_script_output(&script, &out, arch)?)
}

/// Debian's root for `arch` guests (tests/image/build-rootfs.sh, minutes
/// the first time, then cached).
pub fn rootfs(arch: vm::Arch) -> Result<PathBuf, PrepareError> {
    let script = vm::repo_root()?.join("tests/image/build-rootfs.sh");
    crate::progress(&format!(
        "preparing the {arch} Debian root (tests/image/build-rootfs.sh; minutes the first time)"
    ));
    let out = run_script(&script, &["--arch".into(), arch.name().into()])?;
    out.lines()
        .rev()
        .find_map(|l| l.strip_prefix("DMLC_ROOTFS="))
        .map(PathBuf::from)
        .ok_or(PrepareError::Output {
            script,
            key: "DMLC_ROOTFS",
        })
}

/// The digits data (examples/digits/fetch-data.sh prints its path).
pub fn digits_data() -> Result<PathBuf, PrepareError> {
    let script = vm::repo_root()?.join("examples/digits/fetch-data.sh");
    crate::progress("fetching the digits data (examples/digits/fetch-data.sh)");
    let out = run_script(&script, &[])?;
    out.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .ok_or(PrepareError::Output {
            script,
            key: "path",
        })
}
