//! `dmlc-qemu study`: the feasibility study of bench/study (a Python
//! program: it drives jobs, reads their output and draws the report), run
//! in its own environment (bench/study/venv.sh: matplotlib beside the
//! tests' torch). Every argument goes to it, `--help` included.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use dmlc_vm as vm;

use crate::prepare;

/// Replaces this process with the study; returns only on failure, with the
/// exit status to give.
pub fn run(args: &[OsString]) -> i32 {
    let root = match vm::repo_root() {
        Ok(r) => r,
        Err(e) => {
            crate::progress(&format!("error: the study needs the source tree: {e}"));
            return 125;
        }
    };
    let venv = match prepare::run_script(&root.join("bench/study/venv.sh"), &[]) {
        Ok(out) => PathBuf::from(out.trim()),
        Err(e) => {
            crate::progress(&format!("error: the study's Python environment: {e}"));
            return 125;
        }
    };
    let python = venv.join("bin/python");
    let mut path = OsString::from(root.join("bench"));
    if let Some(old) = std::env::var_os("PYTHONPATH") {
        path.push(":");
        path.push(old);
    }
    let err = Command::new(&python)
        .args(["-m", "study"])
        .args(args)
        .env("PYTHONPATH", path)
        .exec();
    crate::progress(&format!("error: cannot run {}: {err}", python.display()));
    125
}
