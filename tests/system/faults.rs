//! Failures a group must survive: a VM killed in the middle of a
//! collective, and the backend killed and started again.

use std::time::{Duration, Instant};

use dmlc_vm::{Options, VmSpec};

use crate::common::{
    console, guest, kill_qemu, metric, metric_sum, progress, setup, vm, wait_console, Backend, Vms,
};

/// `iter K ok` lines in a console.
fn ok_iters(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("iter ") && l.trim_end().ends_with(" ok"))
        .count()
}

fn metrics_of(backend: &Backend) -> String {
    backend
        .metrics()
        .unwrap_or_else(|e| panic!("metrics: {e}\n{}", backend.log_text()))
}

/// Three VMs run checked allreduces. Rank 2 stops after 20 and holds its
/// device; ranks 0 and 1 wait in allreduce 21 for it, and then its QEMU is
/// killed with SIGKILL. The survivors must get `peer lost` at once (not at
/// the backend's timeout), the backend must live on, and a new VM on the
/// dead VM's socket must join the survivors for 20 more allreduces.
#[test]
fn killed_vm_gives_peer_lost_and_a_new_vm_rejoins() {
    let test = "killed_vm_gives_peer_lost_and_a_new_vm_rejoins";
    let Some(env) = setup(test) else {
        return;
    };
    // A long collective timeout: only the lost member may end a collective.
    let mut backend = Backend::start(&env, "kill", 3, &["--timeout-ms", "200000"]);
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    // Interrupts: waiting guests leave the 2 host cores to the others.
    let allreduce = "--interrupt debug allreduce --count 4096";
    let survivors: Vec<VmSpec> = (0..2)
        .map(|r| {
            vm(
                guest(&format!("{allreduce} --iters 40 --retry-secs 200")),
                &backend.socket(r),
            )
        })
        .collect();
    let victim = vm(
        guest(&format!("{allreduce} --iters 20 --hold")),
        &backend.socket(2),
    );
    let t = Instant::now();
    let mut group = Vms::start(&env, &survivors, &opts);
    let doomed = Vms::start(&env, &[victim], &opts);

    let held = wait_console(&doomed, 0, Duration::from_secs(150), |c| {
        c.contains("\nholding")
    });
    assert!(held, "rank 2 did not finish 20 allreduces");
    // Ranks 0 and 1 post allreduce 21 right after their 20th.
    for i in 0..2 {
        assert!(
            wait_console(&group, i, Duration::from_secs(30), |c| ok_iters(c) == 20),
            "rank {i} did not finish 20 allreduces:\n{}",
            console(&group, i)
        );
    }
    // Wait until the backend holds their requests for allreduce 21: 20
    // allreduces of 3 members, and 2 more.
    let waiting = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let m = metrics_of(&backend);
        let posted = metric(&m, "dmlc_requests_total{opcode=\"allreduce\"}").unwrap_or(0.0);
        if posted >= 62.0 {
            break m;
        }
        assert!(
            Instant::now() < waiting,
            "ranks 0 and 1 did not post allreduce 21:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        metric(&before, "dmlc_members_connected"),
        Some(3.0),
        "{before}"
    );
    let generation = metric(&before, "dmlc_generation").expect("generation metric");

    assert_eq!(kill_qemu(&env.qemu, &doomed), 1, "kill rank 2's QEMU");
    let killed = Instant::now();
    for i in 0..2 {
        let told = wait_console(&group, i, Duration::from_secs(60), |c| {
            c.contains("iter 20 error: peer lost")
        });
        assert!(told, "rank {i} was not told that rank 2 was lost");
    }
    let notice = killed.elapsed();
    progress(&format!(
        "{test}: peer lost seen {notice:.1?} after the kill"
    ));
    // Far below the 200 s collective timeout: the loss itself failed it.
    assert!(
        notice < Duration::from_secs(30),
        "peer lost after {notice:?}"
    );
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    let after = metrics_of(&backend);
    assert!(
        metric(&after, "dmlc_generation").is_some_and(|g| g > generation),
        "generation did not change:\n{after}"
    );
    assert!(
        metric(&after, "dmlc_errors_total{status=\"peer_lost\"}").is_some_and(|n| n >= 2.0),
        "peer_lost errors:\n{after}"
    );
    assert!(
        backend.wait_log(
            "rank 2: frontend disconnected, member lost",
            1,
            Duration::from_secs(5)
        ),
        "{}",
        backend.log_text()
    );
    drop(doomed);

    // A new VM takes rank 2's socket; its 20 allreduces are the survivors'
    // 21st to 40th.
    let heir = vm(
        guest(&format!("{allreduce} --iters 20")),
        &backend.socket(2),
    );
    let mut heir = Vms::start(&env, &[heir], &opts);
    let heir_out = heir.wait_ok("new rank 2");
    let out = group.wait_ok("survivors");
    for (i, o) in out.iter().enumerate() {
        assert_eq!(ok_iters(&o.output), 40, "rank {i}:\n{}", o.output);
    }
    assert_eq!(ok_iters(&heir_out[0].output), 20, "{}", heir_out[0].output);
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    assert!(
        backend.wait_log("rank 2: frontend connected", 2, Duration::from_secs(1)),
        "{}",
        backend.log_text()
    );
    progress(&format!("{test}: done in {:.1?}", t.elapsed()));
}

/// Two VMs run allreduces in a loop; the backend is killed with SIGKILL in
/// the middle and started again with the same group id. QEMU reconnects
/// (chardev `reconnect-ms`) and hands the queues to the new backend; the
/// guests' driver sees the same group and goes on without noticing, every
/// result right.
#[test]
fn backend_restart_with_the_same_group_id_is_transparent() {
    let test = "backend_restart_with_the_same_group_id_is_transparent";
    let Some(env) = setup(test) else {
        return;
    };
    let mut backend = Backend::start(&env, "restart", 2, &["--group-id", "0x5ca1ab1e"]);
    let opts = Options {
        timeout: Duration::from_secs(240),
        ..env.opts.clone()
    };
    let iters = 2000;
    let specs: Vec<VmSpec> = (0..2)
        .map(|r| {
            vm(
                guest(&format!(
                    "debug allreduce --count 1024 --iters {iters} --retry-secs 60"
                )),
                &backend.socket(r),
            )
        })
        .collect();
    let t = Instant::now();
    let mut group = Vms::start(&env, &specs, &opts);
    for i in 0..2 {
        assert!(
            wait_console(&group, i, Duration::from_secs(150), |c| ok_iters(c) >= 50),
            "rank {i} did not reach 50 allreduces"
        );
    }
    backend.kill();
    let done_before = ok_iters(&console(&group, 0));
    progress(&format!(
        "{test}: backend killed after {done_before} allreduces"
    ));
    assert!(done_before < iters, "the loop ended before the kill");
    std::thread::sleep(Duration::from_secs(2));
    // Nothing completes while the backend is away.
    let stalled = ok_iters(&console(&group, 0));
    backend.restart();
    for r in 0..2 {
        assert!(
            backend.wait_log(
                &format!("rank {r}: frontend connected"),
                1,
                Duration::from_secs(30)
            ),
            "QEMU of rank {r} did not reconnect:\n{}",
            backend.log_text()
        );
    }
    let out = group.wait_ok("guests");
    for (i, o) in out.iter().enumerate() {
        assert_eq!(ok_iters(&o.output), iters, "rank {i}:\n{}", o.output);
        // Transparent: not even a retried failure.
        assert!(!o.output.contains(" error: "), "rank {i}:\n{}", o.output);
    }
    let m = metrics_of(&backend);
    let served = metric_sum(&m, "dmlc_collectives_total");
    assert!(
        served >= (iters - stalled) as f64,
        "the new backend served {served} collectives, {} were left:\n{m}",
        iters - stalled
    );
    progress(&format!(
        "{test}: {iters} allreduces, {served} after the restart, in {:.1?}",
        t.elapsed()
    ));
}

/// Two VMs run allreduces in a loop that reopens the device when it fails
/// (`pci_probe --recover`); the backend is killed with SIGKILL and started
/// again as a new group (a new group id). QEMU reconnects and hands over
/// its rings; the new group completes the request each guest had in flight
/// with RESET (or the driver finds it dropped first), each guest sees the
/// group id change, reopens the device, and the allreduces work again.
#[test]
fn backend_restart_as_a_new_group_and_the_guests_reopen() {
    let test = "backend_restart_as_a_new_group_and_the_guests_reopen";
    let Some(env) = setup(test) else {
        return;
    };
    let mut backend = Backend::start(&env, "regroup", 2, &[]);
    let opts = Options {
        timeout: Duration::from_secs(240),
        ..env.opts.clone()
    };
    // A few checks and 20 latency runs, then 25 s of allreduces that reopen
    // the device on failure.
    let specs: Vec<VmSpec> = (0..2)
        .map(|r| vm("pci_probe --iters 20 --recover 25", &backend.socket(r)))
        .collect();
    let t = Instant::now();
    let mut group = Vms::start(&env, &specs, &opts);
    for i in 0..2 {
        let looping = wait_console(&group, i, Duration::from_secs(150), |c| {
            c.contains("allreduce 4 B latency")
        });
        assert!(looping, "rank {i} did not reach its recover loop");
    }
    std::thread::sleep(Duration::from_secs(3));
    let old = metrics_of(&backend);
    assert!(
        metric_sum(&old, "dmlc_collectives_total") > 0.0,
        "no collectives before the kill:\n{old}"
    );
    backend.kill();
    std::thread::sleep(Duration::from_secs(2));
    backend.restart();
    let out = group.wait_ok("guests");
    for (i, o) in out.iter().enumerate() {
        assert!(
            o.output.contains("recover: device failed") && o.output.contains("group id changed"),
            "rank {i} did not see the new group:\n{}",
            o.output
        );
        let summary = o
            .output
            .lines()
            .find(|l| l.starts_with("recover: ") && l.ends_with(" reopens"))
            .unwrap_or_else(|| panic!("rank {i}: no recover summary:\n{}", o.output));
        assert!(!summary.ends_with(" 0 reopens"), "rank {i}: {summary}");
        assert!(o.output.contains("PCI-PROBE OK"), "rank {i}:\n{}", o.output);
    }
    let m = metrics_of(&backend);
    let served = metric_sum(&m, "dmlc_collectives_total");
    assert!(served > 0.0, "the new backend served nothing:\n{m}");
    progress(&format!(
        "{test}: {served} allreduces served by the new group, in {:.1?}",
        t.elapsed()
    ));
}

/// Spec 5.X.6.13.3, "Lost members" (DEV-COMM-5, DEV-COMM-6), through QEMU:
/// three VMs run `debug comm-loss --victim 2`. Each splits communicator 0
/// into A = {0, 2} and B = {0, 1} and runs a checked allreduce on each it
/// is in; rank 2 then holds its device while ranks 0 and 1 post requests
/// only it could finish (rank 0: a receive from it and an allreduce on A;
/// rank 1: a send to it and a receive from any source on communicator 0;
/// both: an allreduce on communicator 0). Once the backend holds them all
/// (its metrics), rank 2's QEMU is killed. Every one of them must fail
/// with PEER_LOST naming it, `peer` its rank in the request's
/// communicator (1 in A, 2 in communicator 0), well before the backend's
/// timeout; B then completes a checked allreduce, a new request on A fails
/// at once (revoked), and A's and B's comm_free succeed.
#[test]
fn killed_vm_fails_every_communicator_it_was_in_and_spares_the_others() {
    let test = "killed_vm_fails_every_communicator_it_was_in_and_spares_the_others";
    let Some(env) = setup(test) else {
        return;
    };
    // A long collective timeout: only the loss may end the requests.
    let mut backend = Backend::start(&env, "commloss", 3, &["--timeout-ms", "200000"]);
    let opts = Options {
        timeout: Duration::from_secs(300),
        ..env.opts.clone()
    };
    // Interrupts: waiting guests leave the 2 host cores to the others.
    let command = guest("--interrupt debug comm-loss --victim 2 --count 1024");
    let survivors: Vec<VmSpec> = (0..2).map(|r| vm(&command, &backend.socket(r))).collect();
    let victim = vm(&command, &backend.socket(2));
    let t = Instant::now();
    let mut group = Vms::start(&env, &survivors, &opts);
    let doomed = Vms::start(&env, &[victim], &opts);

    let held = wait_console(&doomed, 0, Duration::from_secs(150), |c| {
        c.contains("\nholding")
    });
    assert!(
        held,
        "rank 2 did not reach `holding`:\n{}",
        console(&doomed, 0)
    );
    for i in 0..2 {
        assert!(
            wait_console(&group, i, Duration::from_secs(60), |c| c
                .contains("\nposted ")),
            "rank {i} did not post its requests:\n{}",
            console(&group, i)
        );
    }
    // Until the loss the backend holds them: before, 2 allreduces on A and
    // 2 on B; then rank 0's allreduce on A, both allreduces on
    // communicator 0, two receives and one send.
    let taken = |m: &str, op: &str| {
        metric(m, &format!("dmlc_requests_total{{opcode=\"{op}\"}}")).unwrap_or(0.0)
    };
    let waiting = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let m = metrics_of(&backend);
        if taken(&m, "allreduce") >= 7.0 && taken(&m, "recv") >= 2.0 && taken(&m, "send") >= 1.0 {
            break m;
        }
        assert!(
            Instant::now() < waiting,
            "the backend did not take the survivors' requests:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        metric(&before, "dmlc_members_connected"),
        Some(3.0),
        "{before}"
    );
    assert_eq!(
        metric(&before, "dmlc_errors_total{status=\"peer_lost\"}"),
        Some(0.0),
        "{before}"
    );
    for i in 0..2 {
        let c = console(&group, i);
        assert!(
            !c.contains("\nlost "),
            "rank {i}: ended before the loss:\n{c}"
        );
    }
    let generation = metric(&before, "dmlc_generation").expect("generation metric");

    // What each survivor must print: `peer` is rank 2's rank in the
    // request's communicator.
    let lost: [&[&str]; 2] = [
        &[
            "lost recv A from rank 2: peer lost peer=1",
            "lost allreduce A: peer lost peer=1",
            "lost allreduce comm 0: peer lost peer=2",
        ],
        &[
            "lost send comm 0 to rank 2: peer lost peer=2",
            "lost recv any comm 0: peer lost peer=2",
            "lost allreduce comm 0: peer lost peer=2",
        ],
    ];
    assert_eq!(kill_qemu(&env.qemu, &doomed), 1, "kill rank 2's QEMU");
    let killed = Instant::now();
    for (i, lines) in lost.iter().enumerate() {
        let told = wait_console(&group, i, Duration::from_secs(60), |c| {
            lines.iter().all(|l| c.contains(l)) || c.contains("\nWRONG ")
        });
        assert!(
            told,
            "rank {i} was not told of every loss:\n{}",
            console(&group, i)
        );
    }
    let notice = killed.elapsed();
    progress(&format!(
        "{test}: all 6 held requests failed with peer lost {notice:.1?} after the kill"
    ));
    for i in 0..2 {
        let c = console(&group, i);
        assert!(!c.contains("\nWRONG "), "rank {i}:\n{c}");
    }
    // The bound is 5 s in TCG VMs; a loaded 2-core CI box gets
    // more. Far below the 200 s timeout either way: the loss ended them.
    assert!(
        notice < Duration::from_secs(20),
        "peer lost after {notice:?}"
    );

    let out = group.wait_ok("survivors");
    for (i, o) in out.iter().enumerate() {
        let mut want = vec!["B after loss: ok", "B freed: ok", "comm-loss ok"];
        if i == 0 {
            want.extend(["A revoked: peer lost peer=1 after ", "A freed: ok"]);
        }
        for w in want {
            assert!(
                o.output.lines().any(|l| l.trim_end().starts_with(w)),
                "rank {i}: no line {w:?}:\n{}",
                o.output
            );
        }
        assert!(!o.output.contains("WRONG "), "rank {i}:\n{}", o.output);
    }
    assert!(backend.alive(), "backend died:\n{}", backend.log_text());
    let after = metrics_of(&backend);
    assert!(
        metric(&after, "dmlc_generation").is_some_and(|g| g > generation),
        "generation did not change:\n{after}"
    );
    // The six requests held, and the one on the revoked A.
    assert!(
        metric(&after, "dmlc_errors_total{status=\"peer_lost\"}").is_some_and(|n| n >= 7.0),
        "peer_lost errors:\n{after}"
    );
    assert!(
        backend.wait_log(
            "rank 2: frontend disconnected, member lost",
            1,
            Duration::from_secs(5)
        ),
        "{}",
        backend.log_text()
    );
    progress(&format!("{test}: done in {:.1?}", t.elapsed()));
}
