//! VM harness of virtio-dmlc: build the guest image, boot N QEMU VMs, run
//! one shell job in each, wait for every job's exit line with a timeout,
//! and kill every VM whatever happens.
//!
//! The system tests and the `dmlc-qemu` launcher both boot their VMs
//! through it. See README.md for the environment variables, an example and
//! the QEMU command line.

mod arch;
mod builds;
mod cluster;
mod console;
mod error;
pub mod qmp;
mod setup;
mod spec;

pub use arch::{Arch, UnknownArch};
pub use builds::{program_for, CrossError};
pub use cluster::{run_ok, Cluster, Outcome, TCG_HOST_ROOT_CPU};
pub use error::Error;
pub use setup::{repo_root, Accel, Image, ImageOptions, Qemu, Virtiofsd, VIRTIOFSD_VERSION};
pub use spec::{vm_ip, Options, Resume, VmSpec};
