//! The daemon: one serve loop per socket, the metrics endpoint, and shutdown.
//!
//! Threads: `start_backend`'s caller waits for a termination signal or a
//! fatal error; one thread per rank accepts connections on that rank's
//! socket; one thread answers metrics requests; one thread waits for
//! SIGINT/SIGTERM. vhost-user-backend adds, per connection, a thread for the
//! frontend's messages and one worker per queue (see [`crate::backend`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use log::{error, info, warn};
use thiserror::Error;
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{BackendConfig, MemberBackend};
use crate::config::Config;
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
        source: VhostUserError,
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
    #[error("cannot block the termination signals")]
    Signals(#[source] io::Error),
}

/// What ends `start_backend`.
enum Stop {
    Signal(i32),
    Failed(DaemonError),
}

/// Runs the daemon until SIGINT or SIGTERM (then `Ok`, after removing the
/// sockets) or until a rank cannot accept connections any more.
///
/// Blocks SIGINT and SIGTERM in the calling thread, and so in every thread
/// started after it, so that one thread can wait for them.
pub fn start_backend(config: Config) -> Result<(), DaemonError> {
    let signals = block_termination_signals()?;
    raise_fd_limit();
    let group = Group::new(config.group.clone());
    let listeners = bind_sockets(&config.socket_paths)?;
    let metrics = match config.metrics_addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .map_err(|source| DaemonError::MetricsListen { addr, source })?,
        ),
        None => None,
    };

    let (stop_tx, stop_rx) = mpsc::channel();
    let result = (|| {
        let tx = stop_tx.clone();
        spawn("dmlc-signals", move || {
            let _ = tx.send(Stop::Signal(wait_for_signal(&signals)));
        })?;
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
            config.group.group_id,
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
                Ok(())
            }
            Ok(Stop::Failed(e)) => Err(e),
            Err(mpsc::RecvError) => Ok(()),
        },
    };
    for path in &config.socket_paths {
        let _ = std::fs::remove_file(path);
    }
    outcome
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
fn bind_sockets(paths: &[PathBuf]) -> Result<Vec<Listener>, DaemonError> {
    let mut listeners = Vec::with_capacity(paths.len());
    for path in paths {
        remove_stale_socket(path)?;
        // On error the listeners bound so far remove their files on drop.
        let listener = Listener::new(path, false).map_err(|source| DaemonError::Listen {
            path: path.clone(),
            source,
        })?;
        listeners.push(listener);
    }
    Ok(listeners)
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
/// with a fresh backend, until accepting fails.
fn serve_member(
    cfg: &BackendConfig,
    group: &Arc<Group>,
    mut listener: Listener,
    path: &Path,
) -> Result<(), DaemonError> {
    let rank = cfg.rank;
    loop {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = Arc::new(MemberBackend::new(cfg.clone(), group.clone(), mem.clone()));
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
        info!("rank {rank}: frontend connected on {}", path.display());
        let ended = daemon.wait();
        // Stop submitting and fail what waited for this member before the
        // workers go away with the daemon.
        let lost = backend.lose("disconnected");
        drop(daemon);
        let how = if lost { ", member lost" } else { "" };
        match ended {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                VhostUserError::Disconnected | VhostUserError::PartialMessage,
            )) => info!("rank {rank}: frontend disconnected{how}"),
            Err(e) => warn!("rank {rank}: connection closed after an error{how}: {e}"),
        }
    }
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

/// Blocks SIGINT and SIGTERM in this thread (and the threads it starts
/// later) and returns the set, for [`wait_for_signal`].
fn block_termination_signals() -> Result<libc::sigset_t, DaemonError> {
    // SAFETY: sigset_t is a plain C struct; all zeroes is a valid value that
    // sigemptyset then initialises properly.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t; these calls only write it
    // and fail only for invalid signal numbers, which these are not.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
    }
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(DaemonError::Signals(io::Error::from_raw_os_error(rc)));
    }
    Ok(set)
}

/// Waits until one of the blocked signals in `set` arrives.
fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    loop {
        let mut sig = 0;
        // SAFETY: `set` is an initialised sigset_t and `sig` a valid place
        // for the result.
        let rc = unsafe { libc::sigwait(set, &mut sig) };
        if rc == 0 {
            return sig;
        }
        error!("sigwait failed: {}", io::Error::from_raw_os_error(rc));
        thread::sleep(Duration::from_millis(100));
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
