//! Jobs on a Debian root of the guest's own architecture (`--rootfs`):
//! which root each VM boots, which of this machine's directories it sees,
//! and which of the launcher's environment carries over.

use std::path::{Path, PathBuf};

use dmlc_vm::Arch;
use serde::{Deserialize, Serialize};

use crate::job::HostRoot;

/// The root of a `--host-root` job's VMs besides this machine's `/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rootfs {
    /// Debian trixie of each VM's architecture, built and cached by
    /// tests/image/build-rootfs.sh (Python, numpy, PyTorch, scikit-learn,
    /// XGBoost): one release, one PyTorch version on every rank.
    Debian,
    /// A directory of the user's (one architecture only).
    Dir(PathBuf),
}

/// Parses `--rootfs`: `debian`, or a directory.
pub fn parse(s: &str) -> Result<Rootfs, String> {
    if s == "debian" {
        return Ok(Rootfs::Debian);
    }
    let p = Path::new(s);
    if !p.join("bin/sh").exists() {
        return Err(format!(
            "{s:?} is neither `debian` nor a root directory (it has no bin/sh)"
        ));
    }
    std::path::absolute(p)
        .map(Rootfs::Dir)
        .map_err(|e| format!("{s}: {e}"))
}

/// The launcher's variables that would be wrong in another root: its PATH
/// and virtual environment name this machine's programs, and its HOME may
/// not exist there.
const HOST_ONLY: [&str; 3] = ["PATH", "VIRTUAL_ENV", "HOME"];

/// The launcher's environment as an `arch` guest on another root sees it:
/// without [`HOST_ONLY`], and `DMLC_LIBRARY` naming that architecture's
/// build of the library (target/TRIPLE/... for target/...).
pub fn environment(env: &[(String, String)], arch: Arch) -> Vec<(String, String)> {
    env.iter()
        .filter(|(k, _)| !HOST_ONLY.contains(&k.as_str()))
        .map(|(k, v)| {
            if k == "DMLC_LIBRARY" {
                let lib = dmlc_vm::program_for(Path::new(v), arch)
                    .map_or_else(|_| v.clone(), |p| p.to_string_lossy().into_owned());
                (k.clone(), lib)
            } else {
                (k.clone(), v.clone())
            }
        })
        .collect()
}

/// The directories of this machine that an `arch` guest on another root
/// needs at their own paths: the working directory, `--bind`'s, the
/// program's, each `PYTHONPATH` entry's and `DMLC_LIBRARY`'s (for that
/// architecture); a directory inside another is left out, being bound with
/// it.
pub fn host_dirs(root: &HostRoot, program: Option<&Path>, arch: Arch) -> Vec<String> {
    let mut dirs: Vec<PathBuf> = vec![PathBuf::from(&root.cwd)];
    dirs.extend(root.bind.iter().map(PathBuf::from));
    if let Some(p) = program {
        let p = dmlc_vm::program_for(p, arch).unwrap_or_else(|_| p.to_owned());
        dirs.extend(p.parent().map(Path::to_path_buf));
    }
    for (k, v) in environment(&root.env, arch) {
        match k.as_str() {
            "PYTHONPATH" => dirs.extend(std::env::split_paths(&v)),
            "DMLC_LIBRARY" => dirs.extend(Path::new(&v).parent().map(Path::to_path_buf)),
            _ => {}
        }
    }
    let mut dirs: Vec<PathBuf> = dirs
        .into_iter()
        .filter(|d| d.is_absolute() && d.is_dir())
        .collect();
    dirs.sort();
    dirs.dedup();
    let outer: Vec<PathBuf> = dirs
        .iter()
        .filter(|d| !dirs.iter().any(|o| o != *d && d.starts_with(o)))
        .cloned()
        .collect();
    outer
        .into_iter()
        .map(|d| d.to_string_lossy().into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    #[test]
    fn debian_or_a_root_directory() {
        assert_eq!(parse("debian"), Ok(Rootfs::Debian));
        assert!(parse("/nonexistent").unwrap_err().contains("no bin/sh"));
        assert_eq!(parse("/"), Ok(Rootfs::Dir(PathBuf::from("/"))));
    }

    #[test]
    fn host_paths_stay_out_and_directories_nest() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        let src = base.join("python/src");
        std::fs::create_dir_all(&src).unwrap();
        let other = tempfile::tempdir().unwrap();
        let env = [
            kv("PATH", "/venv/bin:/usr/bin"),
            kv("VIRTUAL_ENV", "/venv"),
            kv("HOME", "/root"),
            kv(
                "PYTHONPATH",
                &format!("{}:{}", src.display(), other.path().display()),
            ),
        ];
        let e = environment(&env, Arch::Aarch64);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].0, "PYTHONPATH");
        let data = tempfile::tempdir().unwrap();
        let root = HostRoot {
            cwd: base.to_string_lossy().into_owned(),
            env: env.to_vec(),
            kernel_driver: None,
            rootfs: Some(Rootfs::Debian),
            bind: vec![data.path().to_string_lossy().into_owned()],
        };
        let dirs = host_dirs(&root, None, Arch::Aarch64);
        let mut want = vec![
            base.to_string_lossy().into_owned(),
            other.path().to_string_lossy().into_owned(),
            data.path().to_string_lossy().into_owned(),
        ];
        want.sort();
        assert_eq!(dirs, want);
    }
}
