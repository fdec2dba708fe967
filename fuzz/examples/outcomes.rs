//! Runs every input of a corpus through one target's harness and counts
//! the outcomes: which statuses (and detail codes) the corpus reaches.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example outcomes -- TARGET DIR...`

use std::collections::BTreeMap;
use std::process::ExitCode;

use dmlc_fuzz::check::Outcome;
use dmlc_fuzz::{descriptor_chain, request_header};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let run: fn(&[u8]) -> Outcome = match args.first().map(String::as_str) {
        Some("request_header") => request_header::run,
        Some("descriptor_chain") => descriptor_chain::run,
        _ => {
            eprintln!("usage: outcomes request_header|descriptor_chain DIR...");
            return ExitCode::FAILURE;
        }
    };
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for dir in &args[1..] {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("cannot read {dir}: {e}");
                return ExitCode::FAILURE;
            }
        };
        for f in entries.flatten() {
            let Ok(data) = std::fs::read(f.path()) else {
                continue;
            };
            let key = match run(&data) {
                Outcome::Valid { bounces: 0 } => "valid".to_string(),
                Outcome::Valid { .. } => "valid, with bounce copies".to_string(),
                Outcome::Rejected(None) => "no response (used len 0)".to_string(),
                Outcome::Rejected(Some((status, detail))) => format!("{status} {detail}"),
            };
            *counts.entry(key).or_default() += 1;
        }
    }
    for (k, n) in &counts {
        println!("{n:7}  {k}");
    }
    ExitCode::SUCCESS
}
