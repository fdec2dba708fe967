//! Which build of a host program a guest of each architecture runs: the
//! program itself, or cargo's cross-build of it (tests/image/cross-build.sh).

use std::path::{Path, PathBuf};

use crate::Arch;

/// Why a rank of one architecture cannot run a program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CrossError {
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, String),
    #[error("{path} is an ELF file for machine {machine}, which no guest here runs")]
    UnknownMachine { path: PathBuf, machine: u16 },
    #[error(
        "{path} is built for {built}, and there is no {want} build of it at {cross}: \
         build the guest programs with `tests/image/cross-build.sh {want}` \
         (cargo build --release --target {triple}{toolchain}), or give a program built for {want}"
    )]
    NoBuild {
        path: PathBuf,
        built: Arch,
        want: Arch,
        cross: PathBuf,
        triple: &'static str,
        toolchain: String,
    },
    #[error("{cross} is built for {built}, not {want}")]
    WrongBuild {
        cross: PathBuf,
        built: Arch,
        want: Arch,
    },
}

/// The file an `arch` guest runs for host program `path`: `path` itself when
/// it is a script or built for `arch`, else the same program in cargo's
/// cross-build folder: `DIR/PROFILE/NAME` becomes `DIR/TRIPLE/PROFILE/NAME`
/// (target/release/dmlc-guest, say, becomes
/// target/aarch64-unknown-linux-gnu/release/dmlc-guest).
pub fn program_for(path: &Path, arch: Arch) -> Result<PathBuf, CrossError> {
    let read =
        |p: &Path| Arch::of_elf(p).map_err(|e| CrossError::Read(p.to_owned(), e.to_string()));
    let built = match read(path)? {
        None => return Ok(path.to_owned()),
        Some(Ok(a)) if a == arch => return Ok(path.to_owned()),
        Some(Ok(a)) => a,
        Some(Err(machine)) => {
            return Err(CrossError::UnknownMachine {
                path: path.to_owned(),
                machine,
            })
        }
    };
    let cross = cross_path(path, arch);
    match cross.as_deref().map(read) {
        Some(Ok(Some(Ok(a)))) if a == arch => Ok(cross.unwrap_or_default()),
        Some(Ok(Some(Ok(other)))) => Err(CrossError::WrongBuild {
            cross: cross.unwrap_or_default(),
            built: other,
            want: arch,
        }),
        _ => Err(CrossError::NoBuild {
            path: path.to_owned(),
            built,
            want: arch,
            cross: cross.unwrap_or_else(|| path.to_owned()),
            triple: arch.rust_target(),
            toolchain: missing_toolchain(arch),
        }),
    }
}

/// `DIR/PROFILE/NAME` as `DIR/TRIPLE/PROFILE/NAME` (examples too:
/// `DIR/PROFILE/examples/NAME`); `None` for a path not in that shape.
fn cross_path(path: &Path, arch: Arch) -> Option<PathBuf> {
    let name = path.file_name()?;
    let mut dir = path.parent()?;
    let mut tail = vec![name];
    if dir.file_name()? == "examples" {
        tail.insert(0, dir.file_name()?);
        dir = dir.parent()?;
    }
    let profile = dir.file_name()?;
    let mut out = dir.parent()?.join(arch.rust_target()).join(profile);
    out.extend(tail);
    Some(out)
}

/// "; the linker X is missing: install Debian's gcc-..." when the cross
/// C compiler is not on PATH, else "".
fn missing_toolchain(arch: Arch) -> String {
    let gcc = arch.cross_gcc();
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(gcc).is_file()));
    if found {
        String::new()
    } else {
        let pkg = gcc.trim_end_matches("-gcc").replace('_', "-");
        format!("; the linker {gcc} is missing: apt-get install gcc-{pkg}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_builds_live_under_the_triple() {
        assert_eq!(
            cross_path(Path::new("/r/target/release/dmlc-guest"), Arch::Aarch64),
            Some(PathBuf::from(
                "/r/target/aarch64-unknown-linux-gnu/release/dmlc-guest"
            ))
        );
        assert_eq!(
            cross_path(Path::new("/t/debug/examples/pci_probe"), Arch::Riscv64),
            Some(PathBuf::from(
                "/t/riscv64gc-unknown-linux-gnu/debug/examples/pci_probe"
            ))
        );
    }

    #[test]
    fn scripts_run_as_they_are_and_host_builds_need_a_cross_build() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.py");
        std::fs::write(&script, "print(1)\n").unwrap();
        assert_eq!(program_for(&script, Arch::Riscv64).unwrap(), script);
        // This test's own binary: the host's build runs as it is on the
        // host's architecture, and another needs target/TRIPLE/....
        let me = std::env::current_exe().unwrap();
        assert_eq!(program_for(&me, Arch::host()).unwrap(), me);
        let other = if Arch::host() == Arch::Aarch64 {
            Arch::Riscv64
        } else {
            Arch::Aarch64
        };
        let release = dir.path().join("release");
        std::fs::create_dir(&release).unwrap();
        let prog = release.join("prog");
        std::fs::copy(&me, &prog).unwrap();
        let err = program_for(&prog, other).unwrap_err();
        assert!(matches!(err, CrossError::NoBuild { .. }), "{err}");
        assert!(err.to_string().contains("cross-build.sh"), "{err}");
        // A "cross build" that is the host's binary again is refused.
        let cross = dir.path().join(other.rust_target()).join("release");
        std::fs::create_dir_all(&cross).unwrap();
        std::fs::copy(&me, cross.join("prog")).unwrap();
        let err = program_for(&prog, other).unwrap_err();
        assert!(matches!(err, CrossError::WrongBuild { .. }), "{err}");
    }
}
