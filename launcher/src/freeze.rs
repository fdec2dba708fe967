//! The launcher's side of a freeze (docs/debugging.md, spec 5.X.6.15):
//! it follows the backend's freeze state over the control socket, stops
//! every VM through QMP once a collective is held, tells the backend, and
//! when `dmlc-ctl thaw` asks, resumes every VM and tells the backend to
//! run the held collective.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::control_request;
use dmlc_vm::qmp::Qmp;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The debugging options of a job (`submit --control-socket`, `--freeze-*`,
/// `--gdb`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DebugOptions {
    /// Where the backend's control socket goes; `None`: in the launcher's
    /// private directory, if `freeze` or `gdb` needs one.
    pub control_socket: Option<PathBuf>,
    /// The words of a `freeze` request sent before the VMs boot (e.g.
    /// `--at 40`); empty: none.
    pub freeze: Vec<String>,
    /// Each VM gets a gdbstub on port `gdb + i` (VM i) on 127.0.0.1.
    pub gdb: Option<u16>,
}

impl DebugOptions {
    /// Whether the job needs a control socket and QMP sockets.
    pub fn wanted(&self) -> bool {
        self.control_socket.is_some() || !self.freeze.is_empty() || self.gdb.is_some()
    }
}

/// How long a QMP connection or a control request may take.
const PATIENCE: Duration = Duration::from_secs(30);
/// How often the backend's freeze state is read.
const EVERY: Duration = Duration::from_millis(200);

/// Follows the backend's freeze for one job.
pub struct Freezer {
    control: PathBuf,
    /// VM i's QMP socket.
    qmp: Vec<PathBuf>,
    /// Global rank of VM 0.
    first: usize,
    gdb: Option<u16>,
    next_look: Instant,
    /// The freeze whose VMs this launcher stopped, and since when.
    stopped: Option<(u64, Instant)>,
    /// Time the VMs spent stopped so far (the job's timeout leaves it out).
    pub frozen_total: Duration,
}

impl Freezer {
    pub fn new(control: &Path, qmp: Vec<PathBuf>, first: usize, gdb: Option<u16>) -> Freezer {
        Freezer {
            control: control.to_owned(),
            qmp,
            first,
            gdb,
            next_look: Instant::now(),
            stopped: None,
            frozen_total: Duration::ZERO,
        }
    }

    /// Whether the VMs are stopped now.
    pub fn frozen(&self) -> bool {
        self.stopped.is_some()
    }

    /// Runs `command` on every VM; the first failure, if any.
    fn every_vm(&self, command: &str) -> Result<(), String> {
        for (i, path) in self.qmp.iter().enumerate() {
            Qmp::connect(path, PATIENCE)
                .and_then(|mut q| q.execute(command, json!({})))
                .map_err(|e| format!("rank {}: QMP {command}: {e}", self.first + i))?;
        }
        Ok(())
    }

    /// One look at the backend's freeze, acting on it; called from the
    /// monitor's loop. An error is reported and the look made again later.
    pub fn poll(&mut self) {
        if Instant::now() < self.next_look {
            return;
        }
        self.next_look = Instant::now() + EVERY;
        let state = match control_request(&self.control, "frozen", PATIENCE)
            .and_then(|b| serde_json::from_str::<Value>(&b).map_err(|e| e.to_string()))
        {
            Ok(s) => s,
            Err(e) => {
                crate::progress(&format!("freeze: cannot read the backend's state: {e}"));
                self.next_look = Instant::now() + Duration::from_secs(5);
                return;
            }
        };
        let held = &state["held"];
        let id = held["id"].as_u64();
        match (held["phase"].as_str(), id, self.stopped) {
            (Some("held"), Some(id), None) => self.stop_all(id, held),
            (Some("thawing"), Some(id), Some((sid, _))) if sid == id => self.resume_all(id),
            // Released or failed while stopped (a lost member): resume.
            (None, _, Some((sid, _))) => self.resume_all(sid),
            _ => {}
        }
    }

    fn stop_all(&mut self, id: u64, held: &Value) {
        if let Err(e) = self.every_vm("stop") {
            crate::progress(&format!("freeze {id}: {e}; resuming the others"));
            let _ = self.every_vm("cont");
            return;
        }
        if let Err(e) = control_request(&self.control, &format!("stopped {id}"), PATIENCE) {
            // Thawed meanwhile: the VMs go on.
            crate::progress(&format!("freeze {id}: {e}; resuming the VMs"));
            let _ = self.every_vm("cont");
            return;
        }
        self.stopped = Some((id, Instant::now()));
        let ctl = format!("dmlc-ctl --socket {}", self.control.display());
        let mut msg = format!(
            "frozen (freeze {id}): {}; collective {} of queue {} (communicator {}) is held \
             with its inputs in memory, and every VM is stopped.\n  \
             inspect: {ctl} inspect\n  thaw:    {ctl} thaw",
            held["reason"].as_str().unwrap_or("?"),
            held["seq"],
            held["queue"],
            held["comm"],
        );
        for (i, q) in self.qmp.iter().enumerate() {
            msg += &format!("\n  rank {}: QMP {}", self.first + i, q.display());
            if let Some(port) = self.gdb {
                msg += &format!(
                    "; gdb -ex 'target remote 127.0.0.1:{}'",
                    u32::from(port) + i as u32
                );
            }
        }
        crate::progress(&msg);
    }

    fn resume_all(&mut self, id: u64) {
        if let Err(e) = self.every_vm("cont") {
            crate::progress(&format!("freeze {id}: {e}"));
            return;
        }
        let Some((_, since)) = self.stopped.take() else {
            return;
        };
        self.frozen_total += since.elapsed();
        match control_request(&self.control, &format!("resumed {id}"), PATIENCE) {
            Ok(_) => crate::progress(&format!(
                "thawed (freeze {id}) after {:.1} s: the VMs run, the collective goes on",
                since.elapsed().as_secs_f64()
            )),
            // Released some other way (a lost member failed it).
            Err(e) => crate::progress(&format!("freeze {id}: the VMs run again ({e})")),
        }
    }
}
