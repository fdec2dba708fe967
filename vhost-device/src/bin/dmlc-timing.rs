//! dmlc-timing: what a timing file's model (docs/latency-experiments.md)
//! makes one collective take, without a daemon: the formulas the daemon
//! runs with `--timing`, for tools that project a job onto the modelled
//! cluster (`dmlc-qemu study`) and for checking a file by hand.
//!
//! ```text
//! dmlc-timing cluster.toml --members 2 4096 4194304
//! {"members":2,"world":8,"opcode":"allreduce","us":{"4096":...,"4194304":...}}
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use vhost_device_dmlc::timing::Timing;
use virtio_dmlc::Opcode;

/// Print, as one JSON line, the modelled time in microseconds of one
/// collective of each size under FILE's [model]: the model alone, as the
/// daemon computes it before `overhead_us` and any [[delay]], [[bandwidth]]
/// or [[fail]] rule. The file is checked as `vhost-device-dmlc --timing`
/// checks it, and refused with the same message.
#[derive(Debug, Parser)]
#[command(name = "dmlc-timing", version)]
struct Args {
    /// The timing file (TOML, or JSON if its name ends in .json).
    #[arg(value_name = "FILE")]
    file: PathBuf,

    /// Real members of the group: the modelled world size where the file
    /// sets none.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    members: u32,

    /// allreduce, reduce_scatter, allgather, broadcast, reduce or barrier.
    #[arg(long, value_name = "NAME", default_value = "allreduce", value_parser = parse_opcode)]
    opcode: Opcode,

    /// Bytes of one member's block (an allreduce's buffer).
    #[arg(value_name = "BYTES", required = true)]
    bytes: Vec<u64>,
}

fn parse_opcode(name: &str) -> Result<Opcode, String> {
    match Opcode::from_name(name) {
        Some(Opcode::Nop) | None => Err(format!("{name:?} is not a collective")),
        Some(op) => Ok(op),
    }
}

/// The JSON line for `args` under the checked `timing`.
fn answer(timing: &Timing, args: &Args) -> serde_json::Value {
    let us: BTreeMap<String, f64> = args
        .bytes
        .iter()
        .map(|&b| (b.to_string(), timing.model.seconds(args.opcode, b) * 1e6))
        .collect();
    serde_json::json!({
        "members": args.members,
        "world": timing.model.world(),
        "opcode": args.opcode.name(),
        "us": us,
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match Timing::load(&args.file, args.members) {
        Ok(timing) => {
            println!("{}", answer(&timing, &args));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dmlc-timing: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, argv: &[&str]) -> serde_json::Value {
        let args = Args::try_parse_from(argv).unwrap();
        answer(&Timing::from_toml(text, args.members).unwrap(), &args)
    }

    #[test]
    fn a_ring_allreduce_is_the_documented_alpha_beta_time() {
        // 2(p-1)a + 2fNb with p = 4, a = 10 us, 1 GB/s, N = 1 MB:
        // 60 us + 1.5 ms.
        let file = "[model]\nkind = \"ring\"\nalpha_us = 10\nbandwidth_gbs = 1\n";
        let v = run(file, &["dmlc-timing", "f", "--members", "4", "1000000"]);
        assert_eq!(v["world"], 4);
        let us = v["us"]["1000000"].as_f64().unwrap();
        assert!((us - 1560.0).abs() < 1e-6, "{us}");
    }

    #[test]
    fn the_file_s_world_and_kind_are_used() {
        // A binomial tree over 8 ranks: 2L(a + Nb), L = 3: 6 (10 + 1000) us.
        let file = "[model]\nkind = \"tree\"\nworld = 8\nalpha_us = 10\nbandwidth_gbs = 1\n";
        let v = run(file, &["dmlc-timing", "f", "1000000", "0"]);
        assert_eq!(v["world"], 8);
        assert!((v["us"]["1000000"].as_f64().unwrap() - 6060.0).abs() < 1e-6);
        assert!((v["us"]["0"].as_f64().unwrap() - 60.0).abs() < 1e-6);
    }

    #[test]
    fn only_collectives_are_accepted() {
        assert!(Args::try_parse_from(["dmlc-timing", "f", "--opcode", "nop", "1"]).is_err());
        assert!(Args::try_parse_from(["dmlc-timing", "f", "--opcode", "gather", "1"]).is_err());
        assert!(Args::try_parse_from(["dmlc-timing", "f", "--members", "0", "1"]).is_err());
        assert!(Args::try_parse_from(["dmlc-timing", "f"]).is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
