//! A VM paused through the QEMU monitor in the middle of a loop of
//! collectives: its requests stay pending (docs/spec.md 5.X.6.12), its peer
//! waits, and once the VM runs again both finish every collective and the
//! group goes on, with no loss and no generation change. Migration is
//! refused with a message that names the device (docs/qemu.md).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dmlc_vm::Options;
use serde_json::{json, Value};

use crate::common::{console, guest, metric, progress, setup, vm, wait_console, Backend, Vms};

/// A QMP connection to one QEMU (`-qmp unix:PATH,server=on,wait=off`).
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects (retrying while QEMU starts) and leaves capabilities
    /// negotiation mode.
    fn connect(path: &Path, patience: Duration) -> Qmp {
        let deadline = Instant::now() + patience;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("QMP socket {}: {e}", path.display()),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("QMP read timeout");
        let writer = stream.try_clone().expect("dup QMP socket");
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.read_message();
        assert!(greeting.get("QMP").is_some(), "QMP greeting: {greeting}");
        qmp.execute("qmp_capabilities", json!({}))
            .unwrap_or_else(|e| panic!("qmp_capabilities: {e}"));
        qmp
    }

    fn read_message(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("QMP read");
        assert!(n > 0, "QEMU closed its QMP socket");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("QMP message {line:?}: {e}"))
    }

    /// Runs `command`; its `return` value, or the error's description.
    fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, String> {
        let msg = json!({ "execute": command, "arguments": arguments });
        writeln!(self.writer, "{msg}").expect("QMP write");
        loop {
            let reply = self.read_message();
            // Events (STOP, RESUME, ...) come on the same stream.
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                return Err(err["desc"].as_str().unwrap_or("?").to_owned());
            }
            panic!("unexpected QMP reply to {command}: {reply}");
        }
    }

    /// The VM's run state (`running`, `paused`, ...).
    fn status(&mut self) -> String {
        let s = self
            .execute("query-status", json!({}))
            .unwrap_or_else(|e| panic!("query-status: {e}"));
        s["status"].as_str().unwrap_or("?").to_owned()
    }
}

/// `iter K ok` lines in a console.
fn ok_iters(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("iter ") && l.trim_end().ends_with(" ok"))
        .count()
}

fn qmp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("dmlc-qmp-{}-{name}.sock", std::process::id()))
}

#[test]
fn paused_vm_keeps_its_requests_and_the_group_goes_on() {
    let test = "paused_vm_keeps_its_requests_and_the_group_goes_on";
    let Some(env) = setup(test) else {
        return;
    };
    const ITERS: usize = 60;
    const PAUSE: Duration = Duration::from_secs(4);
    // A collective timeout far longer than the pause: only a device that
    // lost the paused member's requests could fail them.
    let mut backend = Backend::start(&env, "pause", 2, &["--timeout-ms", "120000"]);
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    // `--hold` keeps each device open after the loop, so that the checks
    // below see the group before the guests' own exit resets the devices.
    let job = guest(&format!(
        "debug allreduce --count 4096 --iters {ITERS} --hold"
    ));
    let qmp_sock = qmp_path("rank1");
    let _ = std::fs::remove_file(&qmp_sock);
    let mut specs = vec![
        vm(job.clone(), &backend.socket(0)),
        vm(job, &backend.socket(1)),
    ];
    specs[1].qemu_args.extend([
        "-qmp".to_owned(),
        format!("unix:{},server=on,wait=off", qmp_sock.display()),
    ]);
    let t = Instant::now();
    let group = Vms::start(&env, &specs, &opts);
    let mut qmp = Qmp::connect(&qmp_sock, Duration::from_secs(30));

    // Migration and snapshots are refused, naming the device.
    let refused = qmp
        .execute("migrate", json!({ "uri": "exec:cat > /dev/null" }))
        .expect_err("migration of a VM with the dmlc device must be refused");
    assert!(
        refused.contains("vhost-user-dmlc"),
        "the refusal does not name the device: {refused}"
    );
    progress(&format!("{test}: migrate refused: {refused}"));

    assert!(
        wait_console(&group, 1, Duration::from_secs(150), |c| ok_iters(c) >= 10),
        "rank 1 did not finish 10 allreduces:\n{}",
        console(&group, 1)
    );
    qmp.execute("stop", json!({}))
        .unwrap_or_else(|e| panic!("stop: {e}"));
    assert_eq!(qmp.status(), "paused");
    let paused_at = ok_iters(&console(&group, 0));
    std::thread::sleep(PAUSE);
    let during = ok_iters(&console(&group, 0));
    // Rank 0 can finish at most the collective rank 1 had already joined.
    assert!(
        during <= paused_at + 1,
        "rank 0 went on from {paused_at} to {during} allreduces without its peer"
    );
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()));
    assert_eq!(metric(&m, "dmlc_generation"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "dmlc_members_connected"), Some(2.0), "{m}");
    qmp.execute("cont", json!({}))
        .unwrap_or_else(|e| panic!("cont: {e}"));
    assert_eq!(qmp.status(), "running");

    for i in 0..2 {
        assert!(
            wait_console(&group, i, Duration::from_secs(200), |c| c
                .contains("\nholding")),
            "rank {i} did not finish its allreduces after the pause:\n{}",
            console(&group, i)
        );
        let text = console(&group, i);
        assert_eq!(
            ok_iters(&text),
            ITERS,
            "rank {i} did not finish every allreduce:\n{text}"
        );
        assert!(!text.contains(" error: "), "rank {i}:\n{text}");
    }
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    let log = backend.log_text();
    assert!(log.contains("rank 1: queue 0 stopped"), "{log}");
    assert!(
        !log.contains("member lost"),
        "a pause was taken for a loss:\n{log}"
    );
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()));
    assert_eq!(metric(&m, "dmlc_generation"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "dmlc_members_connected"), Some(2.0), "{m}");
    for status in ["peer_lost", "timeout", "reset"] {
        assert_eq!(
            metric(&m, &format!("dmlc_errors_total{{status=\"{status}\"}}")),
            Some(0.0),
            "{m}"
        );
    }
    // The jobs hold their devices until the VMs are killed (drop).
    drop(group);
    let _ = std::fs::remove_file(&qmp_sock);
    progress(&format!(
        "{test}: {ITERS} allreduces on 2 VMs, rank 1 paused {PAUSE:?} after 10, in {:.1?}",
        t.elapsed()
    ));
}
