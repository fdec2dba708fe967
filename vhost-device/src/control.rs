//! The control socket (`--control-socket PATH`): live control of a running
//! group, for `dmlc-ctl` or any client.
//!
//! The socket has the access rules of the vhost-user sockets
//! (`--socket-mode`, `--socket-group`): whoever may act as a rank may also
//! change the timing. One request per connection, served one at a time: a
//! line of text (at most 4 KiB, within 5 s), answered by `ok` or
//! `error: MESSAGE` on the first line and the result after it; then the
//! daemon closes the connection.
//!
//! Requests:
//!
//! - `state`: the group's state as JSON ([`Group::state_json`]);
//! - `metrics`: the Prometheus text of `--metrics-addr`;
//! - `trace`: the flight recorder as Chrome trace JSON (needs
//!   `--trace-out`, which sets the recorder up);
//! - `dump`: writes the trace to `--trace-out`, as SIGUSR1 does;
//! - `summary [WINDOW_MS]`: per window (default 1000 ms), the slowest
//!   member: the one that arrived last most often, its mean lateness and
//!   how much of it was injected ([`crate::trace::Recorder::summary`]);
//! - `delay RANK US`: from the next arrival on, every arrival of `RANK`
//!   counts `US` microseconds late (a constant injected delay, on top of
//!   the file's rules; 0 removes it);
//! - `load FILE`: replaces the whole timing configuration with FILE (the
//!   `--timing` format; the daemon's own path, so relative to its working
//!   directory);
//! - `freeze --at SEQ [--queue Q]`, `freeze --tag T`, `freeze --on-error`
//!   (the last combines with either), `freeze --off`: arms (or disarms) a
//!   freeze ([`crate::group::freeze`], spec 5.X.6.15);
//! - `frozen`: the freeze state as JSON (what the launcher follows);
//! - `thaw`: resumes a frozen job;
//! - `inspect`: the held collective, member by member, as JSON;
//! - `stopped ID`, `resumed ID`: the launcher says it stopped, or resumed,
//!   every VM of freeze `ID`;
//! - `snapshot DIR`: asks the launcher to save every VM of the frozen job
//!   into DIR (`frozen` then shows the snapshot's state); `snapshotted ID
//!   ok` or `snapshotted ID error TEXT`: the launcher's verdict.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use crate::group::freeze::Trigger;
use crate::group::Group;
use crate::timing::Timing;

/// Longest request line.
const MAX_REQUEST: u64 = 4096;

/// Serves the control socket until accepting fails.
pub fn serve(listener: &UnixListener, group: &Group, trace_out: Option<&Path>, world: u32) {
    for stream in listener.incoming() {
        match stream {
            Ok(s) => {
                if let Err(e) = serve_one(s, group, trace_out, world) {
                    log::debug!("control socket: {e}");
                }
            }
            Err(e) => {
                log::warn!("control socket: cannot accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn serve_one(
    stream: UnixStream,
    group: &Group,
    trace_out: Option<&Path>,
    world: u32,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_REQUEST)).read_line(&mut line)?;
    let reply = match answer(line.trim(), group, trace_out, world) {
        Ok(body) => format!("ok\n{body}"),
        Err(e) => format!("error: {e}\n"),
    };
    (&stream).write_all(reply.as_bytes())
}

/// The answer to one request: its body, or why it is refused.
pub fn answer(
    request: &str,
    group: &Group,
    trace_out: Option<&Path>,
    world: u32,
) -> Result<String, String> {
    let words: Vec<&str> = request.split_whitespace().collect();
    match words.as_slice() {
        ["state"] => Ok(format!("{:#}\n", group.state_json())),
        ["metrics"] => Ok(group.metrics().render()),
        ["trace"] => match group.recorder() {
            Some(r) => Ok(format!("{}\n", r.chrome_json(world))),
            None => Err("no flight recorder: start the daemon with --trace-out".into()),
        },
        ["summary"] | ["summary", _] => {
            let ms: f64 = match words.get(1) {
                Some(w) => w
                    .parse()
                    .ok()
                    .filter(|m: &f64| m.is_finite() && *m > 0.0)
                    .ok_or_else(|| format!("WINDOW_MS must be a number > 0, not {w:?}"))?,
                None => 1000.0,
            };
            match group.recorder() {
                Some(r) => Ok(r.summary(Duration::from_secs_f64(ms / 1000.0))),
                None => Err("no flight recorder: start the daemon with --trace-out".into()),
            }
        }
        ["dump"] => match (group.recorder(), trace_out) {
            (Some(r), Some(path)) => r
                .write_chrome(path, world)
                .map(|()| format!("{}\n", path.display()))
                .map_err(|e| format!("cannot write {}: {e}", path.display())),
            _ => Err("no --trace-out to write".into()),
        },
        ["delay", rank, us] => {
            let rank: u32 = rank
                .parse()
                .ok()
                .filter(|r| *r < world)
                .ok_or_else(|| format!("RANK must be a rank below {world}, not {rank:?}"))?;
            let us: f64 = us
                .parse()
                .ok()
                .filter(|u: &f64| u.is_finite() && *u >= 0.0 && *u <= 3.6e9)
                .ok_or_else(|| format!("US must be a number of microseconds >= 0, not {us:?}"))?;
            let current = group.timing().unwrap_or_else(|| Timing::ideal().into());
            let next = current.with_live_delay(rank, Duration::from_secs_f64(us * 1e-6));
            group.set_timing(next).map_err(String::from)?;
            Ok(format!("rank {rank}: arrivals count {us} us late\n"))
        }
        ["load", file] => {
            let t = Timing::load(Path::new(file), world)
                .map_err(|e| dmlc_cli_support::error_text(&e))?;
            group.set_timing(t).map_err(String::from)?;
            Ok(format!("timing from {file}\n"))
        }
        ["freeze", args @ ..] => {
            let (trigger, on_error) = freeze_args(args)?;
            group.freeze(trigger, on_error)
        }
        ["frozen"] => Ok(format!("{:#}\n", group.freeze_json())),
        ["thaw"] => group.thaw(),
        ["inspect"] => group.inspect().map(|j| format!("{j:#}\n")),
        ["stopped", id] => group.frozen_stopped(number(id, "ID")?),
        ["resumed", id] => group.frozen_resumed(number(id, "ID")?),
        ["snapshot", dir] => group.snapshot(dir),
        ["snapshotted", id, "ok"] => group.snapshotted(number(id, "ID")?, Ok(())),
        ["snapshotted", id, "error", why @ ..] => {
            group.snapshotted(number(id, "ID")?, Err(why.join(" ")))
        }
        _ => Err(format!(
            "unknown request {request:?}; the requests are state, metrics, trace, dump, \
             summary [WINDOW_MS], delay RANK US, load FILE, freeze (--at SEQ [--queue Q] | \
             --tag T | --on-error | --off), frozen, thaw, inspect, snapshot DIR"
        )),
    }
}

fn number<T: std::str::FromStr>(word: &str, what: &str) -> Result<T, String> {
    word.parse()
        .map_err(|_| format!("{what} must be a whole number, not {word:?}"))
}

/// The arguments of `freeze`: what to freeze at, and whether on errors.
/// No argument, or `--off`: disarm.
fn freeze_args(args: &[&str]) -> Result<(Option<Trigger>, bool), String> {
    let usage = "freeze takes --at SEQ [--queue Q], --tag T, --on-error (alone or with one \
                 of the others) or --off";
    let (mut at, mut queue, mut tag, mut on_error, mut off) = (None, None, None, false, false);
    let mut words = args.iter();
    while let Some(w) = words.next() {
        let mut value = |name: &str| {
            words
                .next()
                .ok_or_else(|| format!("{w} needs a value ({name})"))
                .map(|v| v.to_string())
        };
        match *w {
            "--at" => at = Some(number::<u64>(&value("SEQ")?, "SEQ")?),
            "--queue" => queue = Some(number::<u16>(&value("Q")?, "Q")?),
            "--tag" => tag = Some(number::<u64>(&value("T")?, "T")?),
            "--on-error" => on_error = true,
            "--off" => off = true,
            other => return Err(format!("unknown argument {other:?}: {usage}")),
        }
    }
    let trigger = match (at, tag) {
        (Some(seq), None) => Some(Trigger::At {
            queue: queue.unwrap_or(0),
            seq,
        }),
        (None, Some(t)) if queue.is_none() => Some(Trigger::Tag(t)),
        (None, None) if queue.is_none() => None,
        _ => return Err(usage.into()),
    };
    if off && (trigger.is_some() || on_error) {
        return Err(usage.into());
    }
    if !off && trigger.is_none() && !on_error {
        return Err(usage.into());
    }
    Ok((trigger, on_error))
}
