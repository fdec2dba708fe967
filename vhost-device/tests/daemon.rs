//! The daemon as a process: options, sockets, signals, metrics, and the
//! vhost-user handshake with a minimal frontend.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dmlc_test_support::frontend::Member;
use dmlc_test_support::{
    backend_bin, free_local_addr, http_get, run_backend, temp_dir, Backend, PATIENCE,
};
use vhost::vhost_user::{Frontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::VhostBackend;
use virtio_dmlc::{
    Status, RESP_SIZE, VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};

const FLAGS: [&str; 19] = [
    "--socket-path",
    "--socket-count",
    "--queues",
    "--queue-size",
    "--reduce-threads",
    "--poll-us",
    "--poll-anyway",
    "--timeout-ms",
    "--max-bytes",
    "--max-segments",
    "--group-id",
    "--metrics-addr",
    "--socket-mode",
    "--socket-group",
    "--timing",
    "--trace-out",
    "--trace-capacity",
    "--control-socket",
    "--log-level",
];

#[test]
fn help_mentions_every_flag() {
    let out = run_backend(&["--help"], PATIENCE);
    assert!(out.exit_status().success());
    let help = out.stdout();
    for flag in FLAGS {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("--help lacks {flag}:\n{help}"));
        // Each flag is explained, not just listed.
        assert!(
            line.split_whitespace().count() > 4,
            "{flag} unexplained: {line}"
        );
    }
}

#[test]
fn bad_options_fail_with_a_clear_message() {
    let dir = temp_dir("bad-options");
    let base = dir.path().join("d.sock");
    let base = base.to_str().unwrap();
    let cases: [(&[&str], &str); 8] = [
        (
            &["--socket-count", "0"],
            "--socket-count must be at least 1",
        ),
        (&["--metrics-addr", "8.8.8.8:1"], "not a loopback address"),
        (&["--metrics-addr", "nowhere"], "is not an address"),
        (&["--queues", "65"], "--queues must be between 1 and 64"),
        (&["--queue-size", "300"], "must be a power of two"),
        (&["--max-bytes", "12X"], "is not a size"),
        (&["--timeout-ms", "0"], "--timeout-ms must be at least 1"),
        (&["--log-level", "loud"], "invalid value 'loud'"),
    ];
    for (extra, message) in cases {
        let mut args = vec!["--socket-path", base];
        args.extend_from_slice(extra);
        let out = run_backend(&args, PATIENCE);
        let stderr = out.stderr();
        assert!(!out.exit_status().success(), "{extra:?} was accepted");
        assert!(stderr.contains("error"), "{extra:?}: {stderr}");
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
    assert!(
        !dir.path().join("d.sock0").exists(),
        "a refused run left a socket"
    );

    let out = run_backend(&[], PATIENCE);
    assert!(!out.exit_status().success());
    assert!(out.stderr().contains("--socket-path"));
}

#[test]
fn sockets_appear_and_are_removed_on_sigterm() {
    let mut daemon = Backend::start("sigterm", 2, &[]);
    for rank in 0..2 {
        let path = daemon.socket(rank);
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    }
    assert!(!daemon.socket(2).exists());
    daemon.wait_for_log("listening on");
    let status = daemon.terminate(PATIENCE);
    assert!(status.success(), "exit status {status}");
    for rank in 0..2 {
        assert!(!daemon.socket(rank).exists(), "socket {rank} left behind");
    }
}

#[test]
fn stale_socket_is_replaced_but_other_files_are_kept() {
    let dir = temp_dir("stale");
    // A socket file nobody serves, as a killed daemon leaves behind.
    drop(UnixListener::bind(Backend::socket_in(dir.path(), 0)).unwrap());
    let mut daemon = Backend::start_in(dir, 1, &[]);
    daemon.assert_running();
    assert!(daemon.terminate(PATIENCE).success());

    let dir = temp_dir("not-a-socket");
    std::fs::write(dir.path().join("d.sock1"), "not a socket").unwrap();
    let base = dir.path().join("d.sock");
    let out = run_backend(
        &[
            "--socket-path",
            base.to_str().unwrap(),
            "--socket-count",
            "2",
        ],
        PATIENCE,
    );
    assert_eq!(out.exit_status().code(), Some(1));
    let stderr = out.stderr();
    assert!(stderr.contains("is not a socket"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("d.sock1")).unwrap(),
        "not a socket"
    );
    assert!(!dir.path().join("d.sock0").exists(), "socket 0 left behind");
}

#[test]
fn second_daemon_on_the_same_path_is_refused() {
    let mut first = Backend::start("second", 1, &[]);
    let out = run_backend(&["--socket-path", first.base().to_str().unwrap()], PATIENCE);
    assert_eq!(out.exit_status().code(), Some(1));
    assert!(out.stderr().contains("in use by another process"));
    first.assert_running();
    assert!(first.socket(0).exists());
}

#[test]
fn metrics_endpoint_answers() {
    let addr = free_local_addr();
    let mut daemon = Backend::start("metrics", 2, &["--metrics-addr", &addr]);
    daemon.wait_for_log("metrics at");

    let (status, head, body) = http_get(&addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(body.contains("# HELP"), "{body}");
    assert!(body.contains("# TYPE"), "{body}");

    let (status, _, _) = http_get(&addr, "/");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _, _) = http_get(&addr, "/metrics/more");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    // Still serving after the 404s.
    let (status, _, _) = http_get(&addr, "/metrics?x=1");
    assert_eq!(status, "HTTP/1.1 200 OK");
    daemon.assert_running();
}

fn expected_features() -> u64 {
    [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
        VIRTIO_DMLC_F_REQ_TIMEOUT,
    ]
    .iter()
    .fold(VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(), |f, b| {
        f | 1 << b
    })
}

#[test]
fn each_socket_reads_its_own_rank_from_config_space() {
    let daemon = Backend::start(
        "config",
        2,
        &[
            "--queues",
            "3",
            "--group-id",
            "0x5eed",
            "--max-bytes",
            "2M",
            "--max-segments",
            "17",
        ],
    );
    for rank in 0..2 {
        let mut m = Member::connect(&daemon.socket(rank));
        // Offered besides: communicators, send/receive and all-to-all,
        // gather, scatter (bits 1 to 3), and the non-finite check (bit 4),
        // which the other tests here do not acknowledge.
        let comm = 0b111 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM;
        let nonfinite = 1 << virtio_dmlc::VIRTIO_DMLC_F_NONFINITE;
        assert_eq!(m.features, expected_features() | comm | nonfinite);
        assert!(m.protocol.contains(
            VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::REPLY_ACK
        ));
        assert_eq!(m.queue_num, 3);
        let c = m.config();
        assert_eq!(c.rank.get(), rank);
        assert_eq!(c.world_size.get(), 2);
        assert_eq!(c.num_queues.get(), 3);
        assert_eq!(c.max_segments.get(), 17);
        assert_eq!(c.max_bytes.get(), 2 << 20);
        assert_eq!(c.group_id.get(), 0x5eed);
        assert_eq!(c.dtypes.get(), virtio_dmlc::Dtype::all_mask());
        // Those of 5.X.6.1 (0 to 6), then those of bits 1 to 3 (7 to 17).
        let comm_opcodes = 0x3_ff80;
        assert_eq!(
            c.opcodes.get(),
            virtio_dmlc::Opcode::all_mask() | comm_opcodes
        );
        assert!(c.generation.get() >= 1);

        // A partial read at an offset: world_size alone.
        let bytes = m.config_bytes(4, 4).unwrap();
        assert_eq!(bytes, 2u32.to_le_bytes());
        // Then max_comms (feature bit 1; the default 64), and past the
        // structure reads as zero. (A read that starts past it is refused
        // with an empty reply, which the vhost crate's frontend waits on
        // forever, so it is not tried here.)
        let bytes = m.config_bytes(44, 20).unwrap();
        assert_eq!(&bytes[..4], &c.group_id.get().to_le_bytes()[4..]);
        assert_eq!(&bytes[4..8], &64u32.to_le_bytes());
        assert_eq!(&bytes[8..], &[0; 12]);
    }
}

#[test]
fn daemon_survives_disconnect_and_reconnect() {
    let mut daemon = Backend::start("reconnect", 2, &[]);
    let mut m = Member::connect(&daemon.socket(1));
    let first = m.config();
    // Negotiate and start the rings, so that the member counts as present.
    m.start(expected_features(), 1, 64);
    drop(m);
    daemon.wait_for_log("rank 1: frontend disconnected, member lost");

    let mut m = Member::connect(&daemon.socket(1));
    let second = m.config();
    assert_eq!(second.rank.get(), 1);
    assert!(
        second.generation.get() > first.generation.get(),
        "losing a member must change the generation: {} then {}",
        first.generation.get(),
        second.generation.get()
    );
    m.start(expected_features(), 1, 64);
    drop(m);

    // A frontend that hangs up without negotiating loses nothing.
    let m = Member::connect(&daemon.socket(0));
    drop(m);
    daemon.wait_for_log("rank 0: frontend disconnected\n");
    let mut m = Member::connect(&daemon.socket(0));
    assert_eq!(m.config().rank.get(), 0);
    daemon.assert_running();
    let log = wait_for_count(&mut daemon, "frontend connected", 4);
    assert_eq!(log.matches("frontend connected").count(), 4, "{log}");
}

/// Waits until the log holds `text` at least `n` times and returns the log.
/// The daemon logs a connection just after it starts serving it, so a
/// frontend may have its first answer before the line is written.
fn wait_for_count(daemon: &mut Backend, text: &str, n: usize) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let log = daemon.log();
        if log.matches(text).count() >= n {
            return log;
        }
        daemon.assert_running();
        assert!(
            Instant::now() < deadline,
            "log never said {text:?} {n} times\n{log}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The permission bits and group of a socket file, after checking that it
/// is a socket.
fn socket_access(path: &Path) -> (u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()),
        "{} is not a socket",
        path.display()
    );
    (meta.permissions().mode() & 0o7777, meta.gid())
}

#[test]
fn sockets_are_private_by_default() {
    let mut daemon = Backend::start("private", 3, &[]);
    for rank in 0..3 {
        let (mode, _) = socket_access(&daemon.socket(rank));
        assert_eq!(mode, 0o600, "socket {rank}: mode {mode:04o}");
    }
    daemon.assert_running();
}

#[test]
fn socket_mode_option_sets_the_mode() {
    for (option, want) in [("0660", 0o660), ("640", 0o640), ("0o700", 0o700)] {
        let mut daemon = Backend::start("mode", 2, &["--socket-mode", option]);
        for rank in 0..2 {
            let (mode, _) = socket_access(&daemon.socket(rank));
            assert_eq!(
                mode, want,
                "--socket-mode {option}: socket {rank} has {mode:04o}"
            );
        }
        assert!(daemon.terminate(PATIENCE).success());
    }
}

/// Starts the daemon with umask 0, so that anything it creates without
/// choosing a mode is open to everyone; returns the mode of socket 0.
fn mode_under_umask_zero(extra: &[&str]) -> (u32, u32) {
    let dir = temp_dir("umask");
    let base = dir.path().join("d.sock");
    let mut command = Command::new(backend_bin());
    // SAFETY: umask and prctl are async-signal-safe and touch no memory of
    // ours. The daemon dies with the test even if the test is killed.
    unsafe {
        command.pre_exec(|| {
            libc::umask(0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = command
        .arg("--socket-path")
        .arg(&base)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start vhost-device-dmlc");
    let socket = dir.path().join("d.sock0");
    let deadline = Instant::now() + PATIENCE;
    while !socket.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the daemon exited");
        assert!(Instant::now() < deadline, "no socket appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
    let access = socket_access(&socket);
    let _ = child.kill();
    let _ = child.wait();
    access
}

#[test]
fn socket_mode_does_not_depend_on_the_callers_umask() {
    assert_eq!(mode_under_umask_zero(&[]).0, 0o600);
    assert_eq!(mode_under_umask_zero(&["--socket-mode", "0660"]).0, 0o660);
}

#[test]
fn socket_group_option_gives_the_sockets_to_the_group() {
    // SAFETY: geteuid and getegid cannot fail and touch no memory.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // Root may give a file to any group; another user only to its own.
    let gid = if euid == 0 { 4242 } else { egid };
    let gid_text = gid.to_string();
    let mut daemon = Backend::start(
        "group",
        2,
        &["--socket-mode", "0660", "--socket-group", &gid_text],
    );
    for rank in 0..2 {
        assert_eq!(socket_access(&daemon.socket(rank)), (0o660, gid));
    }
    assert!(daemon.terminate(PATIENCE).success());
    // Same under umask 0: the group bits only come once the group is set.
    assert_eq!(
        mode_under_umask_zero(&["--socket-mode", "0660", "--socket-group", &gid_text]),
        (0o660, gid)
    );
}

#[test]
fn bad_socket_modes_and_groups_exit_2_without_sockets() {
    let dir = temp_dir("bad-modes");
    let base = dir.path().join("d.sock");
    let base = base.to_str().unwrap();
    let cases: [(&str, &str, &str); 9] = [
        ("--socket-mode", "0999", "is not an octal mode"),
        ("--socket-mode", "rw-rw----", "is not an octal mode"),
        ("--socket-mode", "0x1b6", "is not an octal mode"),
        ("--socket-mode", "-600", "is not an octal mode"),
        ("--socket-mode", "", "is not an octal mode"),
        ("--socket-mode", "1777", "is more than 0777"),
        ("--socket-mode", "04755", "is more than 0777"),
        ("--socket-group", "no-such-group-dmlc", "no group named"),
        ("--socket-group", "4294967295", "is not a group"),
    ];
    for (flag, value, message) in cases {
        // FLAG=VALUE, so that "-600" reaches the parser as a value.
        let option = format!("{flag}={value}");
        let out = run_backend(
            &["--socket-path", base, "--socket-count", "2", &option],
            PATIENCE,
        );
        let stderr = out.stderr();
        assert_eq!(
            out.exit_status().code(),
            Some(2),
            "{flag} {value:?}: {stderr}"
        );
        assert!(stderr.contains("error"), "{flag} {value:?}: {stderr}");
        assert!(stderr.contains(message), "{flag} {value:?}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {value:?}: {stderr}");
    }
    for rank in 0..2 {
        assert!(
            !dir.path().join(format!("d.sock{rank}")).exists(),
            "a refused run left socket {rank}"
        );
    }
}

/// A barrier across `members`: every one must complete it with OK in
/// `generation`.
fn barrier_succeeds(members: &mut [Member], tag: u64, generation: u32) {
    let resps: Vec<u64> = members.iter_mut().map(|m| m.barrier(0, tag).1).collect();
    for (m, resp) in members.iter_mut().zip(resps) {
        let (_, len) = m.wait_used(0);
        assert_eq!(len as usize, RESP_SIZE);
        let r = m.read_resp(resp);
        assert_eq!(Status::from_raw(r.status.get()), Some(Status::Ok), "{r:?}");
        assert_eq!(r.generation.get(), generation);
    }
}

#[test]
fn second_frontend_on_a_served_rank_is_refused() {
    let mut daemon = Backend::start("intruder", 2, &[]);
    let mut members: Vec<Member> = (0..2)
        .map(|rank| {
            let mut m = Member::connect(&daemon.socket(rank));
            m.start(expected_features(), 1, 64);
            m
        })
        .collect();
    let generation = members[1].config().generation.get();
    barrier_succeeds(&mut members, 1, generation);

    // A raw intruder on rank 1 that sends GET_FEATURES (request 1, flags:
    // version 1, no payload): the daemon closes it unanswered.
    let started = Instant::now();
    let mut intruder = UnixStream::connect(daemon.socket(1)).unwrap();
    intruder.set_read_timeout(Some(PATIENCE)).unwrap();
    intruder
        .write_all(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    let mut buf = [0; 64];
    match intruder.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(n) => panic!("the intruder was answered: {:?}", &buf[..n]),
        Err(e) => panic!("the intruder was left waiting, not closed: {e}"),
    }
    assert!(
        started.elapsed() < PATIENCE,
        "refusing took {:?}",
        started.elapsed()
    );
    daemon.wait_for_log("rank 1 already has a frontend: refused a second connection from pid");

    // A vhost-user frontend, as a second QEMU would be: its first request
    // that needs a reply fails instead of hanging.
    let fe = Frontend::connect(daemon.socket(1), 64).expect("connect");
    assert!(fe.get_features().is_err(), "the second frontend was served");

    // The member that holds rank 1 is undisturbed: same rank, same
    // generation, and collectives still complete.
    assert_eq!(members[1].config().rank.get(), 1);
    barrier_succeeds(&mut members, 2, generation);
    assert_eq!(members[0].config().generation.get(), generation);
    daemon.assert_running();
    let log = wait_for_count(&mut daemon, "frontend connected", 2);
    assert!(!log.contains("rank 1: frontend disconnected"), "{log}");
    assert_eq!(log.matches("frontend connected").count(), 2, "{log}");

    // Once rank 1 is free again, a new frontend gets it.
    drop(members.pop());
    daemon.wait_for_log("rank 1: frontend disconnected, member lost");
    let mut m = Member::connect(&daemon.socket(1));
    assert_eq!(m.config().rank.get(), 1);
}

#[test]
fn frontend_reconnecting_at_once_is_served() {
    let mut daemon = Backend::start("at-once", 1, &[]);
    for round in 0..5 {
        // Connects right after the previous frontend hung up, before the
        // daemon may have seen it go.
        let mut m = Member::connect(&daemon.socket(0));
        assert_eq!(m.config().rank.get(), 0, "round {round}");
        m.start(expected_features(), 1, 64);
    }
    daemon.assert_running();
    let log = daemon.log();
    assert!(!log.contains("already has a frontend"), "{log}");
}
