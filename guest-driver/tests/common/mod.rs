//! Shared harness of the integration tests: locate the built binaries,
//! start the backend and rank processes with captured output, wait with
//! timeouts, and kill everything (printing its output) on failure.

#![allow(dead_code)] // each test binary uses a different part

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// The heavy tests run one at a time: the machine may have only two cores,
/// and polling ranks of concurrent tests would starve each other.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `dmlc-guest` binary cargo built for this test.
pub fn guest_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dmlc-guest"))
}

/// The target profile folder (where the binaries and libraries are).
pub fn target_dir() -> PathBuf {
    guest_bin()
        .parent()
        .expect("binary has a folder")
        .to_path_buf()
}

/// Compiles `tests/c/{name}.c` against the headers in `include/` and the
/// library of this test run into `dir`; returns the program's path. Run it
/// through [`c_command`].
pub fn build_c_program(dir: &TempDir, name: &str) -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // `cargo test` rebuilds the library in deps/ but copies it up to the
    // profile folder only on `cargo build`: link the fresh one.
    let lib_dir = target_dir().join("deps");
    assert!(
        lib_dir.join("libdmlc_guest.so").is_file(),
        "{} is missing: run `cargo build -p dmlc-guest` first",
        lib_dir.join("libdmlc_guest.so").display()
    );
    let src = format!("tests/c/{name}.c");
    let exe = dir.0.join(format!("{name}_c"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args([
            "-std=c99",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
        ])
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join(&src))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-ldmlc_guest")
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(
        out.status.success(),
        "compiling {src} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// A command for a program from [`build_c_program`].
pub fn c_command(exe: &Path) -> Command {
    let mut cmd = Command::new(exe);
    // cargo's LD_LIBRARY_PATH puts the profile folder, with the library of
    // the last `cargo build`, before the rpath's deps/: drop it.
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd
}

/// The backend daemon, built by the same cargo run (another crate).
pub fn backend_bin() -> PathBuf {
    let p = target_dir().join("vhost-device-dmlc");
    assert!(
        p.is_file(),
        "backend binary {} is missing: run `cargo build --workspace` (or `cargo test --workspace`) first",
        p.display()
    );
    p
}

/// A private temporary folder, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("dmlc-test-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Captured output lines with the time each arrived.
type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

fn capture(src: impl Read + Send + 'static, lines: Lines) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            lines
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((Instant::now(), line));
        }
    })
}

/// A child process whose stdout and stderr are captured. Dropping it kills
/// the process, and prints its output if the test is failing.
pub struct Proc {
    pub name: String,
    child: Child,
    out: Lines,
    err: Lines,
    readers: Vec<thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        let out: Lines = Arc::default();
        let err: Lines = Arc::default();
        let readers = vec![
            capture(child.stdout.take().expect("piped"), Arc::clone(&out)),
            capture(child.stderr.take().expect("piped"), Arc::clone(&err)),
        ];
        Proc {
            name: name.to_string(),
            child,
            out,
            err,
            readers,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if self.status.is_none() {
                self.status = self.child.try_wait().expect("try_wait");
            }
            if self.status.is_some() || Instant::now() >= deadline {
                if self.status.is_some() {
                    // Let the readers drain the pipes.
                    for r in self.readers.drain(..) {
                        let _ = r.join();
                    }
                }
                return self.status;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for exit and panics (with the output) if it takes longer.
    pub fn finish(&mut self, limit: Duration) -> ExitStatus {
        match self.wait_timeout(limit) {
            Some(st) => st,
            None => panic!("{} did not exit within {limit:?}", self.name),
        }
    }

    /// Waits until a stdout line contains `needle`; returns when it arrived.
    pub fn wait_stdout(&self, needle: &str, limit: Duration) -> Option<Instant> {
        wait_line(&self.out, needle, limit)
    }

    /// Waits until a stderr line contains `needle`; returns when it arrived.
    pub fn wait_stderr(&self, needle: &str, limit: Duration) -> Option<Instant> {
        wait_line(&self.err, needle, limit)
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid; no memory involved.
            unsafe { libc::kill(pid, signal) };
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        self.status = self.child.wait().ok();
    }

    pub fn stdout(&self) -> String {
        join(&self.out)
    }

    pub fn stderr(&self) -> String {
        join(&self.err)
    }

    /// Both streams, for failure messages.
    pub fn dump(&self) -> String {
        format!(
            "---- {} stdout ----\n{}\n---- {} stderr ----\n{}",
            self.name,
            self.stdout(),
            self.name,
            self.stderr()
        )
    }
}

fn wait_line(lines: &Lines, needle: &str, limit: Duration) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(t, _)| *t)
        {
            return Some(t);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(2));
    }
}

fn join(lines: &Lines) -> String {
    lines
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(_, l)| l.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.wait_timeout(Duration::ZERO).is_none() {
            // SIGTERM first, so that `dmlc-guest local` can stop its own
            // children; then SIGKILL.
            if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
                // SAFETY: kill(2) on our own child's pid; no memory involved.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            if self.wait_timeout(Duration::from_secs(3)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        if thread::panicking() {
            eprintln!("{}", self.dump());
        }
    }
}

/// A backend daemon with N sockets in a private folder.
pub struct Backend {
    pub proc: Proc,
    pub dir: TempDir,
    base: PathBuf,
    ranks: u32,
}

impl Backend {
    pub fn start(tag: &str, ranks: u32, extra: &[&str]) -> Backend {
        let dir = TempDir::new(tag);
        let base = dir.0.join("dmlc.sock");
        let proc = spawn_backend(&base, ranks, extra, &HashMap::new());
        Backend {
            proc,
            dir,
            base,
            ranks,
        }
    }

    /// Starts a new daemon on the same sockets, after the old one exited
    /// (see [`Backend::kill9`], [`Backend::terminate`]); waits until it
    /// listens on every socket (a stale socket file left by a killed daemon
    /// does not count).
    pub fn restart(&mut self, extra: &[&str]) {
        assert!(
            !self.alive(),
            "restart: the old backend still runs:\n{}",
            self.proc.dump()
        );
        let stale: HashMap<u32, SocketId> = (0..self.ranks)
            .filter_map(|i| socket_id(&self.socket(i)).map(|id| (i, id)))
            .collect();
        self.proc = spawn_backend(&self.base, self.ranks, extra, &stale);
    }

    /// Kills the daemon with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    /// Sends SIGTERM and waits up to `limit` for the daemon to exit.
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        self.proc.signal(libc::SIGTERM);
        self.proc.finish(limit)
    }

    pub fn socket(&self, rank: u32) -> PathBuf {
        socket_path(&self.base, rank)
    }

    /// True if the daemon is still running.
    pub fn alive(&mut self) -> bool {
        self.proc.wait_timeout(Duration::ZERO).is_none()
    }
}

fn socket_path(base: &Path, rank: u32) -> PathBuf {
    let mut s = base.to_path_buf().into_os_string();
    s.push(rank.to_string());
    PathBuf::from(s)
}

/// Identifies a socket file: inode numbers are reused at once, so the
/// change time (ns) tells a new socket from a stale one.
type SocketId = (u64, i64, i64);

fn socket_id(p: &Path) -> Option<SocketId> {
    fs::symlink_metadata(p)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Spawns the daemon and waits until every socket exists and is not one of
/// the `stale` ones (rank -> id of a socket file left behind).
fn spawn_backend(base: &Path, ranks: u32, extra: &[&str], stale: &HashMap<u32, SocketId>) -> Proc {
    let mut cmd = Command::new(backend_bin());
    cmd.arg("--socket-path")
        .arg(base)
        .arg("--socket-count")
        .arg(ranks.to_string())
        .args(extra);
    let mut proc = Proc::spawn("backend", &mut cmd);
    let ready =
        |i: u32| socket_id(&socket_path(base, i)).is_some_and(|id| stale.get(&i) != Some(&id));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(0..ranks).all(ready) {
        if let Some(st) = proc.wait_timeout(Duration::ZERO) {
            panic!("backend exited early ({st}):\n{}", proc.dump());
        }
        assert!(
            Instant::now() < deadline,
            "backend sockets did not appear:\n{}",
            proc.dump()
        );
        thread::sleep(Duration::from_millis(5));
    }
    proc
}

/// A loopback address with a port that was free a moment ago, for the
/// daemon's `--metrics-addr`.
pub fn free_local_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local address").to_string()
}

/// The value of the metric line `name` (e.g. `dmlc_generation` or
/// `dmlc_requests_total{opcode="allreduce"}`) served at `addr`.
pub fn metric(addr: &str, name: &str) -> f64 {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("metrics at {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("set a read timeout");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("send a metrics request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read the metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

/// Runs `dmlc-guest ARGS` to completion within `limit`; returns the process
/// (exited) for inspection.
pub fn run_guest(name: &str, args: &[&str], limit: Duration) -> Proc {
    let mut p = Proc::spawn(name, Command::new(guest_bin()).args(args));
    p.finish(limit);
    p
}
