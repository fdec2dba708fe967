//! `dmlc-guest local`: a backend and N rank processes on this host.
//!
//! Starts the vhost-user backend on fresh sockets in a private temporary
//! folder, then one `dmlc-guest --socket PATHi SUBCOMMAND...` per rank, and
//! forwards their output: rank 0's stdout and stderr as they are, the other
//! ranks' stderr (and with `--all-output` their stdout) prefixed with
//! `[rank i]`, the backend's prefixed with `[backend]`. When a rank fails,
//! the rest get a grace period and are then killed. Ctrl-C (or SIGTERM)
//! stops everything and removes the folder.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::{Sockets, WaitError};
use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

/// Name of the backend binary looked for next to `dmlc-guest`.
pub const BACKEND_BIN: &str = "vhost-device-dmlc";

/// Options of `dmlc-guest local`.
#[derive(clap::Args, Debug)]
pub struct LocalArgs {
    /// Number of ranks: one backend socket and one `dmlc-guest` process each.
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub ranks: u32,
    /// The backend daemon [default: env DMLC_BACKEND, else vhost-device-dmlc
    /// next to this executable].
    #[arg(long, value_name = "PATH")]
    pub backend: Option<PathBuf>,
    /// Request queues per device (backend --queues) [default: the backend's].
    #[arg(long, value_name = "Q")]
    pub queues: Option<u16>,
    /// Backend busy-poll time before sleeping on the kick eventfd, in
    /// microseconds (backend --poll-us) [default: the backend's].
    #[arg(long, value_name = "U")]
    pub poll_us: Option<u64>,
    /// Log level of the backend (its --log-level).
    #[arg(long, default_value = "warn", value_name = "LEVEL")]
    pub backend_log_level: String,
    /// Extra argument for the backend (repeatable), e.g. `--backend-arg=--timeout-ms=5000`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub backend_arg: Vec<OsString>,
    /// Also write the backend's and every rank's full stdout and stderr to
    /// files in DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    pub keep_logs: Option<PathBuf>,
    /// Forward every rank's stdout (prefixed), not only rank 0's.
    #[arg(long)]
    pub all_output: bool,
    /// After the first rank fails, how long the others may take to finish
    /// before they are killed, in milliseconds.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    pub grace_ms: u64,
    /// The subcommand and arguments every rank runs (after `--`).
    #[arg(last = true, required = true, value_name = "SUBCOMMAND ARGS")]
    pub command: Vec<OsString>,
}

/// Errors of `dmlc-guest local`.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("backend not found at {0} (run `cargo build --workspace`, or give --backend)")]
    BackendMissing(PathBuf),
    #[error("cannot locate the dmlc-guest executable")]
    CurrentExe(#[source] io::Error),
    #[error("cannot create {0}")]
    CreateDir(PathBuf, #[source] io::Error),
    #[error("cannot start {0}")]
    Spawn(PathBuf, #[source] io::Error),
    #[error("backend exited before its sockets appeared ({0})")]
    BackendDied(ExitStatus),
    #[error("backend sockets did not appear within {0:?}")]
    SocketsTimeout(Duration),
    #[error("cannot wait for a child process")]
    Wait(#[source] io::Error),
    #[error("cannot install the signal handler")]
    Signal(#[source] io::Error),
}

/// Global options that every rank process gets too.
#[derive(Clone, Debug, Default)]
pub struct RankGlobals {
    pub args: Vec<OsString>,
}

/// Signal number received (0 = none), stored by signal-hook's handler.
static SIGNALLED: LazyLock<Arc<AtomicUsize>> = LazyLock::new(Arc::default);

fn install_handlers() -> Result<(), LocalError> {
    for sig in [SIGINT, SIGTERM, SIGHUP] {
        signal_hook::flag::register_usize(sig, Arc::clone(&SIGNALLED), sig as usize)
            .map_err(LocalError::Signal)?;
    }
    Ok(())
}

/// The backend binary to use.
pub fn backend_path(explicit: Option<&Path>) -> Result<PathBuf, LocalError> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => match std::env::var_os("DMLC_BACKEND") {
            Some(p) => PathBuf::from(p),
            None => std::env::current_exe()
                .map_err(LocalError::CurrentExe)?
                .with_file_name(BACKEND_BIN),
        },
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(LocalError::BackendMissing(path))
    }
}

/// Where a child's stream goes.
enum Sink {
    Stdout,
    Stderr,
    Discard,
}

/// Copies `src` line by line to `sink` with `prefix`, and to `log` if any.
fn forward(
    src: impl Read + Send + 'static,
    sink: Sink,
    prefix: String,
    log: Option<File>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(src);
        let mut log = log;
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if let Some(f) = log.as_mut() {
                let _ = f.write_all(&line);
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let write = |out: &mut dyn Write| {
                let _ = out.write_all(prefix.as_bytes());
                let _ = out.write_all(&line);
                let _ = out.flush();
            };
            match sink {
                Sink::Stdout => write(&mut io::stdout().lock()),
                Sink::Stderr => write(&mut io::stderr().lock()),
                Sink::Discard => {}
            }
        }
    })
}

/// One child process and its output forwarders.
struct Proc {
    name: String,
    child: Child,
    status: Option<ExitStatus>,
    forwarders: Vec<JoinHandle<()>>,
}

impl Proc {
    fn spawn(
        name: String,
        mut cmd: Command,
        out: (Sink, String),
        err: (Sink, String),
        logs: Option<&Path>,
    ) -> Result<Self, LocalError> {
        let program = PathBuf::from(cmd.get_program());
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // If this launcher dies without cleaning up (SIGKILL), its children
        // must not live on: the kernel sends them SIGKILL.
        // SAFETY: the closure runs in the forked child before exec and only
        // calls prctl, which is async-signal-safe; it touches no memory of
        // the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            });
        }
        let mut child = cmd.spawn().map_err(|e| LocalError::Spawn(program, e))?;
        let log = |suffix: &str| {
            logs.and_then(|dir| File::create(dir.join(format!("{name}.{suffix}"))).ok())
        };
        let mut forwarders = Vec::new();
        if let Some(s) = child.stdout.take() {
            forwarders.push(forward(s, out.0, out.1, log("stdout")));
        }
        if let Some(s) = child.stderr.take() {
            forwarders.push(forward(s, err.0, err.1, log("stderr")));
        }
        Ok(Proc {
            name,
            child,
            status: None,
            forwarders,
        })
    }

    fn poll(&mut self) -> Result<Option<ExitStatus>, LocalError> {
        if self.status.is_none() {
            self.status = self.child.try_wait().map_err(LocalError::Wait)?;
        }
        Ok(self.status)
    }

    fn signal(&self, sig: Signal) {
        if self.status.is_none() {
            if let Ok(pid) = i32::try_from(self.child.id()) {
                let _ = signal::kill(Pid::from_raw(pid), sig);
            }
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; waits and joins the forwarders.
    fn stop(&mut self, grace: Duration) {
        self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while matches!(self.poll(), Ok(None)) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        self.finish();
    }

    /// Kills the process if still running, reaps it, joins the forwarders.
    fn finish(&mut self) {
        if matches!(self.poll(), Ok(None)) {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        for f in self.forwarders.drain(..) {
            let _ = f.join();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The exit code that represents `status` (128 + signal if killed).
fn code_of(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// Runs `local`; returns the exit code for the process.
pub fn run(args: &LocalArgs, globals: &RankGlobals) -> Result<i32, LocalError> {
    let backend = backend_path(args.backend.as_deref())?;
    let exe = std::env::current_exe().map_err(LocalError::CurrentExe)?;
    install_handlers()?;
    // Private (mode 0700), removed on drop.
    let tmp = tempfile::Builder::new()
        .prefix("dmlc-local-")
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir()
        .map_err(|e| LocalError::CreateDir(std::env::temp_dir(), e))?;
    if let Some(dir) = &args.keep_logs {
        fs::create_dir_all(dir).map_err(|e| LocalError::CreateDir(dir.clone(), e))?;
    }
    let logs = args.keep_logs.as_deref();
    let base = tmp.path().join("dmlc.sock");
    let sockets = Sockets::before_start(&base, args.ranks);

    let mut cmd = Command::new(&backend);
    cmd.arg("--socket-path")
        .arg(&base)
        .arg("--socket-count")
        .arg(args.ranks.to_string());
    if let Some(q) = args.queues {
        cmd.arg("--queues").arg(q.to_string());
    }
    if let Some(u) = args.poll_us {
        cmd.arg("--poll-us").arg(u.to_string());
    }
    cmd.arg("--log-level").arg(&args.backend_log_level);
    cmd.args(&args.backend_arg);
    let mut backend_proc = Proc::spawn(
        "backend".into(),
        cmd,
        (Sink::Stderr, "[backend] ".into()),
        (Sink::Stderr, "[backend] ".into()),
        logs,
    )?;

    // The backend binds every socket before serving; wait until all exist.
    enum Stop {
        Failed(LocalError),
        Died(ExitStatus),
        Signalled,
    }
    let wait_limit = Duration::from_secs(20);
    let waited = sockets.wait(wait_limit, || {
        if let Some(status) = backend_proc.poll().map_err(Stop::Failed)? {
            return Err(Stop::Died(status));
        }
        if SIGNALLED.load(Ordering::SeqCst) as i32 != 0 {
            return Err(Stop::Signalled);
        }
        Ok(true)
    });
    match waited {
        Ok(()) => {}
        Err(WaitError::Stopped(Stop::Failed(e))) => return Err(e),
        Err(WaitError::Stopped(Stop::Died(status))) => {
            backend_proc.finish();
            return Err(LocalError::BackendDied(status));
        }
        Err(WaitError::Stopped(Stop::Signalled)) => {
            backend_proc.stop(Duration::from_secs(1));
            return Ok(130);
        }
        Err(WaitError::TimedOut(limit)) => {
            backend_proc.stop(Duration::from_secs(1));
            return Err(LocalError::SocketsTimeout(limit));
        }
    }
    let mut ranks = Vec::new();
    for i in 0..args.ranks {
        let mut cmd = Command::new(&exe);
        cmd.args(&globals.args)
            .arg("--socket")
            .arg(sockets.path(i))
            .args(&args.command)
            .env_remove("DMLC_SOCKET");
        let prefix = format!("[rank {i}] ");
        let (out, err) = if i == 0 {
            ((Sink::Stdout, String::new()), (Sink::Stderr, String::new()))
        } else if args.all_output {
            ((Sink::Stdout, prefix.clone()), (Sink::Stderr, prefix))
        } else {
            ((Sink::Discard, String::new()), (Sink::Stderr, prefix))
        };
        match Proc::spawn(format!("rank{i}"), cmd, out, err, logs) {
            Ok(p) => ranks.push(p),
            Err(e) => {
                drop(ranks);
                backend_proc.stop(Duration::from_secs(1));
                return Err(e);
            }
        }
    }

    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut interrupted = 0;
    loop {
        let mut running = 0;
        for (i, p) in ranks.iter_mut().enumerate() {
            match p.poll()? {
                None => running += 1,
                Some(st) if !st.success() => {
                    if failed.is_none() {
                        failed = Some((i, st));
                        kill_at = Some(Instant::now() + Duration::from_millis(args.grace_ms));
                    }
                }
                Some(_) => {}
            }
        }
        if running == 0 {
            break;
        }
        let sig = SIGNALLED.load(Ordering::SeqCst) as i32;
        if sig != 0 && interrupted == 0 {
            // Ask politely first; whatever still runs shortly after is killed.
            interrupted = sig;
            for p in &ranks {
                p.signal(Signal::SIGTERM);
            }
            let soon = Instant::now() + Duration::from_millis(500);
            kill_at = Some(kill_at.map_or(soon, |t| t.min(soon)));
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for p in &mut ranks {
                if p.status.is_none() {
                    if interrupted == 0 {
                        eprintln!(
                            "dmlc-guest local: killing {} after the grace period",
                            p.name
                        );
                    }
                    p.finish();
                }
            }
        }
        if backend_proc.poll()?.is_some() && kill_at.is_none() {
            eprintln!("dmlc-guest local: the backend exited while ranks were running");
            kill_at = Some(Instant::now() + Duration::from_millis(args.grace_ms));
        }
        thread::sleep(Duration::from_millis(5));
    }
    for p in &mut ranks {
        p.finish();
    }
    backend_proc.stop(Duration::from_secs(2));
    if let Some(st) = backend_proc.status.filter(|s| !s.success()) {
        // SIGTERM is how we stop it; anything else is worth a line.
        if st.signal() != Some(libc::SIGTERM) {
            eprintln!("dmlc-guest local: backend exited with {st}");
        }
    }
    drop(tmp);
    if interrupted != 0 {
        return Ok(128 + interrupted);
    }
    Ok(match failed {
        Some((i, st)) => {
            eprintln!("dmlc-guest local: rank {i} failed ({st})");
            code_of(st)
        }
        None => 0,
    })
}
