//! Fault tests: what the other members of a group observe, and how fast,
//! when a member is killed or exits, when the backend daemon dies or is
//! stopped, when a member never submits, and when members disagree on a
//! collective (docs/spec.md 5.X.6.11).
//!
//! The real daemon serves every member over vhost-user. The members whose
//! view is checked are devices opened by this process (one memfd and one
//! socket each, as separate VMs would have); the member that dies is a
//! `dmlc-guest` process, so that it can be killed with SIGKILL. Every test
//! checks the exact status (and peer) and the time it took; the measured
//! times are printed (`cargo test ... -- --nocapture` shows them).

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use dmlc_driver::transport::TransportError;
use dmlc_driver::{BufSlice, Device, DmaBuf, Done, Dtype, Error, Handle, Opcode, OpenOptions};
use dmlc_driver::{ReduceOp, Request};
use dmlc_test_support::{
    free_local_addr, guest_bin, metric, serial, wait_metric_at_least, Backend, Proc,
};
use virtio_dmlc::VIRTIO_DMLC_F_REQ_TIMEOUT;

/// The daemon's default timeout where no timeout should fire: a test that
/// sees TIMEOUT instead of the expected status fails clearly.
const LONG_TIMEOUT_MS: &str = "20000";
/// A lost member or a vanished daemon must be reported within this time
/// (far below the 20 s collective timeout, generous for a loaded 2-core
/// machine).
const PROMPT: Duration = Duration::from_secs(8);
/// Bound on any wait of these tests, so that a bug fails instead of hanging.
const WAIT: Duration = Duration::from_secs(30);

/// The f32 input of rank `r` at element `i`: the same as
/// `dmlc-guest debug allreduce`, so such a process and a device of this
/// process can take part in one collective.
fn value(r: u32, i: usize) -> f32 {
    (r as f32 + 1.0) * ((i % 64) as f32 + 1.0)
}

/// The u32 input of `dmlc-guest debug multiqueue`.
fn mq_value(q: u16, k: u64, r: u32, i: usize) -> u32 {
    (u32::from(q) << 24) ^ ((k as u32) << 12) ^ (r << 8) ^ (i as u32)
}

fn open(backend: &Backend, rank: u32, poll: bool, dma_bytes: usize) -> Device {
    let opts = OpenOptions {
        poll,
        // Not polling: sleeping on interrupts at once.
        spin_cap: Duration::ZERO,
        dma_bytes,
        ..OpenOptions::default()
    };
    dmlc_driver::host::open(&backend.socket(rank), &opts)
        .unwrap_or_else(|e| panic!("cannot open rank {rank}: {e}"))
}

/// A `dmlc-guest` process on `rank`'s socket.
fn guest(backend: &Backend, name: &str, rank: u32, args: &[&str]) -> Proc {
    let mut cmd = Command::new(guest_bin());
    cmd.arg("--socket").arg(backend.socket(rank)).args(args);
    Proc::spawn(name, &mut cmd)
}

fn generation(dev: &Device) -> u32 {
    dev.try_config().expect("read the config").generation.get()
}

/// One f32 sum allreduce with the [`value`] input, buffers allocated.
struct Allreduce {
    req: Request,
    input: DmaBuf,
    output: DmaBuf,
    queue: u16,
}

impl Allreduce {
    fn new(dev: &Device, count: usize, timeout_ms: u32) -> Self {
        let mut input = dev.alloc(count * 4).expect("alloc input");
        for (i, x) in input.as_elems_mut::<f32>().iter_mut().enumerate() {
            *x = value(dev.rank(), i);
        }
        let output = dev.alloc(count * 4).expect("alloc output");
        let req = Request {
            timeout_ms,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, count as u64)
        };
        Allreduce {
            req,
            input,
            output,
            queue: 0,
        }
    }

    /// The same, submitted on `queue`.
    fn on_queue(self, queue: u16) -> Self {
        Allreduce { queue, ..self }
    }

    fn submit(&self, dev: &Device) -> Handle {
        dev.submit(
            self.queue,
            &self.req,
            &[self.input.all()],
            &[self.output.all()],
        )
        .expect("submit")
    }

    /// Checks the output against the sum over `world` ranks.
    fn check(&self, world: u32) {
        let factor: f32 = (1..=world).map(|r| r as f32).sum();
        if let Some((i, got)) = self
            .output
            .as_elems::<f32>()
            .iter()
            .enumerate()
            .find(|&(i, &got)| got != factor * ((i % 64) as f32 + 1.0))
        {
            panic!(
                "element {i}: got {got}, want {}",
                factor * ((i % 64) as f32 + 1.0)
            );
        }
    }
}

/// Waits for each `(device, handle)` on its own thread; returns each result
/// and the instant it came back.
fn wait_all(waits: &[(&Device, Handle)]) -> Vec<(Result<Done, Error>, Instant)> {
    thread::scope(|s| {
        let threads: Vec<_> = waits
            .iter()
            .map(|&(dev, h)| {
                s.spawn(move || {
                    let r = dev.wait(h, Some(WAIT));
                    (r, Instant::now())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("waiter panicked"))
            .collect()
    })
}

/// Runs one matching allreduce on all `devs` (ranks 0..n of the group) and
/// checks the values; returns the generation of the responses.
fn allreduce_all(devs: &[&Device], count: usize) -> u32 {
    let world = devs[0].world_size();
    let ars: Vec<_> = devs.iter().map(|d| Allreduce::new(d, count, 0)).collect();
    let hs: Vec<_> = devs
        .iter()
        .zip(&ars)
        .map(|(d, a)| (*d, a.submit(d)))
        .collect();
    let mut gens = Vec::new();
    for ((r, _), a) in wait_all(&hs).into_iter().zip(&ars) {
        let done = r.unwrap_or_else(|e| panic!("allreduce failed: {e}"));
        a.check(world);
        gens.push(done.generation);
    }
    assert!(
        gens.windows(2).all(|w| w[0] == w[1]),
        "generations {gens:?}"
    );
    gens[0]
}

/// Waits until the daemon serving metrics at `addr` has taken `n`
/// allreduce requests in all (instead of sleeping and hoping that they
/// arrived, which a loaded machine does not promise).
/// The metric of the allreduce requests the daemon has taken.
const ALLREDUCES_TAKEN: &str = "dmlc_requests_total{opcode=\"allreduce\"}";

fn wait_taken(addr: &str, n: f64) {
    wait_metric_at_least(addr, ALLREDUCES_TAKEN, n, WAIT);
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Fault 1 (a): A member that is killed while the others wait in a collective it
/// never joined: they get PEER_LOST naming it at once, the generation goes
/// up by one, and the restarted member joins a new collective.
#[test]
fn killed_member_that_never_joined_is_reported_as_peer_lost() {
    let _g = serial();
    let addr = free_local_addr();
    let mut backend = Backend::start(
        "fault-kill",
        3,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            LONG_TIMEOUT_MS,
            "--metrics-addr",
            &addr,
        ],
    );
    let mut r2 = guest(
        &backend,
        "rank 2",
        2,
        &["debug", "allreduce", "--iters", "0", "--hold"],
    );
    assert!(
        r2.wait_stdout("holding", WAIT).is_some(),
        "rank 2 did not open its device:\n{}",
        r2.dump()
    );
    // One member polls, the other sleeps on interrupts: both must notice.
    let d0 = open(&backend, 0, true, 16 << 20);
    let d1 = open(&backend, 1, false, 16 << 20);
    let g0 = generation(&d0);
    let (a0, a1) = (Allreduce::new(&d0, 1024, 0), Allreduce::new(&d1, 1024, 0));
    let hs = [(&d0, a0.submit(&d0)), (&d1, a1.submit(&d1))];
    // Both wait in the daemon for rank 2, which never joins.
    wait_taken(&addr, 2.0);
    assert!(!d0.is_done(hs[0].1).unwrap() && !d1.is_done(hs[1].1).unwrap());

    let killed = Instant::now();
    r2.kill9();
    for (rank, (r, at)) in wait_all(&hs).into_iter().enumerate() {
        let delay = at.duration_since(killed);
        eprintln!("kill -9, never joined: rank {rank} got {r:?} after {delay:?}");
        assert!(
            matches!(r, Err(Error::PeerLost { peer: 2 })),
            "rank {rank}: {r:?}"
        );
        assert!(delay < PROMPT, "rank {rank}: PEER_LOST after {delay:?}");
    }
    assert_eq!(generation(&d0), g0 + 1);
    assert_eq!(generation(&d1), g0 + 1);
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());

    // The restarted member and the survivors start again at sequence 0.
    let mut r2 = guest(
        &backend,
        "rank 2 (restarted)",
        2,
        &["debug", "allreduce", "--iters", "1", "--retry-secs", "20"],
    );
    assert_eq!(allreduce_all(&[&d0, &d1], 1024), g0 + 1);
    assert!(r2.finish(WAIT).success(), "{}", r2.dump());
    assert!(r2.stdout().contains("iter 0 ok"), "{}", r2.dump());
    // Its exit (closing the device) is a loss too.
    assert_eq!(generation(&d0), g0 + 2);
}

/// Fault 1 (b): A member that is killed after it joined a 64 MiB allreduce, while
/// the collective's data moves: its input is still mapped by the daemon, so
/// the collective completes with OK and the right values on the survivors
/// (5.X.6.9 allows this). The survivors' next collective, which the killed
/// member never joined, fails with PEER_LOST; the generation goes up once.
///
/// The daemon runs a collective on the queue thread of the member that
/// arrived last; here the killed member arrived first, so a survivor's
/// thread moves the data. PEER_LOST must come while the data still moves.
#[test]
fn killed_member_during_a_64_mib_reduction_it_arrived_first_to() {
    kill_during_big_reduction(false);
}

/// Runs [`kill_during_big_reduction_once`] until the kill lands before the
/// end of the data movement (the start of the data movement is seen through
/// the daemon's metrics, so on a loaded machine the kill may come late).
fn kill_during_big_reduction(killed_last: bool) {
    for attempt in 1..=3 {
        if kill_during_big_reduction_once(killed_last) {
            return;
        }
        eprintln!("attempt {attempt}: the collective ended before the kill; again");
    }
    panic!("the kill never landed during the data movement: nothing was tested");
}

/// Fault 1 (b), the killed member arriving last: its own queue thread runs
/// the big collective, yet the loss must not wait for that collective to
/// end: the next collective's PEER_LOST must come while the data still
/// moves (docs/spec.md, Appendix B).
#[test]
fn killed_member_during_a_64_mib_reduction_it_arrived_last_to() {
    kill_during_big_reduction(true);
}

/// Returns false if the big collective had ended before the kill.
fn kill_during_big_reduction_once(killed_last: bool) -> bool {
    let _g = serial();
    const COUNT: usize = 16 << 20; // f32: 64 MiB per buffer
    let order = if killed_last { "last" } else { "first" };
    let addr = free_local_addr();
    let mut backend = Backend::start(
        "fault-kill-big",
        3,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            LONG_TIMEOUT_MS,
            "--metrics-addr",
            &addr,
            // The next collective goes on queue 1, so that its arrival does
            // not wait behind the big one on queue 0's thread.
            "--queues",
            "2",
        ],
    );
    let d0 = open(&backend, 0, true, 136 << 20);
    let d1 = open(&backend, 1, true, 136 << 20);
    let g0 = generation(&d0);
    let (a0, a1) = (Allreduce::new(&d0, COUNT, 0), Allreduce::new(&d1, COUNT, 0));
    let (n0, n1) = (
        Allreduce::new(&d0, 1024, 0).on_queue(1),
        Allreduce::new(&d1, 1024, 0).on_queue(1),
    );
    let requests = "dmlc_requests_total{opcode=\"allreduce\"}";
    let deadline = Instant::now() + WAIT;
    let arrivals = |n: f64, r2: &mut Proc| {
        while metric(&addr, requests) < n {
            assert!(
                Instant::now() < deadline && r2.wait_timeout(Duration::ZERO).is_none(),
                "requests did not arrive:\n{}",
                r2.dump()
            );
        }
    };
    let count = COUNT.to_string();
    let mut r2 = guest(
        &backend,
        "rank 2",
        2,
        &[
            "debug",
            "allreduce",
            "--count",
            &count,
            "--iters",
            "1",
            "--hold",
        ],
    );
    let submit = || {
        [
            (&d0, a0.submit(&d0)),
            (&d1, a1.submit(&d1)),
            (&d0, n0.submit(&d0)),
            (&d1, n1.submit(&d1)),
        ]
    };
    let hs = if killed_last {
        let hs = submit();
        arrivals(5.0, &mut r2);
        hs
    } else {
        arrivals(1.0, &mut r2);
        let hs = submit();
        arrivals(5.0, &mut r2);
        hs
    };
    let arrived = Instant::now();
    r2.kill9();
    let killed = Instant::now();
    let results = wait_all(&hs);
    let after = |at: Instant| ms(at.saturating_duration_since(killed));
    for (rank, (r, at)) in results[..2].iter().enumerate() {
        eprintln!(
            "kill -9 during a 64 MiB reduction (killed rank arrived {order}): rank {rank} got \
             {r:?} {:.1} ms after the last arrival, {:.1} ms after the kill",
            ms(at.duration_since(arrived)),
            after(*at)
        );
        assert!(r.is_ok(), "rank {rank}: {r:?}");
    }
    let big_done = results[..2].iter().map(|(_, at)| *at).max().unwrap();
    // Did the kill come before the end of the data movement?
    let tested = big_done > killed;
    for (rank, (r, at)) in results[2..].iter().enumerate() {
        eprintln!(
            "kill -9 during a 64 MiB reduction (killed rank arrived {order}): rank {rank}'s \
             next collective got {r:?} {:.1} ms after the kill",
            after(*at)
        );
        assert!(
            matches!(r, Err(Error::PeerLost { peer: 2 })),
            "rank {rank}: {r:?}"
        );
        if tested {
            assert!(
                at.duration_since(killed) < PROMPT && *at < big_done,
                "rank {rank}: PEER_LOST {:.1} ms after the kill",
                after(*at)
            );
        }
    }
    a0.check(3);
    a1.check(3);
    assert_eq!(generation(&d0), g0 + 1);
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());
    assert_eq!(metric(&addr, "dmlc_members_connected"), 2.0);

    let mut r2 = guest(
        &backend,
        "rank 2 (restarted)",
        2,
        &["debug", "allreduce", "--iters", "1", "--retry-secs", "20"],
    );
    assert_eq!(allreduce_all(&[&d0, &d1], 1024), g0 + 1);
    assert!(r2.finish(WAIT).success(), "{}", r2.dump());
    tested
}

/// Fault 2: The daemon killed (SIGKILL) or stopped (SIGTERM) while members wait in
/// a collective: after SIGKILL both end their wait with "device backend
/// disconnected" within a few alive checks, after SIGTERM with RESET (the
/// daemon resets the group before it exits); later calls fail with the
/// transport error instead of hanging, and devices opened on a new daemon
/// on the same sockets work.
/// A new daemon is a new group: generation 1 again, another group id.
#[test]
fn backend_killed_or_stopped_mid_collective() {
    let _g = serial();
    // A fresh metrics port for every daemon: the old one's may linger.
    let args = |addr: &str| {
        [
            "--log-level",
            "warn",
            "--timeout-ms",
            LONG_TIMEOUT_MS,
            "--metrics-addr",
            addr,
        ]
        .map(String::from)
    };
    let mut addr = free_local_addr();
    // Rank 2 never connects: the others wait for it.
    let mut backend = Backend::start(
        "fault-backend",
        3,
        &args(&addr).each_ref().map(|s| s.as_str()),
    );
    for how in ["SIGKILL", "SIGTERM"] {
        let d0 = open(&backend, 0, true, 16 << 20);
        let d1 = open(&backend, 1, false, 16 << 20);
        let group_id = d0.config().group_id.get();
        // The restarted daemon of the previous round has counted that
        // round's requests: these two come on top.
        let before = metric(&addr, ALLREDUCES_TAKEN);
        let (a0, a1) = (Allreduce::new(&d0, 1024, 0), Allreduce::new(&d1, 1024, 0));
        let hs = [(&d0, a0.submit(&d0)), (&d1, a1.submit(&d1))];
        // Mid-collective: the daemon holds both requests.
        wait_taken(&addr, before + 2.0);
        let stopped = Instant::now();
        let results = thread::scope(|s| {
            let waits = s.spawn(|| wait_all(&hs));
            if how == "SIGKILL" {
                backend.kill9();
            } else {
                let st = backend.terminate(WAIT);
                assert!(st.success(), "SIGTERM: daemon exited with {st}");
            }
            waits.join().expect("waiters panicked")
        });
        for (rank, (r, at)) in results.into_iter().enumerate() {
            let delay = at.duration_since(stopped);
            eprintln!("daemon {how}: rank {rank} got {r:?} after {delay:?}");
            // An orderly stop resets the group first: RESET on every pending
            // request; a killed daemon answers nothing (spec 5.X.6.11).
            let want = if how == "SIGKILL" {
                matches!(
                    r,
                    Err(Error::Transport(TransportError::Disconnected { .. }))
                )
            } else {
                matches!(r, Err(Error::Reset))
            };
            assert!(want, "daemon {how}: rank {rank}: {r:?}");
            assert!(delay < PROMPT, "daemon {how}: rank {rank}: after {delay:?}");
        }
        if how == "SIGTERM" {
            // An orderly stop removes the sockets.
            assert!((0..3).all(|r| !backend.socket(r).exists()));
        }
        // Everything after that fails the same way, promptly.
        let t = Instant::now();
        let again = Allreduce::new(&d0, 1024, 0);
        let h = d0
            .submit(0, &again.req, &[again.input.all()], &[again.output.all()])
            .expect("posting needs no daemon");
        let r = d0.wait(h, Some(WAIT));
        assert!(
            matches!(
                r,
                Err(Error::Transport(TransportError::Disconnected { .. }))
            ),
            "{r:?}"
        );
        assert!(matches!(
            d1.try_config(),
            Err(Error::Transport(TransportError::Disconnected { .. }))
        ));
        drop((d0, d1));
        assert!(t.elapsed() < PROMPT, "after {how}: {:?}", t.elapsed());

        addr = free_local_addr();
        backend.restart(&args(&addr).each_ref().map(|s| s.as_str()));
        let devs: Vec<_> = (0..3).map(|r| open(&backend, r, true, 16 << 20)).collect();
        let refs: Vec<&Device> = devs.iter().collect();
        assert_eq!(generation(&devs[0]), 1);
        assert_ne!(devs[0].config().group_id.get(), group_id);
        assert_eq!(allreduce_all(&refs, 1024), 1);
    }
}

/// Fault 3: A member that never submits: the others get TIMEOUT naming it after
/// the daemon's --timeout-ms, or after the request's own timeout_ms (the
/// earliest deadline of the members present rules); each timed-out
/// collective keeps its sequence number, so the late member's requests for
/// them fail at once with TIMEOUT, whatever their header, and then the
/// group is in step again, in the same generation.
#[test]
fn silent_member_times_out_and_catches_up() {
    let _g = serial();
    // The daemon's timeout and the requests' own are 10x apart. Each
    // TIMEOUT must come at or after its deadline and less than half the gap
    // between the two timeouts after it, so which one ruled is told apart
    // with a margin (1.35 s) that a loaded two-core machine keeps.
    const DEFAULT_MS: u32 = 3000;
    const REQ_MS: u32 = 300;
    let margin = Duration::from_millis(u64::from(DEFAULT_MS - REQ_MS) / 2);
    let backend = Backend::start(
        "fault-timeout",
        3,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            &DEFAULT_MS.to_string(),
        ],
    );
    let devs: Vec<_> = (0..3).map(|r| open(&backend, r, true, 16 << 20)).collect();
    let (d0, d1, d2) = (&devs[0], &devs[1], &devs[2]);
    assert!(d0.features() & (1 << VIRTIO_DMLC_F_REQ_TIMEOUT) != 0);
    let g0 = generation(d0);

    // (rank 0's timeout_ms, rank 1's timeout_ms, expected effective timeout)
    let cases = [
        (0, 0, DEFAULT_MS),
        (REQ_MS, REQ_MS, REQ_MS),
        (REQ_MS, 0, REQ_MS),
    ];
    for (t0, t1, want) in cases {
        let (a0, a1) = (Allreduce::new(d0, 1024, t0), Allreduce::new(d1, 1024, t1));
        let start = Instant::now();
        let hs = [(d0, a0.submit(d0)), (d1, a1.submit(d1))];
        for (rank, (r, at)) in wait_all(&hs).into_iter().enumerate() {
            let took = at.duration_since(start);
            eprintln!(
                "timeout_ms {t0}/{t1} (daemon {DEFAULT_MS}): rank {rank} got {r:?} after \
                 {took:?} (effective timeout {want} ms)"
            );
            assert!(
                matches!(r, Err(Error::Timeout { peer: 2 })),
                "rank {rank}: {r:?}"
            );
            let want = Duration::from_millis(want.into());
            assert!(
                took >= want && took < want + margin,
                "rank {rank}: TIMEOUT after {took:?}, effective timeout {want:?}"
            );
        }
    }
    // The late member's three requests meet timed-out collectives: each
    // fails at once, even one that does not match (count 8).
    for (k, count) in [(0, 1024), (1, 1024), (2, 8)] {
        let a = Allreduce::new(d2, count, 0);
        let t = Instant::now();
        let r = d2.wait(a.submit(d2), Some(WAIT));
        let took = t.elapsed();
        eprintln!("late member, collective {k}: {r:?} after {took:?}");
        assert!(matches!(r, Err(Error::Timeout { peer: 2 })), "k={k}: {r:?}");
        // At once: not after waiting for a timeout of its own.
        assert!(
            took < Duration::from_millis(u64::from(DEFAULT_MS) / 2),
            "k={k}: after {took:?}"
        );
    }
    // In step again; a timeout does not change the generation.
    assert_eq!(allreduce_all(&[d0, d1, d2], 1024), g0);
    assert_eq!(generation(d0), g0);
}

/// The buffers of one request of [`run_case`].
struct Bufs {
    input: Option<DmaBuf>,
    output: Option<DmaBuf>,
}

impl Bufs {
    fn slices(&self) -> (Vec<BufSlice>, Vec<BufSlice>) {
        let s = |b: &Option<DmaBuf>| {
            b.iter()
                .filter(|b| !b.is_empty())
                .map(DmaBuf::all)
                .collect()
        };
        (s(&self.input), s(&self.output))
    }
}

/// Submits `reqs[r]` on rank r (u32 data: element i of rank r's input is
/// `100 * r + i`) and returns every member's result and buffers.
fn run_case(devs: &[Device], reqs: &[Request]) -> Vec<(Result<Done, Error>, Bufs)> {
    let bufs: Vec<Bufs> = devs
        .iter()
        .zip(reqs)
        .map(|(dev, req)| {
            let e = dev.buffer_elems(req).expect("valid request");
            let size = if req.opcode == Opcode::Barrier {
                1
            } else {
                req.dtype.size()
            };
            let fill = |n: u64| {
                let mut b = dev.alloc(n as usize * size).expect("alloc");
                for (i, x) in b.as_elems_mut::<u32>().iter_mut().enumerate() {
                    *x = 100 * dev.rank() + i as u32;
                }
                b
            };
            if req.in_place {
                Bufs {
                    input: None,
                    output: Some(fill(e.output)),
                }
            } else {
                Bufs {
                    input: Some(fill(e.input)),
                    output: Some(dev.alloc(e.output as usize * size).expect("alloc")),
                }
            }
        })
        .collect();
    let hs: Vec<_> = devs
        .iter()
        .zip(reqs)
        .zip(&bufs)
        .map(|((dev, req), b)| {
            let (i, o) = b.slices();
            (dev, dev.submit(0, req, &i, &o).expect("submit"))
        })
        .collect();
    wait_all(&hs)
        .into_iter()
        .map(|(r, _)| r)
        .zip(bufs)
        .collect()
}

/// Fault 4: Mismatched collectives, the cases integration.rs does not cover: two
/// fields on one member, one member out of three differing, two members
/// differing in different fields, the reference (rank 0) being the odd one;
/// and the differences that are not mismatches (flags, timeout_ms, fields
/// the opcode ignores). Every member gets the same MISMATCH, the message
/// names the fields and the peer, and the group works afterwards.
#[test]
fn mismatches_fail_every_member_and_name_the_fields_and_peer() {
    let _g = serial();
    let backend = Backend::start(
        "fault-mismatch",
        3,
        &["--log-level", "warn", "--timeout-ms", LONG_TIMEOUT_MS],
    );
    let devs: Vec<_> = (0..3).map(|r| open(&backend, r, true, 16 << 20)).collect();
    let g0 = generation(&devs[0]);
    let base = Request {
        tag: 5,
        ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 16)
    };
    // (what differs, how rank r's request is changed, expected mismatch
    // fields and peer or None for OK)
    type Edit = fn(u32, &mut Request);
    type Want = Option<(&'static str, u32)>;
    let cases: [(&str, Edit, Want); 8] = [
        (
            "count and tag on rank 1",
            |r, q| {
                if r == 1 {
                    q.count = 8;
                    q.tag = 6;
                }
            },
            Some(("count, tag", 1)),
        ),
        (
            "dtype on rank 2 only",
            |r, q| {
                if r == 2 {
                    q.dtype = Dtype::I32;
                }
            },
            Some(("dtype", 2)),
        ),
        (
            "op on rank 1, tag on rank 2",
            |r, q| match r {
                1 => q.op = ReduceOp::Max,
                2 => q.tag = 9,
                _ => {}
            },
            Some(("op, tag", 1)),
        ),
        (
            "count on rank 0, the reference",
            |r, q| {
                if r == 0 {
                    q.count = 4;
                }
            },
            Some(("count", 1)),
        ),
        (
            "in place on rank 1, timeout_ms on rank 2",
            |r, q| match r {
                1 => q.in_place = true,
                2 => q.timeout_ms = 5000,
                _ => {}
            },
            None,
        ),
        (
            "barrier with different dtype and op",
            |r, q| {
                *q = Request::new(Opcode::Barrier, Dtype::U32, ReduceOp::Sum, 0);
                if r == 1 {
                    q.dtype = Dtype::F64;
                    q.op = ReduceOp::Max;
                }
            },
            None,
        ),
        (
            "broadcast with different op",
            |r, q| {
                q.opcode = Opcode::Broadcast;
                q.root = 2;
                if r == 0 {
                    q.op = ReduceOp::Prod;
                }
            },
            None,
        ),
        (
            "root of a broadcast on rank 2",
            |r, q| {
                q.opcode = Opcode::Broadcast;
                q.root = if r == 2 { 1 } else { 0 };
            },
            Some(("root", 2)),
        ),
    ];
    for (name, edit, want) in cases {
        let reqs: Vec<Request> = (0..3)
            .map(|r| {
                let mut q = base;
                edit(r, &mut q);
                q
            })
            .collect();
        let t = Instant::now();
        let results = run_case(&devs, &reqs);
        eprintln!("mismatch case {name:?}: all answered in {:?}", t.elapsed());
        for (rank, ((r, bufs), req)) in results.iter().zip(&reqs).enumerate() {
            match want {
                Some((fields, peer)) => {
                    let Err(e @ Error::Mismatch { fields: f, peer: p }) = r else {
                        panic!("{name}: rank {rank}: {r:?}");
                    };
                    assert_eq!((f.as_str(), *p), (fields, peer), "{name}: rank {rank}");
                    let verb = if fields.contains(", ") {
                        "differ"
                    } else {
                        "differs"
                    };
                    assert_eq!(
                        e.to_string(),
                        format!("collective mismatch: {fields} {verb} on rank {peer}")
                    );
                }
                None => {
                    assert!(r.is_ok(), "{name}: rank {rank}: {r:?}");
                    let out = bufs
                        .output
                        .as_ref()
                        .map_or(&[][..], |b| b.as_elems::<u32>());
                    let n = req.count as usize;
                    let want: Vec<u32> = match req.opcode {
                        Opcode::Allreduce => (0..n as u32).map(|i| 300 + 3 * i).collect(),
                        Opcode::Broadcast => (0..n as u32).map(|i| 100 * req.root + i).collect(),
                        _ => Vec::new(),
                    };
                    assert_eq!(&out[..want.len()], want, "{name}: rank {rank}");
                }
            }
        }
        // The group goes on (the failed collective used up its number).
        let after = run_case(&devs, &[base; 3]);
        assert!(
            after.iter().all(|(r, _)| r.is_ok()),
            "after {name}: {:?}",
            after.iter().map(|(r, _)| r).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        generation(&devs[0]),
        g0,
        "a mismatch changed the generation"
    );
}

/// Submits u32 sum allreduces `k` in `ks` on every queue with the input of
/// `dmlc-guest debug multiqueue` (count `count`, tag k); returns, per
/// request, (queue, k, handle, input, output).
type MqReq = (u16, u64, Handle, DmaBuf, DmaBuf);

fn multiqueue_submit(dev: &Device, ks: std::ops::Range<u64>, count: usize) -> Vec<MqReq> {
    let mut reqs = Vec::new();
    for k in ks {
        for q in 0..dev.num_queues() {
            let mut input = dev.alloc(count * 4).expect("alloc");
            for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
                *x = mq_value(q, k, dev.rank(), i);
            }
            let output = dev.alloc(count * 4).expect("alloc");
            let req = Request {
                tag: k,
                ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, count as u64)
            };
            let h = dev
                .submit(q, &req, &[input.all()], &[output.all()])
                .expect("submit");
            reqs.push((q, k, h, input, output));
        }
    }
    reqs
}

fn multiqueue_check(world: u32, (q, k, _, _, output): &MqReq) {
    for (i, &got) in output.as_elems::<u32>().iter().enumerate() {
        let want = (0..world).fold(0u32, |a, r| a.wrapping_add(mq_value(*q, *k, r, i)));
        assert_eq!(got, want, "queue {q} k {k} element {i}");
    }
}

/// Fault 5 (a): A member that exits normally (closes its device) while the other
/// has collectives pending on four queues: all of them fail at once with
/// PEER_LOST naming it, and the generation goes up once, not per queue.
#[test]
fn member_exiting_normally_fails_pending_collectives_on_every_queue() {
    let _g = serial();
    let backend = Backend::start(
        "fault-exit",
        2,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            LONG_TIMEOUT_MS,
            "--queues",
            "4",
        ],
    );
    let d0 = open(&backend, 0, true, 16 << 20);
    assert_eq!(d0.num_queues(), 4);
    let g0 = generation(&d0);
    // Rank 1 joins collectives 0..8 of each queue, then exits.
    let reqs = multiqueue_submit(&d0, 0..16, 256);
    let mut r1 = guest(
        &backend,
        "rank 1",
        1,
        &[
            "debug",
            "multiqueue",
            "--inflight",
            "8",
            "--iters",
            "8",
            "--count",
            "256",
        ],
    );
    assert!(r1.finish(WAIT).success(), "{}", r1.dump());
    let printed = r1
        .wait_stdout("multiqueue ok: 32 requests on 4 queue(s)", Duration::ZERO)
        .unwrap_or_else(|| panic!("{}", r1.dump()));
    let waits: Vec<_> = reqs.iter().map(|(_, _, h, _, _)| (&d0, *h)).collect();
    let mut worst = Duration::ZERO;
    for ((r, at), req) in wait_all(&waits).into_iter().zip(&reqs) {
        let (q, k) = (req.0, req.1);
        if k < 8 {
            assert!(r.is_ok(), "queue {q} k {k}: {r:?}");
            multiqueue_check(2, req);
        } else {
            assert!(
                matches!(r, Err(Error::PeerLost { peer: 1 })),
                "queue {q} k {k}: {r:?}"
            );
            worst = worst.max(at.saturating_duration_since(printed));
        }
    }
    eprintln!(
        "normal exit: 32 pending requests on 4 queues failed within {worst:?} of its last output"
    );
    assert!(worst < PROMPT, "PEER_LOST after {worst:?}");
    assert_eq!(generation(&d0), g0 + 1);

    // Every queue starts again at 0 with a new member 1.
    let d1 = open(&backend, 1, true, 16 << 20);
    let (a, b) = (
        multiqueue_submit(&d0, 0..2, 64),
        multiqueue_submit(&d1, 0..2, 64),
    );
    for (dev, reqs) in [(&d0, &a), (&d1, &b)] {
        for req in reqs.iter() {
            let r = dev.wait(req.2, Some(WAIT));
            assert!(r.is_ok(), "rank {}: {r:?}", dev.rank());
            multiqueue_check(2, req);
        }
    }
}

/// Fault 5 (b): A member killed with requests in flight on four queues: the
/// daemon drops exactly those (they have no ring to complete on), the
/// others are not disturbed, and the group goes on with the restarted
/// member on every queue.
#[test]
fn member_killed_with_requests_in_flight_on_several_queues() {
    let _g = serial();
    let addr = free_local_addr();
    let mut backend = Backend::start(
        "fault-kill-mq",
        2,
        &[
            "--log-level",
            "warn",
            "--timeout-ms",
            LONG_TIMEOUT_MS,
            "--queues",
            "4",
            "--metrics-addr",
            &addr,
        ],
    );
    let d0 = open(&backend, 0, true, 16 << 20);
    let g0 = generation(&d0);
    let reqs = multiqueue_submit(&d0, 0..16, 256);
    // Rank 1 runs ahead: after the 16 collectives of each queue it has 8
    // more in flight on each of the 4 queues, which rank 0 never joins.
    let mut r1 = guest(
        &backend,
        "rank 1",
        1,
        &[
            "debug",
            "multiqueue",
            "--inflight",
            "8",
            "--iters",
            "1000",
            "--count",
            "256",
        ],
    );
    let waits: Vec<_> = reqs.iter().map(|(_, _, h, _, _)| (&d0, *h)).collect();
    for ((r, _), req) in wait_all(&waits).into_iter().zip(&reqs) {
        assert!(r.is_ok(), "queue {} k {}: {r:?}", req.0, req.1);
        multiqueue_check(2, req);
    }
    let requests = "dmlc_requests_total{opcode=\"allreduce\"}";
    let deadline = Instant::now() + WAIT;
    while metric(&addr, requests) < (64 + 96) as f64 {
        assert!(
            Instant::now() < deadline,
            "rank 1 did not run ahead:\n{}",
            r1.dump()
        );
        thread::sleep(Duration::from_millis(5));
    }
    let dropped = metric(&addr, "dmlc_dropped_requests_total");
    let killed = Instant::now();
    r1.kill9();
    let deadline = killed + PROMPT;
    while metric(&addr, "dmlc_generation") < f64::from(g0 + 1) {
        assert!(Instant::now() < deadline, "the loss was not noticed");
        thread::sleep(Duration::from_millis(1));
    }
    eprintln!(
        "kill -9 with 32 requests in flight on 4 queues: new generation after {:?}",
        killed.elapsed()
    );
    assert_eq!(metric(&addr, "dmlc_dropped_requests_total") - dropped, 32.0);
    assert_eq!(generation(&d0), g0 + 1);
    assert!(backend.alive(), "backend died:\n{}", backend.proc.dump());

    let mut r1 = guest(
        &backend,
        "rank 1 (restarted)",
        1,
        &[
            "debug",
            "multiqueue",
            "--inflight",
            "4",
            "--iters",
            "4",
            "--count",
            "256",
        ],
    );
    let reqs = multiqueue_submit(&d0, 0..4, 256);
    for req in &reqs {
        let r = d0.wait(req.2, Some(WAIT));
        assert!(
            matches!(r, Ok(Done { generation, .. }) if generation == g0 + 1),
            "{r:?}"
        );
        multiqueue_check(2, req);
    }
    assert!(r1.finish(WAIT).success(), "{}", r1.dump());
}

/// `#wrong N` on rank `rank`'s own line of a `dmlc-guest bench` run under
/// `local --all-output` (rank 0's line is not prefixed, the others' are).
fn bench_wrong(out: &str, rank: u32) -> u64 {
    let head = format!("# rank {rank} of 2: ");
    let line = out
        .lines()
        .find_map(|l| l.split_once(&head).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no line of rank {rank} in:\n{out}"));
    line.split_once("#wrong ")
        .and_then(|(_, n)| n.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no #wrong on rank {rank}'s line {line:?}"))
}

/// Fault 6: a device that completes a later collective with OK but does
/// not write one rank's output (`DMLC_TEST_FAULTS=skip-write:R:N` in the
/// daemon: the N-th data-moving collective, 0-based) is caught by `bench`
/// on that rank alone: its own line counts the wrong elements, the other
/// rank's line says 0, and the run fails. The counts are each rank's own,
/// not a sum through the device. A device that gives every rank the same
/// wrong result (`drop-input:1:11`: reductions from collective 11 on leave
/// out rank 1's input) is caught by both.
#[test]
fn bench_catches_a_device_that_skips_writing_one_output() {
    let _g = serial();
    // Collective 0 is the bench's untimed touch of its pools; 1 to 8 are
    // the 4 B size, 9 to 16 the 16 B size (out of place, then in place):
    // 11 is a timed out-of-place allreduce of the second size.
    let bench = [
        "local",
        "--ranks",
        "2",
        "--all-output",
        "--",
        "bench",
        "-b",
        "4",
        "-e",
        "1K",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "--rotate",
        "64K",
    ];
    let run = |fault: Option<String>| {
        let mut cmd = Command::new(guest_bin());
        cmd.args(bench);
        match &fault {
            Some(f) => cmd.env("DMLC_TEST_FAULTS", f),
            None => cmd.env_remove("DMLC_TEST_FAULTS"),
        };
        let mut p = Proc::spawn(&format!("bench, fault {fault:?}"), &mut cmd);
        let st = p.finish(WAIT * 4);
        (st, p)
    };
    let (st, p) = run(None);
    assert!(st.success(), "{}", p.dump());
    let out = p.stdout();
    assert_eq!(
        (bench_wrong(&out, 0), bench_wrong(&out, 1)),
        (0, 0),
        "{out}"
    );
    for skipped in [1, 0] {
        let (st, p) = run(Some(format!("skip-write:{skipped}:11")));
        let out = p.stdout();
        let (bad, good) = (bench_wrong(&out, skipped), bench_wrong(&out, 1 - skipped));
        eprintln!("skip-write on rank {skipped}: #wrong {bad} there, {good} on the other; {st}");
        assert!(
            bad > 0,
            "rank {skipped} did not see its unwritten output:\n{}",
            p.dump()
        );
        assert_eq!(good, 0, "rank {}:\n{}", 1 - skipped, p.dump());
        assert!(!st.success(), "the run passed:\n{}", p.dump());
        assert!(
            p.stderr().contains(&format!(
                "dmlc-guest bench: rank {skipped}: {bad} wrong values"
            )),
            "{}",
            p.dump()
        );
    }
    let (st, p) = run(Some("drop-input:1:11".to_owned()));
    let out = p.stdout();
    let wrong = (bench_wrong(&out, 0), bench_wrong(&out, 1));
    assert!(wrong.0 > 0 && wrong.1 > 0, "{wrong:?}:\n{}", p.dump());
    assert!(!st.success(), "the run passed:\n{}", p.dump());
}

/// The driver's generation watch (spec 5.X.7.4) against the real daemon:
/// a peer lost while a wait watches the config space still ends that wait
/// with the device's PEER_LOST (the daemon completes the request before the
/// new generation is visible, and the watch drains the ring before it
/// calls a request dropped); a daemon killed mid-wait ends it with a
/// disconnect, not a hang.
#[test]
fn waits_watch_the_generation_without_mistaking_a_peer_loss() {
    let _g = serial();
    let mut backend = Backend::start(
        "watch",
        2,
        &["--log-level", "warn", "--timeout-ms", "20000"],
    );
    let opts = OpenOptions {
        dma_bytes: 8 << 20,
        ..OpenOptions::default()
    };
    let open = |rank: u32| dmlc_driver::host::open(&backend.socket(rank), &opts).expect("open");
    let d0 = open(0);
    let req = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 256);
    let input = d0.alloc(1024).expect("alloc");
    let output = d0.alloc(1024).expect("alloc");
    for round in 0..3 {
        let d1 = open(1);
        let h = d0
            .submit(0, &req, &[input.all()], &[output.all()])
            .expect("submit");
        let got = thread::scope(|s| {
            let waiter = s.spawn(|| d0.wait(h, Some(Duration::from_secs(30))));
            // Long enough for the wait to be reading the config.
            thread::sleep(Duration::from_millis(50 + 20 * round));
            drop(d1);
            waiter.join().expect("waiter")
        });
        assert!(
            matches!(got, Err(Error::PeerLost { peer: 1 })),
            "round {round}: {got:?}\n{}",
            backend.proc.dump()
        );
    }
    let h = d0
        .submit(0, &req, &[input.all()], &[output.all()])
        .expect("submit");
    let (got, after) = thread::scope(|s| {
        let waiter = s.spawn(|| d0.wait(h, None));
        thread::sleep(Duration::from_millis(50));
        let killed = Instant::now();
        backend.kill9();
        let got = waiter.join().expect("waiter");
        (got, killed.elapsed())
    });
    let err = got.expect_err("the wait must fail");
    assert!(
        err.to_string().contains("device backend disconnected"),
        "{err}"
    );
    assert!(after < Duration::from_secs(5), "noticed after {after:?}");
}

/// A nop is the device's own round trip: it comes back at once while the
/// member's allreduce waits for a peer that has not arrived, on the same
/// queue, and leaves that allreduce's matching alone (spec DEV-OP-18).
#[test]
fn a_nop_comes_back_while_the_group_waits_for_a_member() {
    let _g = serial();
    let backend = Backend::start(
        "nop-backend",
        2,
        &["--log-level", "warn", "--timeout-ms", LONG_TIMEOUT_MS],
    );
    let d0 = open(&backend, 0, true, 1 << 20);
    let a0 = Allreduce::new(&d0, 256, 0);
    let pending = a0.submit(&d0);
    let t = Instant::now();
    for _ in 0..100 {
        d0.nop().expect("a nop while rank 1 is missing");
    }
    assert!(t.elapsed() < PROMPT, "100 nops took {:?}", t.elapsed());
    assert!(!d0.is_done(pending).unwrap(), "the allreduce needs rank 1");
    // A nop with a count is refused as the spec's step 8 says.
    let counted = Request::new(Opcode::Nop, Dtype::U8, ReduceOp::Sum, 1);
    assert!(
        matches!(d0.check(&counted, &[], &[]), Err(Error::BadRequest { .. })),
        "a nop with a count passed the driver's checks"
    );
    // Rank 1 arrives: the allreduce completes with the right sum.
    let d1 = open(&backend, 1, true, 1 << 20);
    let a1 = Allreduce::new(&d1, 256, 0);
    let h1 = a1.submit(&d1);
    d0.wait(pending, Some(WAIT)).expect("rank 0's allreduce");
    d1.wait(h1, Some(WAIT)).expect("rank 1's allreduce");
    a0.check(2);
    a1.check(2);
}
