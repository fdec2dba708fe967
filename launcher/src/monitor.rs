//! Following a job's VMs until it ends: each VM's console (its program's
//! output streamed as it comes, the start and exit markers, files fetched
//! back), the VMs' QEMUs, the backend, the job's timeout, and, when the job
//! can be frozen, the launcher's side of the freeze ([`Freezer`]).

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::{alphabet, Engine as _};
use dmlc_vm as vm;

use crate::freeze::Freezer;
use crate::job::{tail, Backend, End, RankOutcome, GRACE};
use crate::signals;

/// What the launcher knows of a VM's QEMU guard process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guard {
    Pid(i32),
    /// /proc cannot be read: death is not detected (the timeout still is).
    Unknown,
}

/// Follows one VM's console.
pub(crate) struct Console {
    /// The global rank (what the output names).
    rank: usize,
    /// The VM's index on this machine (`vmI.*` in the cluster's directory).
    vm: usize,
    log: PathBuf,
    pos: u64,
    /// A line not yet ended.
    partial: Vec<u8>,
    start_line: String,
    exit_marker: String,
    fetch_begin: String,
    fetch_end: String,
    /// Blank lines held back (the init prints one before its exit line).
    blanks: usize,
    /// A file being sent back: (guest path, base64 so far).
    fetching: Option<(String, String)>,
    /// Console lines before the program started (for diagnostics).
    boot_tail: Vec<String>,
    /// Job output lines (the last few, for diagnostics).
    out_tail: Vec<String>,
    /// Copy of the job's output in the log directory.
    out_file: Option<File>,
    /// The QEMU guard process of this VM (a child of the launcher).
    guard: Guard,
    started_at: Instant,
    pub(crate) outcome: RankOutcome,
}

const TAIL_LINES: usize = 30;

fn push_tail(v: &mut Vec<String>, line: &str) {
    if v.len() == TAIL_LINES {
        v.remove(0);
    }
    v.push(line.to_owned());
}

impl Console {
    /// Reads what the console gained and handles each complete line.
    fn poll(&mut self, out: &mut dyn Write) {
        let Ok(mut f) = File::open(&self.log) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        let Ok(n) = f.read_to_end(&mut buf) else {
            return;
        };
        self.pos += n as u64;
        self.partial.extend_from_slice(&buf);
        while let Some(nl) = self.partial.iter().position(|&b| b == b'\n') {
            let raw: Vec<u8> = self.partial.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&raw[..raw.len() - 1]);
            self.line(line.trim_end_matches('\r'), out);
        }
    }

    /// Handles a line left without its newline (at the end).
    fn flush(&mut self, out: &mut dyn Write) {
        if !self.partial.is_empty() {
            let raw = std::mem::take(&mut self.partial);
            let line = String::from_utf8_lossy(&raw).into_owned();
            self.line(line.trim_end_matches('\r'), out);
        }
    }

    fn emit(&mut self, line: &str, out: &mut dyn Write) {
        let _ = writeln!(out, "[rank {}] {line}", self.rank);
        if let Some(f) = &mut self.out_file {
            let _ = writeln!(f, "{line}");
        }
        push_tail(&mut self.out_tail, line);
    }

    fn line(&mut self, line: &str, out: &mut dyn Write) {
        if self.outcome.status.is_some() {
            return;
        }
        if self.outcome.boot.is_none() {
            if line.trim() == self.start_line {
                self.outcome.boot = Some(self.started_at.elapsed());
            } else if line.starts_with("dmlc-init:") {
                // The image's init reports setup problems this way.
                self.emit(line, out);
            } else {
                push_tail(&mut self.boot_tail, line);
            }
            return;
        }
        if let Some(pos) = line.find(&self.exit_marker) {
            let rest = &line[pos + self.exit_marker.len()..];
            let digits: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '-')
                .collect();
            if let Ok(status) = digits.parse() {
                // Kernel messages may share the line.
                if pos > 0 {
                    self.emit(&line[..pos], out);
                }
                self.outcome.status = Some(status);
                self.outcome.total = Some(self.started_at.elapsed());
                return;
            }
        }
        if let Some((path, mut data)) = self.fetching.take() {
            if line.trim() == self.fetch_end {
                self.outcome.fetched.push((path, decode_base64(&data)));
            } else {
                data.push_str(line.trim());
                self.fetching = Some((path, data));
            }
            return;
        }
        if let Some(path) = line.trim().strip_prefix(&self.fetch_begin) {
            self.fetching = Some((path.to_owned(), String::new()));
            return;
        }
        if line.is_empty() {
            self.blanks += 1;
            return;
        }
        for _ in 0..std::mem::take(&mut self.blanks) {
            self.emit("", out);
        }
        self.emit(line, out);
    }
}

/// Decodes standard base64, skipping characters outside the alphabet
/// (a stray kernel message cannot stop the rest from decoding).
fn decode_base64(text: &str) -> Vec<u8> {
    // Padding is dropped with the rest of what is not in the alphabet, and
    // a cut-off last group decodes as far as it goes.
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::RequireNone)
            .with_decode_allow_trailing_bits(true),
    );
    let mut clean: Vec<u8> = text
        .bytes()
        .filter(|&c| c.is_ascii_alphanumeric() || c == b'+' || c == b'/')
        .collect();
    // One character left over holds no whole byte.
    if clean.len() % 4 == 1 {
        clean.pop();
    }
    LENIENT.decode(&clean).unwrap_or_default()
}

/// The state of a process in /proc: `None` if it is gone.
fn proc_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid ...": comm may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    after.trim_start().chars().next()
}

/// Follows every VM until the job ends.
pub(crate) struct Monitor {
    pub(crate) consoles: Vec<Console>,
    cluster_dir: PathBuf,
    /// When the first worker exited non-zero.
    pub(crate) failed_at: Option<SystemTime>,
}

impl Monitor {
    /// Follows the `n` VMs of `cluster`, VM i running global rank
    /// `first + i`.
    pub(crate) fn new(
        cluster: &vm::Cluster,
        n: usize,
        first: usize,
        token: &str,
        log_dir: Option<&Path>,
        resumed: bool,
    ) -> Monitor {
        let dir = cluster.dir().to_owned();
        let consoles = (0..n)
            .map(|i| {
                let cmd = cluster.command_line(i);
                let nonce = cmd
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("dmlc.nonce="))
                    .unwrap_or_default()
                    .to_owned();
                let log = dir.join(format!("vm{i}.log"));
                let guard = match i32::try_from(cluster.pid(i)) {
                    Ok(pid) if Path::new("/proc/self/stat").exists() => Guard::Pid(pid),
                    _ => Guard::Unknown,
                };
                let out_file = log_dir
                    .and_then(|d| File::create(d.join(format!("rank{}.out", first + i))).ok());
                Console {
                    rank: first + i,
                    vm: i,
                    log,
                    pos: 0,
                    partial: Vec::new(),
                    start_line: format!("DMLC-START {nonce}"),
                    exit_marker: format!("DMLC-EXIT {nonce} "),
                    fetch_begin: format!("DMLC-FETCH {token} BEGIN "),
                    fetch_end: format!("DMLC-FETCH {token} END"),
                    blanks: 0,
                    fetching: None,
                    boot_tail: Vec::new(),
                    out_tail: Vec::new(),
                    out_file,
                    guard,
                    started_at: Instant::now(),
                    outcome: RankOutcome {
                        // A restored VM booted before it was saved.
                        boot: resumed.then_some(Duration::ZERO),
                        ..RankOutcome::default()
                    },
                }
            })
            .collect();
        Monitor {
            consoles,
            cluster_dir: dir,
            failed_at: None,
        }
    }

    /// Each VM's program status so far (`None`: still running, or stopped).
    pub(crate) fn statuses(&self) -> Vec<Option<i32>> {
        self.consoles.iter().map(|c| c.outcome.status).collect()
    }

    pub(crate) fn flush(&mut self, out: &mut dyn Write) {
        for c in &mut self.consoles {
            c.poll(out);
            c.flush(out);
        }
        let _ = out.flush();
    }

    /// Polls the consoles, the VMs and the backend until the job ends.
    pub(crate) fn run(
        &mut self,
        out: &mut dyn Write,
        backend: &mut Backend,
        timeout: Option<Duration>,
        mut freezer: Option<&mut Freezer>,
    ) -> End {
        let start = Instant::now();
        let n = self.consoles.len();
        let mut failed: Option<(usize, i32, Instant)> = None;
        let mut all_running = false;
        let mut next_note = start + Duration::from_secs(20);
        loop {
            if let Some(sig) = signals::received() {
                crate::progress(&format!("{}: stopping every VM", signals::name(sig)));
                return End::Interrupted(sig);
            }
            for c in &mut self.consoles {
                c.poll(out);
            }
            let _ = out.flush();
            if !all_running && self.consoles.iter().all(|c| c.outcome.boot.is_some()) {
                all_running = true;
                let boots: Vec<f64> = self
                    .consoles
                    .iter()
                    .filter_map(|c| c.outcome.boot.map(|b| b.as_secs_f64()))
                    .collect();
                let lo = boots.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = boots.iter().copied().fold(0.0, f64::max);
                let took = if hi - lo < 0.05 {
                    format!("{hi:.1} s")
                } else {
                    format!("{lo:.1} to {hi:.1} s")
                };
                crate::progress(&format!(
                    "{n} worker{} running (booted in {took})",
                    if n == 1 { "" } else { "s" }
                ));
            }
            for c in &self.consoles {
                if let (Some(status), None) = (c.outcome.status, failed) {
                    if status != 0 {
                        if self.consoles.iter().any(|o| o.outcome.status.is_none()) {
                            crate::progress(&format!(
                                "rank {} exited with status {status}; stopping the others in {} s",
                                c.rank,
                                GRACE.as_secs()
                            ));
                        }
                        failed = Some((c.rank, status, Instant::now()));
                        self.failed_at = Some(SystemTime::now());
                    }
                }
            }
            if self.consoles.iter().all(|c| c.outcome.status.is_some()) {
                return match failed {
                    Some((rank, status, _)) => End::Failed { rank, status },
                    None => End::Completed,
                };
            }
            if let Some(rank) = self.dead_vm(out) {
                return End::VmDied { rank };
            }
            if let Some(status) = backend.exited() {
                crate::progress(&format!(
                    "the backend exited ({status}); its log:\n{}",
                    backend.log_tail()
                ));
                return End::BackendDied(status.to_string());
            }
            if let Some((rank, status, at)) = failed {
                // A frozen job waits for its thaw: a freeze on a lost
                // member keeps the others stopped to be looked at.
                let frozen = freezer.as_deref().is_some_and(Freezer::frozen);
                if at.elapsed() >= GRACE && !frozen {
                    return End::Failed { rank, status };
                }
            }
            if let Some(f) = freezer.as_deref_mut() {
                f.poll();
            }
            // Time frozen does not count towards the job's timeout.
            let frozen = freezer
                .as_deref()
                .map_or(Duration::ZERO, |f| f.frozen_total);
            let frozen_now = freezer.as_deref().is_some_and(Freezer::frozen);
            if let (Some(t), false) = (timeout, frozen_now) {
                if start.elapsed().saturating_sub(frozen) >= t {
                    let pending: Vec<String> = self
                        .consoles
                        .iter()
                        .filter(|c| c.outcome.status.is_none())
                        .map(|c| c.rank.to_string())
                        .collect();
                    crate::progress(&format!(
                        "timeout after {} s (ranks still running: {}); stopping every VM",
                        t.as_secs(),
                        pending.join(" ")
                    ));
                    return End::Timeout(t);
                }
            }
            if !all_running && Instant::now() >= next_note {
                next_note += Duration::from_secs(20);
                let booting: Vec<String> = self
                    .consoles
                    .iter()
                    .filter(|c| c.outcome.boot.is_none())
                    .map(|c| c.rank.to_string())
                    .collect();
                crate::progress(&format!(
                    "still booting after {:.0} s: rank {}",
                    start.elapsed().as_secs_f64(),
                    booting.join(" ")
                ));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// A VM whose QEMU is gone although its job did not report an exit.
    fn dead_vm(&mut self, out: &mut dyn Write) -> Option<usize> {
        for c in &mut self.consoles {
            if c.outcome.status.is_some() {
                continue;
            }
            let gone = match c.guard {
                Guard::Pid(pid) => matches!(proc_state(pid), None | Some('Z' | 'X')),
                Guard::Unknown => false,
            };
            if gone {
                // The exit line may have landed just before QEMU exited.
                c.poll(out);
                if c.outcome.status.is_some() {
                    continue;
                }
                let qemu_err = fs::read_to_string(self.cluster_dir.join(format!("vm{}.err", c.vm)))
                    .unwrap_or_default();
                let mut msg = format!(
                    "rank {}: the VM stopped without the job's exit line",
                    c.rank
                );
                if !qemu_err.trim().is_empty() {
                    let _ = write!(msg, "\nQEMU said:\n{}", tail(&qemu_err, 20));
                }
                let console = if c.outcome.boot.is_some() {
                    &c.out_tail
                } else {
                    &c.boot_tail
                };
                if !console.is_empty() {
                    let _ = write!(msg, "\nlast console lines:\n{}", console.join("\n"));
                }
                crate::progress(&msg);
                return Some(c.rank);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn console(dir: &Path) -> Console {
        Console {
            rank: 1,
            vm: 1,
            log: dir.join("vm1.log"),
            pos: 0,
            partial: Vec::new(),
            start_line: "DMLC-START n".to_owned(),
            exit_marker: "DMLC-EXIT n ".to_owned(),
            fetch_begin: "DMLC-FETCH t BEGIN ".to_owned(),
            fetch_end: "DMLC-FETCH t END".to_owned(),
            blanks: 0,
            fetching: None,
            boot_tail: Vec::new(),
            out_tail: Vec::new(),
            out_file: None,
            guard: Guard::Unknown,
            started_at: Instant::now(),
            outcome: RankOutcome::default(),
        }
    }

    #[test]
    fn console_streams_job_lines_and_reads_the_exit() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = console(dir.path());
        let mut out = Vec::new();
        fs::write(
            &c.log,
            "boot noise\r\ndmlc-init: insmod x failed\r\nDMLC-START n\r\nhel",
        )
        .unwrap();
        c.poll(&mut out);
        assert!(c.outcome.boot.is_some());
        assert_eq!(
            String::from_utf8_lossy(&out),
            "[rank 1] dmlc-init: insmod x failed\n"
        );
        let mut f = fs::OpenOptions::new().append(true).open(&c.log).unwrap();
        write!(
            f,
            "lo\r\n\r\nworld\r\nDMLC-FETCH t BEGIN /r.json\r\neyJhIjox\r\nfQ==\r\nDMLC-FETCH t END\r\n\r\nDMLC-EXIT n 3\r\nafter\r\n"
        )
        .unwrap();
        c.poll(&mut out);
        c.flush(&mut out);
        assert_eq!(
            String::from_utf8_lossy(&out),
            "[rank 1] dmlc-init: insmod x failed\n[rank 1] hello\n[rank 1] \n[rank 1] world\n"
        );
        assert_eq!(c.outcome.status, Some(3));
        assert_eq!(
            c.outcome.fetched,
            vec![("/r.json".to_owned(), b"{\"a\":1}".to_vec())]
        );
        assert_eq!(c.boot_tail, vec!["boot noise".to_owned()]);
    }

    #[test]
    fn base64_decodes_and_skips_noise() {
        assert_eq!(decode_base64("Zm9vYmFy"), b"foobar");
        assert_eq!(decode_base64("Zm9v\nYg=="), b"foob");
        assert_eq!(decode_base64("Zm9vYmE="), b"fooba");
        assert_eq!(decode_base64(""), b"");
        assert_eq!(decode_base64("Zm9v\r\n[ ]: *\nYmFy"), b"foobar");
        assert_eq!(decode_base64("Zm9vY"), b"foo");
    }

    #[test]
    fn proc_state_sees_this_process() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(matches!(proc_state(me), Some('R' | 'S')));
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        child.kill().unwrap();
        // Killed but not reaped: a zombie, which the monitor counts as gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc_state(pid) != Some('Z') && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(proc_state(pid), Some('Z'));
        child.wait().unwrap();
        assert_eq!(proc_state(pid), None);
    }
}
