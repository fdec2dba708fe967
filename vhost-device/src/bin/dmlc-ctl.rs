//! dmlc-ctl: sends one request to a vhost-device-dmlc control socket
//! (`--control-socket`) and prints the answer.
//!
//! ```text
//! dmlc-ctl --socket PATH state
//! dmlc-ctl --socket PATH delay 1 2000     # rank 1 arrives 2 ms late
//! dmlc-ctl --socket PATH load ring.toml   # a new timing configuration
//! dmlc-ctl --socket PATH trace > trace.json
//! dmlc-ctl --socket PATH summary 1000     # the slowest member per second
//! dmlc-ctl --socket PATH freeze --at 40    # hold collective 40 of queue 0
//! dmlc-ctl --socket PATH freeze --on-error # hold instead of failing
//! dmlc-ctl --socket PATH inspect           # the held collective, per rank
//! dmlc-ctl --socket PATH snapshot /tmp/s   # save every VM of the frozen job
//! dmlc-ctl --socket PATH thaw              # resume the VMs, run it
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// Live control of a vhost-device-dmlc daemon started with
/// --control-socket: state, metrics, trace, dump, summary [WINDOW_MS],
/// delay RANK US, load FILE, freeze, frozen, inspect, thaw.
///
/// Freezing (docs/debugging.md): `freeze --at SEQ [--queue Q]` (collective
/// SEQ of queue Q, default 0, of communicator 0), `freeze --tag T` (the
/// first collective whose requests carry tag T) or `freeze --on-error`
/// (any collective about to fail with MISMATCH, TIMEOUT, NONFINITE or, for
/// the members that remain, PEER_LOST)
/// holds that collective once every member has arrived and before any of
/// its data moves; `dmlc-qemu` then stops every VM. `inspect` prints the
/// held collective rank by rank (`--json`: as the daemon sends it);
/// `thaw` resumes the VMs and runs it; `freeze --off` disarms. `snapshot
/// DIR` has the launcher save every VM of the frozen job into DIR and waits
/// until it has; `dmlc-qemu restore DIR` continues the job from there.
#[derive(Debug, Parser)]
#[command(name = "dmlc-ctl", version)]
struct Args {
    /// The daemon's control socket (its --control-socket).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,

    /// `inspect` and `frozen`: print the daemon's JSON instead of a table.
    #[arg(long)]
    json: bool,

    /// The request and its arguments: state | metrics | trace | dump |
    /// summary [WINDOW_MS] | delay RANK US | load FILE | freeze (--at SEQ
    /// [--queue Q] | --tag T | --on-error | --off) | frozen | inspect | thaw
    /// | snapshot DIR.
    #[arg(value_name = "REQUEST", required = true, num_args = 1.., allow_hyphen_values = true,
          trailing_var_arg = true)]
    request: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(body) => {
            let shown = match args.request.first().map(String::as_str) {
                Some("inspect") if !args.json => render_inspect(&body),
                _ => body,
            };
            print!("{shown}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dmlc-ctl: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<String, String> {
    let ask = |line: &str| {
        dmlc_cli_support::daemon::control_request(&args.socket, line, Duration::from_secs(30))
    };
    if let [verb, dir] = args.request.as_slice() {
        if verb == "snapshot" {
            // The daemon's own working directory is not ours.
            let dir = std::path::absolute(dir)
                .map_err(|e| format!("{dir}: {e}"))?
                .display()
                .to_string();
            let asked = ask(&format!("snapshot {dir}"))?;
            eprint!("{asked}");
            return wait_for_snapshot(&ask, &dir);
        }
    }
    ask(&args.request.join(" "))
}

/// Waits until the launcher has saved the snapshot into `dir` (it says so
/// through the daemon's `frozen`).
fn wait_for_snapshot(
    ask: &dyn Fn(&str) -> Result<String, String>,
    dir: &str,
) -> Result<String, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(900);
    loop {
        let state: serde_json::Value =
            serde_json::from_str(&ask("frozen")?).map_err(|e| e.to_string())?;
        let s = &state["held"]["snapshot"];
        match s["state"].as_str() {
            Some("done") => {
                return Ok(format!(
                    "snapshot saved in {dir}\nrestore: dmlc-qemu restore {dir}\n"
                ))
            }
            Some("failed") => {
                return Err(format!(
                    "the snapshot failed: {}",
                    s["error"].as_str().unwrap_or("no reason given")
                ))
            }
            Some(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Some(_) => {
                return Err("no snapshot after 15 minutes: is a launcher following the \
                                   freeze (dmlc-qemu submit)?"
                    .into())
            }
            None => return Err("the freeze ended before the snapshot was saved".into()),
        }
    }
}

/// The daemon's `inspect` JSON as a table, one rank per line (the JSON
/// itself if it cannot be read as one).
fn render_inspect(body: &str) -> String {
    let Ok(j) = serde_json::from_str::<serde_json::Value>(body) else {
        return body.to_owned();
    };
    // Display of a JSON value ignores width: every cell goes through text.
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "-".to_owned(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    // Extremes of a float input in 5 significant digits (the JSON has all).
    let short = |v: &serde_json::Value| match v.as_str().map(str::parse::<f64>) {
        Some(Ok(x)) if v.as_str().is_some_and(|s| s.contains('e')) => format!("{x:.4e}"),
        _ => text(v),
    };
    let mut out = format!(
        "freeze {} ({}, held {:.1} s): {}\ncollective: communicator {}, queue {}, sequence {}\n",
        j["id"],
        text(&j["phase"]),
        j["held_ms"].as_f64().unwrap_or(0.0) / 1e3,
        text(&j["reason"]),
        j["comm"],
        j["queue"],
        j["seq"]
    );
    out +=
        &format!(
        "{:>4} {:>11} {:<14} {:<5} {:<4} {:>10} {:>6} {:>10} {:>12} {:>12} {:>6} {:>6} {:>10}\n",
        "rank", "arrived_ms", "opcode", "dtype", "op", "count", "tag", "elements", "min", "max",
        "nan", "inf", "first_bad"
    );
    let mut last = None;
    for m in j["members"].as_array().into_iter().flatten() {
        if m["arrived"] != serde_json::Value::Bool(true) {
            let what = if m["lost"] == serde_json::Value::Bool(true) {
                "lost"
            } else {
                "not arrived"
            };
            out += &format!("{:>4} ({what})\n", text(&m["rank"]));
            continue;
        }
        if m["last"] == serde_json::Value::Bool(true) {
            last = Some(m["rank"].clone());
        }
        let (h, i) = (&m["header"], &m["input"]);
        out += &format!(
            "{:>4} {:>11.3} {:<14} {:<5} {:<4} {:>10} {:>6} {:>10} {:>12} {:>12} {:>6} {:>6} {:>10}\n",
            text(&m["rank"]),
            m["arrived_ms_after_first"].as_f64().unwrap_or(0.0),
            text(&h["opcode"]),
            text(&h["dtype"]),
            text(&h["op"]),
            text(&h["count"]),
            text(&h["tag"]),
            text(&i["elements"]),
            short(&i["min"]),
            short(&i["max"]),
            text(&i["nan"]),
            text(&i["inf"]),
            text(&i["first_non_finite"]),
        );
    }
    if let Some(r) = last {
        out += &format!("rank {r} arrived last\n");
    }
    out
}
