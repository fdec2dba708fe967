//! Requests through real sockets: frontends playing VMs submit chains, the
//! daemon's backends hand them to the group engine, and the answers come
//! back through the used rings.

use std::time::{Duration, Instant};

use dmlc_test_support::frontend::{Desc, Member};
use dmlc_test_support::{free_local_addr, metric, Backend, PATIENCE};
use vhost::vhost_user::VhostUserFrontend;
use vhost::vhost_user::VhostUserVirtioFeatures;
use virtio_dmlc::{
    Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, VirtioDmlcResp, NO_PEER, REQ_HEADER_SIZE,
    RESP_SIZE, VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};

const QUEUE_SIZE: u16 = 64;

fn features(event_idx: bool, req_timeout: bool) -> u64 {
    let mut f = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_INDIRECT_DESC;
    if event_idx {
        f |= 1 << VIRTIO_RING_F_EVENT_IDX;
    }
    if req_timeout {
        f |= 1 << VIRTIO_DMLC_F_REQ_TIMEOUT;
    }
    f
}

/// Connects one member per socket and starts `queues` queues on each.
fn members(daemon: &Backend, features: u64, queues: u16) -> Vec<Member> {
    (0..daemon.ranks())
        .map(|rank| {
            let mut m = Member::connect(&daemon.socket(rank));
            m.start(features, queues, QUEUE_SIZE);
            m
        })
        .collect()
}

fn header(opcode: Opcode, count: u64, tag: u64) -> VirtioDmlcReq {
    VirtioDmlcReq {
        opcode: opcode.raw().into(),
        dtype: Dtype::F32.raw(),
        op: ReduceOp::Sum.raw(),
        count: count.into(),
        tag: tag.into(),
        ..Default::default()
    }
}

/// Where one request's buffers live in a member's memory.
struct Pending {
    head: u16,
    out: u64,
    out_len: usize,
    resp: u64,
}

/// Makes an f32 sum allreduce of `input` available on queue `q` of `m`;
/// kicks unless `kick` is false.
fn allreduce(m: &mut Member, q: usize, input: &[f32], tag: u64, kick: bool) -> Pending {
    let len = std::mem::size_of_val(input);
    let hdr = m.alloc(REQ_HEADER_SIZE);
    let inp = m.alloc(len);
    let out = m.alloc(len);
    let resp = m.alloc(RESP_SIZE);
    m.write(hdr, &header(Opcode::Allreduce, input.len() as u64, tag));
    m.write(inp, input);
    m.write(out, &vec![f32::NAN; input.len()][..]);
    let descs = [
        Desc::r(hdr, REQ_HEADER_SIZE),
        Desc::r(inp, len),
        Desc::w(out, len),
        Desc::w(resp, RESP_SIZE),
    ];
    let head = if kick {
        m.submit(q, &descs)
    } else {
        m.publish(q, &descs);
        0
    };
    Pending {
        head,
        out,
        out_len: len,
        resp,
    }
}

/// A chain with a header and a response only (barrier, or a request the
/// device refuses before looking at data).
fn header_only(m: &mut Member, q: usize, hdr_value: &VirtioDmlcReq) -> Pending {
    let hdr = m.alloc(REQ_HEADER_SIZE);
    let resp = m.alloc(RESP_SIZE);
    m.write(hdr, hdr_value);
    let head = m.submit(
        q,
        &[Desc::r(hdr, REQ_HEADER_SIZE), Desc::w(resp, RESP_SIZE)],
    );
    Pending {
        head,
        out: 0,
        out_len: 0,
        resp,
    }
}

/// Waits for `p` on queue `q` and returns its response.
fn finish(m: &mut Member, q: usize, p: &Pending) -> VirtioDmlcResp {
    let (head, len) = m.wait_used(q);
    assert_eq!(head, p.head, "queue {q}: chains completed out of order");
    assert_eq!(len as usize, p.out_len + RESP_SIZE, "used length");
    m.read_resp(p.resp)
}

fn status(resp: &VirtioDmlcResp) -> Option<Status> {
    Status::from_raw(resp.status.get())
}

fn read_f32(m: &Member, addr: u64, n: usize) -> Vec<f32> {
    m.read_bytes(addr, 4 * n)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Two members, two queues, a few rounds each: every member gets the sum,
/// and the driver gets an interrupt.
fn allreduce_rounds(extra: &[&str], event_idx: bool) {
    let daemon = Backend::start("rounds", 2, &[&["--queues", "2"], extra].concat());
    let mut ms = members(&daemon, features(event_idx, false), 2);
    let n = 1000;
    for round in 0..3u64 {
        for q in 0..2 {
            let inputs: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    (0..n)
                        .map(|i| (i as f32) * (r as f32 + 1.0) + round as f32)
                        .collect()
                })
                .collect();
            let pending: Vec<Pending> = ms
                .iter_mut()
                .zip(&inputs)
                .map(|(m, input)| allreduce(m, q, input, round, true))
                .collect();
            for (m, p) in ms.iter_mut().zip(&pending) {
                let resp = finish(m, q, p);
                assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
                assert_eq!(resp.peer.get(), NO_PEER);
                assert_eq!(resp.generation.get(), 1);
                let got = read_f32(m, p.out, n);
                for (i, v) in got.iter().enumerate() {
                    assert_eq!(*v, inputs[0][i] + inputs[1][i], "element {i}");
                }
                assert!(m.wait_interrupt(q, PATIENCE), "no interrupt on queue {q}");
            }
        }
    }
}

#[test]
fn allreduce_with_event_idx() {
    allreduce_rounds(&[], true);
}

#[test]
fn allreduce_without_event_idx() {
    allreduce_rounds(&[], false);
}

#[test]
fn allreduce_with_busy_polling() {
    allreduce_rounds(&["--poll-us", "300"], true);
}

#[test]
fn busy_polling_finds_requests_without_a_kick() {
    // Polling whether or not a CPU is spare: the tests run side by side.
    let daemon = Backend::start("busy-poll", 2, &["--poll-us", "2000000", "--poll-anyway"]);
    let mut ms = members(&daemon, features(true, false), 1);
    let input = [1.0f32, 2.0, 3.0];
    // The first round is kicked; it leaves both workers polling.
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &input, 1, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        assert_eq!(status(&finish(m, 0, p)), Some(Status::Ok));
    }
    // Published, not kicked: only a polling device sees these.
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &input, 2, false))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        m.wait_used(0);
        assert_eq!(status(&m.read_resp(p.resp)), Some(Status::Ok));
        assert_eq!(read_f32(m, p.out, 3), [2.0, 4.0, 6.0]);
    }
}

#[test]
fn without_polling_an_unkicked_request_waits_for_the_kick() {
    let daemon = Backend::start("no-poll", 1, &[]);
    let mut ms = members(&daemon, features(true, false), 1);
    let m = &mut ms[0];
    // Enabling a ring makes the worker look at it once, possibly after the
    // first kick is served: a round trip and a pause let that look pass.
    let p = allreduce(m, 0, &[4.0], 1, true);
    assert_eq!(status(&finish(m, 0, &p)), Some(Status::Ok));
    std::thread::sleep(Duration::from_millis(200));
    let p = allreduce(m, 0, &[5.0], 2, false);
    assert_eq!(m.wait_used_for(0, Duration::from_millis(300)), None);
    m.kick(0);
    m.wait_used(0);
    assert_eq!(status(&m.read_resp(p.resp)), Some(Status::Ok));
    assert_eq!(read_f32(m, p.out, 1), [5.0]);
}

#[test]
fn guest_mistakes_get_answers_and_the_daemon_keeps_serving() {
    let mut daemon = Backend::start("mistakes", 2, &["--queues", "2"]);
    let mut ms = members(&daemon, features(true, false), 2);

    // An unknown opcode is answered at once, without the other member.
    let mut bad = header(Opcode::Barrier, 0, 0);
    bad.opcode = 77.into();
    let p = header_only(&mut ms[0], 0, &bad);
    let resp = finish(&mut ms[0], 0, &p);
    assert_eq!(status(&resp), Some(Status::Unsupported));

    // No response descriptor: used with length 0.
    let hdr = ms[0].alloc(REQ_HEADER_SIZE);
    ms[0].write(hdr, &header(Opcode::Barrier, 0, 0));
    let head = ms[0].submit(0, &[Desc::r(hdr, REQ_HEADER_SIZE)]);
    assert_eq!(ms[0].wait_used(0), (head, 0));

    // A descriptor outside guest memory.
    let resp_addr = ms[0].alloc(RESP_SIZE);
    let hdr = ms[0].alloc(REQ_HEADER_SIZE);
    ms[0].write(hdr, &header(Opcode::Allreduce, 4, 0));
    let head = ms[0].submit(
        0,
        &[
            Desc::r(hdr, REQ_HEADER_SIZE),
            Desc::r(1 << 40, 16),
            Desc::w(1 << 40, 16),
            Desc::w(resp_addr, RESP_SIZE),
        ],
    );
    let (used, _) = ms[0].wait_used(0);
    assert_eq!(used, head);
    let resp = ms[0].read_resp(resp_addr);
    assert_eq!(status(&resp), Some(Status::BadRequest));
    assert_eq!(resp.detail.get(), virtio_dmlc::bad::ADDRESS);

    // An avail index far ahead of the ring breaks queue 0 of rank 0 ...
    ms[0].set_avail_idx(0, 1000);
    ms[0].kick(0);
    daemon.wait_for_log("malformed virtqueue");
    daemon.assert_running();

    // ... but queue 1 and the other member still work: a barrier.
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| header_only(m, 1, &header(Opcode::Barrier, 0, 9)))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        assert_eq!(status(&finish(m, 1, p)), Some(Status::Ok));
    }
    assert_eq!(ms[1].config().generation.get(), 1);
}

#[test]
fn a_member_that_disconnects_fails_the_waiting_collective_promptly() {
    let mut daemon = Backend::start("disconnect", 2, &["--timeout-ms", "60000"]);
    let mut ms = members(&daemon, features(true, false), 1);
    let p = allreduce(&mut ms[0], 0, &[1.0, 2.0], 1, true);
    // Let the request reach the engine before the peer goes.
    assert_eq!(ms[0].wait_used_for(0, Duration::from_millis(100)), None);
    let started = Instant::now();
    drop(ms.pop());
    let resp = finish(&mut ms[0], 0, &p);
    assert!(started.elapsed() < PATIENCE);
    assert_eq!(status(&resp), Some(Status::PeerLost), "{resp:?}");
    assert_eq!(resp.peer.get(), 1);
    assert_eq!(resp.generation.get(), 2);
    daemon.wait_for_log("rank 1: frontend disconnected, member lost");

    // Rank 1 comes back; a new collective works in the new generation.
    let mut back = Member::connect(&daemon.socket(1));
    back.start(features(true, false), 1, QUEUE_SIZE);
    ms.push(back);
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &[1.0, 2.0], 2, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        let resp = finish(m, 0, p);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(resp.generation.get(), 2);
        assert_eq!(read_f32(m, p.out, 2), [2.0, 4.0]);
    }
}

#[test]
fn a_reset_loses_the_member_until_it_starts_again() {
    let mut daemon = Backend::start("reset", 2, &["--timeout-ms", "60000"]);
    let mut ms = members(&daemon, features(false, false), 1);
    let p = allreduce(&mut ms[0], 0, &[3.0], 1, true);
    assert_eq!(ms[0].wait_used_for(0, Duration::from_millis(100)), None);

    // What the patched QEMU does when the guest resets the device.
    ms[1].fe.reset_device().expect("RESET_DEVICE");
    ms[1].stop_queue(0);
    daemon.wait_for_log("rank 1: device reset, member lost");
    let resp = finish(&mut ms[0], 0, &p);
    assert_eq!(status(&resp), Some(Status::PeerLost));
    assert_eq!(resp.peer.get(), 1);
    assert_eq!(ms[0].config().generation.get(), 2);

    // The driver starts the device again on the same connection.
    ms[1].start(features(false, false), 1, QUEUE_SIZE);
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &[3.0], 2, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        let resp = finish(m, 0, p);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(read_f32(m, p.out, 1), [6.0]);
    }
}

/// A paused VM: its ring is stopped (GET_VRING_BASE) without a reset. Its
/// popped request stays pending, the collective completes when the peer
/// arrives, and the paused member finds it in its used ring once the ring
/// runs again; nothing is lost and the generation does not change.
#[test]
fn a_stopped_ring_is_a_pause_and_its_requests_complete_after_it_runs_again() {
    for protocol in [false, true] {
        let mut daemon = Backend::start("pause", 2, &["--timeout-ms", "60000"]);
        let mut ms = members(&daemon, features(protocol, false), 1);
        let p1 = allreduce(&mut ms[1], 0, &[3.0, -1.0], 1, true);
        // Popped and pending: rank 0 has not arrived.
        assert_eq!(ms[1].wait_used_for(0, Duration::from_millis(100)), None);
        let base = ms[1].pause_queue(0);
        assert_eq!(base, 1, "the popped chain counts in the ring base");
        daemon.wait_for_log("rank 1: queue 0 stopped");

        // The peer arrives during the pause: the collective runs and rank 0
        // is answered at once.
        let p0 = allreduce(&mut ms[0], 0, &[1.0, 2.0], 1, true);
        let resp = finish(&mut ms[0], 0, &p0);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(read_f32(&ms[0], p0.out, 2), [4.0, 1.0]);
        // The paused member's ring belongs to the frontend: untouched.
        assert_eq!(ms[1].wait_used_for(0, Duration::from_millis(200)), None);

        ms[1].resume_queue(0, base);
        assert!(
            ms[1].wait_interrupt(0, Duration::from_secs(20)),
            "no interrupt once the ring ran again"
        );
        let resp = finish(&mut ms[1], 0, &p1);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(read_f32(&ms[1], p1.out, 2), [4.0, 1.0]);
        assert_eq!(ms[0].config().generation.get(), 1, "a pause is no loss");

        // The group goes on.
        let pending: Vec<Pending> = ms
            .iter_mut()
            .map(|m| allreduce(m, 0, &[5.0], 2, true))
            .collect();
        for (m, p) in ms.iter_mut().zip(&pending) {
            let resp = finish(m, 0, p);
            assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
            assert_eq!(read_f32(m, p.out, 1), [10.0]);
        }
        assert!(!daemon.log().contains("member lost"), "{}", daemon.log());
    }
}

#[test]
fn timeouts_come_from_the_option_or_the_request() {
    // Device default: 300 ms.
    let daemon = Backend::start("timeouts", 2, &["--timeout-ms", "300"]);
    let mut ms = members(&daemon, features(true, false), 1);
    let started = Instant::now();
    let p = allreduce(&mut ms[0], 0, &[1.0], 1, true);
    let resp = finish(&mut ms[0], 0, &p);
    assert_eq!(status(&resp), Some(Status::Timeout));
    assert_eq!(resp.peer.get(), 1);
    assert!(started.elapsed() >= Duration::from_millis(300));
    drop(ms);
    drop(daemon);

    // A long default, a short per-request timeout, honoured only because
    // the driver acked VIRTIO_DMLC_F_REQ_TIMEOUT.
    let daemon = Backend::start("timeouts-req", 2, &["--timeout-ms", "60000"]);
    let mut ms = members(&daemon, features(true, true), 1);
    let m = &mut ms[0];
    let hdr = m.alloc(REQ_HEADER_SIZE);
    let resp_addr = m.alloc(RESP_SIZE);
    let mut h = header(Opcode::Barrier, 0, 0);
    h.timeout_ms = 200.into();
    m.write(hdr, &h);
    let started = Instant::now();
    m.submit(
        0,
        &[Desc::r(hdr, REQ_HEADER_SIZE), Desc::w(resp_addr, RESP_SIZE)],
    );
    m.wait_used(0);
    assert!(started.elapsed() < PATIENCE);
    assert_eq!(status(&m.read_resp(resp_addr)), Some(Status::Timeout));
}

#[test]
fn a_device_reset_loses_the_member() {
    let mut daemon = Backend::start("device-reset", 2, &["--timeout-ms", "60000"]);
    let mut ms = members(&daemon, features(true, false), 1);
    let p = allreduce(&mut ms[0], 0, &[3.0], 1, true);
    assert_eq!(ms[0].wait_used_for(0, Duration::from_millis(100)), None);
    ms[1].fe.reset_device().expect("RESET_DEVICE");
    daemon.wait_for_log("rank 1: device reset, member lost");
    let resp = finish(&mut ms[0], 0, &p);
    assert_eq!(status(&resp), Some(Status::PeerLost));
    assert_eq!(resp.peer.get(), 1);
}

#[test]
fn metrics_count_what_happened() {
    let addr = free_local_addr();
    let mut daemon = Backend::start("metrics", 2, &["--metrics-addr", &addr]);
    let mut ms = members(&daemon, features(true, false), 1);

    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &[1.0; 8], 1, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        assert_eq!(status(&finish(m, 0, p)), Some(Status::Ok));
    }
    let mut bad = header(Opcode::Barrier, 0, 0);
    bad.dtype = 99;
    bad.opcode = Opcode::Allreduce.raw().into();
    let p = header_only(&mut ms[0], 0, &bad);
    assert_eq!(
        status(&finish(&mut ms[0], 0, &p)),
        Some(Status::Unsupported)
    );

    assert_eq!(
        metric(&addr, "dmlc_collectives_total{opcode=\"allreduce\"}"),
        1.0
    );
    assert_eq!(
        metric(&addr, "dmlc_errors_total{status=\"unsupported\"}"),
        1.0
    );
    assert_eq!(metric(&addr, "dmlc_members_connected"), 2.0);
    assert_eq!(metric(&addr, "dmlc_generation"), 1.0);

    drop(ms.pop());
    daemon.wait_for_log("rank 1: frontend disconnected, member lost");
    assert_eq!(metric(&addr, "dmlc_members_connected"), 1.0);
    assert_eq!(metric(&addr, "dmlc_generation"), 2.0);
}

/// A ring set up again at another place after a stop, without the reset
/// that says the driver changed (a frontend without the RESET_DEVICE
/// patch): the completion kept for the old ring is dropped, not written
/// into the new one.
#[test]
fn a_ring_restarted_elsewhere_after_a_stop_gets_no_stale_completion() {
    let mut daemon = Backend::start("restarted-ring", 2, &["--timeout-ms", "60000"]);
    let mut ms = members(&daemon, features(true, false), 1);
    let _old = allreduce(&mut ms[1], 0, &[1.0], 1, true);
    assert_eq!(ms[1].wait_used_for(0, Duration::from_millis(100)), None);
    ms[1].pause_queue(0);
    let p0 = allreduce(&mut ms[0], 0, &[2.0], 1, true);
    assert_eq!(status(&finish(&mut ms[0], 0, &p0)), Some(Status::Ok));

    // Zeroed rings from index 0: another driver's rings.
    ms[1].start(features(true, false), 1, QUEUE_SIZE);
    daemon.wait_for_log("completion(s) kept for it dropped");
    assert_eq!(ms[1].wait_used_for(0, Duration::from_millis(200)), None);
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &[4.0], 2, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        let resp = finish(m, 0, p);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(read_f32(m, p.out, 1), [8.0]);
    }
}

/// A frontend that reconnects again and again with a ring the daemon
/// refuses (QEMU retries every second with the guest's setup): one loss,
/// one warning, not one of each per attempt.
#[test]
fn a_frontend_that_keeps_failing_its_setup_costs_one_loss_and_one_warning() {
    use vhost::vhost_user::message::VhostUserVringAddrFlags;
    use vhost::{VhostBackend, VringConfigData};

    let daemon = Backend::start("failing-setup", 2, &["--timeout-ms", "60000"]);
    let mut m0 = Member::connect(&daemon.socket(0));
    m0.start(features(true, false), 1, QUEUE_SIZE);
    let mut ms = vec![m0];
    // The first refused setup is a loss (the member was active from
    // SET_FEATURES on); the repeats are not.
    let attempts = 4;
    for attempt in 1..=attempts {
        let m = Member::connect(&daemon.socket(1));
        m.fe.set_features(features(true, false))
            .expect("SET_FEATURES");
        m.fe.set_mem_table(&m.mem_table()).expect("SET_MEM_TABLE");
        m.fe.set_vring_num(0, QUEUE_SIZE).expect("SET_VRING_NUM");
        // Host addresses in no region of the memory table.
        let nowhere = VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags: VhostUserVringAddrFlags::empty().bits(),
            desc_table_addr: 0x7f00_dead_0000,
            used_ring_addr: 0x7f00_dead_2000,
            avail_ring_addr: 0x7f00_dead_1000,
            log_addr: None,
        };
        let _ = m.fe.set_vring_addr(0, &nowhere);
        // The daemon closes the connection; wait until the close is logged.
        let deadline = Instant::now() + PATIENCE;
        while daemon
            .log()
            .matches("connection closed after an error")
            .count()
            < attempt
        {
            assert!(
                Instant::now() < deadline,
                "attempt {attempt}:\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let log = daemon.log();
    assert_eq!(
        ms[0].config().generation.get(),
        2,
        "a repeated refused setup was another loss:\n{log}"
    );
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("connection closed after an error"))
        .count();
    assert_eq!(warnings, 1, "{log}");

    // A driver that sets the device up properly joins the group again.
    let mut back = Member::connect(&daemon.socket(1));
    back.start(features(true, false), 1, QUEUE_SIZE);
    ms.push(back);
    let pending: Vec<Pending> = ms
        .iter_mut()
        .map(|m| allreduce(m, 0, &[1.5], 3, true))
        .collect();
    for (m, p) in ms.iter_mut().zip(&pending) {
        let resp = finish(m, 0, p);
        assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
        assert_eq!(read_f32(m, p.out, 1), [3.0]);
    }
}

/// A frontend hands its rings to a restarted daemon (QEMU reconnecting):
/// the chain the old daemon had taken but not completed is available again.
/// A new group completes it with RESET without running it, since its
/// sequence number was the old group's; a daemon restarted with the same
/// `--group-id` continues the group and serves it.
#[test]
fn requests_handed_over_to_a_restarted_daemon_are_reset_unless_the_group_id_is_fixed() {
    for fixed in [false, true] {
        let extra: &[&str] = if fixed {
            &["--timeout-ms", "60000", "--group-id", "0x5ca1ab1e"]
        } else {
            &["--timeout-ms", "60000"]
        };
        let old = Backend::start("old", 2, extra);
        let mut ms = members(&old, features(true, false), 1);
        let p1 = allreduce(&mut ms[1], 0, &[3.0, -1.0], 1, true);
        // Taken by the old daemon, pending: rank 0 has not arrived.
        assert_eq!(ms[1].wait_used_for(0, Duration::from_millis(100)), None);

        let new = Backend::start("new", 2, extra);
        ms[1].hand_over(&new.socket(1), features(true, false));
        let mut m0 = Member::connect(&new.socket(0));
        m0.start(features(true, false), 1, QUEUE_SIZE);
        if fixed {
            // The same group: rank 1's request is its first collective.
            let p0 = allreduce(&mut m0, 0, &[1.0, 2.0], 1, true);
            let resp = finish(&mut m0, 0, &p0);
            assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
            let resp = finish(&mut ms[1], 0, &p1);
            assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
            assert_eq!(read_f32(&ms[1], p1.out, 2), [4.0, 1.0]);
        } else {
            let resp = finish(&mut ms[1], 0, &p1);
            assert_eq!(status(&resp), Some(Status::Reset), "{resp:?}");
            assert_eq!(resp.peer.get(), NO_PEER);
            // Not run: the output keeps what the driver put there.
            assert!(read_f32(&ms[1], p1.out, 2).iter().all(|x| x.is_nan()));
            // The new group's first collective lines up on both members.
            let p0 = allreduce(&mut m0, 0, &[1.0], 2, true);
            let p1 = allreduce(&mut ms[1], 0, &[5.0], 2, true);
            for (m, p) in [(&mut m0, &p0), (&mut ms[1], &p1)] {
                let resp = finish(m, 0, p);
                assert_eq!(status(&resp), Some(Status::Ok), "{resp:?}");
                assert_eq!(read_f32(m, p.out, 1), [6.0]);
            }
        }
        assert_eq!(m0.config().generation.get(), 1);
        drop(old);
    }
}
