//! Unit tests for `bench.rs`: busbw factors, argument parsing, result checking and the JSON document.

use super::*;

#[test]
fn busbw_factors_follow_nccl_tests() {
    let c = Pattern::Collective;
    assert_eq!(busbw_factor(c(Opcode::Allreduce), 4), 1.5);
    assert_eq!(busbw_factor(c(Opcode::Allgather), 4), 0.75);
    assert_eq!(busbw_factor(c(Opcode::Broadcast), 4), 1.0);
    assert_eq!(busbw_factor(Pattern::SendRecv, 4), 1.0);
    assert_eq!(busbw_factor(Pattern::Alltoall, 4), 0.75);
}

#[test]
fn shapes() {
    let c = Pattern::Collective;
    assert_eq!(shape(c(Opcode::Allreduce), Dtype::F32, 2, 4), Some((1, 4)));
    assert_eq!(shape(c(Opcode::Allreduce), Dtype::F64, 2, 4), None);
    assert_eq!(
        shape(c(Opcode::Allgather), Dtype::F32, 4, 64),
        Some((4, 64))
    );
    assert_eq!(shape(c(Opcode::Allgather), Dtype::F32, 4, 8), None);
    assert_eq!(
        shape(c(Opcode::ReduceScatter), Dtype::U8, 3, 100),
        Some((33, 99))
    );
    // nccl-tests' sizes: a sendrecv message, and all N blocks of an all-to-all.
    assert_eq!(shape(Pattern::SendRecv, Dtype::F32, 4, 64), Some((16, 64)));
    assert_eq!(shape(Pattern::Alltoall, Dtype::F32, 4, 64), Some((4, 64)));
}

#[test]
fn sendrecv_and_alltoall_have_no_in_place_form() {
    for p in [Pattern::SendRecv, Pattern::Alltoall] {
        assert!(elems_of(p, 4, 1, 0, 8, true).expect("sizes").is_none());
    }
    let a2a = elems_of(Pattern::Alltoall, 4, 1, 0, 8, false).expect("sizes");
    assert_eq!(a2a.map(|b| (b.input, b.output)), Some((32, 32)));
    assert!(matches!(
        plan(&args(&["--opcode", "sendrecv"]), 1, u64::MAX),
        Err(CliError::Usage(_))
    ));
}

fn parse(argv: &[&str]) -> BenchArgs {
    #[derive(clap::Parser)]
    struct P {
        #[command(flatten)]
        a: BenchArgs,
    }
    <P as clap::Parser>::try_parse_from(["bench"].iter().chain(argv))
        .expect("parses")
        .a
}

fn args(extra: &[&str]) -> BenchArgs {
    let mut argv = vec![
        "-e", "64K", "-f", "16", "-n", "3", "-w", "1", "--rotate", "256K",
    ];
    argv.extend_from_slice(extra);
    parse(&argv)
}

/// Two members over loopback TCP: every collective the Communicator has,
/// checked by the bench's own #wrong count.
#[test]
fn tcp_sweep_is_correct_on_two_members() {
    for opcode in [
        "allreduce",
        "broadcast",
        "allgather",
        "barrier",
        "sendrecv",
        "alltoall",
    ] {
        let a = args(&["--opcode", opcode, "--root", "1", "-d", "bf16"]);
        let plan = plan(&a, 2, u64::MAX).expect("plan");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        // Rank 1 is the highest rank: it only connects, so its own
        // address is never used.
        let peers = vec![
            listener.local_addr().expect("addr"),
            "127.0.0.1:9".parse().unwrap(),
        ];
        let ok = std::thread::scope(|s| {
            let p = peers.clone();
            let (a, plan) = (&a, &plan);
            let r1 = s.spawn(move || {
                let c = TcpComm::connect(1, &p, Duration::from_secs(10)).expect("rank 1");
                tcp_sweep(c, p, Duration::ZERO, a, plan).expect("rank 1 sweep")
            });
            let c = TcpComm::with_listener(0, listener, &peers, Duration::from_secs(10))
                .expect("rank 0");
            let ok0 = tcp_sweep(c, peers.clone(), Duration::ZERO, a, plan).expect("sweep");
            (ok0, r1.join().expect("rank 1 thread"))
        });
        assert_eq!(ok, (true, true), "{opcode}");
    }
}

/// A group of one whose collective copies the input to the output
/// (right for every opcode with one member), except that it writes
/// nothing in the collectives numbered in `skip` (0-based, in the
/// order of the sweep).
struct OneMember {
    inpool: Vec<u8>,
    outpool: Vec<u8>,
    runs: u64,
    skip: Vec<u64>,
}

impl OneMember {
    fn new(plan: &Plan, skip: &[u64]) -> Self {
        let pool = plan.pool_bytes as usize;
        OneMember {
            inpool: vec![0; pool],
            outpool: vec![0; pool],
            runs: 0,
            skip: skip.to_vec(),
        }
    }
}

impl Engine for OneMember {
    fn rank(&self) -> u32 {
        0
    }
    fn world(&self) -> u32 {
        1
    }
    fn pools(&mut self) -> (&mut [u8], &mut [u8]) {
        (&mut self.inpool, &mut self.outpool)
    }
    fn out_pool(&self) -> &[u8] {
        &self.outpool
    }
    fn touch(&mut self) -> Result<(), CliError> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CliError> {
        Ok(())
    }
    fn run(&mut self, sh: &Shape, slot: u64, in_place: bool) -> Result<(), CliError> {
        let k = self.runs;
        self.runs += 1;
        if self.skip.contains(&k) || in_place {
            // In place the input already is the result.
            return Ok(());
        }
        let n = sh.elems.input as usize * sh.dtype.size();
        let (i, o) = ((slot * sh.in_slot) as usize, (slot * sh.out_slot) as usize);
        self.outpool[o..o + n].copy_from_slice(&self.inpool[i..i + n]);
        Ok(())
    }
    fn describe(&self) -> Vec<String> {
        Vec::new()
    }
    fn json(&self) -> PathJson {
        PathJson::One {}
    }
}

fn setup() -> Setup {
    Setup {
        transport: "test".into(),
        mode: "none",
    }
}

#[test]
fn a_right_path_has_no_wrong_value() {
    let a = args(&[]);
    let plan = plan(&a, 1, u64::MAX).expect("plan");
    let mut e = OneMember::new(&plan, &[]);
    let out = sweep(&mut e, &a, &plan, &setup()).expect("sweep");
    // 4 sizes (4 B .. 64 KiB, x16), 1 + 3 collectives per direction.
    assert_eq!(out.sizes, 4);
    assert_eq!(out.checked, 4 * 2 * 4);
    assert!(out.ok(), "{out:?}");
}

/// A right output matches its expected digest: the element-by-element
/// count is only the slow path after a mismatch.
#[test]
fn a_right_output_matches_the_expected_digest() {
    let a = args(&["--opcode", "allgather", "-d", "f16"]);
    let plan = plan(&a, 1, u64::MAX).expect("plan");
    let mut e = OneMember::new(&plan, &[]);
    let gen = Gen {
        dtype: Dtype::F16,
        op: ReduceOp::Sum,
        key: 99,
        world: 1,
        nans: false,
    };
    for p in 0..plan.pool_bytes as usize / 2 {
        data::write(&mut e.inpool, 2, p, gen.value(0, p as u64));
    }
    let elems = buffer_elems(Opcode::Allgather, 1, 0, 0, 1000, false).expect("elems");
    let sh = Shape {
        pattern: Pattern::Collective(Opcode::Allgather),
        dtype: Dtype::F16,
        op: ReduceOp::Sum,
        root: 0,
        count: 1000,
        tag: 2000,
        elems,
        ip_elems: buffer_elems(Opcode::Allgather, 1, 0, 0, 1000, true),
        in_slot: 2048,
        out_slot: 2048,
        slots: 3,
    };
    let case = sh.case(0, 1, false, 0);
    prepare(&mut e, &sh, 2, false);
    e.run(&sh, 2, false).expect("run");
    let want = expected_digest(&sh, &case, &gen, 2);
    assert_eq!(Digest::of(&e.outpool[2 * 2048..2 * 2048 + 2000]), want);
    assert_eq!(count_wrong(&e, &sh, &case, &gen, 2, want), 0);
    // Another slot's data is wrong here.
    assert_eq!(
        count_wrong(
            &e,
            &sh,
            &case,
            &gen,
            2,
            expected_digest(&sh, &case, &gen, 1)
        ),
        0,
        "a digest mismatch is recounted element by element"
    );
    assert!(
        count_wrong(
            &e,
            &sh,
            &case,
            &gen,
            1,
            expected_digest(&sh, &case, &gen, 1)
        ) > 0
    );
}

/// One collective whose output is not written, in the timed part of
/// the third size (a warm-up one of the fourth too): caught, counted
/// in the direction it happened, element by element.
#[test]
fn one_unwritten_output_is_counted() {
    let a = args(&[]);
    let plan = plan(&a, 1, u64::MAX).expect("plan");
    // Collectives: 8 per size, out of place first.
    let (third_size_oop_2, fourth_size_warmup) = (2 * 8 + 2, 3 * 8);
    let mut e = OneMember::new(&plan, &[third_size_oop_2, fourth_size_warmup]);
    let out = sweep(&mut e, &a, &plan, &setup()).expect("sweep");
    // Sizes 4, 64, 1024 and 16384 B of f32: 256 and 4096 elements.
    assert_eq!(out.wrong_oop, 256 + 4096, "{out:?}");
    assert_eq!((out.wrong_ip, out.bad), (0, 2), "{out:?}");
    assert!(!out.ok());
}

/// The same data as the iteration before is no excuse: with one slot
/// every iteration reuses the buffers, and an unwritten output still
/// holds the poison, not the last result.
#[test]
fn an_unwritten_output_in_a_reused_slot_is_caught() {
    let a = parse(&[
        "--rotate", "64", "-b", "128", "-e", "128", "-n", "3", "-w", "1",
    ]);
    let plan = plan(&a, 1, u64::MAX).expect("plan");
    let mut e = OneMember::new(&plan, &[3]);
    let out = sweep(&mut e, &a, &plan, &setup()).expect("sweep");
    assert_eq!((out.wrong_oop, out.bad), (32, 1), "{out:?}");
}

#[test]
fn reduce_has_no_tcp_counterpart() {
    let a = args(&[
        "--transport",
        "tcp",
        "--opcode",
        "reduce",
        "--rank",
        "0",
        "--peers",
        "127.0.0.1:1",
    ]);
    assert!(matches!(run_tcp(&a), Err(CliError::Usage(_))));
}

/// The document has the keys bench/compare.py reads, in this order,
/// and strings that need escaping survive.
#[test]
fn json_document_has_every_key() {
    let a = args(&[]);
    let side = |median: f64, wrong: u64| Side {
        stats: Stats {
            median,
            avg: 2.0,
            min: 0.5,
            max: 3.0,
            p99: 3.0,
        },
        wrong,
        checked: 4,
        bad: u64::from(wrong > 0),
    };
    let rows = [Row {
        size: 4096,
        count: 1024,
        oop: side(1.234_567, 0),
        ip: Some(side(0.0, 3)),
        traffic: 16384,
    }];
    let setup = Setup {
        transport: "a\"b\\c\n".into(),
        mode: "m",
    };
    let path = PathJson::Tcp {
        peers: vec!["127.0.0.1:1".into()],
        connect_ms: 1.5,
        oop: "o",
        ip: "i",
    };
    let text = json(&a, path, 2, 64, &setup, &rows);
    let doc: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let keys = |v: &serde_json::Value| -> Vec<String> {
        v.as_object().expect("object").keys().cloned().collect()
    };
    let mut top = keys(&doc);
    top.sort();
    assert_eq!(
        top,
        [
            "dtype",
            "iters",
            "mode",
            "op",
            "opcode",
            "queue",
            "results",
            "root",
            "rotate_bytes",
            "tcp",
            "tool",
            "transport",
            "warmup",
            "world"
        ]
    );
    // Written in the order of the fields, whatever the parser keeps.
    assert!(text.find("\"rotate_bytes\"") < text.find("\"tcp\""));
    assert!(text.find("\"tcp\"") < text.find("\"results\""));
    assert_eq!(doc["transport"], "a\"b\\c\n");
    assert_eq!(doc["tool"], "dmlc-guest bench");
    assert_eq!(doc["tcp"]["peers"][0], "127.0.0.1:1");
    let r = &doc["results"][0];
    assert_eq!(
        (r["size"].as_u64(), r["count"].as_u64()),
        (Some(4096), Some(1024))
    );
    let side_keys = [
        "algbw", "avg_us", "busbw", "max_us", "min_us", "p99_us", "time_us", "wrong",
    ];
    let mut oop = keys(&r["oop"]);
    oop.sort();
    let mut want: Vec<&str> = side_keys.to_vec();
    want.push("membw");
    want.sort();
    assert_eq!(oop, want);
    let mut ip = keys(&r["ip"]);
    ip.sort();
    assert_eq!(ip, side_keys);
    // 4096 B in 1.234567 us, rounded as the table shows it.
    assert_eq!(r["oop"]["time_us"], 1.235);
    assert_eq!(r["oop"]["algbw"], 3.3178);
    assert_eq!(r["oop"]["busbw"], 3.3178);
    assert_eq!(r["oop"]["membw"], 13.271);
    assert_eq!(
        (r["ip"]["wrong"].as_u64(), r["ip"]["algbw"].as_f64()),
        (Some(3), Some(0.0))
    );
}
