//! What the VMs are made of: the repository's scripts, the QEMU binary, the
//! guest image and the CPU emulation.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{Arch, Error};

/// The repository root: `DMLC_REPO`, else the first directory above this
/// crate that holds tests/image/build-image.sh.
pub fn repo_root() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("DMLC_REPO") {
        return Ok(PathBuf::from(dir));
    }
    let start = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    start
        .ancestors()
        .find(|d| d.join("tests/image/build-image.sh").is_file())
        .map(Path::to_path_buf)
        .ok_or(Error::NoRepoRoot)
}

/// Runs `bash SCRIPT ARGS` and returns its stdout.
fn run_script(script: &Path, args: &[OsString]) -> Result<String, Error> {
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            what: script.display().to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Script {
            script: script.to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The value of the last line `KEY=value` in the stdout of `script` (the
/// repository's scripts report their results that way).
fn script_value(script: &Path, stdout: &str, key: &'static str) -> Result<String, Error> {
    let prefix = format!("{key}=");
    stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(str::to_owned)
        .ok_or(Error::ScriptOutput {
            script: script.to_owned(),
            key,
        })
}

/// A guest kernel and initramfs from tests/image/build-image.sh.
#[derive(Debug, Clone)]
pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// What the kernel and the image's programs run on.
    pub arch: Arch,
}

/// How to build an [`Image`].
#[derive(Debug, Clone, Default)]
pub struct ImageOptions {
    /// Strip debug info from the extra ELF files (smaller, faster to boot).
    pub strip: bool,
    /// The guest's architecture (default: the host's).
    pub arch: Arch,
}

impl Image {
    /// tests/image/build-image.sh, which builds images and caches them.
    pub fn script() -> Result<PathBuf, Error> {
        Ok(repo_root()?.join("tests/image/build-image.sh"))
    }

    /// The script's arguments for `extra` files, given as (host path,
    /// absolute guest path; a guest path ending in '/' is a directory to
    /// copy into).
    pub fn script_args(extra: &[(&Path, &str)], opts: &ImageOptions) -> Vec<OsString> {
        let mut args = vec![OsString::from("--arch"), OsString::from(opts.arch.name())];
        if opts.strip {
            args.push(OsString::from("--strip"));
        }
        for (host, guest) in extra {
            let mut a = host.as_os_str().to_owned();
            a.push(":");
            a.push(guest);
            args.push(a);
        }
        args
    }

    /// The image of `arch` that the script's stdout names.
    pub fn from_script_output(script: &Path, stdout: &str, arch: Arch) -> Result<Image, Error> {
        Ok(Image {
            initrd: PathBuf::from(script_value(script, stdout, "DMLC_INITRD")?),
            kernel: PathBuf::from(script_value(script, stdout, "DMLC_KERNEL")?),
            arch,
        })
    }

    /// Builds (or finds in the cache) the image with `extra` files (see
    /// [`Image::script_args`]).
    pub fn build(extra: &[(&Path, &str)], opts: &ImageOptions) -> Result<Image, Error> {
        let script = Image::script()?;
        let out = run_script(&script, &Image::script_args(extra, opts))?;
        Image::from_script_output(&script, &out, opts.arch)
    }
}

/// The QEMU binary and the directories it takes firmware from (`-L`).
#[derive(Debug, Clone)]
pub struct Qemu {
    /// `qemu-system-x86_64` (the host's architecture); the other
    /// architectures' binaries are beside it.
    pub binary: PathBuf,
    pub firmware: Vec<PathBuf>,
}

impl Qemu {
    /// The binary that runs `arch` guests: [`Qemu::binary`] for the host's
    /// architecture, else `qemu-system-ARCH` in the same directory (the
    /// patched build makes all three).
    pub fn binary_for(&self, arch: Arch) -> Result<PathBuf, Error> {
        if arch == Arch::host() {
            return Ok(self.binary.clone());
        }
        let sibling = self.binary.with_file_name(arch.qemu_binary());
        if sibling.is_file() {
            Ok(sibling)
        } else {
            Err(Error::NoQemuFor {
                arch,
                path: sibling,
            })
        }
    }

    /// `DMLC_QEMU` (binary) and `DMLC_QEMU_FIRMWARE` (':'-separated `-L`
    /// directories; none if unset). Without `DMLC_QEMU`, runs
    /// `qemu-patches/build-qemu.sh --env` (the patched build, cached after
    /// its first run) and takes both from its output.
    pub fn from_env() -> Result<Qemu, Error> {
        let (binary, firmware) = match std::env::var_os("DMLC_QEMU") {
            Some(b) => (
                b,
                std::env::var_os("DMLC_QEMU_FIRMWARE").unwrap_or_default(),
            ),
            None => {
                let script = repo_root()?.join("qemu-patches/build-qemu.sh");
                let out = run_script(&script, &[OsString::from("--env")])?;
                let value = |key| script_value(&script, &out, key).map(|v| shell_unquote(&v));
                (
                    OsString::from(value("DMLC_QEMU")?),
                    OsString::from(value("DMLC_QEMU_FIRMWARE")?),
                )
            }
        };
        Ok(Qemu {
            binary: PathBuf::from(binary),
            firmware: std::env::split_paths(&firmware)
                .filter(|p| !p.as_os_str().is_empty())
                .collect(),
        })
    }
}

/// The virtiofsd version vm-harness/build-virtiofsd.sh builds, and the
/// directory of its cache path.
pub const VIRTIOFSD_VERSION: &str = "1.14.0";

/// virtiofsd, the vhost-user virtio-fs daemon (rust-vmm) that shares the
/// host's root with guests whose [`crate::VmSpec::host_root`] is set.
#[derive(Debug, Clone)]
pub struct Virtiofsd {
    pub binary: PathBuf,
}

impl Virtiofsd {
    /// `DMLC_VIRTIOFSD`, else what vm-harness/build-virtiofsd.sh caches:
    /// `${DMLC_CACHE:-~/.cache/virtio-dmlc}/virtiofsd/1.14.0/bin/virtiofsd`.
    /// Nothing is built here (the build takes minutes):
    /// [`Error::NoVirtiofsd`] says how.
    pub fn from_env() -> Result<Virtiofsd, Error> {
        let binary = match std::env::var_os("DMLC_VIRTIOFSD") {
            Some(b) if !b.is_empty() => PathBuf::from(b),
            _ => Virtiofsd::cache_path(),
        };
        if binary.is_file() {
            Ok(Virtiofsd { binary })
        } else {
            Err(Error::NoVirtiofsd(binary))
        }
    }

    /// Runs vm-harness/build-virtiofsd.sh (minutes the first time, then
    /// instant) and takes the binary it prints; afterwards
    /// [`Virtiofsd::from_env`] finds it too (unless `DMLC_VIRTIOFSD` names
    /// another). For tests and tools that would rather build than fail.
    pub fn build() -> Result<Virtiofsd, Error> {
        let script = repo_root()?.join("vm-harness/build-virtiofsd.sh");
        let out = run_script(&script, &[OsString::from("--env")])?;
        let binary = shell_unquote(&script_value(&script, &out, "DMLC_VIRTIOFSD")?);
        Ok(Virtiofsd {
            binary: PathBuf::from(binary),
        })
    }

    /// Where vm-harness/build-virtiofsd.sh puts the binary.
    pub fn cache_path() -> PathBuf {
        let cache = match std::env::var_os("DMLC_CACHE") {
            Some(c) if !c.is_empty() => PathBuf::from(c),
            _ => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/virtio-dmlc"),
        };
        cache
            .join("virtiofsd")
            .join(VIRTIOFSD_VERSION)
            .join("bin/virtiofsd")
    }
}

/// Undoes bash's `printf %q` of one word; anything that is not one shell
/// word is taken as it is.
fn shell_unquote(s: &str) -> String {
    match shlex::split(s).as_deref() {
        Some([word]) => word.clone(),
        _ => s.to_owned(),
    }
}

/// CPU emulation: TCG (default; nested KVM hangs on some hosts) or KVM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Tcg,
    Kvm,
}

impl Accel {
    /// `DMLC_ACCEL=kvm` asks for KVM (checked: /dev/kvm must open
    /// read-write); unset or `tcg` gives TCG.
    pub fn from_env() -> Result<Accel, Error> {
        match std::env::var("DMLC_ACCEL").as_deref() {
            Err(_) | Ok("") | Ok("tcg") => Ok(Accel::Tcg),
            Ok("kvm") => {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/kvm")
                    .map_err(Error::NoKvm)?;
                Ok(Accel::Kvm)
            }
            Ok(other) => Err(Error::BadAccel(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_unquote_undoes_printf_q() {
        assert_eq!(shell_unquote("/a/b\\ c/q"), "/a/b c/q");
        assert_eq!(shell_unquote("/plain:/x"), "/plain:/x");
        assert_eq!(shell_unquote("/a/\\#b\\'c"), "/a/#b'c");
    }

    #[test]
    fn repo_root_holds_the_image_script() {
        if std::env::var_os("DMLC_REPO").is_none() {
            assert!(Image::script().unwrap().is_file());
        }
    }

    #[test]
    fn image_script_protocol() {
        let files = [(Path::new("/h/a"), "/usr/bin/"), (Path::new("/h/b"), "/b")];
        let opts = ImageOptions {
            strip: true,
            arch: Arch::Riscv64,
        };
        let args = Image::script_args(&files, &opts);
        assert_eq!(
            args,
            ["--arch", "riscv64", "--strip", "/h/a:/usr/bin/", "/h/b:/b"]
        );
        let s = Path::new("s.sh");
        let out = "DMLC_KERNEL=/old\nnoise\nDMLC_INITRD=/i\nDMLC_KERNEL=/k\n";
        let image = Image::from_script_output(s, out, Arch::Aarch64).unwrap();
        assert_eq!(
            (image.initrd.to_str(), image.kernel.to_str(), image.arch),
            (Some("/i"), Some("/k"), Arch::Aarch64)
        );
        assert!(matches!(
            Image::from_script_output(s, "DMLC_KERNEL=/k\n", Arch::X86_64),
            Err(Error::ScriptOutput {
                key: "DMLC_INITRD",
                ..
            })
        ));
    }
}
