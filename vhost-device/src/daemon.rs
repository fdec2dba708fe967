//! The daemon: one serve loop per socket, the metrics endpoint, and shutdown.
//!
//! Threads: `start_backend`'s caller waits for a termination signal or a
//! fatal error; one thread per rank accepts connections on that rank's
//! socket; one thread answers metrics requests; one thread waits for
//! SIGINT/SIGTERM (and SIGUSR1, which writes the flight recorder's trace
//! to `--trace-out`; so does the shutdown). vhost-user-backend adds, per connection, a thread for the
//! frontend's messages and one worker per queue (see [`crate::backend`]).
//! While a rank is served, one more thread refuses any second frontend that
//! connects to that rank's socket.
//!
//! Access: each socket is created with the configured mode (0600 unless
//! told otherwise) and never exists with a wider one; docs/security.md
//! gives the threat model.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
use thiserror::Error;
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::{BackendConfig, MemberBackend};
use crate::config::{Config, SocketAccess};
use crate::group::Group;

/// vhost-user-backend's error, which does not implement `std::error::Error`.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct LibError(String);

impl From<vhost_user_backend::Error> for LibError {
    fn from(e: vhost_user_backend::Error) -> Self {
        LibError(e.to_string())
    }
}

/// Why the daemon could not start or had to stop.
#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("MPI: {0}")]
    Mpi(String),
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    #[error("{0} is in use by another process")]
    SocketInUse(PathBuf),
    #[error("cannot remove the stale socket {path}")]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot give {path} to group {gid}")]
    SocketGroup {
        path: PathBuf,
        gid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot set the mode of {path} to {mode:04o}")]
    SocketMode {
        path: PathBuf,
        mode: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot create the event that ends rank {rank}'s refusals")]
    RefuseEvent {
        rank: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot listen for metrics on {addr}")]
    MetricsListen {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot create the vhost-user daemon of rank {rank}")]
    NewDaemon {
        rank: u32,
        #[source]
        source: LibError,
    },
    #[error("rank {rank} cannot accept a connection")]
    Accept {
        rank: u32,
        #[source]
        source: LibError,
    },
    #[error("cannot start thread {name}")]
    Thread {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot install the handler of the termination signals")]
    Signals(#[source] io::Error),
    #[error("bad fault-injection plan")]
    Faults(#[source] crate::fault::FaultSpecError),
}

/// What ends `start_backend`.
enum Stop {
    Signal(i32),
    Failed(DaemonError),
}

/// Runs the daemon until SIGINT or SIGTERM (then `Ok`, after removing the
/// sockets) or until a rank cannot accept connections any more.
///
/// SIGINT and SIGTERM are caught by signal-hook's handler and read by one
/// thread, which stops the daemon.
pub fn start_backend(config: Config) -> Result<(), DaemonError> {
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGUSR1]).map_err(DaemonError::Signals)?;
    raise_fd_limit();
    // Before the sockets, so that failing here leaves no socket behind.
    let metrics = match config.metrics_addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .map_err(|source| DaemonError::MetricsListen { addr, source })?,
        ),
        None => None,
    };
    // Before the group's threads start: binding changes the process umask.
    let listeners = bind_sockets(&config.socket_paths, config.socket_access)?;
    let control = match &config.control_socket {
        Some(path) => {
            match remove_stale_socket(path).and_then(|()| bind_unix(path, config.socket_access)) {
                Ok(l) => Some(l),
                Err(e) => {
                    for p in &config.socket_paths {
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let mut group_config = config.group.clone();
    group_config.faults = crate::fault::faults_from_env().map_err(DaemonError::Faults)?;
    if !group_config.faults.is_none() {
        let items: Vec<String> = group_config
            .faults
            .items()
            .iter()
            .map(ToString::to_string)
            .collect();
        warn!(
            "DMLC_TEST_FAULTS is set: this daemon injects faults ({}); results will be wrong on purpose, for tests only",
            items.join(", ")
        );
    }
    if let Some(t) = &group_config.timing {
        info!(
            "timing model {:?} (modelled world size {}), {} delay rule(s), {} bandwidth rule(s), \
             {} failure(s) and {} withheld completion(s) planned",
            t.model,
            t.model.world(),
            t.delays.len(),
            t.bandwidth.len(),
            t.fails.len(),
            t.withholds.len()
        );
    }
    #[cfg(feature = "mpi")]
    let mut mpi_finished = None;
    #[cfg(feature = "mpi")]
    if config.mpi {
        let (joined, link, finished) =
            crate::multihost::start(group_config.group_id, config.mpi_piece)
                .map_err(DaemonError::Mpi)?;
        group_config.group_id = joined.group_id;
        mpi_finished = Some((link.clone(), finished));
        group_config.remote = Some(link);
        info!(
            "host {} of {}: local members are global ranks {} to {} of {}; pieces of {} bytes",
            joined.host,
            joined.hosts,
            joined.host * group_config.world_size,
            (joined.host + 1) * group_config.world_size - 1,
            joined.hosts * group_config.world_size,
            joined.piece
        );
    }
    // Host 0's, with --mpi.
    let group_id = group_config.group_id;
    let group = Group::new(group_config);
    let world = config.group.world_size;

    let (stop_tx, stop_rx) = mpsc::channel();
    let result = (|| {
        let tx = stop_tx.clone();
        let dump = (group.clone(), config.trace_out.clone());
        spawn("dmlc-signals", move || {
            for sig in signals.forever() {
                if sig == SIGUSR1 {
                    write_trace(&dump.0, dump.1.as_deref(), world);
                    continue;
                }
                let _ = tx.send(Stop::Signal(sig));
                break;
            }
        })?;
        if let Some(listener) = control {
            let group = group.clone();
            let trace_out = config.trace_out.clone();
            spawn("dmlc-control", move || {
                crate::control::serve(&listener, &group, trace_out.as_deref(), world)
            })?;
            if let Some(path) = &config.control_socket {
                info!("control socket at {}", path.display());
            }
        }
        if let Some(listener) = metrics {
            let addr = listener.local_addr().ok();
            let group = group.clone();
            spawn("dmlc-metrics", move || serve_metrics(&listener, &group))?;
            if let Some(addr) = addr {
                info!("metrics at http://{addr}/metrics");
            }
        }
        for (rank, listener) in (0u32..).zip(listeners) {
            let backend = BackendConfig {
                rank,
                num_queues: config.group.num_queues,
                queue_size: config.queue_size,
                poll: config.poll,
                poll_anyway: config.poll_anyway,
                defer_activation: false,
                serve_earlier_requests: config.fixed_group_id,
            };
            let group = group.clone();
            let tx = stop_tx.clone();
            let path = config.socket_paths[rank as usize].clone();
            spawn(&format!("dmlc-listen{rank}"), move || {
                if let Err(e) = serve_member(&backend, &group, listener, &path) {
                    let _ = tx.send(Stop::Failed(e));
                }
            })?;
        }
        info!(
            "group {:#x}: {} members, {} queue(s) each, listening on {}",
            group_id,
            config.group.world_size,
            config.group.num_queues,
            describe_paths(&config.socket_paths)
        );
        Ok(())
    })();

    let outcome = match result {
        Err(e) => Err(e),
        // The signal thread holds a sender for the daemon's whole life.
        Ok(()) => match stop_rx.recv() {
            Ok(Stop::Signal(sig)) => {
                info!("signal {sig}: shutting down");
                // Pending collectives complete with RESET rather than
                // leaving their drivers to find the device gone.
                group.reset();
                write_trace(&group, config.trace_out.as_deref(), world);
                Ok(())
            }
            Ok(Stop::Failed(e)) => Err(e),
            Err(mpsc::RecvError) => Ok(()),
        },
    };
    for path in config.socket_paths.iter().chain(&config.control_socket) {
        let _ = std::fs::remove_file(path);
    }
    #[cfg(feature = "mpi")]
    if let Some((link, finished)) = mpi_finished {
        // After the reset above, so that a waiting step gives up first.
        link.stop();
        if finished.wait(MPI_FINALIZE_WAIT) {
            info!("MPI finalised");
        } else {
            warn!(
                "MPI was not finalised within {MPI_FINALIZE_WAIT:?} (another host's daemon may \
                 be gone); exiting without it"
            );
        }
    }
    outcome
}

/// How long a stopping `--mpi` daemon waits for `MPI_Finalize`, which
/// returns once every daemon of the job has called it.
#[cfg(feature = "mpi")]
const MPI_FINALIZE_WAIT: Duration = Duration::from_secs(10);

/// Writes the flight recorder's trace to `path`, if both exist.
pub(crate) fn write_trace(group: &Group, path: Option<&Path>, world: u32) {
    let (Some(rec), Some(path)) = (group.recorder(), path) else {
        if path.is_none() {
            info!("SIGUSR1: no --trace-out, so no trace to write");
        }
        return;
    };
    match rec.write_chrome(path, world) {
        Ok(()) => info!("trace written to {}", path.display()),
        Err(e) => error!("cannot write the trace to {}: {e}", path.display()),
    }
}

/// `PATH0`, or `PATH0 .. PATHn` for several sockets.
fn describe_paths(paths: &[PathBuf]) -> String {
    match paths {
        [] => String::new(),
        [one] => one.display().to_string(),
        [first, .., last] => format!("{} .. {}", first.display(), last.display()),
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), DaemonError> {
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map(drop)
        .map_err(|source| DaemonError::Thread {
            name: name.to_owned(),
            source,
        })
}

/// Binds every socket, after removing stale socket files. Refuses to
/// remove anything that is not a socket, or a socket that someone serves.
/// On error, removes the sockets it bound (and only those).
fn bind_sockets(paths: &[PathBuf], access: SocketAccess) -> Result<Vec<Listener>, DaemonError> {
    let mut listeners = Vec::with_capacity(paths.len());
    for path in paths {
        match remove_stale_socket(path).and_then(|()| bind_socket(path, access)) {
            Ok(listener) => listeners.push(listener),
            Err(e) => {
                for bound in &paths[..listeners.len()] {
                    let _ = std::fs::remove_file(bound);
                }
                return Err(e);
            }
        }
    }
    Ok(listeners)
}

/// Binds one socket so that it never has more access than `access` gives.
///
/// bind() creates the file with mode 0777 less the umask, so the umask is
/// set to give exactly the wanted bits for the call: nobody can connect
/// between bind and a later chmod, as they could with chmod alone. With a
/// group to set, the group and other bits are held back until the file
/// belongs to that group, so the daemon's own group never gets them. The
/// final chmod makes the mode exact where the umask does not apply (a
/// directory with a default ACL).
fn bind_socket(path: &Path, access: SocketAccess) -> Result<Listener, DaemonError> {
    // Not `Listener::new`: its listener would remove the file when dropped,
    // and `start_backend` does that itself.
    bind_unix(path, access).map(Listener::from)
}

/// [`bind_socket`] as a plain Unix listener (the control socket too).
fn bind_unix(path: &Path, access: SocketAccess) -> Result<UnixListener, DaemonError> {
    let first = match access.group {
        Some(_) => access.mode & 0o700,
        None => access.mode,
    };
    let listener = with_umask(!first & 0o777, || UnixListener::bind(path)).map_err(|source| {
        DaemonError::Listen {
            path: path.to_owned(),
            source,
        }
    })?;
    let finish = || {
        if let Some(gid) = access.group {
            std::os::unix::fs::lchown(path, None, Some(gid)).map_err(|source| {
                DaemonError::SocketGroup {
                    path: path.to_owned(),
                    gid,
                    source,
                }
            })?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode)).map_err(
            |source| DaemonError::SocketMode {
                path: path.to_owned(),
                mode: access.mode,
                source,
            },
        )
    };
    if let Err(e) = finish() {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(listener)
}

/// Runs `f` with the process umask set to `mask`, then restores it. The
/// umask is per process: call this only while no other thread creates
/// files.
fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask only swaps the process's file creation mask; it cannot
    // fail and touches no memory of ours.
    let old = unsafe { libc::umask(mask as libc::mode_t) };
    let out = f();
    // SAFETY: as above, putting back the mask that was there.
    unsafe { libc::umask(old) };
    out
}

fn remove_stale_socket(path: &Path) -> Result<(), DaemonError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(DaemonError::NotASocket(path.to_owned()));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(DaemonError::SocketInUse(path.to_owned()));
    }
    std::fs::remove_file(path).map_err(|source| DaemonError::RemoveStale {
        path: path.to_owned(),
        source,
    })
}

/// Serves rank `cfg.rank` on `listener`: one connection at a time, each
/// with a fresh backend, until accepting fails. While a connection is
/// served, other frontends that connect are refused (closed at once).
fn serve_member(
    cfg: &BackendConfig,
    group: &Arc<Group>,
    mut listener: Listener,
    path: &Path,
) -> Result<(), DaemonError> {
    let rank = cfg.rank;
    let ended =
        EventFd::new(EFD_NONBLOCK).map_err(|source| DaemonError::RefuseEvent { rank, source })?;
    let mut refusals = RefusalLog::new(rank);
    let mut failed_setups = SetupFailures::default();
    loop {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let cfg = BackendConfig {
            defer_activation: failed_setups.count > 0,
            ..cfg.clone()
        };
        let backend = Arc::new(MemberBackend::new(cfg, group.clone(), mem.clone()));
        let mut daemon = VhostUserDaemon::new(format!("dmlc-rank{rank}"), backend.clone(), mem)
            .map_err(|e| DaemonError::NewDaemon {
                rank,
                source: e.into(),
            })?;
        daemon
            .start(&mut listener)
            .map_err(|e| DaemonError::Accept {
                rank,
                source: e.into(),
            })?;
        if failed_setups.count == 0 {
            info!("rank {rank}: frontend connected on {}", path.display());
        } else {
            debug!("rank {rank}: frontend connected on {}", path.display());
        }
        let result = thread::scope(|s| {
            let refuser = thread::Builder::new()
                .name(format!("dmlc-refuse{rank}"))
                .spawn_scoped(s, || refuse_while_served(&listener, &ended, &mut refusals));
            if let Err(e) = refuser {
                warn!("rank {rank}: cannot start the thread that refuses second frontends ({e}); they will wait instead");
            }
            let result = daemon.wait();
            // The scope then waits for the refuser to stop.
            let _ = ended.write(1);
            result
        });
        // Reset the event for the next connection.
        let _ = ended.read();
        // Stop submitting and fail what waited for this member before the
        // workers go away with the daemon.
        let lost = backend.lose("disconnected");
        drop(daemon);
        let how = if lost { ", member lost" } else { "" };
        match result {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                VhostUserError::Disconnected | VhostUserError::PartialMessage,
            )) => {
                failed_setups.ended(rank, backend.submitted_any(), None);
                info!("rank {rank}: frontend disconnected{how}");
            }
            Err(e) => {
                let msg = e.to_string();
                if failed_setups.ended(rank, backend.submitted_any(), Some(&msg)) {
                    warn!("rank {rank}: connection closed after an error{how}: {msg}");
                } else {
                    debug!("rank {rank}: connection closed after an error{how}: {msg}");
                }
            }
        }
    }
}

/// Connections of one rank that failed before the driver's first request.
/// QEMU reconnects every second and sets the device up the same way, so
/// the same failure repeats: it is logged once, and such a connection
/// joins the group only at its first request (`defer_activation`), so it
/// is not one more loss for the peers each time.
#[derive(Default)]
struct SetupFailures {
    count: u64,
    last: Option<String>,
}

impl SetupFailures {
    /// Records how a connection ended; true if its error is worth a warning
    /// (the first of a run, or a different one).
    fn ended(&mut self, rank: u32, submitted: bool, error: Option<&str>) -> bool {
        if submitted || error.is_none() {
            if self.count > 1 {
                info!(
                    "rank {rank}: {} connections in a row had failed before their first request",
                    self.count
                );
            }
            *self = SetupFailures::default();
            return true;
        }
        self.count += 1;
        let new = self.last.as_deref() != error;
        if new {
            self.last = error.map(str::to_owned);
        } else if self.count == 2 {
            info!(
                "rank {rank}: the frontend keeps failing the same way; \
                 further such closes are logged at debug level"
            );
        }
        new
    }
}

/// How long a connection that arrives while a rank is served waits before
/// it is refused. A frontend that reconnects at once after hanging up can
/// arrive before the serve loop has seen its old connection end; within
/// this time it is left for the serve loop instead of being refused.
const REFUSE_GRACE: Duration = Duration::from_millis(500);

/// Accepts and closes every connection made to `listener` until `ended`
/// is signalled: a rank has one frontend at a time, and a second one must
/// neither take over nor wait unseen in the backlog.
fn refuse_while_served(listener: &Listener, ended: &EventFd, log: &mut RefusalLog) {
    // Non-blocking so that a connection gone before accept cannot stall
    // this thread (and with it the serve loop, which joins it).
    if let Err(e) = listener.set_nonblocking(true) {
        warn!(
            "rank {}: cannot refuse second frontends ({e}); they will wait instead",
            log.rank
        );
        return;
    }
    'serving: loop {
        // First a connection arrives, then it gets its grace period.
        for timeout in [None, Some(REFUSE_GRACE)] {
            match wait_readable(listener.as_raw_fd(), ended.as_raw_fd(), timeout) {
                Ok(Ready::Ended) => break 'serving,
                Ok(Ready::Listener) => {}
                Err(e) => {
                    warn!(
                        "rank {}: poll failed while refusing frontends: {e}",
                        log.rank
                    );
                    break 'serving;
                }
            }
        }
        loop {
            match listener.accept() {
                Ok(Some(stream)) => {
                    log.refused(&stream);
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                }
                Ok(None) => break,
                Err(e) => {
                    // Such as running out of file descriptors: back off.
                    warn!(
                        "rank {}: cannot accept a second frontend to refuse it: {e}",
                        log.rank
                    );
                    thread::sleep(Duration::from_millis(100));
                    break;
                }
            }
        }
    }
    if let Err(e) = listener.set_nonblocking(false) {
        // The serve loop's accept would spin on a non-blocking listener.
        error!(
            "rank {}: cannot make the socket blocking again: {e}",
            log.rank
        );
    }
}

/// What [`wait_readable`] saw.
enum Ready {
    /// The connection being served ended (checked first).
    Ended,
    /// A connection waits on the listener, or the timeout passed.
    Listener,
}

/// Waits until `ended` is readable (then [`Ready::Ended`]), or until
/// `listener` is readable or `timeout` has passed (then
/// [`Ready::Listener`]). With a timeout, only `ended` is watched: the wait
/// is a grace period before refusing.
fn wait_readable(listener: RawFd, ended: RawFd, timeout: Option<Duration>) -> io::Result<Ready> {
    let mut fds = [
        libc::pollfd {
            fd: ended,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: listener,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let (count, ms) = match timeout {
        Some(t) => (1, i32::try_from(t.as_millis()).unwrap_or(i32::MAX)),
        None => (2, -1),
    };
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        // SAFETY: `fds` holds `count` (at most 2) valid pollfd entries that
        // poll may write for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), count, ms) };
        if rc >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    if fds[0].revents != 0 {
        Ok(Ready::Ended)
    } else {
        Ok(Ready::Listener)
    }
}

/// Logs refused connections, at most one line a second per rank, so that a
/// frontend retrying in a loop cannot flood the log.
struct RefusalLog {
    rank: u32,
    last: Option<Instant>,
    quiet: u64,
}

impl RefusalLog {
    fn new(rank: u32) -> Self {
        RefusalLog {
            rank,
            last: None,
            quiet: 0,
        }
    }

    fn refused(&mut self, stream: &UnixStream) {
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            self.quiet += 1;
            return;
        }
        let who = match peer_credentials(stream) {
            Some((pid, uid)) => format!("pid {pid} (uid {uid})"),
            None => "an unknown process".to_owned(),
        };
        let more = match self.quiet {
            0 => String::new(),
            n => format!("; {n} more refused since the last report"),
        };
        warn!(
            "rank {} already has a frontend: refused a second connection from {who}{more}",
            self.rank
        );
        self.last = Some(Instant::now());
        self.quiet = 0;
    }
}

/// The process id and user id of the peer of `stream` (SO_PEERCRED).
fn peer_credentials(stream: &UnixStream) -> Option<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writing, and `len` gives the
    // size of `cred`; the kernel writes at most that much.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some((cred.pid, cred.uid))
}

/// Answers metrics requests one at a time, for the daemon's whole life.
fn serve_metrics(listener: &TcpListener, group: &Group) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                if let Err(e) = answer_metrics(stream, group) {
                    log::debug!("metrics request failed: {e}");
                }
            }
            Err(e) => {
                // Such as running out of file descriptors: back off a little.
                warn!("metrics endpoint cannot accept: {e}");
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Largest request head the metrics endpoint reads.
const MAX_REQUEST_HEAD: usize = 8192;

/// Handles one HTTP/1.1 request: `GET /metrics` gets the Prometheus text,
/// any other path 404 and any other method 405. The connection then closes.
fn answer_metrics(mut stream: TcpStream, group: &Group) -> io::Result<()> {
    // A client that stalls must not hold the endpoint for long.
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST_HEAD {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            );
        }
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(
            &mut stream,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &group.metrics().render(),
        ),
        ("GET", _) => respond(&mut stream, "404 Not Found", "text/plain", "not found\n"),
        _ => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        ),
    }
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// Raises the soft limit on open files to the hard limit. Every
/// connection holds several descriptors, and vhost-user-backend 0.24 leaks
/// one per queue per connection (the exit event it takes from
/// [`MemberBackend`]), so a daemon whose VMs restart often needs room.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur >= lim.rlim_max
    {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: `raised` is a valid rlimit; setrlimit only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        log::debug!(
            "open file limit raised from {} to {}",
            lim.rlim_cur,
            lim.rlim_max
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_socket_is_removed_but_live_one_and_files_are_not() {
        let dir = std::env::temp_dir().join(format!("dmlc-daemon-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let stale = dir.join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(stale.exists());
        remove_stale_socket(&stale).unwrap();
        assert!(!stale.exists());

        let live = dir.join("live.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&live).unwrap();
        assert!(matches!(
            remove_stale_socket(&live),
            Err(DaemonError::SocketInUse(_))
        ));

        let file = dir.join("file");
        std::fs::write(&file, b"keep me").unwrap();
        assert!(matches!(
            remove_stale_socket(&file),
            Err(DaemonError::NotASocket(_))
        ));
        assert!(file.exists());

        remove_stale_socket(&dir.join("absent")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn paths_are_described_briefly() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(describe_paths(&[p("/a0")]), "/a0");
        assert_eq!(
            describe_paths(&[p("/a0"), p("/a1"), p("/a2")]),
            "/a0 .. /a2"
        );
    }
}
