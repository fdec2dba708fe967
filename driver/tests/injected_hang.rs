//! A member that never completes, on purpose: the daemon withholds rank
//! 1's completion of one collective (`--timing` `[[fail]] status =
//! "withheld"`, docs/latency-experiments.md section 5). Over the host
//! transport and the real daemon: rank 0 completes; rank 1's wait ends with
//! the driver's bounded error (`Unanswered`, after the request's timeout
//! plus the wait margin, shortened here from the default 60 s to 5 s with
//! `OpenOptions::wait_margin`); meanwhile
//! the group keeps serving both ranks; rank 1 recovers as the error says
//! (reset and reopen: a loss and a new generation for the group).

use std::time::{Duration, Instant};

use dmlc_driver::{Device, DmaBuf, Dtype, Error, Handle, Opcode, OpenOptions, ReduceOp, Request};
use dmlc_test_support::{free_local_addr, metric, serial, temp_dir, Backend};
use virtio_dmlc::VIRTIO_DMLC_F_REQ_TIMEOUT;

/// The requests' own timeout: the driver's wait bound is this plus
/// [`MARGIN`].
const TIMEOUT_MS: u32 = 1000;
/// The driver's wait margin in this test (`OpenOptions::wait_margin`).
const MARGIN: Duration = Duration::from_secs(5);
const COUNT: usize = 256;
/// Bound on the waits that should succeed.
const WAIT: Duration = Duration::from_secs(30);

struct Allreduce {
    req: Request,
    input: DmaBuf,
    output: DmaBuf,
}

impl Allreduce {
    fn new(dev: &Device, round: u32) -> Self {
        let mut input = dev.alloc(COUNT * 4).expect("alloc input");
        for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
            *x = (dev.rank() + 1) * 1000 + round * 10 + i as u32;
        }
        let output = dev.alloc(COUNT * 4).expect("alloc output");
        let req = Request {
            timeout_ms: TIMEOUT_MS,
            ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, COUNT as u64)
        };
        Allreduce { req, input, output }
    }

    fn submit(&self, dev: &Device) -> Handle {
        dev.submit(0, &self.req, &[self.input.all()], &[self.output.all()])
            .expect("submit")
    }

    /// The sum over ranks 0 and 1.
    fn check(&self, round: u32) {
        for (i, got) in self.output.as_elems::<u32>().iter().enumerate() {
            let want = 1000 + 2000 + 2 * (round * 10 + i as u32);
            assert_eq!(*got, want, "round {round}, element {i}");
        }
    }
}

/// One allreduce on both devices, checked; returns the generation.
fn allreduce_both(d0: &Device, d1: &Device, round: u32) -> u32 {
    let (a0, a1) = (Allreduce::new(d0, round), Allreduce::new(d1, round));
    let (h0, h1) = (a0.submit(d0), a1.submit(d1));
    let r0 = d0.wait(h0, Some(WAIT)).expect("rank 0");
    let r1 = d1.wait(h1, Some(WAIT)).expect("rank 1");
    a0.check(round);
    a1.check(round);
    assert_eq!(r0.generation, r1.generation);
    r0.generation
}

#[test]
fn a_withheld_completion_ends_the_wait_with_unanswered_and_the_group_goes_on() {
    let _g = serial();
    let dir = temp_dir("withheld-timing");
    let file = dir.path().join("withheld.toml");
    std::fs::write(
        &file,
        "[[fail]]\nstatus = \"withheld\"\nrank = 1\ncollective = 0\n",
    )
    .expect("write the timing file");
    let addr = free_local_addr();
    let timing = format!("--timing={}", file.display());
    let mut backend = Backend::start(
        "withheld",
        2,
        &[
            "--log-level",
            "info",
            "--timeout-ms",
            "20000",
            "--metrics-addr",
            &addr,
            &timing,
        ],
    );
    let opts = OpenOptions {
        dma_bytes: 8 << 20,
        wait_margin: MARGIN,
        ..OpenOptions::default()
    };
    let sockets: Vec<_> = (0..2).map(|r| backend.socket(r)).collect();
    let open = |rank: u32| dmlc_driver::host::open(&sockets[rank as usize], &opts).expect("open");
    let d0 = open(0);
    let mut d1 = open(1);
    assert!(d1.features() & (1 << VIRTIO_DMLC_F_REQ_TIMEOUT) != 0);

    // Collective 0: rank 0 completes, rank 1's completion is withheld.
    let (a0, a1) = (Allreduce::new(&d0, 0), Allreduce::new(&d1, 0));
    let posted = Instant::now();
    let (h0, h1) = (a0.submit(&d0), a1.submit(&d1));
    d0.wait(h0, Some(WAIT)).expect("rank 0 completes");
    a0.check(0);
    // A wait with the caller's own limit ends with that limit's error.
    let got = d1.wait(h1, Some(Duration::from_millis(300)));
    assert!(matches!(got, Err(Error::WaitTimeout)), "{got:?}");
    assert_eq!(metric(&addr, "dmlc_injected_withheld_total"), 1.0);

    // The group keeps serving both ranks while rank 1's request hangs.
    assert_eq!(allreduce_both(&d0, &d1, 1), 1);
    assert_eq!(allreduce_both(&d0, &d1, 2), 1);

    // The unbounded wait ends with the driver's bounded error, at the
    // request's timeout plus the margin after posting.
    let bound = Duration::from_millis(u64::from(TIMEOUT_MS)) + MARGIN;
    let got = d1.wait(h1, None);
    let after = posted.elapsed();
    assert!(
        matches!(got, Err(Error::Unanswered { after }) if after == bound),
        "{got:?}"
    );
    assert!(after >= bound, "ended after {after:?}, bound {bound:?}");
    assert!(after < bound + WAIT, "ended after {after:?}");
    println!("withheld: Unanswered after {:.1} s", after.as_secs_f64());
    backend.assert_running();

    // Recovery, as Unanswered says: reset and reopen. The group sees rank
    // 1 lost and back, in a new generation, and both ranks go on.
    drop(d1);
    d1 = open(1);
    // Rank 0 posts only once the loss is visible, so that its request is
    // not one the loss fails.
    let deadline = Instant::now() + WAIT;
    while d0.try_config().expect("config").generation.get() < 2 {
        assert!(Instant::now() < deadline, "the loss of rank 1 never showed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(allreduce_both(&d0, &d1, 3), 2);
    assert_eq!(metric(&addr, "dmlc_injected_withheld_total"), 1.0);
    assert!(
        backend.log().contains("withheld"),
        "the daemon logs the injection:\n{}",
        backend.log()
    );
}
