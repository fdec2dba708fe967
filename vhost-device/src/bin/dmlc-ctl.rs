//! dmlc-ctl: sends one request to a vhost-device-dmlc control socket
//! (`--control-socket`) and prints the answer.
//!
//! ```text
//! dmlc-ctl --socket PATH state
//! dmlc-ctl --socket PATH delay 1 2000     # rank 1 arrives 2 ms late
//! dmlc-ctl --socket PATH load ring.toml   # a new timing configuration
//! dmlc-ctl --socket PATH trace > trace.json
//! dmlc-ctl --socket PATH summary 1000     # the slowest member per second
//! ```

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// Live control of a vhost-device-dmlc daemon started with
/// --control-socket: state, metrics, trace, dump, summary [WINDOW_MS],
/// delay RANK US, load FILE.
#[derive(Debug, Parser)]
#[command(name = "dmlc-ctl", version)]
struct Args {
    /// The daemon's control socket (its --control-socket).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,

    /// The request and its arguments: state | metrics | trace | dump |
    /// summary [WINDOW_MS] | delay RANK US | load FILE.
    #[arg(value_name = "REQUEST", required = true, num_args = 1.., allow_hyphen_values = true,
          trailing_var_arg = true)]
    request: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(body) => {
            print!("{body}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dmlc-ctl: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<String, String> {
    let shown = args.socket.display();
    let mut s =
        UnixStream::connect(&args.socket).map_err(|e| format!("cannot connect to {shown}: {e}"))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let line = format!("{}\n", args.request.join(" "));
    s.write_all(line.as_bytes())
        .map_err(|e| format!("cannot send to {shown}: {e}"))?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)
        .map_err(|e| format!("no answer from {shown}: {e}"))?;
    match reply.split_once('\n') {
        Some(("ok", body)) => Ok(body.to_owned()),
        Some((status, _)) => Err(status.strip_prefix("error: ").unwrap_or(status).to_owned()),
        None => Err(format!("no answer from {shown}")),
    }
}
