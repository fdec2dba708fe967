//! The device against TCP between the same two VMs, in the same run, all
//! measured by `dmlc-guest bench` with the same sizes and iterations: over
//! the device (`--pci`) polling for completions, then sleeping on
//! interrupts (uio_pci_generic), then with the hybrid wait (`--hybrid`:
//! spin up to 200 us, then sleep), then over the TCP Communicator on
//! virtio-net (`--transport tcp`). Rank 0's tables are printed side by side
//! with the p50 ratios and the goals (device at least 10x faster
//! than TCP at 4 B and 50x at 1 MiB). Only correctness is asserted (every
//! run exits 0, every #wrong is 0, the backend served the device runs
//! without errors): timings on a shared 2-core host are reported, not
//! checked.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use dmlc_vm::{vm_ip, Options, VmSpec};

use crate::common::{guest, metric_sum, progress, setup, vm, Backend, Vms};

/// Sizes and iterations of both runs: 4 B to 1 MiB in steps of 8 (7 sizes,
/// both goal sizes among them).
const BENCH: &str = "bench -b 4 -e 1M -f 8 -n 50 -w 5";
const SIZES: [u64; 7] = [4, 32, 256, 2048, 16384, 131_072, 1_048_576];
const PORT: u16 = 29500;
/// (size, how many times lower the device's p50 should be), from the issue.
const GOALS: [(u64, f64); 2] = [(4, 10.0), (1 << 20, 50.0)];

/// One row of a bench table.
#[derive(Debug, Clone, Copy)]
struct Row {
    size: u64,
    oop_us: f64,
    oop_wrong: u64,
    ip_us: f64,
    ip_wrong: u64,
    p99_us: f64,
}

/// One bench run as rank 0 printed it.
#[derive(Debug)]
struct Table {
    header: String,
    rows: Vec<Row>,
    summary: String,
}

/// Parses a table row: size count type redop root, out-of-place time algbw
/// busbw #wrong, in-place time algbw busbw #wrong, avg min max p99 membw.
fn row(line: &str) -> Option<Row> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 18 {
        return None;
    }
    Some(Row {
        size: f[0].parse().ok()?,
        oop_us: f[5].parse().ok()?,
        oop_wrong: f[8].parse().ok()?,
        ip_us: f[9].parse().ok()?,
        ip_wrong: f[12].parse().ok()?,
        p99_us: f[16].parse().ok()?,
    })
}

/// Every bench table in a job's output, in order.
fn tables(output: &str) -> Vec<Table> {
    let mut out: Vec<Table> = Vec::new();
    for line in output.lines() {
        let line = line.trim_end();
        if line.starts_with("# dmlc-guest bench:") {
            out.push(Table {
                header: line.to_owned(),
                rows: Vec::new(),
                summary: String::new(),
            });
        } else if let Some(t) = out.last_mut() {
            if line.starts_with("# ok:") || line.starts_with("# WRONG") {
                t.summary = line.to_owned();
            } else if let Some(r) = row(line) {
                t.rows.push(r);
            }
        }
    }
    out
}

/// Checks a table's sizes and correctness; `what` names it in messages.
fn check(t: &Table, what: &str, output: &str) {
    let sizes: Vec<u64> = t.rows.iter().map(|r| r.size).collect();
    assert_eq!(sizes, SIZES, "{what}: sizes:\n{output}");
    for r in &t.rows {
        assert_eq!(
            (r.oop_wrong, r.ip_wrong),
            (0, 0),
            "{what}: wrong values at {} B:\n{output}",
            r.size
        );
        assert!(
            r.oop_us > 0.0 && r.ip_us > 0.0,
            "{what}: no time at {} B:\n{output}",
            r.size
        );
    }
    assert_eq!(
        t.summary,
        format!("# ok: {} size(s), #wrong total 0", SIZES.len()),
        "{what}: summary:\n{output}"
    );
}

fn ratio(tcp: f64, dev: f64) -> f64 {
    if dev > 0.0 {
        tcp / dev
    } else {
        f64::INFINITY
    }
}

/// The device tables and the TCP table side by side, with the ratios and
/// the goals.
fn comparison(devs: &[(&str, &Table)], tcp: &Table) -> String {
    let mut s = String::new();
    for (name, d) in devs {
        let _ = writeln!(s, "{name}: {}", d.header);
    }
    let _ = writeln!(s, "tcp: {}", tcp.header);
    let _ = writeln!(
        s,
        "p50 in us; x = TCP p50 / device p50; oop = out-of-place, ip = in-place"
    );
    let mut head = format!("{:>9} | {:>10} {:>10}", "size (B)", "tcp oop", "tcp ip");
    for (name, _) in devs {
        let _ = write!(head, " | {:>27}", format!("{name} oop (x), ip (x)"));
    }
    let _ = writeln!(s, "{head}");
    for (k, t) in tcp.rows.iter().enumerate() {
        let _ = write!(s, "{:>9} | {:>10.2} {:>10.2}", t.size, t.oop_us, t.ip_us);
        for (_, d) in devs {
            if let Some(d) = d.rows.get(k) {
                let _ = write!(
                    s,
                    " | {:>7.1} ({:>5.1}) {:>7.1} ({:>5.1})",
                    d.oop_us,
                    ratio(t.oop_us, d.oop_us),
                    d.ip_us,
                    ratio(t.ip_us, d.ip_us)
                );
            }
        }
        let _ = writeln!(s);
    }
    for (size, goal) in GOALS {
        let find = |tab: &Table| tab.rows.iter().find(|r| r.size == size).copied();
        let verdict = |r: f64| if r >= goal { "met" } else { "missed" };
        for (name, d) in devs {
            if let (Some(d), Some(t)) = (find(d), find(tcp)) {
                let (o, i) = (ratio(t.oop_us, d.oop_us), ratio(t.ip_us, d.ip_us));
                let _ = writeln!(
                    s,
                    "goal at {size} B (device p50 {goal}x lower), {name}: oop {o:.1}x ({}), ip {i:.1}x ({})",
                    verdict(o),
                    verdict(i)
                );
            }
        }
    }
    s
}

/// The runs of each VM's job, in order: what rank 0's header says, and the
/// command (the TCP run's peers and rank are added per VM).
const RUNS: [(&str, &str); 4] = [
    ("device poll", "--poll "),
    ("device interrupt", "--interrupt "),
    ("device hybrid", "--hybrid "),
    ("tcp", "tcp"),
];

#[test]
fn device_vs_tcp_between_two_vms() {
    let test = "device_vs_tcp_between_two_vms";
    let Some(env) = setup(test) else {
        return;
    };
    let backend = Backend::start(&env, "tcpdev", 2, &[]);
    let peers = format!("{}:{PORT},{}:{PORT}", vm_ip(0), vm_ip(1));
    let specs: Vec<VmSpec> = (0..2)
        .map(|r| {
            // Every run whatever the previous one did, then fail if one did.
            let mut job = String::from("ok=0; ");
            for (name, flag) in RUNS {
                let cmd = if flag == "tcp" {
                    format!("dmlc-guest {BENCH} --transport tcp --rank {r} --peers {peers}")
                } else {
                    guest(&format!("{flag}{BENCH}"))
                };
                let _ = write!(
                    job,
                    "{cmd}; s=$?; echo \"bench exit: {name} $s\"; [ $s -eq 0 ] || ok=1; "
                );
            }
            job.push_str("exit $ok");
            let mut spec = vm(job, &backend.socket(r));
            // The bench rotates 2 x LLC / N per direction through DMA
            // memory (16 MiB with TCG's 16 MiB L3): two pools and the
            // queues need more than the default 32 MiB of hugepages.
            spec.hugepages = 48;
            // For the interrupt run; the polling run keeps the binding and
            // ignores the interrupts.
            spec.bind = Some("uio_pci_generic".to_owned());
            spec
        })
        .collect();
    let opts = Options {
        net: true,
        timeout: Duration::from_secs(240),
        ..env.opts.clone()
    };
    let t = Instant::now();
    let mut vms = Vms::start(&env, &specs, &opts);
    let out = vms.wait_ok("device and TCP bench on 2 VMs");
    let elapsed = t.elapsed();
    for (r, o) in out.iter().enumerate() {
        for (name, _) in RUNS {
            assert!(
                o.output.contains(&format!("bench exit: {name} 0")),
                "vm {r}: {name} run failed:\n{}",
                o.output
            );
        }
    }
    // Only rank 0 prints tables; rank 1 ran the same loops.
    assert!(
        tables(&out[1].output).is_empty(),
        "rank 1 printed a table:\n{}",
        out[1].output
    );
    let text = &out[0].output;
    let tabs = tables(text);
    assert_eq!(tabs.len(), RUNS.len(), "rank 0: one table per run:\n{text}");
    let (poll, intr, hybrid, tcp) = (&tabs[0], &tabs[1], &tabs[2], &tabs[3]);
    for (tab, want) in [
        (
            poll,
            "transport virtio-pci (first 1af4:107f device), mode poll,",
        ),
        (
            intr,
            "transport virtio-pci (first 1af4:107f device), mode interrupt,",
        ),
        (
            hybrid,
            "transport virtio-pci (first 1af4:107f device), mode hybrid,",
        ),
        (tcp, "transport tcp,"),
    ] {
        assert!(tab.header.contains(want), "want {want:?}: {}", tab.header);
    }
    check(poll, "device poll", text);
    check(intr, "device interrupt", text);
    check(hybrid, "device hybrid", text);
    check(tcp, "tcp", text);
    progress(&format!(
        "{test}: 2 VMs in {elapsed:.1?} (boot {:.1?}, slowest job end {:.1?})\n{}",
        out.iter().map(|o| o.boot).max().unwrap_or_default(),
        out.iter().map(|o| o.total).max().unwrap_or_default(),
        comparison(
            &[("poll", poll), ("interrupt", intr), ("hybrid", hybrid)],
            tcp
        )
    ));
    // The device runs went through the backend: every collective of both
    // directions and sizes, and no error.
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics after the run: {e}"));
    let collectives = metric_sum(&m, "dmlc_collectives_total");
    let least = (3 * SIZES.len() * 2 * (50 + 5)) as f64;
    assert!(
        collectives >= least,
        "backend counted {collectives} collectives, the device runs make at least {least}:\n{m}"
    );
    assert_eq!(metric_sum(&m, "dmlc_errors_total"), 0.0, "errors:\n{m}");
}

mod parse {
    use super::*;

    const SAMPLE: &str = "\
# dmlc-guest bench: allreduce f32 sum, transport tcp, mode in-place communicator, N 2
#       size        count   type  redop  root      time    algbw    busbw  #wrong      time    algbw    busbw  #wrong       avg       min       max       p99    membw
           4            1    f32    sum    -1    430.12    0.000    0.000       0    420.00    0.000    0.000       3    440.00    400.00    900.00    880.00    0.000
# ok: 1 size(s), #wrong total 0
";

    #[test]
    fn reads_rows_and_summary() {
        let t = tables(SAMPLE);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].rows.len(), 1);
        let r = t[0].rows[0];
        assert_eq!((r.size, r.oop_wrong, r.ip_wrong), (4, 0, 3));
        assert_eq!((r.oop_us, r.ip_us, r.p99_us), (430.12, 420.0, 880.0));
        assert_eq!(t[0].summary, "# ok: 1 size(s), #wrong total 0");
    }
}
