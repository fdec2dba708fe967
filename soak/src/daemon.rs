//! The daemons under test: where the binary is, starting one per group in
//! a private folder, stopping them, and sampling their memory and fds.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::{socket_path, Sockets, WaitError};
use serde::Serialize;
use tempfile::TempDir;
use thiserror::Error;

/// Name of the daemon binary.
pub const BACKEND_NAME: &str = "vhost-device-dmlc";
/// How long a daemon may take to create its sockets.
const SOCKETS_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("finding this program's path failed")]
    CurrentExe(#[source] io::Error),
    #[error(
        "daemon binary {0} not found: build it (cargo build --release -p vhost-device-dmlc) or \
         give --backend PATH or DMLC_BACKEND_BIN"
    )]
    Missing(PathBuf),
    #[error("creating the socket folder {0} failed")]
    TempDir(PathBuf, #[source] io::Error),
    #[error("starting the daemon {0} failed")]
    Spawn(PathBuf, #[source] io::Error),
    #[error("daemon of group {group} exited before its sockets appeared ({status})")]
    Exited { group: String, status: ExitStatus },
    #[error("daemon of group {group} did not create its sockets within {SOCKETS_TIMEOUT:?}")]
    NoSockets { group: String },
    #[error("waiting for the daemon of group {group} failed")]
    Wait {
        group: String,
        #[source]
        source: io::Error,
    },
}

/// The daemon binary: `explicit` if given, else the one next to this
/// program.
pub fn backend_path(explicit: Option<&Path>) -> Result<PathBuf, DaemonError> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .map_err(DaemonError::CurrentExe)?
            .with_file_name(BACKEND_NAME),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(DaemonError::Missing(path))
    }
}

/// A private folder (mode 0700) for the sockets, removed on drop; its
/// name carries this process's pid.
pub fn temp_dir() -> Result<TempDir, DaemonError> {
    let prefix = format!("dmlc-soak-{}-", std::process::id());
    tempfile::Builder::new()
        .prefix(&prefix)
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir()
        .map_err(|e| DaemonError::TempDir(std::env::temp_dir().join(prefix + "*"), e))
}

/// One group's daemon; killed and reaped on drop.
pub struct Daemon {
    child: Child,
    base: PathBuf,
}

/// How to start one daemon.
pub struct DaemonSpec<'a> {
    pub binary: &'a Path,
    pub group: &'a str,
    pub dir: &'a Path,
    pub ranks: u32,
    pub group_id: u64,
    pub timeout_ms: u64,
    pub extra: &'a [String],
}

impl Daemon {
    /// Starts the daemon and waits until all its sockets exist.
    pub fn start(spec: &DaemonSpec<'_>) -> Result<Daemon, DaemonError> {
        let base = spec.dir.join(format!("{}.sock", spec.group));
        let mut cmd = Command::new(spec.binary);
        cmd.arg("--socket-path")
            .arg(&base)
            .arg("--socket-count")
            .arg(spec.ranks.to_string())
            .arg("--group-id")
            .arg(spec.group_id.to_string())
            .arg("--timeout-ms")
            .arg(spec.timeout_ms.to_string())
            .arg("--log-level")
            .arg("warn")
            .args(spec.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and
        // only calls prctl, which is async-signal-safe.
        unsafe {
            // If this program dies without cleaning up (SIGKILL), the
            // daemon goes too. The main thread spawns and outlives it.
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let sockets = Sockets::before_start(&base, spec.ranks);
        let child = cmd
            .spawn()
            .map_err(|e| DaemonError::Spawn(spec.binary.to_path_buf(), e))?;
        let mut d = Daemon { child, base };
        let group = || spec.group.to_owned();
        let waited = sockets.wait(SOCKETS_TIMEOUT, || match d.child.try_wait() {
            Ok(None) => Ok(true),
            Ok(Some(status)) => Err(DaemonError::Exited {
                group: group(),
                status,
            }),
            Err(source) => Err(DaemonError::Wait {
                group: group(),
                source,
            }),
        });
        match waited {
            Ok(()) => Ok(d),
            Err(WaitError::Stopped(e)) => Err(e),
            Err(WaitError::TimedOut(_)) => Err(DaemonError::NoSockets { group: group() }),
        }
    }

    /// Rank `rank`'s socket.
    pub fn socket(&self, rank: u32) -> PathBuf {
        socket_path(&self.base, rank)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the daemon has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Already reaped (it died, or --kill-daemon killed it): its pid
        // may belong to another process now, so signal nothing.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SIGTERM first: the daemon removes its sockets; then make sure.
        // SAFETY: kill(2) on our own child's pid, not yet reaped (checked
        // just above; only this thread reaps it).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(2);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A daemon's resources at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Anonymous resident memory, KiB (the daemon's own allocations).
    pub rss_anon_kib: u64,
    /// All resident memory, KiB (includes guest memfd pages it touched).
    pub vm_rss_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
}

/// Reads `pid`'s RssAnon, VmRSS and fd count from /proc.
pub fn usage(pid: u32) -> io::Result<Usage> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> io::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| io::Error::other(format!("no {name} in /proc/{pid}/status")))
    };
    let fds = fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    Ok(Usage {
        rss_anon_kib: field("RssAnon:")?,
        vm_rss_kib: field("VmRSS:")?,
        fds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_of_this_process_is_plausible() {
        let u = usage(std::process::id()).unwrap();
        assert!(u.rss_anon_kib > 0 && u.vm_rss_kib >= u.rss_anon_kib);
        assert!(u.fds >= 3, "{u:?}");
    }

    #[test]
    fn a_missing_backend_is_named() {
        let e = backend_path(Some(Path::new("/nonexistent/vhost-device-dmlc"))).unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent/vhost-device-dmlc"),
            "{e}"
        );
    }

    #[test]
    fn temp_dir_is_private_and_removed() {
        let path = {
            let t = temp_dir().unwrap();
            let mode = fs::metadata(t.path()).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
            t.path().to_path_buf()
        };
        assert!(!path.exists());
    }
}
