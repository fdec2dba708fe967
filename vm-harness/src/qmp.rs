//! A QMP client (QEMU's machine protocol: one JSON object per line over
//! the VM's `-qmp unix:PATH,server=on,wait=off` socket): enough to stop,
//! resume and query a VM, for the launcher's freeze and for the tests.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// One connection to a VM's QMP socket.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl Qmp {
    /// Connects (retrying for up to `patience` while QEMU starts, or while
    /// another client holds the socket: QEMU serves one at a time) and
    /// leaves capabilities negotiation mode. Replies are awaited for at
    /// most 60 s each.
    pub fn connect(path: &Path, patience: Duration) -> io::Result<Qmp> {
        let deadline = Instant::now() + patience;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("QMP socket {}: {e}", path.display()),
                    ))
                }
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let writer = stream.try_clone()?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(bad(format!("not a QMP greeting: {greeting}")));
        }
        qmp.execute("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> io::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "QEMU closed its QMP socket",
            ));
        }
        serde_json::from_str(&line).map_err(|e| bad(format!("QMP message {line:?}: {e}")))
    }

    /// Runs `command`; its `return` value, or QEMU's error (kind `Other`,
    /// its description as the message).
    pub fn execute(&mut self, command: &str, arguments: Value) -> io::Result<Value> {
        let msg = json!({ "execute": command, "arguments": arguments });
        writeln!(self.writer, "{msg}")?;
        loop {
            let reply = self.read_message()?;
            // Events (STOP, RESUME, ...) come on the same stream.
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let desc = err["desc"].as_str().unwrap_or("?");
                return Err(io::Error::other(format!("{command}: {desc}")));
            }
            return Err(bad(format!("unexpected QMP reply to {command}: {reply}")));
        }
    }

    /// The VM's run state (`running`, `paused`, ...).
    pub fn status(&mut self) -> io::Result<String> {
        let s = self.execute("query-status", json!({}))?;
        Ok(s["status"].as_str().unwrap_or("?").to_owned())
    }
}
