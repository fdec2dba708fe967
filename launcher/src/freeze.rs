//! The launcher's side of a freeze (docs/debugging.md, spec 5.X.6.15):
//! it follows the backend's freeze state over the control socket, stops
//! every VM through QMP once a collective is held, tells the backend, and
//! when `dmlc-ctl thaw` asks, resumes every VM and tells the backend to
//! run the held collective. When `dmlc-ctl snapshot DIR` asks, it saves
//! every stopped VM into DIR (QMP `migrate` to a file: the device's state
//! carries its member's part of the group) with what `dmlc-qemu restore`
//! needs besides ([`Snapshot`], `snapshot.json`).

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
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

/// What `dmlc-qemu restore DIR` reads from `DIR/snapshot.json`, besides
/// each rank's saved VM (`DIR/rankR.vmstate`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// The job as `submit` ran it ([`crate::job::Job`]).
    pub job: Value,
    /// The job's token (its markers in the guests' consoles).
    pub token: String,
    /// The VM cluster's token (the guests' nonces).
    pub vm_token: String,
    /// The backend's group id, which the new backend takes.
    pub group_id: String,
    /// Where it lies (not saved: the directory it is read from).
    #[serde(skip)]
    pub dir: PathBuf,
}

/// The file of a snapshot that names the rest.
pub const SNAPSHOT_FILE: &str = "snapshot.json";

impl Snapshot {
    /// Rank `rank`'s saved VM.
    pub fn vm_state(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank{rank}.vmstate"))
    }

    /// Reads the snapshot in `dir`.
    pub fn load(dir: &Path) -> Result<Snapshot, String> {
        let file = dir.join(SNAPSHOT_FILE);
        let text = fs::read_to_string(&file).map_err(|e| {
            format!(
                "{}: {e} (not a snapshot of dmlc-ctl snapshot?)",
                file.display()
            )
        })?;
        let mut s: Snapshot =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        s.dir = dir.to_owned();
        Ok(s)
    }
}

impl DebugOptions {
    /// Whether the job needs a control socket and QMP sockets.
    pub fn wanted(&self) -> bool {
        self.control_socket.is_some() || !self.freeze.is_empty() || self.gdb.is_some()
    }
}

/// Runs every VM of a restored job once it has loaded its saved state:
/// a VM saved while stopped comes back stopped.
pub fn run_restored(qmp: &[PathBuf], first: usize) -> Result<(), String> {
    for (i, path) in qmp.iter().enumerate() {
        let rank = first + i;
        let started = Instant::now();
        let mut q = Qmp::connect(path, PATIENCE).map_err(|e| format!("rank {rank}: {e}"))?;
        loop {
            let status = q.status().map_err(|e| format!("rank {rank}: {e}"))?;
            match status.as_str() {
                "inmigrate" if started.elapsed() < Duration::from_secs(600) => {
                    thread::sleep(Duration::from_millis(50));
                }
                "inmigrate" => return Err(format!("rank {rank}: still loading after 10 minutes")),
                "running" => break,
                "paused" | "postmigrate" | "prelaunch" | "restore-vm" => {
                    q.execute("cont", json!({}))
                        .map_err(|e| format!("rank {rank}: cont: {e}"))?;
                    break;
                }
                other => {
                    return Err(format!(
                        "rank {rank}: the VM is {other} after loading its saved state (QEMU's \
                         log says why)"
                    ))
                }
            }
        }
        crate::progress(&format!(
            "rank {rank}: VM restored in {:.1} s",
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
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
    /// The job, for a snapshot.
    saved: Snapshot,
    /// The freeze whose snapshot this launcher made (or failed).
    snapshotted: Option<u64>,
}

impl Freezer {
    pub fn new(
        control: &Path,
        qmp: Vec<PathBuf>,
        first: usize,
        gdb: Option<u16>,
        saved: Snapshot,
    ) -> Freezer {
        Freezer {
            control: control.to_owned(),
            qmp,
            first,
            gdb,
            next_look: Instant::now(),
            stopped: None,
            frozen_total: Duration::ZERO,
            saved,
            snapshotted: None,
        }
    }

    /// Whether the VMs are stopped now.
    pub fn frozen(&self) -> bool {
        self.stopped.is_some()
    }

    /// Runs `command` on every VM whose QEMU is still there (one whose
    /// program ended has powered off); the first failure, if any.
    fn every_vm(&self, command: &str) -> Result<(), String> {
        for (i, path) in self.qmp.iter().enumerate() {
            let mut q = match Qmp::connect(path, Duration::from_secs(2)) {
                Ok(q) => q,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(format!("rank {}: QMP: {e}", self.first + i)),
            };
            q.execute(command, json!({}))
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
        let snapshot = &held["snapshot"];
        if let (Some("saving"), Some(dir), Some(id)) =
            (snapshot["state"].as_str(), snapshot["dir"].as_str(), id)
        {
            if self.stopped.is_some() && self.snapshotted != Some(id) {
                self.snapshotted = Some(id);
                let verdict = match self.save(Path::new(dir)) {
                    Ok(()) => {
                        crate::progress(&format!(
                            "snapshot of freeze {id} saved in {dir} (dmlc-qemu restore {dir})"
                        ));
                        "ok".to_owned()
                    }
                    Err(e) => {
                        crate::progress(&format!("snapshot of freeze {id} failed: {e}"));
                        format!("error {}", e.replace('\n', " "))
                    }
                };
                if let Err(e) = control_request(
                    &self.control,
                    &format!("snapshotted {id} {verdict}"),
                    PATIENCE,
                ) {
                    crate::progress(&format!("snapshot of freeze {id}: {e}"));
                }
            }
        }
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

    /// Saves every VM into `dir`, then `snapshot.json`.
    fn save(&mut self, dir: &Path) -> Result<(), String> {
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let state: Value = control_request(&self.control, "state", PATIENCE)
            .and_then(|b| serde_json::from_str(&b).map_err(|e| e.to_string()))?;
        self.saved.group_id = state["group_id"].as_str().unwrap_or_default().to_owned();
        self.saved.dir = dir.to_owned();
        for (i, path) in self.qmp.iter().enumerate() {
            let rank = self.first + i;
            let file = self.saved.vm_state(rank);
            let started = Instant::now();
            let mut q = Qmp::connect(path, PATIENCE).map_err(|e| format!("rank {rank}: {e}"))?;
            q.execute(
                "migrate",
                json!({ "uri": format!("file:{}", file.display()) }),
            )
            .map_err(|e| format!("rank {rank}: {e}"))?;
            loop {
                let m = q
                    .execute("query-migrate", json!({}))
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                match m["status"].as_str() {
                    Some("completed") => break,
                    Some("failed" | "cancelled") => {
                        return Err(format!(
                            "rank {rank}: saving the VM failed: {} (QEMU's log says why)",
                            m["error-desc"].as_str().unwrap_or("no reason given")
                        ))
                    }
                    _ if started.elapsed() > Duration::from_secs(600) => {
                        return Err(format!("rank {rank}: saving the VM takes over 10 minutes"))
                    }
                    _ => thread::sleep(Duration::from_millis(50)),
                }
            }
            crate::progress(&format!(
                "rank {rank}: VM saved in {:.1} s ({})",
                started.elapsed().as_secs_f64(),
                file.display()
            ));
        }
        let text = serde_json::to_string_pretty(&self.saved).map_err(|e| e.to_string())?;
        let file = dir.join(SNAPSHOT_FILE);
        fs::write(&file, text).map_err(|e| format!("{}: {e}", file.display()))
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
