//! What the project's integration tests share: locate (and if needed
//! build) the binaries, start the backend and other processes with captured
//! output, wait with timeouts, and kill everything (printing its output)
//! on failure. Test-only: crates use it as a dev-dependency.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

pub use tempfile::TempDir;

use dmlc_cli_support::daemon::{socket_path, Sockets, WaitError};

#[cfg(feature = "trace")]
pub mod chrome_trace;
#[cfg(feature = "frontend")]
pub mod frontend;

/// How long a wait for something that should come at once (a socket, a log
/// line, a completion) may take before the test fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The heavy tests run one at a time: the machine may have only two cores,
/// and polling ranks of concurrent tests would starve each other.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The target profile folder of this test run (`target/debug` or
/// `target/release`): a test executable lives in its `deps/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let deps = exe.parent().expect("the test executable has a folder");
    deps.parent()
        .expect("the deps folder has a parent")
        .to_path_buf()
}

/// Something cargo builds in a workspace package, found in the target
/// folder by [`workspace_file`].
#[derive(Clone, Copy, Debug)]
pub enum Built<'a> {
    /// A binary target (`--bin NAME`), at `target/PROFILE/NAME`.
    Bin(&'a str),
    /// An example (`--example NAME`), at `target/PROFILE/examples/NAME`.
    Example(&'a str),
    /// The package's library (`--lib`) as the file `NAME` (e.g.
    /// `libdmlc_guest.so`) at `target/PROFILE/NAME`.
    Lib(&'a str),
}

impl<'a> Built<'a> {
    fn path(self) -> PathBuf {
        match self {
            Built::Bin(n) | Built::Lib(n) => target_dir().join(n),
            Built::Example(n) => target_dir().join("examples").join(n),
        }
    }

    /// cargo build's arguments that select it.
    fn cargo_args(self) -> Vec<&'a str> {
        match self {
            Built::Bin(n) => vec!["--bin", n],
            Built::Example(n) => vec!["--example", n],
            Built::Lib(_) => vec!["--lib"],
        }
    }
}

/// `what` of package `package`, from this test run's target folder, built
/// with cargo (same profile) if it is not there yet, so that `cargo test -p
/// CRATE` works on its own; a binary of the test's own package is the one
/// cargo built for it (`CARGO_BIN_EXE_<bin>`, set at run time by cargo 1.94
/// and later). Built once per process. This is the one way the tests find
/// the workspace's programs; [`env_or_workspace_file`] lets a variable
/// name another build (e.g. a release one).
pub fn workspace_file(package: &str, what: Built) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    if let Built::Bin(bin) = what {
        if let Some(own) = std::env::var_os(format!("CARGO_BIN_EXE_{bin}")) {
            let own = PathBuf::from(own);
            if own.is_file() {
                return own;
            }
        }
    }
    let path = what.path();
    let key = format!("{package} {what:?}");
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if built.contains(&key) {
        return path;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--quiet", "-p", package]);
    cmd.args(what.cargo_args());
    if target_dir().file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    // A no-op beyond cargo's freshness check when the workspace was built
    // first (tests/run.sh does).
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cargo} to build {what:?}: {e}"));
    assert!(
        status.success() && path.is_file(),
        "{} ({what:?} of package {package}) is needed by this test and could not be built: \
         run `cargo build -p {package}` and look at its errors",
        path.display()
    );
    built.push(key);
    path
}

/// The binary `bin` of package `package` (see [`workspace_file`]).
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    workspace_file(package, Built::Bin(bin))
}

/// The file that the environment variable `var` names, if it is set (it
/// must exist), else [`workspace_file`]`(package, what)`.
pub fn env_or_workspace_file(var: &str, package: &str, what: Built) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "{var}={} is not a file: build it, or unset {var} to use this \
                 test run's {what:?} of package {package}",
                p.display()
            );
            p
        }
        None => workspace_file(package, what),
    }
}

/// The `dmlc-guest` CLI.
pub fn guest_bin() -> PathBuf {
    workspace_bin("dmlc-guest", "dmlc-guest")
}

/// Compiles `{src_dir}/{name}.c` against the headers in `include_dir` and
/// the C library (`libdmlc_guest`) of this test run into `dir`; returns the
/// program's path. Run it through [`c_command`].
pub fn build_c_program(dir: &Path, include_dir: &Path, src_dir: &Path, name: &str) -> PathBuf {
    // `cargo test` rebuilds the library in deps/ but copies it up to the
    // profile folder only on `cargo build`: link the fresh one.
    let lib_dir = target_dir().join("deps");
    assert!(
        lib_dir.join("libdmlc_guest.so").is_file(),
        "{} is missing: run `cargo build -p dmlc-capi` first",
        lib_dir.join("libdmlc_guest.so").display()
    );
    let src = src_dir.join(format!("{name}.c"));
    let exe = dir.join(format!("{name}_c"));
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
        .arg(include_dir)
        .arg(&src)
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
        "compiling {} failed:\n{}{}",
        src.display(),
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

/// The backend daemon (another package: built here if missing).
pub fn backend_bin() -> PathBuf {
    workspace_bin("vhost-device-dmlc", "vhost-device-dmlc")
}

/// A private temporary folder (mode 0700), removed on drop; `tag` names it.
pub fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("dmlc-test-{tag}-"))
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir()
        .expect("create a temporary folder")
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

    /// The exit status of a process seen to exit (by [`Proc::finish`],
    /// [`run`]); panics if it has not.
    pub fn exit_status(&self) -> ExitStatus {
        self.status
            .unwrap_or_else(|| panic!("{} has not exited", self.name))
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
///
/// It logs at `debug` unless `extra` names a `--log-level`; its log (its
/// stderr) is captured: [`Backend::log`], [`Backend::wait_for_log`]. The
/// daemon is killed when the thread that started it ends, so that a killed
/// test leaves none behind, and when the `Backend` is dropped (its output
/// printed if the test is failing).
pub struct Backend {
    pub proc: Proc,
    pub dir: TempDir,
    base: PathBuf,
    ranks: u32,
}

impl Backend {
    /// Starts the daemon with `ranks` sockets and the options `extra` in a
    /// new folder named after `tag`, and waits until it serves them.
    pub fn start(tag: &str, ranks: u32, extra: &[&str]) -> Backend {
        Backend::start_in(temp_dir(tag), ranks, extra)
    }

    /// As [`Backend::start`], in a prepared folder (its sockets are
    /// [`Backend::socket_in`]; a socket file already there is taken for a
    /// stale one, not for the daemon's).
    pub fn start_in(dir: TempDir, ranks: u32, extra: &[&str]) -> Backend {
        let base = dir.path().join(SOCKET_NAME);
        let proc = spawn_backend(&base, ranks, extra);
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
        self.proc = spawn_backend(&self.base, self.ranks, extra);
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

    /// The socket of `rank`.
    pub fn socket(&self, rank: u32) -> PathBuf {
        socket_path(&self.base, rank)
    }

    /// The socket of `rank` of a backend started in `dir` (see
    /// [`Backend::start_in`]).
    pub fn socket_in(dir: &Path, rank: u32) -> PathBuf {
        socket_path(&dir.join(SOCKET_NAME), rank)
    }

    /// The daemon's `--socket-path`: each socket is this path and its rank.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The number of sockets (ranks).
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// True if the daemon is still running.
    pub fn alive(&mut self) -> bool {
        self.proc.wait_timeout(Duration::ZERO).is_none()
    }

    /// Fails the test (with the log) if the daemon has exited.
    pub fn assert_running(&mut self) {
        if let Some(st) = self.proc.wait_timeout(Duration::ZERO) {
            panic!("the backend exited ({st}):\n{}", self.proc.dump());
        }
    }

    /// Everything the daemon logged so far, each line ending in `\n`.
    pub fn log(&self) -> String {
        let mut log = self.proc.stderr();
        if !log.is_empty() {
            log.push('\n');
        }
        log
    }

    /// Waits up to [`PATIENCE`] until the log contains `text` (which may
    /// span lines); fails the test if it does not, or if the daemon exits.
    pub fn wait_for_log(&mut self, text: &str) {
        let deadline = Instant::now() + PATIENCE;
        while !self.log().contains(text) {
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "the backend never logged {text:?}:\n{}",
                self.proc.dump()
            );
            thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The file name of the sockets' `--socket-path` in a backend's folder.
const SOCKET_NAME: &str = "dmlc.sock";

/// The value of `--log-level` in `args`, if they name one.
fn log_level<'a>(args: &[&'a str]) -> Option<&'a str> {
    args.iter()
        .enumerate()
        .find_map(|(i, a)| match a.strip_prefix("--log-level")? {
            "" => Some(args.get(i + 1).copied().unwrap_or_default()),
            v => v.strip_prefix('='),
        })
}

/// Spawns the daemon and waits until it serves every socket: each exists
/// and is not a stale one (a socket file there before), and, where the
/// daemon logs at `info` or more, it has said so (it has set the sockets'
/// mode and group by then).
fn spawn_backend(base: &Path, ranks: u32, extra: &[&str]) -> Proc {
    let sockets = Sockets::before_start(base, ranks);
    let mut cmd = Command::new(backend_bin());
    cmd.arg("--socket-path")
        .arg(base)
        .arg("--socket-count")
        .arg(ranks.to_string());
    let level = log_level(extra);
    if level.is_none() {
        cmd.args(["--log-level", "debug"]);
    }
    cmd.args(extra);
    // SAFETY: prctl is async-signal-safe and touches no memory of ours; it
    // makes the daemon die with the thread that started it, even if the
    // test is killed.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut proc = Proc::spawn("backend", &mut cmd);
    let says_listening = !matches!(level, Some("warn" | "error" | "off"));
    let waited = sockets.wait(Duration::from_secs(20), || {
        if let Some(st) = proc.wait_timeout(Duration::ZERO) {
            return Err(st);
        }
        Ok(!says_listening || proc.wait_stderr("listening on", Duration::ZERO).is_some())
    });
    match waited {
        Ok(()) => proc,
        Err(WaitError::Stopped(st)) => panic!("backend exited early ({st}):\n{}", proc.dump()),
        Err(WaitError::TimedOut(_)) => panic!("backend sockets did not appear:\n{}", proc.dump()),
    }
}

/// A loopback address with a port that was free a moment ago, for the
/// daemon's `--metrics-addr`.
pub fn free_local_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local address").to_string()
}

/// One HTTP/1.1 GET of `path` from `addr` (e.g. the daemon's
/// `--metrics-addr`); returns the status line, the head and the body.
pub fn http_get(addr: &str, path: &str) -> (String, String, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(PATIENCE))
        .expect("set a read timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("send a request");
    let mut reply = String::new();
    s.read_to_string(&mut reply)
        .unwrap_or_else(|e| panic!("read the reply to GET {path} from {addr}: {e}"));
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("a reply without a head and a body: {reply:?}"));
    let status = head.lines().next().unwrap_or("").to_owned();
    (status, head.to_owned(), body.to_owned())
}

/// The value of the metric line `name` (e.g. `dmlc_generation` or
/// `dmlc_requests_total{opcode="allreduce"}`) served at `addr`.
pub fn metric(addr: &str, name: &str) -> f64 {
    let (_, _, text) = http_get(addr, "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

/// Waits until the metric line `name` served at `addr` reaches at least
/// `n` (for example `dmlc_requests_total{opcode="allreduce"}`: requests the
/// daemon has taken), instead of sleeping and hoping the event happened,
/// which a loaded machine does not promise; fails the test after `limit`.
pub fn wait_metric_at_least(addr: &str, name: &str, n: f64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let v = metric(addr, name);
        if v >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} stayed at {v}, below {n}, for {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs `cmd` to completion within `limit` (fails the test if it takes
/// longer); returns the process (exited) for inspection.
pub fn run(name: &str, cmd: &mut Command, limit: Duration) -> Proc {
    let mut p = Proc::spawn(name, cmd);
    p.finish(limit);
    p
}

/// Runs `dmlc-guest ARGS` to completion within `limit`; returns the process
/// (exited) for inspection.
pub fn run_guest(name: &str, args: &[&str], limit: Duration) -> Proc {
    run(name, Command::new(guest_bin()).args(args), limit)
}

/// Runs the backend daemon with `args` alone (no sockets of its own: for
/// options it refuses, `--help`) to completion within `limit`.
pub fn run_backend(args: &[&str], limit: Duration) -> Proc {
    run("backend", Command::new(backend_bin()).args(args), limit)
}

/// Whether this runs under CI (`CI` set and not "", "false" or "0"), where
/// a test that lacks what it needs must fail instead of skipping.
pub fn under_ci() -> bool {
    !matches!(
        std::env::var("CI").as_deref(),
        Err(_) | Ok("" | "false" | "0")
    )
}

/// What the multi-host tests (network namespaces joined by `mpirun`) lack
/// here, if anything: root, `ip` or `mpirun`.
pub fn missing_for_namespaces() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("root (network namespaces)".into());
    }
    for tool in ["ip", "mpirun"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("{tool} on PATH"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_level_is_found_in_either_spelling() {
        assert_eq!(log_level(&["--queues", "2"]), None);
        assert_eq!(log_level(&["--log-level", "warn", "-x"]), Some("warn"));
        assert_eq!(log_level(&["--log-level=error"]), Some("error"));
        assert_eq!(log_level(&["--log-level"]), Some(""));
        assert_eq!(log_level(&["--log-levels=x"]), None);
    }

    #[test]
    fn sockets_are_the_base_and_the_rank() {
        let dir = Path::new("/run/x");
        assert_eq!(
            Backend::socket_in(dir, 12),
            PathBuf::from("/run/x/dmlc.sock12")
        );
    }
}
