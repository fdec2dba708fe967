//! One job across several hosts (`submit --hosts` or `--hostfile`): one
//! `mpirun` starts this launcher once per host (hidden subcommand
//! `host-part`), and each of those runs its host's part of the job like a
//! one-host job: a `--mpi` backend (the MPI process of its host) and its
//! `L = N / H` VMs, ranks `h*L .. h*L+L-1` (host-major, the daemons' order).
//!
//! Three processes per host, so that Open MPI's signals reach only what
//! expects them:
//!
//! - the top-level launcher runs `mpirun` in its own process group, relays
//!   its output, reads each host's end report and decides when to stop:
//!   once every host has reported, or on a signal, the timeout or a host's
//!   failure, it sends `mpirun` SIGUSR1, which Open MPI forwards to every
//!   `host-part`;
//! - `host-part` is what `mpirun` starts (Open MPI signals its whole process
//!   group, and when it ends a job, SIGTERM is followed by SIGKILL 1 s
//!   later): it only starts `host-run` in a group of its own and turns any
//!   signal into a SIGTERM for it, so the teardown goes on if it is killed;
//! - `host-run` reads its host index from the MPI environment and runs the
//!   part; its backend, its child, inherits that environment and is the MPI
//!   process of the host. It prints one report line when its monitor has
//!   decided the end, stops its VMs, and keeps its backend until the stop
//!   comes: a backend that leaves the MPI job ends it (Open MPI then ends
//!   every other process of the job), so they leave together.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::job::{term_with_parent, End, Job, Place};
use crate::signals;

/// How long `mpirun` gets to end the job after SIGUSR1, and then after
/// SIGTERM, before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(30);
const TERM_WAIT: Duration = Duration::from_secs(15);

/// What every host's part gets (one JSON argument of `host-part`).
#[derive(Debug, Serialize, Deserialize)]
pub struct Part {
    /// Marks the report lines of this job on `mpirun`'s output.
    pub token: String,
    pub hosts: usize,
    /// The whole job (`place` unset; each part sets its own).
    pub job: Job,
}

/// How a host's part ended (one line on stdout: [`REPORT`] token host JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// `completed`, `failed`, `timeout`, `interrupted`, `vm-died`,
    /// `backend-died`, or `error` (the part could not start).
    pub end: String,
    /// The part's own exit status (as a one-host job's).
    pub code: i32,
    /// Each local VM's program status, local order (`None`: stopped).
    pub statuses: Vec<Option<i32>>,
    /// When it ended or its first worker failed, ms since the Unix epoch.
    pub at_ms: u64,
}

const REPORT: &str = "DMLC-QEMU-HOST";

/// Parses a hostfile: one host per line (the first word; Open MPI's
/// `slots=` and `max_slots=` words are allowed and ignored), `#` starts a
/// comment, blank lines are skipped.
pub fn parse_hostfile(text: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        let mut words = line.split_whitespace();
        let Some(host) = words.next() else { continue };
        if let Some(w) = words.find(|w| !w.starts_with("slots=") && !w.starts_with("max_slots=")) {
            return Err(format!(
                "line {}: unexpected {w:?} after the host name (one host per line)",
                i + 1
            ));
        }
        hosts.push(host.to_owned());
    }
    Ok(hosts)
}

/// Checks a list of hosts: not empty, each once, no commas or spaces.
pub fn check_hosts(hosts: &[String]) -> Result<(), String> {
    if hosts.is_empty() {
        return Err("no hosts given".to_owned());
    }
    for (i, h) in hosts.iter().enumerate() {
        if h.is_empty() || h.contains([',', ' ', '\t']) {
            return Err(format!("{h:?} is not a host name"));
        }
        if hosts[..i].contains(h) {
            return Err(format!(
                "host {h} is given twice: each host runs one backend and its share of the VMs"
            ));
        }
    }
    Ok(())
}

/// Backend options that an `--mpi` backend refuses or that the launcher
/// sets itself; `None` if `arg` is fine.
pub fn refused_backend_arg(arg: &str) -> Option<&'static str> {
    let name = arg.split('=').next().unwrap_or(arg);
    match name {
        "--timing" | "--control-socket" => {
            Some("vhost-device-dmlc --mpi does not take it yet (docs/multi-host.md)")
        }
        "--queues" => Some("vhost-device-dmlc --mpi serves one request queue per member"),
        "--socket-path" | "--socket-count" | "--mpi" => {
            Some("the launcher sets it for each host's backend")
        }
        _ => None,
    }
}

/// What the probe `BACKEND --mpi --queues 2` says about the build: an mpi
/// build refuses the queues (and starts nothing), one without the feature
/// says so first.
pub fn backend_has_mpi(backend: &Path) -> Result<(), String> {
    let out = Command::new(backend)
        .args([
            "--mpi",
            "--queues",
            "2",
            "--socket-count",
            "1",
            "--socket-path",
        ])
        .arg("/nonexistent/dmlc-qemu-probe.sock")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run the backend {}: {e}", backend.display()))?;
    let text = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    if text.contains("built without MPI") {
        return Err(format!(
            "the backend {} was built without MPI, which --hosts needs: build it with \
             `cargo build --release -p vhost-device-dmlc --features mpi` (needs \
             libopenmpi-dev and libclang-dev) or give --backend PATH",
            backend.display()
        ));
    }
    if !text.contains("one request queue per member") {
        return Err(format!(
            "the backend {} does not look like vhost-device-dmlc with --mpi (asked \
             `--mpi --queues 2`, it said: {})",
            backend.display(),
            text.trim()
        ));
    }
    Ok(())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A token unique to this job.
fn token() -> String {
    format!("{}-{:x}", std::process::id(), now_ms())
}

/// The `mpirun` command line that starts one `host-part` per host.
pub fn mpirun_command(
    mpirun: &Path,
    hosts: &[String],
    user_args: &[OsString],
    exe: &Path,
    part_json: &str,
) -> Command {
    let mut cmd = Command::new(mpirun);
    cmd.arg("-n")
        .arg(hosts.len().to_string())
        .arg("--host")
        .arg(hosts.join(","))
        .args(["--map-by", "node"]);
    // What the parts on other hosts need of this environment (QEMU, the
    // caches, the repository, virtiofsd), as ssh does not bring it.
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("DMLC_") || k == "TMPDIR" || k == "RUST_LOG")
        .collect();
    names.sort();
    for k in names {
        cmd.arg("-x").arg(k);
    }
    cmd.args(user_args).arg(exe).arg("host-part").arg(part_json);
    cmd
}

/// Runs `job` across `hosts` through `mpirun`; returns the exit status.
pub fn submit(
    mut job: Job,
    hosts: &[String],
    mpirun: &Path,
    mpirun_args: &[OsString],
) -> Result<i32, String> {
    let started = Instant::now();
    let exe = std::env::current_exe().map_err(|e| format!("cannot find dmlc-qemu itself: {e}"))?;
    if let Some(dir) = &job.log_dir {
        job.log_dir =
            Some(std::path::absolute(dir).map_err(|e| format!("{}: {e}", dir.display()))?);
    }
    let part = Part {
        token: token(),
        hosts: hosts.len(),
        job,
    };
    let json = serde_json::to_string(&part).map_err(|e| format!("cannot encode the job: {e}"))?;
    let job = &part.job;
    let local = job.num_workers / hosts.len();
    let mut cmd = mpirun_command(mpirun, hosts, mpirun_args, &exe, &json);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        // A Ctrl-C reaches the launcher, which stops the job through mpirun.
        .process_group(0);
    // mpirun ends the job if the launcher is SIGKILLed.
    term_with_parent(&mut cmd);
    crate::progress(&format!(
        "starting {} worker{} on {} host{} ({} each: {}) with {}",
        job.num_workers,
        if job.num_workers == 1 { "" } else { "s" },
        hosts.len(),
        if hosts.len() == 1 { "" } else { "s" },
        local,
        hosts.join(", "),
        mpirun.display()
    ));
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", mpirun.display()))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    let marker = format!("{REPORT} {} ", part.token);
    let relay = thread::spawn(move || relay(stdout, &marker, &tx, &mut io::stdout()));

    let mut reports: Vec<Option<Report>> = vec![None; hosts.len()];
    let mut stop: Option<(Stop, Instant)> = None;
    let mut termed = false;
    let status: ExitStatus = loop {
        for (h, r) in rx.try_iter() {
            if h >= reports.len() || reports[h].is_some() {
                continue;
            }
            if stop.is_none() && r.end != "completed" {
                crate::progress(&format!(
                    "host {h} ({}) ended: {}; stopping the other hosts",
                    hosts[h],
                    describe(&r, h * local)
                ));
                stop = Some((Stop::Host, Instant::now()));
                usr1(&child);
            }
            reports[h] = Some(r);
        }
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if stop.is_none() && reports.iter().all(Option::is_some) {
            // Every host's VMs are done: their backends leave the MPI job
            // together.
            stop = Some((Stop::Done, Instant::now()));
            usr1(&child);
        }
        if stop.is_none() {
            if let Some(sig) = signals::received() {
                crate::progress(&format!("{}: stopping every host", signals::name(sig)));
                stop = Some((Stop::Signal(sig), Instant::now()));
                usr1(&child);
            } else if let Some(t) = job.timeout {
                if started.elapsed() >= t {
                    crate::progress(&format!(
                        "timeout after {} s; stopping every host",
                        t.as_secs()
                    ));
                    stop = Some((Stop::Timeout, Instant::now()));
                    usr1(&child);
                }
            }
        }
        if let Some((_, at)) = stop {
            if !termed && at.elapsed() >= STOP_WAIT {
                crate::progress("mpirun did not end the job in time; sending it SIGTERM");
                termed = true;
                term(&child, Signal::SIGTERM);
            } else if termed && at.elapsed() >= STOP_WAIT + TERM_WAIT {
                crate::progress("mpirun still runs; killing it");
                term(&child, Signal::SIGKILL);
            }
        }
        thread::sleep(Duration::from_millis(50));
    };
    // EOF once mpirun and whatever inherited its stdout are gone; a
    // straggler holding it does not keep the launcher.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !relay.is_finished() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    for (h, r) in rx.try_iter() {
        if h < reports.len() && reports[h].is_none() {
            reports[h] = Some(r);
        }
    }
    let code = exit_code(stop.map(|(s, _)| s), &reports);
    let mut words = Vec::new();
    for (h, r) in reports.iter().enumerate() {
        for l in 0..local {
            let rank = h * local + l;
            words.push(match r.as_ref().and_then(|r| r.statuses.get(l).copied()) {
                Some(Some(s)) => format!("rank {rank}: {s}"),
                Some(None) => format!("rank {rank}: stopped"),
                None => format!("rank {rank}: unknown"),
            });
        }
    }
    let missing: Vec<String> = (0..hosts.len())
        .filter(|&h| reports[h].is_none())
        .map(|h| format!("{h} ({})", hosts[h]))
        .collect();
    if !missing.is_empty() {
        crate::progress(&format!(
            "no report from host {} (mpirun exited: {status}); see the messages above",
            missing.join(", ")
        ));
    }
    crate::progress(&format!(
        "{} after {:.1} s; exit status {code}",
        words.join(", "),
        started.elapsed().as_secs_f64()
    ));
    Ok(code)
}

/// Why the launcher stopped the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Signal(i32),
    Timeout,
    /// A host's part ended other than completed.
    Host,
    /// Every host reported its end.
    Done,
}

/// The launcher's exit status: its own stop (signal, timeout) first; then
/// the first host to end other than completed (by time): its worker's
/// status, 124, 125 or 128+N; with every host completed, the first
/// non-zero status in rank order; 125 when a host sent no report.
fn exit_code(stop: Option<Stop>, reports: &[Option<Report>]) -> i32 {
    match stop {
        Some(Stop::Signal(sig)) => return 128 + sig,
        Some(Stop::Timeout) => return 124,
        _ => {}
    }
    let mut first: Option<&Report> = None;
    for r in reports.iter().flatten() {
        if r.end != "completed" && first.is_none_or(|f| r.at_ms < f.at_ms) {
            first = Some(r);
        }
    }
    if let Some(r) = first {
        return r.code;
    }
    if reports.iter().any(Option::is_none) {
        return 125;
    }
    reports
        .iter()
        .flatten()
        .flat_map(|r| r.statuses.iter().flatten())
        .copied()
        .find(|&s| s != 0)
        .unwrap_or(0)
}

/// A report in words, for the progress line.
fn describe(r: &Report, first_rank: usize) -> String {
    let failed: Vec<String> = r
        .statuses
        .iter()
        .enumerate()
        .filter_map(|(l, s)| match s {
            Some(s) if *s != 0 => Some(format!("rank {} exited with status {s}", first_rank + l)),
            _ => None,
        })
        .collect();
    if r.end == "failed" && !failed.is_empty() {
        return failed.join(", ");
    }
    format!("{} (status {})", r.end, r.code)
}

/// Asks mpirun to stop the job: SIGUSR1, which it forwards to every part.
fn usr1(child: &Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGUSR1);
    }
}

fn term(child: &Child, sig: Signal) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // mpirun leads its own group; the whole group on SIGKILL.
        let _ = match sig {
            Signal::SIGKILL => killpg(Pid::from_raw(pid), sig),
            _ => kill(Pid::from_raw(pid), sig),
        };
    }
}

/// Copies mpirun's stdout to ours, line by line, and sends the report
/// lines (`marker` HOST JSON) to `tx` instead.
fn relay(
    stdout: impl io::Read,
    marker: &str,
    tx: &mpsc::Sender<(usize, Report)>,
    out: &mut dyn Write,
) {
    for line in BufReader::new(stdout).split(b'\n') {
        let Ok(line) = line else { break };
        let text = String::from_utf8_lossy(&line);
        if let Some(rest) = text.strip_prefix(marker) {
            if let Some((h, json)) = rest.split_once(' ') {
                if let (Ok(h), Ok(r)) = (h.parse(), serde_json::from_str(json)) {
                    let _ = tx.send((h, r));
                    continue;
                }
            }
        }
        let _ = out.write_all(&line);
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }
}

/// This process's rank in the MPI job (the host index) and the job's size,
/// from Open MPI's environment (or PMIx's rank).
fn mpi_rank() -> Result<(usize, Option<usize>), String> {
    let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let rank = get("OMPI_COMM_WORLD_RANK")
        .or_else(|| get("PMIX_RANK"))
        .ok_or("host-part: no OMPI_COMM_WORLD_RANK or PMIX_RANK: it is started by mpirun")?;
    Ok((rank, get("OMPI_COMM_WORLD_SIZE")))
}

/// `host-part JSON`: what mpirun starts on each host. Runs `host-run JSON`
/// in a process group of its own and turns the signals that Open MPI sends
/// this process's group (SIGUSR1 forwarded from the launcher, SIGTERM when
/// it ends the job) into one SIGTERM for it.
pub fn host_part(json: &str) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            crate::progress(&format!("host-part: cannot find dmlc-qemu itself: {e}"));
            return 125;
        }
    };
    let mut cmd = Command::new(exe);
    cmd.arg("host-run")
        .arg(json)
        .stdin(Stdio::null())
        .process_group(0);
    term_with_parent(&mut cmd);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            crate::progress(&format!("host-part: cannot start host-run: {e}"));
            return 125;
        }
    };
    let mut forwarded = false;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => {
                use std::os::unix::process::ExitStatusExt;
                return s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0));
            }
            Ok(None) => {}
            Err(e) => {
                crate::progress(&format!("host-part: cannot wait for host-run: {e}"));
                return 125;
            }
        }
        if !forwarded && signals::received().is_some() {
            forwarded = true;
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// `host-run JSON`: this host's part of the job. Prints its report line
/// and returns 0 once it has; 125 if it cannot even tell which host it is.
pub fn host_run(json: &str) -> i32 {
    let part: Part = match serde_json::from_str(json) {
        Ok(p) => p,
        Err(e) => {
            crate::progress(&format!("host-run: bad job description: {e}"));
            return 125;
        }
    };
    let (host, size) = match mpi_rank() {
        Ok(r) => r,
        Err(e) => {
            crate::progress(&e);
            return 125;
        }
    };
    crate::set_progress_prefix(format!("host {host}: "));
    let report = |r: &Report| {
        let line = serde_json::to_string(r).expect("a report encodes");
        let mut out = io::stdout().lock();
        let _ = writeln!(out, "{REPORT} {} {host} {line}", part.token);
        let _ = out.flush();
    };
    let error = |code: i32| Report {
        end: "error".to_owned(),
        code,
        statuses: Vec::new(),
        at_ms: now_ms(),
    };
    if host >= part.hosts || size.is_some_and(|s| s != part.hosts) {
        crate::progress(&format!(
            "MPI rank {host} of {size:?}, but the job has {} hosts: give mpirun one \
             process per host",
            part.hosts
        ));
        report(&error(125));
        return 0;
    }
    let mut job = part.job;
    job.place = Some(Place {
        host,
        hosts: part.hosts,
    });
    if let Some(dir) = &job.log_dir {
        job.log_dir = Some(dir.join(format!("host{host}")));
    }
    crate::progress(&format!(
        "ranks {} to {} of {} on {}",
        job.first_rank(),
        job.first_rank() + job.local_workers() - 1,
        job.num_workers,
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default()
    ));
    let mut out = io::stdout();
    let mut reported = false;
    let result = crate::prepare::qemu()
        .map_err(crate::job::JobError::from)
        .and_then(|qemu| {
            job.run_reporting(&qemu, &mut out, &mut |end, statuses, failed_at| {
                let (name, code) = end_name(end, statuses);
                report(&Report {
                    end: name.to_owned(),
                    code,
                    statuses: statuses.to_vec(),
                    at_ms: failed_at.map_or_else(now_ms, |t| {
                        t.duration_since(UNIX_EPOCH)
                            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                            .unwrap_or(0)
                    }),
                });
                reported = true;
            })
        });
    let _ = out.flush();
    match result {
        Ok(_) => {}
        Err(e) => {
            let code = crate::job_error(&e);
            if e.to_string().contains("built without MPI") {
                crate::progress(
                    "the backend on this host is not an mpi build: build it with \
                     `cargo build --release -p vhost-device-dmlc --features mpi`",
                );
            }
            if !reported {
                report(&error(code));
            }
        }
    }
    0
}

/// The report's name of an end, and the part's exit status.
fn end_name(end: &End, statuses: &[Option<i32>]) -> (&'static str, i32) {
    let outcome = crate::job::Outcome {
        end: end.clone(),
        ranks: statuses
            .iter()
            .map(|&status| crate::job::RankOutcome {
                status,
                ..Default::default()
            })
            .collect(),
        image: Duration::ZERO,
        shutdown: Duration::ZERO,
        wall: Duration::ZERO,
    };
    let name = match end {
        End::Completed => "completed",
        End::Failed { .. } => "failed",
        End::Timeout(_) => "timeout",
        End::Interrupted(_) => "interrupted",
        End::VmDied { .. } => "vm-died",
        End::BackendDied(_) => "backend-died",
    };
    (name, outcome.exit_code())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles_name_one_host_a_line() {
        let text = "# two hosts\nnode-a slots=4\n\n  node-b   # the second\n";
        assert_eq!(parse_hostfile(text).unwrap(), ["node-a", "node-b"]);
        assert!(parse_hostfile("a b\n").unwrap_err().contains("line 1"));
        assert!(parse_hostfile("# nothing\n").unwrap().is_empty());
        assert!(check_hosts(&[]).is_err());
        assert!(check_hosts(&["a".into(), "a".into()])
            .unwrap_err()
            .contains("twice"));
        assert!(check_hosts(&["a,b".into()]).is_err());
        assert!(check_hosts(&["a".into(), "b".into()]).is_ok());
    }

    #[test]
    fn backend_args_the_mpi_daemon_refuses_are_named() {
        assert!(refused_backend_arg("--timing=ring.toml").is_some());
        assert!(refused_backend_arg("--control-socket").is_some());
        assert!(refused_backend_arg("--queues=2").is_some());
        assert!(refused_backend_arg("--socket-count").is_some());
        assert_eq!(refused_backend_arg("--trace-out=t.json"), None);
        assert_eq!(refused_backend_arg("--reduce-threads=1"), None);
    }

    fn report(end: &str, code: i32, statuses: &[Option<i32>], at_ms: u64) -> Option<Report> {
        Some(Report {
            end: end.to_owned(),
            code,
            statuses: statuses.to_vec(),
            at_ms,
        })
    }

    #[test]
    fn the_exit_status_is_the_first_hosts_failure() {
        let ok = report("completed", 0, &[Some(0), Some(0)], 5);
        assert_eq!(exit_code(None, &[ok.clone(), ok.clone()]), 0);
        // Rank 3 failed first (status 7); rank 0 then saw PEER_LOST (1).
        let a = report("failed", 1, &[Some(1), None], 20);
        let b = report("failed", 7, &[None, Some(7)], 10);
        assert_eq!(exit_code(Some(Stop::Host), &[a, b.clone()]), 7);
        // The other host was stopped by the launcher: it does not count.
        let stopped = report("interrupted", 143, &[None, None], 30);
        assert_eq!(exit_code(Some(Stop::Host), &[stopped.clone(), b]), 7);
        let late = report("completed", 3, &[Some(0), Some(3)], 5);
        assert_eq!(exit_code(None, &[ok.clone(), late]), 3);
        assert_eq!(exit_code(None, &[ok.clone(), None]), 125);
        assert_eq!(exit_code(Some(Stop::Timeout), &[ok.clone(), stopped]), 124);
        assert_eq!(exit_code(Some(Stop::Signal(2)), &[ok, None]), 130);
    }

    #[test]
    fn reports_are_taken_from_the_output_and_the_rest_is_relayed() {
        let (tx, rx) = mpsc::channel();
        let r = report("completed", 0, &[Some(0)], 1).unwrap();
        let text = format!(
            "[rank 0] hello\n{REPORT} tok 1 {}\n{REPORT} other 0 {{}}\n",
            serde_json::to_string(&r).unwrap()
        );
        let mut out = Vec::new();
        relay(text.as_bytes(), &format!("{REPORT} tok "), &tx, &mut out);
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [(1, r)]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("[rank 0] hello\n{REPORT} other 0 {{}}\n")
        );
    }

    #[test]
    fn mpirun_gets_one_part_per_host_and_the_users_args_last() {
        let cmd = mpirun_command(
            Path::new("/usr/bin/mpirun"),
            &["a".into(), "b".into()],
            &["--mca".into(), "btl".into(), "tcp,self".into()],
            Path::new("/x/dmlc-qemu"),
            "{}",
        );
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(&args[..6], ["-n", "2", "--host", "a,b", "--map-by", "node"]);
        let n = args.len();
        assert_eq!(
            &args[n - 6..],
            [
                "--mca",
                "btl",
                "tcp,self",
                "/x/dmlc-qemu",
                "host-part",
                "{}"
            ]
        );
    }
}
