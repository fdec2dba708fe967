//! Runs every input of a corpus through one target's harness and counts
//! the outcomes: which statuses (and detail codes) the corpus reaches.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example outcomes -- TARGET DIR...`

use std::collections::BTreeMap;
use std::process::ExitCode;

use dmlc_fuzz::check::Outcome;
use dmlc_fuzz::oracle::Model;
use dmlc_fuzz::{comm_header, descriptor_chain, request_header};

/// A target's run that also says which model its answer matched.
type RunModel = fn(&[u8]) -> (Outcome, Model);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let run: fn(&[u8]) -> Outcome = match args.first().map(String::as_str) {
        Some("request_header") => request_header::run,
        Some("descriptor_chain") => descriptor_chain::run,
        Some("comm_header") => comm_header::run,
        _ => {
            eprintln!("usage: outcomes request_header|descriptor_chain|comm_header DIR...");
            return ExitCode::FAILURE;
        }
    };
    // Which answers were the backend's known deviations from the spec (D1
    // to D4 in src/oracle.rs; request_header's chains cannot show them).
    let run_model: Option<RunModel> = match args[0].as_str() {
        "comm_header" => Some(comm_header::run_model),
        "descriptor_chain" => Some(descriptor_chain::run_model),
        _ => None,
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
            let (outcome, model) = match run_model {
                Some(f) => f(&data),
                None => (run(&data), Model::SPEC),
            };
            let key = match outcome {
                Outcome::Valid { bounces: 0 } => "valid".to_string(),
                Outcome::Valid { .. } => "valid, with bounce copies".to_string(),
                Outcome::Rejected(None) => "no response (used len 0)".to_string(),
                Outcome::Rejected(Some((status, detail))) => format!("{status} {detail}"),
            };
            let key = if model == Model::SPEC {
                key
            } else {
                format!("{key} (known deviation {model}: the spec says otherwise)")
            };
            *counts.entry(key).or_default() += 1;
        }
    }
    for (k, n) in &counts {
        println!("{n:7}  {k}");
    }
    ExitCode::SUCCESS
}
