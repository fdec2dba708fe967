//! The daemon as a process: options, sockets, signals, metrics, and the
//! vhost-user handshake with a minimal frontend.

mod common;

use std::os::unix::net::UnixListener;

use common::{free_port, http_get, run, Daemon, Member, TempDir};
use vhost::vhost_user::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_dmlc::{
    VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};

const FLAGS: [&str; 12] = [
    "--socket-path",
    "--socket-count",
    "--queues",
    "--queue-size",
    "--reduce-threads",
    "--poll-us",
    "--timeout-ms",
    "--max-bytes",
    "--max-segments",
    "--group-id",
    "--metrics-addr",
    "--log-level",
];

#[test]
fn help_mentions_every_flag() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
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
    let dir = TempDir::new();
    let base = dir.0.join("d.sock");
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
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(stderr.contains("error"), "{extra:?}: {stderr}");
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
    assert!(
        !dir.0.join("d.sock0").exists(),
        "a refused run left a socket"
    );

    let out = run(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--socket-path"));
}

#[test]
fn sockets_appear_and_are_removed_on_sigterm() {
    let mut daemon = Daemon::start(2, &[]);
    for rank in 0..2 {
        let path = daemon.socket(rank);
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    }
    assert!(!daemon.socket(2).exists());
    daemon.wait_for_log("listening on");
    let status = daemon.terminate();
    assert!(status.success(), "exit status {status}");
    for rank in 0..2 {
        assert!(!daemon.socket(rank).exists(), "socket {rank} left behind");
    }
}

#[test]
fn stale_socket_is_replaced_but_other_files_are_kept() {
    let dir = TempDir::new();
    // A socket file nobody serves, as a killed daemon leaves behind.
    drop(UnixListener::bind(dir.0.join("d.sock0")).unwrap());
    let mut daemon = Daemon::start_in(dir, 1, &[]);
    daemon.assert_running();
    assert!(daemon.terminate().success());

    let dir = TempDir::new();
    std::fs::write(dir.0.join("d.sock1"), "not a socket").unwrap();
    let base = dir.0.join("d.sock");
    let out = run(&[
        "--socket-path",
        base.to_str().unwrap(),
        "--socket-count",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not a socket"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.0.join("d.sock1")).unwrap(),
        "not a socket"
    );
    assert!(!dir.0.join("d.sock0").exists(), "socket 0 left behind");
}

#[test]
fn second_daemon_on_the_same_path_is_refused() {
    let mut first = Daemon::start(1, &[]);
    let base = first.dir().join("d.sock");
    let out = run(&["--socket-path", base.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use by another process"));
    first.assert_running();
    assert!(first.socket(0).exists());
}

#[test]
fn metrics_endpoint_answers() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut daemon = Daemon::start(2, &["--metrics-addr", &addr]);
    daemon.wait_for_log("metrics at");

    let (status, head, body) = http_get(port, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(body.contains("# HELP"), "{body}");
    assert!(body.contains("# TYPE"), "{body}");

    let (status, _, _) = http_get(port, "/");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _, _) = http_get(port, "/metrics/more");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    // Still serving after the 404s.
    let (status, _, _) = http_get(port, "/metrics?x=1");
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
    let daemon = Daemon::start(
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
        assert_eq!(m.features, expected_features());
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
        assert_eq!(c.opcodes.get(), virtio_dmlc::Opcode::all_mask());
        assert!(c.generation.get() >= 1);

        // A partial read at an offset: world_size alone.
        let bytes = m.config_bytes(4, 4).unwrap();
        assert_eq!(bytes, 2u32.to_le_bytes());
        // Past the structure reads as zero. (A read that starts past it
        // is refused with an empty reply, which the vhost crate's frontend
        // waits on forever, so it is not tried here.)
        let bytes = m.config_bytes(44, 8).unwrap();
        assert_eq!(&bytes[..4], &c.group_id.get().to_le_bytes()[4..]);
        assert_eq!(&bytes[4..], &[0; 4]);
    }
}

#[test]
fn daemon_survives_disconnect_and_reconnect() {
    let mut daemon = Daemon::start(2, &[]);
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
    let log = daemon.log();
    assert_eq!(log.matches("frontend connected").count(), 4, "{log}");
}
