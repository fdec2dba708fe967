//! The backend daemon's sockets as the programs that start it find them:
//! the daemon's naming rule (`--socket-path BASE --socket-count N` serves
//! `BASE0` .. `BASE{N-1}`) and the one wait for a daemon just started to
//! serve all of them.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

/// The socket of member `index` of a daemon started with `--socket-path
/// base`: `base` with the decimal `index` appended (`/tmp/d.sock` ->
/// `/tmp/d.sock0`). The daemon names its sockets with this function.
pub fn socket_path(base: &Path, index: u32) -> PathBuf {
    let mut name = OsString::from(base.as_os_str());
    name.push(index.to_string());
    PathBuf::from(name)
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

/// Why [`Sockets::wait`] gave up.
#[derive(Debug, PartialEq, Eq)]
pub enum WaitError<E> {
    /// The caller's check said to stop (the daemon exited, a signal came).
    Stopped(E),
    /// Not every socket was served within this long.
    TimedOut(Duration),
}

/// The sockets of a daemon about to be started. Made before spawning it:
/// socket files left there by an earlier daemon (killed, so it could not
/// remove them) do not count as served.
#[derive(Debug)]
pub struct Sockets {
    base: PathBuf,
    stale: Vec<Option<SocketId>>,
}

impl Sockets {
    /// The `count` sockets of a daemon to start with `--socket-path base`.
    pub fn before_start(base: &Path, count: u32) -> Sockets {
        Sockets {
            base: base.to_path_buf(),
            stale: (0..count)
                .map(|i| socket_id(&socket_path(base, i)))
                .collect(),
        }
    }

    /// Member `index`'s socket.
    pub fn path(&self, index: u32) -> PathBuf {
        socket_path(&self.base, index)
    }

    /// True when every socket exists, each a new one.
    pub fn all_served(&self) -> bool {
        self.stale.iter().enumerate().all(|(i, stale)| {
            let id = socket_id(&self.path(i as u32));
            id.is_some() && id != *stale
        })
    }

    /// Waits until every socket is served and `check` returns `Ok(true)`
    /// (a caller that waits for nothing more returns `Ok(true)`; one that
    /// also wants the daemon's "listening" log line returns whether it has
    /// come). `check` runs on every poll, before the sockets are looked
    /// at, so that a daemon that exits at start is reported as such (its
    /// `Err` ends the wait) and not as a timeout after `limit`.
    pub fn wait<E>(
        &self,
        limit: Duration,
        mut check: impl FnMut() -> Result<bool, E>,
    ) -> Result<(), WaitError<E>> {
        let deadline = Instant::now() + limit;
        loop {
            let checked = check().map_err(WaitError::Stopped)?;
            if checked && self.all_served() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(WaitError::TimedOut(limit));
            }
            thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Sends one request line to the daemon's control socket
/// (`--control-socket`, one request per connection) and returns the body
/// of an `ok` answer, or the daemon's `error: ...` text (or why no answer
/// came) as the error. `patience` bounds the wait for the answer.
pub fn control_request(
    socket: &Path,
    request: &str,
    patience: std::time::Duration,
) -> Result<String, String> {
    use std::io::{Read, Write};
    let shown = socket.display();
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {shown}: {e}"))?;
    let _ = s.set_read_timeout(Some(patience));
    s.write_all(format!("{request}\n").as_bytes())
        .map_err(|e| format!("cannot send to {shown}: {e}"))?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)
        .map_err(|e| format!("no answer from {shown}: {e}"))?;
    match reply.split_once('\n') {
        Some(("ok", body)) => Ok(body.to_owned()),
        Some((status, _)) => Err(status.strip_prefix("error: ").unwrap_or(status).to_owned()),
        None => Err(format!("no answer from {shown}")),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn sockets_are_the_base_with_the_index_appended() {
        assert_eq!(
            socket_path(Path::new("/run/d.sock"), 12),
            Path::new("/run/d.sock12")
        );
    }

    #[test]
    fn only_new_sockets_count_and_a_stop_ends_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("s");
        // A stale socket of member 0, left by an earlier daemon.
        let old = UnixListener::bind(socket_path(&base, 0)).unwrap();
        let sockets = Sockets::before_start(&base, 2);
        assert!(!sockets.all_served());
        let short = Duration::from_millis(50);
        assert_eq!(
            sockets.wait(short, || Ok::<_, ()>(true)),
            Err(WaitError::TimedOut(short))
        );
        assert_eq!(
            sockets.wait(Duration::from_secs(60), || Err("exited")),
            Err(WaitError::Stopped("exited"))
        );
        drop(old);
        fs::remove_file(socket_path(&base, 0)).unwrap();
        let _a = UnixListener::bind(socket_path(&base, 0)).unwrap();
        let _b = UnixListener::bind(socket_path(&base, 1)).unwrap();
        assert!(sockets.all_served());
        // Served, but the caller's own condition has not come yet.
        assert_eq!(
            sockets.wait(short, || Ok::<_, ()>(false)),
            Err(WaitError::TimedOut(short))
        );
        assert_eq!(sockets.wait(short, || Ok::<_, ()>(true)), Ok(()));
    }
}
