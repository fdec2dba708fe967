//! dmlc-soak: a soak test of the virtio-dmlc backend. Runs many checked
//! collectives across host ranks on several daemons at once and checks
//! that nothing is lost, duplicated or wrong and that the daemons' memory
//! and fds do not grow. See `dmlc-soak --help`.

mod args;
mod daemon;
mod pattern;
mod rank;
mod report;

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use dmlc_cli_support::error_text;
use serde::Serialize;
use thiserror::Error;

use crate::args::{Args, ArgsError, QUEUE_SIZE};
use crate::daemon::{Daemon, DaemonError, DaemonSpec};
use crate::pattern::Kind;
use crate::rank::{
    comm_buf_elems, Global, GroupShared, Kill, KillWhat, Plan, RankReport, INTERRUPTED,
};
use crate::report::{DaemonKill, GroupResult, Limits};

#[derive(Debug, Error)]
enum SoakError {
    #[error(transparent)]
    Args(#[from] ArgsError),
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    #[error("starting rank thread {0} failed")]
    Thread(String, #[source] std::io::Error),
    #[error("writing {0} failed")]
    Json(PathBuf, #[source] std::io::Error),
    #[error("interrupted")]
    Interrupted,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("dmlc-soak: FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::from(if matches!(e, SoakError::Args(_)) {
                2
            } else {
                1
            })
        }
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is
        // async-signal-safe; the cast is the form signal(2) takes.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
}

fn group_name(g: usize) -> String {
    char::from(b'A' + g as u8).to_string()
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Device memory per rank: the buffers, the rings and their slots, and
/// some room for the allocator's alignment.
fn dma_bytes(args: &Args) -> usize {
    let large = if args.large > 0 {
        2 * args.large_bytes as usize
    } else {
        0
    };
    let small = 2 * args.window as usize * round_up(args.small_bytes as usize, 64);
    let comm = if args.comm_ops > 0 {
        let elems = comm_buf_elems(args.ranks, (args.small_bytes / 8) as usize);
        2 * round_up(elems * 8, 64)
    } else {
        0
    };
    round_up(large + small + comm + (1 << 20), 1 << 20)
}

fn plan_of(args: &Args) -> Plan {
    let mut plan = Plan {
        groups: args.groups,
        ranks: args.ranks,
        small: args.small,
        small_elems: (args.small_bytes / 8) as usize,
        window: args.window as usize,
        large: args.large,
        large_elems: (args.large_bytes / 8) as usize,
        comm_ops: args.comm_ops,
        rounds: args.rounds,
        poll: args.poll,
        kill: None,
        wait_limit: Duration::from_millis(args.timeout_ms.saturating_mul(2)),
        dma_bytes: dma_bytes(args),
        queue_size: QUEUE_SIZE,
    };
    let what = if args.kill_one {
        Some(KillWhat::Rank)
    } else if args.kill_daemon {
        Some(KillWhat::Daemon)
    } else {
        None
    };
    if let Some(what) = what {
        // The last rank of group B, in the middle of the middle round.
        let r = plan.range(Kind::Small, args.rounds / 2);
        plan.kill = Some(Kill {
            what,
            group: 1,
            rank: args.ranks - 1,
            seq: r.start + (r.end - r.start) / 2,
        });
    }
    plan
}

/// What the progress line says once the kill happened.
fn kill_label(plan: &Plan) -> &'static str {
    match plan.kill.map(|k| k.what) {
        Some(KillWhat::Daemon) => "group B's daemon killed",
        _ => "group B's rank closed",
    }
}

/// The daemon's exit status if it has exited; reaps it under the group's
/// lock, so that --kill-daemon never signals a reaped (reusable) pid.
fn reap(d: &mut Daemon, sh: &GroupShared) -> Option<ExitStatus> {
    let mut reaped = sh.reaped.lock().unwrap_or_else(|e| e.into_inner());
    let st = d.exited();
    *reaped |= st.is_some();
    st
}

/// True if `g`'s daemon exiting is the --kill-daemon kill, not a failure.
fn expected_exit(plan: &Plan, sh: &GroupShared) -> bool {
    sh.killed_at().is_some()
        && plan
            .kill
            .is_some_and(|k| k.what == KillWhat::Daemon && k.group == sh.index)
}

/// The options, as the JSON's `config`.
#[derive(Serialize)]
struct ConfigJson {
    groups: u32,
    ranks: u32,
    small: u64,
    small_bytes: u64,
    window: u32,
    large: u64,
    large_bytes: u64,
    comm_ops: u64,
    rounds: u32,
    poll: bool,
    kill_one: bool,
    kill_daemon: bool,
    max_rss_growth: u64,
    max_stall_ms: u64,
    timeout_ms: u64,
    dma_bytes: usize,
}

fn config_json(args: &Args, plan: &Plan) -> ConfigJson {
    ConfigJson {
        groups: args.groups,
        ranks: args.ranks,
        small: args.small,
        small_bytes: args.small_bytes,
        window: args.window,
        large: args.large,
        large_bytes: args.large_bytes,
        comm_ops: args.comm_ops,
        rounds: args.rounds,
        poll: args.poll,
        kill_one: args.kill_one,
        kill_daemon: args.kill_daemon,
        max_rss_growth: args.max_rss_growth,
        max_stall_ms: args.max_stall_ms,
        timeout_ms: args.timeout_ms,
        dma_bytes: plan.dma_bytes,
    }
}

fn rate(n: u64, prev: u64, dt: f64) -> String {
    let r = n.saturating_sub(prev) as f64 / dt;
    if r >= 1e3 {
        format!("{:.1}k/s", r / 1e3)
    } else {
        format!("{r:.1}/s")
    }
}

fn run(args: &Args) -> Result<bool, SoakError> {
    args.validate()?;
    let backend = daemon::backend_path(args.backend.as_deref())?;
    install_signal_handlers();
    let plan = plan_of(args);
    println!(
        "dmlc-soak: {} groups x {} ranks, {} small of {} B (window {}), {} large of {} B, \
         {} communicator cycles per round, {} rounds, {} mode{}; daemon {}",
        args.groups,
        args.ranks,
        args.small,
        args.small_bytes,
        args.window,
        args.large,
        args.large_bytes,
        args.comm_ops,
        args.rounds,
        if args.poll { "poll" } else { "interrupt" },
        args.kill_flag().map_or(String::new(), |f| format!(", {f}")),
        backend.display()
    );
    // Declared before the daemons so it is removed after they stop.
    let dir = daemon::temp_dir()?;
    let id_base = u64::from(std::process::id()) << 16 | 0xd000;
    let mut daemons = Vec::new();
    for g in 0..args.groups as usize {
        let name = group_name(g);
        daemons.push(Daemon::start(&DaemonSpec {
            binary: &backend,
            group: &name,
            dir: dir.path(),
            ranks: args.ranks,
            group_id: id_base + g as u64,
            timeout_ms: args.timeout_ms,
            extra: &args.backend_args,
        })?);
    }
    let shared: Vec<GroupShared> = daemons
        .iter()
        .enumerate()
        .map(|(g, d)| GroupShared::new(g, group_name(g), d.pid()))
        .collect();
    let global = Global::default();
    let started = Instant::now();
    let mut daemon_exit: Vec<Option<ExitStatus>> = vec![None; daemons.len()];

    let reports: Vec<Vec<RankReport>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (g, d) in daemons.iter().enumerate() {
            let mut group = Vec::new();
            for r in 0..args.ranks {
                let (plan, sh, global, socket) = (&plan, &shared[g], &global, d.socket(r));
                let name = format!("{}{r}", group_name(g));
                let h = std::thread::Builder::new()
                    .name(name.clone())
                    .spawn_scoped(s, move || rank::run(plan, sh, global, r, &socket))
                    .map_err(|e| SoakError::Thread(name, e));
                match h {
                    Ok(h) => group.push(h),
                    Err(e) => {
                        global.abort.store(true, Ordering::SeqCst);
                        // Let the ones started see the abort and return.
                        for _ in 0..(args.ranks * args.groups) {
                            global.opened.arrive();
                        }
                        return Err(e);
                    }
                }
            }
            handles.push(group);
        }
        // Progress, and a daemon that dies stops the run.
        let tick = Duration::from_millis(100);
        let every = Duration::from_secs(args.progress_secs);
        let mut last = Instant::now();
        let mut prev: Vec<(u64, u64)> = vec![(0, 0); shared.len()];
        let comm_total = args.comm_ops * u64::from(args.rounds);
        while !handles.iter().flatten().all(|h| h.is_finished()) {
            std::thread::sleep(tick);
            for (g, d) in daemons.iter_mut().enumerate() {
                if daemon_exit[g].is_none() {
                    if let Some(st) = reap(d, &shared[g]) {
                        daemon_exit[g] = Some(st);
                        // After --kill-daemon the ranks must find out
                        // by themselves: that is what is measured.
                        if !expected_exit(&plan, &shared[g]) {
                            eprintln!(
                                "dmlc-soak: the daemon of group {} exited ({st})",
                                group_name(g)
                            );
                            shared[g].abort.store(true, Ordering::SeqCst);
                        }
                    }
                }
            }
            if args.progress_secs > 0 && last.elapsed() >= every {
                let dt = last.elapsed().as_secs_f64();
                last = Instant::now();
                let mut line = format!("[{:>5.0} s]", started.elapsed().as_secs_f64());
                for (g, sh) in shared.iter().enumerate() {
                    let (sm, lg) = (
                        sh.small_done.load(Ordering::Relaxed),
                        sh.large_done.load(Ordering::Relaxed),
                    );
                    line.push_str(&format!(
                        " {}: small {sm}/{} ({}), large {lg}/{} ({}), comm {}/{comm_total};",
                        sh.name,
                        args.small,
                        rate(sm, prev[g].0, dt),
                        args.large,
                        rate(lg, prev[g].1, dt),
                        sh.comm_done.load(Ordering::Relaxed)
                    ));
                    prev[g] = (sm, lg);
                }
                if sh_killed(&shared) {
                    line.push_str(&format!(" ({})", kill_label(&plan)));
                }
                println!("{}", line.trim_end_matches(';'));
            }
        }
        Ok(handles
            .into_iter()
            .map(|group| {
                group
                    .into_iter()
                    .enumerate()
                    .map(|(r, h)| {
                        h.join().unwrap_or_else(|_| RankReport {
                            rank: r as u32,
                            messages: vec![format!("rank {r}: the thread panicked")],
                            lost: 1,
                            ..Default::default()
                        })
                    })
                    .collect()
            })
            .collect())
    })?;
    let wall = started.elapsed();
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err(SoakError::Interrupted);
    }
    // A daemon may have exited since the last look; the killed one may
    // take a moment to be gone.
    for (g, d) in daemons.iter_mut().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(2);
        while daemon_exit[g].is_none() {
            daemon_exit[g] = reap(d, &shared[g]);
            if !expected_exit(&plan, &shared[g]) || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    let limits = Limits {
        max_rss_growth: args.max_rss_growth,
        max_stall: Duration::from_millis(args.max_stall_ms),
    };
    let results: Vec<_> = reports
        .into_iter()
        .zip(shared)
        .zip(daemon_exit)
        .map(|((ranks, sh), exit)| {
            let killed = sh.killed_at().is_some();
            let kill = plan.kill.filter(|k| k.group == sh.index && killed);
            let victim = kill.is_some_and(|k| k.what == KillWhat::Rank);
            let daemon_kill = kill
                .filter(|k| k.what == KillWhat::Daemon)
                .map(|k| DaemonKill {
                    round: args.rounds / 2,
                    seq: k.seq,
                    exit: exit.map(|st| (st.to_string(), st.signal())),
                });
            // The killed daemon's exit is judged as part of the kill.
            let exit = exit.filter(|_| daemon_kill.is_none());
            let g = GroupResult {
                name: sh.name,
                group_id: id_base + sh.index as u64,
                daemon_pid: sh.daemon_pid,
                ranks,
                samples: sh.samples.into_inner().unwrap_or_else(|e| e.into_inner()),
                rounds: sh.rounds.into_inner().unwrap_or_else(|e| e.into_inner()),
                daemon_exit: exit.map(|st| st.to_string()),
                victim,
                daemon_kill,
            };
            let f = report::evaluate(&plan, &limits, &g);
            (g, f)
        })
        .collect();
    let mut passed = results.iter().all(|(_, f)| f.passed());
    if args.kill_one && !results.iter().any(|(g, _)| g.victim) {
        passed = false;
        eprintln!("dmlc-soak: --kill-one did not close a rank");
    }
    if args.kill_daemon && !results.iter().any(|(g, _)| g.daemon_kill.is_some()) {
        passed = false;
        eprintln!("dmlc-soak: --kill-daemon did not kill a daemon");
    }
    println!("\nfinished in {:.1} s", wall.as_secs_f64());
    print!("{}", report::table(&results));
    print!(
        "{}",
        report::details(
            &results,
            plan.kill
                .is_some()
                .then(|| (args.rounds / 2, kill_label(&plan)))
        )
    );
    if let Some(path) = &args.json {
        let text = report::json(&config_json(args, &plan), wall, passed, &results);
        std::fs::write(path, text).map_err(|e| SoakError::Json(path.clone(), e))?;
    }
    println!("dmlc-soak: {}", if passed { "PASSED" } else { "FAILED" });
    drop(daemons);
    drop(dir);
    Ok(passed)
}

fn sh_killed(shared: &[GroupShared]) -> bool {
    shared.iter().any(|s| s.killed_at().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_memory_fits_the_buffers() {
        let a = Args::try_parse_from(["dmlc-soak"]).unwrap();
        assert!(dma_bytes(&a) >= 32 << 20);
        let a = Args::try_parse_from(["dmlc-soak", "--large", "0"]).unwrap();
        assert_eq!(dma_bytes(&a), 2 << 20);
    }

    #[test]
    fn kill_one_picks_the_middle_of_group_b() {
        let a = Args::try_parse_from(["dmlc-soak", "--kill-one", "--small", "2000"]).unwrap();
        let p = plan_of(&a);
        let want = Kill {
            what: KillWhat::Rank,
            group: 1,
            rank: 3,
            seq: 1050,
        };
        assert_eq!(p.kill, Some(want));
        let a = Args::try_parse_from(["dmlc-soak", "--kill-daemon", "--small", "2000"]).unwrap();
        let p = plan_of(&a);
        assert_eq!(
            p.kill,
            Some(Kill {
                what: KillWhat::Daemon,
                ..want
            })
        );
        assert_eq!(
            plan_of(&Args::try_parse_from(["dmlc-soak"]).unwrap()).kill,
            None
        );
    }
}
