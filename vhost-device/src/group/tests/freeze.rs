//! Freezing (spec 5.X.6.15): a held collective moves no data and does not
//! time out however long it is held, `inspect` describes what each member
//! offers, and `thaw` runs it (or fails it, when it was held on an error)
//! with the deadlines of everything else moved on. Expected sums,
//! extremes and indices come from the inputs the tests build.

use std::time::Duration;

use virtio_dmlc::{Dtype, Opcode, ReduceOp, Status, FLAG_CHECK_FINITE, VIRTIO_DMLC_F_NONFINITE};

use super::comms::{creq, post, status, Posted, FEATURES as COMM_FEATURES};
use super::*;
use crate::group::freeze::Trigger;

const FEATURES: u64 = COMM_FEATURES | 1 << VIRTIO_DMLC_F_NONFINITE;
/// The group's collective timeout in these tests: short, so that holding
/// for several times as long shows that frozen time does not count.
const TIMEOUT: Duration = Duration::from_millis(200);

fn world(n: u32) -> World {
    let mut cfg = config(n);
    cfg.timeout = TIMEOUT;
    let w = World::new(cfg);
    for r in 0..n {
        w.group.set_member_features(r, FEATURES);
    }
    w
}

/// f32 input of member `r`: element i is `i * (r + 1)`, except `bad`.
fn input(r: u32, elems: usize, bad: Option<(usize, f32)>) -> Vec<u8> {
    (0..elems)
        .map(|i| match bad {
            Some((at, v)) if at == i => v,
            _ => (i as f32) * (r + 1) as f32,
        })
        .flat_map(f32::to_le_bytes)
        .collect()
}

/// Member `r` posts an f32 allreduce of `elems` with `flags` and `tag`.
fn allreduce(
    w: &mut World,
    r: u32,
    elems: usize,
    flags: u32,
    tag: u64,
    bad: Option<(usize, f32)>,
) -> Posted {
    let mut h = creq(Opcode::Allreduce.raw(), 0, 0, 0, elems as u64, tag, 0, &[]);
    h.base.dtype = Dtype::F32.raw();
    h.base.op = ReduceOp::Sum.raw();
    h.base.flags = flags.into();
    post(w, r, 0, &h, &[], &input(r, elems, bad), elems * 4)
}

fn held(w: &World) -> serde_json::Value {
    w.group.freeze_json()["held"].clone()
}

/// Long enough for several timeouts to pass, were they counted.
const HELD_FOR: Duration = Duration::from_millis(1000);

#[test]
fn a_held_collective_outlives_its_timeout_and_runs_on_thaw() {
    let n = 2;
    let mut w = world(n);
    let elems = 1000;
    w.group
        .freeze(Some(Trigger::At { queue: 0, seq: 1 }), false)
        .unwrap();
    // Collective 0 runs as usual.
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, elems, 0, 7, None))
        .collect();
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Ok, 0));
    }
    assert!(held(&w).is_null());
    // Collective 1 is held once both have arrived: it is filed, complete,
    // and does not run or time out.
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, elems, 0, 8, None))
        .collect();
    let h = held(&w);
    assert_eq!(
        (h["queue"].as_u64(), h["seq"].as_u64()),
        (Some(0), Some(1)),
        "{h}"
    );
    assert_eq!(h["phase"], "held");
    assert!(
        w.wait_for(&p[0].p, HELD_FOR).is_none(),
        "a held collective completed"
    );
    assert!(w.is_pending(&p[1].p));
    // Its outputs are untouched: no data moved.
    let out = w.members[1].read(p[1].out.unwrap().addr, elems * 4);
    assert!(out.iter().all(|&b| b == 0x5a));

    let j = w.group.inspect().unwrap();
    let members = j["members"].as_array().unwrap();
    assert_eq!(members.len(), 2);
    for (r, m) in members.iter().enumerate() {
        assert_eq!(m["rank"], r as u64);
        assert_eq!(m["header"]["opcode"], "allreduce");
        assert_eq!(m["header"]["dtype"], "f32");
        assert_eq!(m["header"]["tag"], 8);
        let i = &m["input"];
        assert_eq!(i["elements"], elems as u64);
        let max = ((elems - 1) * (r + 1)) as f64;
        assert_eq!(i["min"].as_str().unwrap().parse::<f64>().unwrap(), 0.0);
        assert_eq!(i["max"].as_str().unwrap().parse::<f64>().unwrap(), max);
        assert_eq!((i["nan"].as_u64(), i["inf"].as_u64()), (Some(0), Some(0)));
        assert!(i["first_non_finite"].is_null());
    }
    // Rank 1 posted second: it arrived last.
    assert_eq!(members[1]["last"], true);

    assert!(w.group.thaw().unwrap().contains("thawed"));
    for (r, x) in p.iter().enumerate() {
        assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Ok, 0), "rank {r}");
        let got = w.members[r].read(x.out.unwrap().addr, elems * 4);
        let want: Vec<u8> = (0..elems)
            .flat_map(|i| (i as f32 * 3.0).to_le_bytes())
            .collect();
        assert_eq!(got, want, "rank {r}");
    }
    assert!(held(&w).is_null());
    assert!(w.group.thaw().is_err(), "nothing is frozen any more");
    // The trigger fired once; timeouts count again: a lone member times out.
    let lone = allreduce(&mut w, 0, elems, 0, 9, None);
    assert_eq!(status(&w.wait_comm(&lone.p).1), (Status::Timeout, 0));
}

#[test]
fn a_tag_trigger_and_the_launchers_handshake() {
    let n = 2;
    let mut w = world(n);
    w.group.freeze(Some(Trigger::Tag(42)), false).unwrap();
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, 16, 0, 41, None))
        .collect();
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Ok, 0));
    }
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, 16, 0, 42, None))
        .collect();
    let id = held(&w)["id"].as_u64().unwrap();
    assert!(w.group.frozen_resumed(id).is_err(), "not thawing yet");
    assert!(w.group.frozen_stopped(id + 1).is_err(), "another freeze");
    w.group.frozen_stopped(id).unwrap();
    assert_eq!(held(&w)["phase"], "frozen");
    // Thawing a frozen job waits for the launcher to resume its VMs.
    assert!(w.group.thaw().unwrap().contains("thawing"));
    assert_eq!(held(&w)["phase"], "thawing");
    assert!(w.wait_for(&p[0].p, TIMEOUT * 2).is_none());
    w.group.frozen_resumed(id).unwrap();
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Ok, 0));
    }
}

/// Freeze-on-error holds a mismatch and a non-finite checked input before
/// any data moves; thawing completes them with the status they would have
/// had. Each hold disarms it.
#[test]
fn on_error_holds_a_mismatch_and_a_non_finite_input() {
    let n = 2;
    let mut w = world(n);
    w.group.freeze(None, true).unwrap();
    let p = [
        allreduce(&mut w, 0, 8, 0, 1, None),
        allreduce(&mut w, 1, 9, 0, 1, None),
    ];
    let h = held(&w);
    assert!(h["reason"].as_str().unwrap().contains("MISMATCH"), "{h}");
    assert!(w.wait_for(&p[0].p, HELD_FOR).is_none());
    w.group.thaw().unwrap();
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1).0, Status::Mismatch);
    }

    w.group.freeze(None, true).unwrap();
    let elems = 300;
    let p = [
        allreduce(&mut w, 0, elems, FLAG_CHECK_FINITE, 2, None),
        allreduce(
            &mut w,
            1,
            elems,
            FLAG_CHECK_FINITE,
            2,
            Some((123, f32::NAN)),
        ),
    ];
    let h = held(&w);
    assert!(
        h["reason"]
            .as_str()
            .unwrap()
            .contains("rank 1, element 123"),
        "{h}"
    );
    let j = w.group.inspect().unwrap();
    let i = &j["members"][1]["input"];
    assert_eq!(
        (i["nan"].as_u64(), i["first_non_finite"].as_u64()),
        (Some(1), Some(123))
    );
    assert_eq!(j["members"][0]["input"]["nan"], 0);
    // The inputs are as offered: the output still holds the fill.
    let out = w.members[0].read(p[0].out.unwrap().addr, elems * 4);
    assert!(out.iter().all(|&b| b == 0x5a));
    w.group.thaw().unwrap();
    for x in &p {
        let resp = w.wait_comm(&x.p).1;
        assert_eq!(status(&resp).0, Status::NonFinite);
        assert_eq!((resp.base.peer.get(), resp.length.get()), (1, 123));
    }
    // Disarmed: the next mismatch fails at once.
    let p = [
        allreduce(&mut w, 0, 8, 0, 3, None),
        allreduce(&mut w, 1, 9, 0, 3, None),
    ];
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1).0, Status::Mismatch);
    }
}

/// A collective whose deadline passes with a member absent is held on
/// freeze-on-error; the absent member is named, and thawing fails it.
#[test]
fn on_error_holds_a_timeout() {
    let n = 2;
    let mut w = world(n);
    w.group.freeze(None, true).unwrap();
    let p = allreduce(&mut w, 0, 8, 0, 1, None);
    // The hold is made by the timer thread once the deadline passes.
    assert!(w.wait_for(&p.p, TIMEOUT + HELD_FOR).is_none());
    let h = held(&w);
    assert!(
        h["reason"]
            .as_str()
            .unwrap()
            .contains("TIMEOUT (missing ranks [1])"),
        "{h}"
    );
    let j = w.group.inspect().unwrap();
    assert_eq!(j["members"][1]["arrived"], false);
    w.group.thaw().unwrap();
    assert_eq!(status(&w.wait_comm(&p.p).1), (Status::Timeout, 0));
}

/// A member's state for a snapshot (spec 5.X.6.15): refused unless the job
/// is frozen; then the held collective's sequence number and each member's
/// head; a new group with the same id takes it back (sequence numbers and
/// generation), and serves the member's request again under it, which
/// then meets its peer's; a group of another id refuses it.
#[test]
fn a_snapshot_state_is_given_only_when_frozen_and_taken_back_by_the_same_group() {
    let n = 2;
    let mut w = world(n);
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, 8, 0, 1, None))
        .collect();
    for x in &p {
        assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Ok, 0));
    }
    assert!(w.group.member_state(0).unwrap_err().contains("not frozen"));
    w.group
        .freeze(Some(Trigger::At { queue: 0, seq: 1 }), false)
        .unwrap();
    let p: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut w, r, 8, 0, 2, None))
        .collect();
    let id = held(&w)["id"].as_u64().unwrap();
    assert!(
        w.group.member_state(0).unwrap_err().contains("not frozen"),
        "held, not frozen"
    );
    w.group.frozen_stopped(id).unwrap();
    let states: Vec<_> = (0..n).map(|r| w.group.member_state(r).unwrap()).collect();
    for (r, s) in states.iter().enumerate() {
        assert_eq!((s.rank, s.group_id, s.generation), (r as u32, 0x1234, 1));
        // The config's 4 queues: only queue 0 has a request in flight.
        assert_eq!(
            s.seqs,
            vec![1, 0, 0, 0],
            "rank {r}: the held collective's number"
        );
        assert_eq!(s.in_flight[0], vec![p[r].p.head], "rank {r}");
        assert!(s.in_flight[1..].iter().all(Vec::is_empty), "rank {r}");
    }

    // A new group of the same id takes them back: member 0's request,
    // served again, is collective 1 and meets member 1's.
    let mut fresh = world(n);
    for s in &states {
        fresh.group.adopt_member(s).unwrap();
    }
    let again: Vec<Posted> = (0..n)
        .map(|r| allreduce(&mut fresh, r, 8, 0, 2, None))
        .collect();
    for x in &again {
        assert_eq!(status(&fresh.wait_comm(&x.p).1), (Status::Ok, 0));
    }
    let state = fresh.group.state_json();
    assert_eq!(state["members"][0]["next_seq"][0], 2, "{state:#}");

    let mut cfg = config(n);
    cfg.group_id = 0x999;
    let other = World::new(cfg);
    let refused = other.group.adopt_member(&states[0]).unwrap_err();
    assert!(refused.contains("--group-id 0x1234"), "{refused}");
}

/// A member lost while the others wait, with freeze-on-error: their
/// collective is held instead of failed, config space keeps the old
/// generation, `inspect` shows the remaining members' inputs and the lost
/// one; thawed, they complete with PEER_LOST naming it, in the new
/// generation, which config space then shows.
#[test]
fn on_error_holds_the_others_when_a_member_is_lost() {
    let n = 3;
    let mut w = world(n);
    w.group.freeze(None, true).unwrap();
    let p: Vec<Posted> = (0..2)
        .map(|r| allreduce(&mut w, r, 8, 0, 1, None))
        .collect();
    w.group.member_lost(2);
    let h = held(&w);
    assert!(
        h["reason"]
            .as_str()
            .unwrap()
            .contains("PEER_LOST (rank 2 was lost)"),
        "{h}"
    );
    assert!(
        w.wait_for(&p[0].p, HELD_FOR).is_none(),
        "a held failure completed"
    );
    assert_eq!(w.group.config_space(0).base.generation.get(), 1);
    let j = w.group.inspect().unwrap();
    let m = j["members"].as_array().unwrap();
    assert_eq!(m.len(), 3, "{j:#}");
    assert_eq!(
        (m[0]["arrived"].as_bool(), m[1]["arrived"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(
        (m[2]["arrived"].as_bool(), m[2]["lost"].as_bool()),
        (Some(false), Some(true))
    );
    assert_eq!(m[1]["input"]["elements"], 8);
    assert!(
        w.group.member_state(0).is_err(),
        "no snapshot of a job with a lost member"
    );
    w.group.thaw().unwrap();
    for x in &p {
        let resp = w.wait_comm(&x.p).1;
        assert_eq!(status(&resp), (Status::PeerLost, 0));
        assert_eq!((resp.base.peer.get(), resp.base.generation.get()), (2, 2));
    }
    assert_eq!(w.group.config_space(0).base.generation.get(), 2);
}
