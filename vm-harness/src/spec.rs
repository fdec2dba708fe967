//! What each VM runs and how a group of VMs is set up.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use crate::{Accel, Image};

/// What one VM runs and how it is built.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Shell command line run in the guest with `sh -c`, in /root (or
    /// [`VmSpec::cwd`]).
    pub command: String,
    /// Environment for the command.
    pub env: Vec<(String, String)>,
    /// Guest RAM, shared with the backend (and virtiofsd) through memfd.
    /// 512 MiB boots the initramfs; Python with torch wants 2048 or more.
    pub mem_mib: u32,
    pub cpus: u32,
    /// 2 MiB hugepages reserved at boot (kernel `hugepages=`).
    pub hugepages: u32,
    /// vhost-user socket of the backend: adds the virtio-dmlc device.
    pub dmlc_socket: Option<PathBuf>,
    /// Kernel driver allowed to bind the dmlc device (`dmlc.bind`); `None`
    /// leaves it to the userspace driver.
    pub bind: Option<String>,
    /// The job's working directory in the guest (`dmlc.cwd`); `None`:
    /// /root.
    pub cwd: Option<String>,
    /// Share the host's root directory with the guest read-only (one
    /// virtiofsd per VM, virtio-fs tag `hostroot`) and run the job chrooted
    /// there (`dmlc.root=virtiofs:hostroot`), with tmpfs on /tmp, /run and
    /// /var/tmp and a RAM overlay on /root: the host's programs, Python and
    /// virtual environments run as they are. Needs virtiofsd (see
    /// [`crate::Virtiofsd`]). `append` can override the writable
    /// directories (`dmlc.tmpfs=DIR,...`, `dmlc.overlay=DIR,...`).
    pub host_root: bool,
    /// With `host_root`: share this directory as the job's root instead of
    /// the host's `/` (a Debian root of the guest's architecture).
    pub root_dir: Option<PathBuf>,
    /// With `root_dir`: the host's directories (absolute) bound into that
    /// root at the same paths (the job's working directory, say), through a
    /// second virtio-fs share of the host's `/`. The root is then a RAM
    /// overlay over its share.
    pub host_dirs: Vec<String>,
    /// Extra kernel command line words (after the harness's own: a
    /// `dmlc.*` word here overrides the harness's).
    pub append: Vec<String>,
    /// Extra QEMU arguments.
    pub qemu_args: Vec<String>,
    /// This VM's own image, which may be of another architecture than the
    /// cluster's (a group across instruction sets); `None`: the cluster's.
    /// The image's architecture picks the QEMU binary, machine, CPU and
    /// console.
    pub image: Option<Image>,
}

impl VmSpec {
    pub fn new(command: impl Into<String>) -> VmSpec {
        VmSpec {
            command: command.into(),
            env: Vec::new(),
            mem_mib: 512,
            cpus: 1,
            hugepages: 16,
            dmlc_socket: None,
            bind: None,
            cwd: None,
            host_root: false,
            root_dir: None,
            host_dirs: Vec::new(),
            append: Vec::new(),
            qemu_args: Vec::new(),
            image: None,
        }
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> VmSpec {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn dmlc_socket(mut self, path: impl Into<PathBuf>) -> VmSpec {
        self.dmlc_socket = Some(path.into());
        self
    }

    /// Runs the job in the host's root, shared read-only (see
    /// [`VmSpec::host_root`]).
    pub fn host_root(mut self) -> VmSpec {
        self.host_root = true;
        self
    }

    /// The job's working directory in the guest.
    pub fn cwd(mut self, dir: impl Into<String>) -> VmSpec {
        self.cwd = Some(dir.into());
        self
    }

    /// Boots this VM from `image` instead of the cluster's.
    pub fn image(mut self, image: Image) -> VmSpec {
        self.image = Some(image);
        self
    }

    /// Whether the VM gets the second share ([`VmSpec::host_dirs`]).
    pub(crate) fn shares_host_dirs(&self) -> bool {
        self.host_root && self.root_dir.is_some() && !self.host_dirs.is_empty()
    }

    /// Guest RAM in MiB.
    pub fn mem_mib(mut self, mib: u32) -> VmSpec {
        self.mem_mib = mib;
        self
    }
}

/// Options for a group of VMs.
#[derive(Debug, Clone)]
pub struct Options {
    pub accel: Accel,
    /// Give every VM a virtio-net NIC on one multicast socket netdev (a
    /// shared Ethernet segment on host loopback); VM i gets [`vm_ip`]`(i)`.
    pub net: bool,
    /// Time for all jobs to print their exit line, from the start.
    pub timeout: Duration,
    /// Where the cluster's directory goes; `None`: the temp dir. Tests
    /// pass `CARGO_TARGET_TMPDIR` to keep their logs under target/.
    pub tmp_dir: Option<PathBuf>,
    /// Start the VMs from saved states instead of booting them.
    pub resume: Option<Resume>,
}

/// VMs that continue from saved states (QEMU's `-incoming file:PATH`): the
/// same specs as when they were saved, and the cluster's token then, which
/// the guests' consoles still print.
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// [`crate::Cluster::token`] of the cluster that was saved.
    pub token: String,
    /// VM i's saved state.
    pub incoming: Vec<PathBuf>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            accel: Accel::Tcg,
            net: false,
            timeout: Duration::from_secs(120),
            tmp_dir: None,
            resume: None,
        }
    }
}

/// Address of VM `i` on the virtio-net segment (/24).
pub fn vm_ip(i: usize) -> Ipv4Addr {
    let host = u8::try_from(i + 1).unwrap_or(u8::MAX);
    Ipv4Addr::new(10, 0, 0, host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_ips_are_distinct() {
        assert_eq!(vm_ip(0), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(vm_ip(3), Ipv4Addr::new(10, 0, 0, 4));
    }
}
