//! The timing model, injected delays and failures, and the flight
//! recorder, in the engine. Time bounds are lower bounds (a completion
//! never comes before its modelled time) and generous upper bounds, so a
//! loaded machine does not fail them.

use serde_json::Value;

use super::*;
use crate::timing::Timing;

/// Generous: far above any scheduling delay, far below a hang.
const SLACK: Duration = Duration::from_secs(3);

fn timed(n: u32, toml: &str) -> crate::group::GroupConfig {
    let mut cfg = config(n);
    cfg.timing = Some(Arc::new(Timing::from_toml(toml, n).unwrap()));
    cfg
}

/// Builds every member's chain for `c`, submits them all on queue `q`,
/// and returns the pending chains, the built chains and the inputs, with
/// the time just before the first was submitted (no arrival is earlier).
fn submit_all(
    w: &mut World,
    q: u16,
    c: &Coll,
    rng: &mut Rng,
) -> (Vec<Pending>, Vec<Built>, Vec<Vec<u8>>, Instant) {
    let n = w.members.len() as u32;
    let inputs = c.inputs(n, rng);
    let built: Vec<Built> = (0..n)
        .map(|r| build(w, r, &c.header(false), &inputs[r as usize], &[]))
        .collect();
    let t = Instant::now();
    let pend: Vec<Pending> = (0..n)
        .map(|r| w.submit(r, q, &built[r as usize].descs))
        .collect();
    (pend, built, inputs, t)
}

/// The recorder's records once `done` says they are all there (a record
/// is pushed just after its members' completions are made).
fn records_when(
    w: &World,
    done: impl Fn(&[crate::trace::Record]) -> bool,
) -> Vec<crate::trace::Record> {
    let rec = w.group.recorder().expect("a recorder");
    let deadline = Instant::now() + SLACK;
    loop {
        let r = rec.records();
        if done(&r) || Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn ring_model_completes_no_earlier_than_the_modelled_time() {
    // 2 real members standing for 8 ranks; alpha 2 ms, 1 GB/s.
    let mut w = World::new(timed(
        2,
        "[model]\nkind = \"ring\"\nworld = 8\nalpha_us = 2000\nbandwidth_gbs = 1\n",
    ));
    assert!(w.group.timed());
    let mut rng = Rng::new(1);
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 1000);
    let modelled = Duration::from_secs_f64(14.0 * 2e-3 + 2.0 * 7.0 / 8.0 * 4000.0 * 1e-9);
    let before = Instant::now();
    let (pend, built, inputs, _) = submit_all(&mut w, 0, &c, &mut rng);
    let want = c.expected(&inputs, &[false, false]);
    for (r, p) in pend.iter().enumerate() {
        let (_, resp) = w.wait(p);
        let done = before.elapsed();
        assert_eq!(resp, ok_resp(1));
        assert_eq!(w.members[r].gather(&built[r].outputs), want[r]);
        assert!(
            done >= modelled,
            "rank {r} after {done:?}, model {modelled:?}"
        );
        assert!(done < modelled + SLACK, "rank {r} after {done:?}");
    }
    let text = w.group.metrics().render();
    assert!(text.contains("dmlc_model_error_seconds_count 2"), "{text}");
}

#[test]
fn split_collectives_are_held_too() {
    // Big enough to be split over the reduction threads.
    let mut cfg = timed(
        2,
        "[model]\nkind = \"halving-doubling\"\nalpha_us = 50000\nbandwidth_gbs = 100\n",
    );
    cfg.reduce_threads = 2;
    let mut w = World::with_region(cfg, 8 << 20);
    let mut rng = Rng::new(2);
    let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, 512 << 10);
    let (pend, built, inputs, t) = submit_all(&mut w, 0, &c, &mut rng);
    for p in &pend {
        assert_eq!(w.wait(p).1, ok_resp(1));
        assert!(
            t.elapsed() >= Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
    }
    let want = c.expected(&inputs, &[false, false]);
    for r in 0..pend.len() {
        assert_eq!(w.members[r].gather(&built[r].outputs), want[r]);
    }
    assert_eq!(w.group.metrics().split_count(), 1);
}

#[test]
fn a_held_completion_blocks_neither_the_submitter_nor_other_queues() {
    // Every collective takes 2 s on the modelled cluster (long, so that a
    // loaded machine keeps the bounds below).
    let mut w = World::new(timed(
        2,
        "[model]\nkind = \"tree\"\nalpha_us = 1000000\nbandwidth_gbs = 1\n",
    ));
    let model = Duration::from_secs(2);
    let t0 = Instant::now();
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let a0 = w.submit(0, 0, &d[0]);
    let a1 = w.submit(1, 0, &d[1]);
    // The last arrival's thread came back at once: nothing sleeps there.
    assert!(t0.elapsed() < model / 2, "{:?}", t0.elapsed());
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let b0 = w.submit(0, 1, &d[0]);
    let b1 = w.submit(1, 1, &d[1]);
    for p in [&a0, &a1, &b0, &b1] {
        assert_eq!(w.wait(p).1, ok_resp(1));
        assert!(t0.elapsed() >= model);
    }
    // Queue 1 ran alongside queue 0, not after it.
    assert!(
        t0.elapsed() < 2 * model - Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn collectives_on_one_queue_follow_each_other_on_the_modelled_cluster() {
    // 200 ms each; the second cannot start before the first ends.
    let mut w = World::new(timed(
        2,
        "[model]\nkind = \"ring\"\nalpha_us = 100000\nbandwidth_gbs = 1\n",
    ));
    let t0 = Instant::now();
    let mut pend = Vec::new();
    for _ in 0..2 {
        for r in 0..2 {
            let d = barrier_descs(&mut w, r);
            pend.push(w.submit(r, 0, &d));
        }
    }
    for (i, p) in pend.iter().enumerate() {
        assert_eq!(w.wait(p).1, ok_resp(1));
        let want = Duration::from_millis(if i < 2 { 200 } else { 400 });
        assert!(t0.elapsed() >= want, "{i}: {:?}", t0.elapsed());
    }
    assert!(t0.elapsed() < Duration::from_millis(400) + SLACK);
}

#[test]
fn mismatches_are_not_held() {
    let mut w = World::new(timed(
        2,
        "[model]\nkind = \"ring\"\nalpha_us = 5000000\nbandwidth_gbs = 1\n",
    ));
    let t0 = Instant::now();
    let mut descs = Vec::new();
    for (r, tag) in [(0, 1), (1, 2)] {
        let m = &mut w.members[r as usize];
        descs.push(vec![
            m.header(&hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, tag, 0, 0)),
            m.response(),
        ]);
    }
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &descs[r as usize])).collect();
    for p in &p {
        assert_eq!(w.wait(p).1.status.get(), Status::Mismatch.raw());
    }
    // The 10 s model was not applied.
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn an_injected_delay_counts_as_a_late_arrival_and_repeats_with_the_seed() {
    let toml =
        "seed = 9\n[[delay]]\nranks = [1]\ndist = \"uniform\"\nmin_us = 80000\nmax_us = 120000\n";
    let mut delays = Vec::new();
    for _ in 0..2 {
        let mut cfg = timed(2, toml);
        cfg.trace_capacity = 16;
        let mut w = World::new(cfg);
        let mut rng = Rng::new(3);
        let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4);
        for _ in 0..3 {
            let (pend, _, _, t) = submit_all(&mut w, 0, &c, &mut rng);
            for p in &pend {
                assert_eq!(w.wait(p).1, ok_resp(1));
                assert!(
                    t.elapsed() >= Duration::from_millis(80),
                    "{:?}",
                    t.elapsed()
                );
            }
        }
        let m = w.group.metrics();
        assert_eq!(m.injected_delays(), 3);
        let text = m.render();
        // Skews of 80 ms or more: none in the buckets up to 50 ms.
        assert!(
            text.contains("dmlc_straggler_skew_seconds_bucket{le=\"0.05\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("dmlc_straggler_skew_seconds_bucket{le=\"0.5\"} 3"),
            "{text}"
        );
        let recs = records_when(&w, |r| r.len() == 3);
        assert_eq!(recs.len(), 3);
        let d: Vec<Duration> = recs.iter().map(|r| r.members[1].delay).collect();
        assert!(recs.iter().all(|r| r.members[0].delay.is_zero()));
        assert!(recs
            .iter()
            .all(|r| r.injected.len() == 1 && r.injected[0].contains("rank 1")));
        // One window of a minute: rank 1 is the slowest, 3 times, by at
        // least the injected 80 ms, all of it injected.
        let summary = w.group.recorder().unwrap().summary(Duration::from_secs(60));
        let row: Vec<&str> = summary.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row[1..5], ["3", "rank", "1", "3"], "{summary}");
        let late: f64 = row[5].parse().unwrap();
        let injected: f64 = row[6].parse().unwrap();
        assert!(injected >= 80_000.0 && late >= injected - 1.0, "{summary}");
        delays.push(d);
    }
    // The same seed gives the same delays.
    assert_eq!(delays[0], delays[1]);
    assert!(delays[0]
        .iter()
        .all(|d| (80..=120).contains(&d.as_millis())));
}

#[test]
fn an_injected_timeout_gives_what_a_real_one_gives() {
    let mut cfg = timed(
        3,
        "[[fail]]\nstatus = \"timeout\"\nrank = 1\ncollective = 0\n",
    );
    cfg.timeout = Duration::from_millis(150);
    let mut w = World::new(cfg);
    let mut rng = Rng::new(4);
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4);
    let (pend, built, _, t) = submit_all(&mut w, 0, &c, &mut rng);
    for (r, p) in pend.iter().enumerate() {
        let (written, got) = w.wait(p);
        // As in timeout_fails_present_members_and_late_arrivals: peer = the
        // rank that seemed missing, generation unchanged, outputs untouched.
        assert_eq!(got, resp(Status::Timeout, 0, 1, 1));
        assert_eq!(written as usize, RESP_SIZE + 16);
        assert!(w.members[r]
            .gather(&built[r].outputs)
            .iter()
            .all(|&x| x == 0x5a));
        assert!(t.elapsed() >= Duration::from_millis(150));
    }
    let m = w.group.metrics();
    assert_eq!(m.errors(Status::Timeout), 3);
    assert_eq!(m.injected_errors(Status::Timeout), 3);
    // The next collective (number 1) runs.
    let (pend, built, inputs, _) = submit_all(&mut w, 0, &c, &mut rng);
    let want = c.expected(&inputs, &[false; 3]);
    for (r, p) in pend.iter().enumerate() {
        assert_eq!(w.wait(p).1, ok_resp(1));
        assert_eq!(w.members[r].gather(&built[r].outputs), want[r]);
    }
}

#[test]
fn an_injected_peer_lost_gives_what_a_real_one_gives() {
    let mut cfg = timed(
        3,
        "[[fail]]\nstatus = \"peer-lost\"\nrank = 2\nqueue = 1\ncollective = 1\n",
    );
    cfg.trace_capacity = 8;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(5);
    let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, 8);
    // A collective waiting on queue 0 (member 2 absent) fails too, as in a
    // real loss.
    let d = barrier_descs(&mut w, 0);
    let waiting = w.submit(0, 0, &d);
    for expect_fail in [false, true] {
        let (pend, _, _, t) = submit_all(&mut w, 1, &c, &mut rng);
        for (r, p) in pend.iter().enumerate() {
            let got = w.wait(p).1;
            let want = match (expect_fail, r) {
                (false, _) => ok_resp(1),
                // The survivors see exactly what
                // member_lost_fails_waiting_peers_promptly_and_restarts_sequences
                // checks for a real loss of rank 2.
                (true, 0 | 1) => resp(Status::PeerLost, 0, 2, 2),
                // Rank 2 is alive: it sees the group reset.
                (true, _) => resp(Status::Reset, 0, NO_PEER, 2),
            };
            assert_eq!(got, want, "rank {r}");
            assert!(t.elapsed() < SLACK);
        }
    }
    assert_eq!(w.wait(&waiting).1, resp(Status::PeerLost, 0, 2, 2));
    assert_eq!(w.group.config_space(0).base.generation.get(), 2);
    let m = w.group.metrics();
    assert_eq!(m.injected_errors(Status::PeerLost), 3);
    assert_eq!(m.injected_errors(Status::Reset), 1);
    // Everyone starts again at sequence 0, rank 2 included.
    let (pend, _, _, _) = submit_all(&mut w, 1, &c, &mut rng);
    for p in &pend {
        assert_eq!(w.wait(p).1, ok_resp(2));
    }
    let recs = records_when(&w, |r| r.iter().any(|r| !r.injected.is_empty()));
    let failed = recs
        .iter()
        .find(|r| r.queue == 1 && r.injected.iter().any(|i| i.contains("peer_lost")))
        .expect("the injected loss is recorded");
    assert_eq!(failed.members[2].status, Status::Reset);
    assert_eq!(failed.members[0].status, Status::PeerLost);
}

#[test]
fn a_delay_past_the_deadline_times_out() {
    let mut cfg = timed(
        2,
        "[[delay]]\nranks = [1]\ndist = \"constant\"\nus = 400000\n",
    );
    cfg.timeout = Duration::from_millis(100);
    let mut w = World::new(cfg);
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let t = Instant::now();
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &d[r as usize])).collect();
    for p in &p {
        assert_eq!(w.wait(p).1, resp(Status::Timeout, 0, 1, 1));
        assert!(t.elapsed() >= Duration::from_millis(100));
    }
}

#[test]
fn a_file_that_models_nothing_costs_nothing() {
    let w = World::new(timed(2, "seed = 4\n[model]\nkind = \"ideal\"\n"));
    assert!(!w.group.timed());
    assert!(w.group.delayer.is_none());
    let w = World::new(config(2));
    assert!(!w.group.timed());
    assert!(w.group.recorder().is_none());
}

#[test]
fn the_trace_is_chrome_json_with_one_process_per_member() {
    let mut cfg = timed(
        2,
        "[model]\nkind = \"ring\"\nalpha_us = 1000\nbandwidth_gbs = 1\n\
         [[delay]]\nranks = [1]\ndist = \"constant\"\nus = 5000\n",
    );
    cfg.trace_capacity = 4;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(6);
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 64);
    // Two in flight on queue 0 at once, then more: the ring keeps the last 4.
    for _ in 0..2 {
        let (a, _, _, _) = submit_all(&mut w, 0, &c, &mut rng);
        let (b, _, _, _) = submit_all(&mut w, 0, &c, &mut rng);
        for p in a.iter().chain(&b) {
            assert_eq!(w.wait(p).1, ok_resp(1));
        }
    }
    let (p, _, _, _) = submit_all(&mut w, 2, &c, &mut rng);
    for p in &p {
        w.wait(p);
    }
    let recs = records_when(&w, |r| r.iter().any(|r| r.queue == 2));
    assert_eq!(recs.len(), 4);
    let rec = w.group.recorder().unwrap();
    let dir = std::env::temp_dir().join(format!("dmlc-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.json");
    rec.write_chrome(&path, 2).unwrap();
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(trace["otherData"]["overwritten"], 1);
    let slices = dmlc_test_support::chrome_trace::check(&trace);
    let of = |pid: u64| -> Vec<&Value> {
        slices
            .iter()
            .filter(|((p, _), _)| *p == pid)
            .flat_map(|(_, v)| v)
            .collect()
    };
    // Rank 1 (pid 2): an injected delay before each collective, marked.
    let delays: Vec<&Value> = of(2)
        .into_iter()
        .filter(|e| e["name"] == "injected delay")
        .collect();
    assert_eq!(delays.len(), 4);
    assert!(delays
        .iter()
        .all(|e| e["args"]["injected"] == true && e["cat"] == "injected"));
    let coll: Vec<&Value> = of(2)
        .into_iter()
        .filter(|e| e["cat"] == "collective")
        .collect();
    assert_eq!(coll.len(), 4);
    for e in &coll {
        assert_eq!(e["name"], "allreduce");
        assert_eq!(e["args"]["bytes"], 256);
        assert_eq!(e["args"]["status"], "ok");
        assert!(e["args"]["injected_delay_us"].as_f64().unwrap() >= 5000.0);
        assert!(e["args"]["modelled_us"].as_f64().unwrap() >= 2000.0);
    }
    // Rank 0 (pid 1): no injected delay; its collectives start earlier.
    assert!(of(1).iter().all(|e| e["cat"] == "collective"));
    assert_eq!(of(1).len(), 4);
    // The device (pid 0): data movement and the modelled time.
    let dev = of(0);
    assert_eq!(
        dev.iter().filter(|e| e["cat"] == "data movement").count(),
        4
    );
    assert_eq!(dev.iter().filter(|e| e["cat"] == "model").count(), 4);
    // Named processes for the device and each member.
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["device", "rank 0", "rank 1"]);
}

#[test]
fn a_generation_change_delivers_held_completions_at_once() {
    // 10 s per collective: far longer than the test waits.
    let toml = "[model]\nkind = \"ring\"\nalpha_us = 5000000\nbandwidth_gbs = 1\n";
    let model = Duration::from_secs(10);
    // A loss: the survivor gets the result of the collective that ran; the
    // lost member's completion is dropped.
    let mut w = World::new(timed(2, toml));
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let t = Instant::now();
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &d[r as usize])).collect();
    assert!(w.wait_for(&p[0], Duration::from_millis(100)).is_none());
    w.group.member_lost(1);
    let (_, got) = w.wait(&p[0]);
    assert_eq!(got.status.get(), Status::Ok.raw());
    assert!(t.elapsed() < model / 2, "{:?}", t.elapsed());
    assert!(w.wait_for(&p[1], Duration::from_millis(50)).is_none());
    assert_eq!(w.group.generation(), 2);
    // A reset (as at shutdown) does the same for everyone.
    let mut w = World::new(timed(2, toml));
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let t = Instant::now();
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &d[r as usize])).collect();
    w.group.reset();
    for p in &p {
        assert_eq!(w.wait(p).1.status.get(), Status::Ok.raw());
    }
    assert!(t.elapsed() < model / 2, "{:?}", t.elapsed());
    // Dropping the group delivers what is still held, too.
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &d[r as usize])).collect();
    let (group, hub, _parts) = w.into_parts();
    drop(group);
    for p in &p {
        assert!(hub.wait_for(p, SLACK).is_some());
    }
}

#[test]
fn members_of_a_chain_complete_at_their_own_modelled_times() {
    // A ring broadcast from rank 0 over 8 modelled ranks is a chain: rank 0
    // has sent the data after one hop (a + Nb), rank 1 has forwarded it
    // after two (2a + Nb); the model's end is 7a + Nb. Alpha 300 ms keeps
    // the order on a loaded machine.
    let mut cfg = timed(
        2,
        "[model]\nkind = \"ring\"\nworld = 8\nalpha_us = 300000\nbandwidth_gbs = 1\n",
    );
    cfg.trace_capacity = 4;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(7);
    let c = Coll::new(Opcode::Broadcast, Dtype::F32, ReduceOp::Sum, 16);
    let (pend, built, inputs, t) = submit_all(&mut w, 0, &c, &mut rng);
    let nb = Duration::from_nanos(64);
    let alpha = Duration::from_millis(300);
    let d0 = w.wait_for(&pend[0], SLACK + alpha * 8).expect("rank 0");
    let d1 = w.wait_for(&pend[1], SLACK + alpha * 8).expect("rank 1");
    assert!(d0.at - t >= alpha + nb, "rank 0 after {:?}", d0.at - t);
    assert!(d1.at - t >= alpha * 2 + nb, "rank 1 after {:?}", d1.at - t);
    assert!(d0.at < d1.at, "{:?} {:?}", d0.at - t, d1.at - t);
    let want = c.expected(&inputs, &[false, false]);
    for r in 0..2 {
        assert_eq!(w.members[r].gather(&built[r].outputs), want[r]);
    }
    // The recorder keeps each member's modelled and actual completion; the
    // collective's modelled end is that of the whole chain.
    let recs = records_when(&w, |r| !r.is_empty());
    let r = &recs[0];
    let (start, end) = r.modelled.unwrap();
    assert_eq!(end - start, alpha * 7 + nb);
    assert_eq!(r.members[0].modelled.unwrap() - start, alpha + nb);
    assert_eq!(r.members[1].modelled.unwrap() - start, alpha * 2 + nb);
    for m in &r.members {
        assert!(m.completed.unwrap() >= m.modelled.unwrap());
        assert!(!m.withheld);
    }
    let text = w.group.metrics().render();
    assert!(text.contains("dmlc_model_error_seconds_count 2"), "{text}");
    // Dumped: each member's slice ends at its own completion.
    let trace = w.group.recorder().unwrap().chrome_json(2);
    let slices = dmlc_test_support::chrome_trace::check(&trace);
    let done_us: Vec<f64> = [1u64, 2]
        .iter()
        .map(|pid| {
            let e = slices
                .iter()
                .filter(|((p, _), _)| p == pid)
                .flat_map(|(_, v)| v)
                .find(|e| e["cat"] == "collective")
                .expect("a member slice");
            let end = e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap();
            assert!(e["args"]["modelled_completion_us"].as_f64().unwrap() <= end + 1.0);
            end
        })
        .collect();
    assert!(done_us[1] - done_us[0] >= 250_000.0, "{done_us:?}");
}

#[test]
fn a_bandwidth_factor_in_a_window_slows_only_its_collectives() {
    // 2 ranks at 1 MB/s: a 4 KiB allreduce moves 2 * (1/2) * 4096 bytes,
    // 4.1 ms; collective 1 of queue 0 has rank 1's link at 1/100 of that.
    let mut cfg = timed(
        2,
        "[model]\nkind = \"ring\"\nalpha_us = 0\nbandwidth_gbs = 0.001\n\
         [[bandwidth]]\nranks = [1]\nfactor = 0.01\nqueue = 0\n\
         from_collective = 1\nuntil_collective = 2\n",
    );
    cfg.trace_capacity = 8;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(8);
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 1024);
    let fast = Duration::from_nanos(4_096_000);
    for i in 0..3 {
        let (pend, _, _, t) = submit_all(&mut w, 0, &c, &mut rng);
        for p in &pend {
            assert_eq!(w.wait(p).1, ok_resp(1));
        }
        if i == 1 {
            assert!(t.elapsed() >= fast * 100, "{:?}", t.elapsed());
        }
    }
    assert_eq!(w.group.metrics().injected_bandwidth_count(), 1);
    assert!(w
        .group
        .metrics()
        .render()
        .contains("dmlc_injected_bandwidth_total 1"));
    let recs = records_when(&w, |r| r.len() == 3);
    let modelled: Vec<Duration> = recs
        .iter()
        .map(|r| {
            let (a, b) = r.modelled.unwrap();
            b - a
        })
        .collect();
    assert_eq!(modelled, [fast, fast * 100, fast]);
    assert!(recs[0].injected.is_empty() && recs[2].injected.is_empty());
    assert_eq!(recs[1].injected.len(), 1);
    assert!(
        recs[1].injected[0].contains("rank 1 at 0.01x"),
        "{:?}",
        recs[1].injected
    );
}

#[test]
fn a_withheld_completion_is_never_made_and_the_group_goes_on() {
    let mut cfg = timed(
        2,
        "[[fail]]\nstatus = \"withheld\"\nrank = 1\ncollective = 0\n",
    );
    cfg.trace_capacity = 8;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(9);
    let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, 8);
    let (pend, built, inputs, _) = submit_all(&mut w, 0, &c, &mut rng);
    assert_eq!(w.wait(&pend[0]).1, ok_resp(1));
    assert_eq!(w.group.metrics().injected_withheld_count(), 1);
    // The data moved; rank 1's completion never comes.
    let want = c.expected(&inputs, &[false, false]);
    assert_eq!(w.members[1].gather(&built[1].outputs), want[1]);
    assert!(w.wait_for(&pend[1], Duration::from_millis(300)).is_none());
    // The next collectives run, for rank 1 too.
    for _ in 0..2 {
        let (pend, _, _, _) = submit_all(&mut w, 0, &c, &mut rng);
        for p in &pend {
            assert_eq!(w.wait(p).1, ok_resp(1));
        }
    }
    // A generation change (held completions are flushed) does not make it.
    w.group.reset();
    assert!(w.wait_for(&pend[1], Duration::from_millis(100)).is_none());
    let recs = records_when(&w, |r| r.len() == 3);
    let r = &recs[0];
    assert!(r.members[0].completed.is_some());
    assert!(r.members[1].completed.is_none() && r.members[1].withheld);
    assert!(
        r.injected.iter().any(|i| i.contains("rank 1 withheld")),
        "{:?}",
        r.injected
    );
    let text = w.group.metrics().render();
    assert!(text.contains("dmlc_injected_withheld_total 1"), "{text}");
    let trace = w.group.recorder().unwrap().chrome_json(2);
    dmlc_test_support::chrome_trace::check(&trace);
    let withheld = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["args"]["withheld"] == true)
        .count();
    assert_eq!(withheld, 1);
}

#[test]
fn the_files_overhead_comes_off_the_modelled_time() {
    // 400 ms modelled (a 2-rank ring barrier: 2a), 100 ms of it declared
    // the host's own.
    let mut cfg = timed(
        2,
        "overhead_us = 100000\n[model]\nkind = \"ring\"\nalpha_us = 200000\nbandwidth_gbs = 1\n",
    );
    cfg.trace_capacity = 2;
    let mut w = World::new(cfg);
    let d: Vec<Vec<Desc>> = (0..2).map(|r| barrier_descs(&mut w, r)).collect();
    let t = Instant::now();
    let p: Vec<Pending> = (0..2).map(|r| w.submit(r, 0, &d[r as usize])).collect();
    for p in &p {
        assert_eq!(w.wait(p).1, ok_resp(1));
        assert!(t.elapsed() >= Duration::from_millis(300));
    }
    let recs = records_when(&w, |r| !r.is_empty());
    let (from, to) = recs[0].modelled.unwrap();
    assert_eq!(to - from, Duration::from_millis(300));
}
