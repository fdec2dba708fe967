//! Every collective, checked bitwise in every guest: `dmlc-guest selftest
//! --quick` on 2 VMs polling for completions (`--poll`) and on
//! 4 VMs sleeping on interrupts (uio_pci_generic), all sharing one backend.
//! Interrupts also keep 4 guests from spinning on 2 host cores: there the
//! polling run takes about 3 times as long.

use std::time::{Duration, Instant};

use dmlc_vm::{Options, VmSpec};

use crate::common::{guest, metric_sum, progress, setup, vm, Backend, Vms};

/// How the guests wait for completions: dmlc-guest's flag, and what the PCI
/// transport logs (at info level) when it opens the device that way.
struct Mode {
    flag: &'static str,
    log: &'static str,
}

const POLL: Mode = Mode {
    flag: "--poll",
    log: "polling, bus mastering tied to /dev/uio",
};

const INTERRUPT: Mode = Mode {
    flag: "--interrupt",
    log: "interrupts through /dev/uio",
};

/// Runs the quick self-test in `n` VMs at once and checks that each one
/// waited as `mode` says and passed as rank i of n, and that the backend
/// served the collectives.
fn selftest_group(test: &str, n: usize, mode: Mode, timeout: Duration) {
    let Some(env) = setup(test) else {
        return;
    };
    let backend = Backend::start(&env, &format!("st{n}"), n, &[]);
    let specs: Vec<VmSpec> = (0..n)
        .map(|r| {
            vm(
                guest(&format!("{} selftest --quick", mode.flag)),
                &backend.socket(r),
            )
            .env("RUST_LOG", "dmlc_driver=info")
        })
        .collect();
    let opts = Options {
        timeout,
        ..env.opts.clone()
    };
    let t = Instant::now();
    let mut vms = Vms::start(&env, &specs, &opts);
    let out = vms.wait_ok(&format!("selftest on {n} VMs"));
    let mut cases = Vec::new();
    let mut classic_sections = Vec::new();
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.output.contains(mode.log),
            "vm {r}: wait mode not reported ({}):\n{}",
            mode.log,
            o.output
        );
        let pass = o
            .output
            .lines()
            .find(|l| l.starts_with("selftest PASS: "))
            .unwrap_or_else(|| panic!("vm {r}: no PASS line:\n{}", o.output));
        assert!(
            pass.ends_with(&format!(", rank {r} of {n}")),
            "vm {r} is not rank {r} of {n}: {pass}"
        );
        let n_cases: u64 = pass["selftest PASS: ".len()..]
            .split(' ')
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("vm {r}: no case count in {pass}"));
        assert!(n_cases > 1000, "vm {r}: only {n_cases} cases: {pass}");
        cases.push(n_cases);
        // The classic part (5.X.6.1) is the same on every rank, line for
        // line; the communicator part (5.X.6.13) depends on the
        // communicators a rank is in, so it is checked to have run and
        // passed, not to have the same counts.
        let lines: Vec<&str> = o
            .output
            .lines()
            .skip_while(|l| !l.starts_with("# selftest:"))
            .skip(1)
            .take_while(|l| !l.starts_with("# communicators:") && !l.starts_with("selftest "))
            .collect();
        classic_sections.push(lines.join("\n"));
        for opcode in [
            "comm_split",
            "send/recv",
            "alltoallv",
            "gatherv",
            "scatterv",
        ] {
            assert!(
                o.output
                    .lines()
                    .any(|l| l.starts_with(opcode) && l.ends_with("PASS")),
                "vm {r}: no passing {opcode} line (communicators not tested?):\n{}",
                o.output
            );
        }
    }
    assert!(
        classic_sections.windows(2).all(|w| w[0] == w[1]),
        "the ranks' classic sections differ:\n{}",
        classic_sections.join("\n-----\n")
    );
    // Each classic case but the nops is one collective of the group.
    let collective_cases: u64 = classic_sections[0]
        .lines()
        .filter(|l| !l.starts_with("nop "))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words
                .iter()
                .position(|w| matches!(*w, "cases:" | "barriers"))?;
            words.get(at.checked_sub(1)?)?.parse::<u64>().ok()
        })
        .sum();
    progress(&format!(
        "{test}: {} cases on {n} VMs in {:.1?} (boot {:.1?}, slowest job end {:.1?})",
        cases[0],
        t.elapsed(),
        out.iter().map(|o| o.boot).max().unwrap_or_default(),
        out.iter().map(|o| o.total).max().unwrap_or_default(),
    ));
    let m = backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics after the run: {e}"));
    let collectives = metric_sum(&m, "dmlc_collectives_total");
    assert!(
        collectives >= collective_cases as f64,
        "backend counted {collectives} collectives for {collective_cases} cases that are \
         collectives:\n{m}"
    );
    // The communicator part makes messages larger than their receives on
    // purpose (TRUNCATE); nothing else may fail.
    let truncated: f64 = m
        .lines()
        .filter(|l| l.starts_with("dmlc_errors_total{") && l.contains("\"truncate\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        metric_sum(&m, "dmlc_errors_total") - truncated,
        0.0,
        "errors other than the truncations the self-test makes:\n{m}"
    );
}

#[test]
fn selftest_on_two_vms_polling() {
    selftest_group(
        "selftest_on_two_vms_polling",
        2,
        POLL,
        Duration::from_secs(240),
    );
}

#[test]
fn selftest_on_four_vms_with_interrupts() {
    selftest_group(
        "selftest_on_four_vms_with_interrupts",
        4,
        INTERRUPT,
        Duration::from_secs(420),
    );
}
