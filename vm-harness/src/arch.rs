//! The guest architectures: what QEMU, the image builder and cargo call
//! each, and how a VM of each is put together.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// A guest instruction set. All three are little-endian, as the device's
/// rings and headers are (virtio 1.x).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    X86_64,
    Aarch64,
    Riscv64,
}

/// An `--arch` word that names no architecture.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown architecture {0:?} (known: x86_64, aarch64, riscv64)")]
pub struct UnknownArch(pub String);

impl Arch {
    pub const ALL: [Arch; 3] = [Arch::X86_64, Arch::Aarch64, Arch::Riscv64];

    /// The name QEMU (`qemu-system-NAME`), the kernel and `uname -m` use.
    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
            Arch::Riscv64 => "riscv64",
        }
    }

    /// The architecture this program was built for (the host's, for the
    /// launcher and the tests).
    pub fn host() -> Arch {
        if cfg!(target_arch = "aarch64") {
            Arch::Aarch64
        } else if cfg!(target_arch = "riscv64") {
            Arch::Riscv64
        } else {
            Arch::X86_64
        }
    }

    /// Rust's target triple for programs of this architecture (the
    /// cross-builds go to `target/TRIPLE/...`).
    pub fn rust_target(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64-unknown-linux-gnu",
            Arch::Aarch64 => "aarch64-unknown-linux-gnu",
            Arch::Riscv64 => "riscv64gc-unknown-linux-gnu",
        }
    }

    /// Debian's cross C compiler, the linker of those builds.
    pub fn cross_gcc(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64-linux-gnu-gcc",
            Arch::Aarch64 => "aarch64-linux-gnu-gcc",
            Arch::Riscv64 => "riscv64-linux-gnu-gcc",
        }
    }

    /// The ELF header's `e_machine` of this architecture's programs.
    pub fn elf_machine(self) -> u16 {
        match self {
            Arch::X86_64 => 62,
            Arch::Aarch64 => 183,
            Arch::Riscv64 => 243,
        }
    }

    /// QEMU's binary for this architecture.
    pub fn qemu_binary(self) -> String {
        format!("qemu-system-{}", self.name())
    }

    /// `-machine`: q35 on x86, the generic `virt` board (PCIe host bridge)
    /// elsewhere; guest RAM is the shared memfd `mem`.
    pub fn machine(self) -> &'static str {
        match self {
            Arch::X86_64 => "q35,memory-backend=mem",
            Arch::Aarch64 | Arch::Riscv64 => "virt,memory-backend=mem",
        }
    }

    /// `-cpu` under TCG, or `None` for QEMU's default. aarch64 needs one
    /// (virt's default, cortex-a15, is 32-bit): Neoverse N1, a server core
    /// without SVE or pointer authentication, which TCG runs slowly.
    /// riscv64's default `rv64` has the RVA20 set Debian builds for.
    pub fn tcg_cpu(self) -> Option<&'static str> {
        match self {
            Arch::X86_64 | Arch::Riscv64 => None,
            Arch::Aarch64 => Some("neoverse-n1"),
        }
    }

    /// The serial console's device in the guest.
    pub fn console(self) -> &'static str {
        match self {
            Arch::X86_64 | Arch::Riscv64 => "ttyS0",
            Arch::Aarch64 => "ttyAMA0",
        }
    }

    /// The longest kernel command line to build (the kernel's
    /// COMMAND_LINE_SIZE less a margin); longer jobs go through fw_cfg.
    pub fn cmdline_limit(self) -> usize {
        match self {
            Arch::X86_64 | Arch::Aarch64 => 1900,
            Arch::Riscv64 => 900,
        }
    }

    /// The architecture an ELF file was built for: `Ok(None)` when it is
    /// not an ELF file (a script), `Ok(Some(Err(m)))` for an ELF file of an
    /// architecture this project runs no guests of.
    pub fn of_elf(path: &Path) -> std::io::Result<Option<Result<Arch, u16>>> {
        use std::io::Read as _;
        let mut head = [0u8; 20];
        let mut f = std::fs::File::open(path)?;
        let n = f.read(&mut head)?;
        if n < head.len() || &head[..4] != b"\x7fELF" {
            return Ok(None);
        }
        // e_machine: 2 bytes at 18, in the byte order EI_DATA names.
        let m = match head[5] {
            2 => u16::from_be_bytes([head[18], head[19]]),
            _ => u16::from_le_bytes([head[18], head[19]]),
        };
        Ok(Some(
            Arch::ALL
                .into_iter()
                .find(|a| a.elf_machine() == m)
                .ok_or(m),
        ))
    }

    /// Parses a comma-separated list (`--arch x86_64,aarch64`).
    pub fn parse_list(list: &str) -> Result<Vec<Arch>, UnknownArch> {
        list.split(',').map(str::parse).collect()
    }
}

impl FromStr for Arch {
    type Err = UnknownArch;

    /// The QEMU names, and Debian's for the same architectures.
    fn from_str(s: &str) -> Result<Arch, UnknownArch> {
        match s.trim() {
            "x86_64" | "amd64" | "x86-64" => Ok(Arch::X86_64),
            "aarch64" | "arm64" => Ok(Arch::Aarch64),
            "riscv64" => Ok(Arch::Riscv64),
            other => Err(UnknownArch(other.to_owned())),
        }
    }
}

impl Default for Arch {
    fn default() -> Arch {
        Arch::host()
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_debian_names_parse() {
        for a in Arch::ALL {
            assert_eq!(a.name().parse::<Arch>(), Ok(a));
        }
        assert_eq!("arm64".parse::<Arch>(), Ok(Arch::Aarch64));
        assert_eq!("amd64".parse::<Arch>(), Ok(Arch::X86_64));
        assert_eq!(
            Arch::parse_list("x86_64,aarch64,riscv64"),
            Ok(Arch::ALL.to_vec())
        );
        assert_eq!(
            Arch::parse_list("x86_64,sparc"),
            Err(UnknownArch("sparc".into()))
        );
    }

    #[test]
    fn elf_machine_of_this_test_binary_is_the_hosts() {
        let me = std::env::current_exe().unwrap();
        assert_eq!(Arch::of_elf(&me).unwrap(), Some(Ok(Arch::host())));
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s.sh");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        assert_eq!(Arch::of_elf(&script).unwrap(), None);
        // An s390x ELF header (big-endian, e_machine 22).
        let mut s390 = vec![0x7f, b'E', b'L', b'F', 2, 2, 1, 0];
        s390.extend([0; 10]);
        s390.extend([0, 22]);
        let f = dir.path().join("s390");
        std::fs::write(&f, s390).unwrap();
        assert_eq!(Arch::of_elf(&f).unwrap(), Some(Err(22)));
    }
}
