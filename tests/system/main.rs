//! System tests of virtio-dmlc: real QEMU VMs (the patched build, TCG by
//! default, KVM with `DMLC_ACCEL=kvm`) with the `vhost-user-dmlc-pci`
//! device, one `vhost-device-dmlc` daemon, and `dmlc-guest` in every guest.
//!
//! Run them one at a time (two cores cannot boot two groups of VMs at once;
//! the tests also take turns by themselves):
//!
//! ```text
//! cargo build -p dmlc-guest -p vhost-device-dmlc --bins && cargo build -p dmlc-driver --example pci_probe
//! cargo test -p dmlc-system-tests --test system -- --test-threads=1
//! ```
//!
//! The binaries come from the test's own profile directory (target/debug);
//! `DMLC_GUEST_BIN`, `DMLC_PCI_PROBE_BIN` and `DMLC_BACKEND_BIN` pick other
//! builds (tests/run.sh uses release builds: the guests run under
//! emulation). `CI=true` turns a missing QEMU or KVM into a failure instead
//! of a SKIP line. Each test prints its timings past the output capture.
//!
//! - `plumbing`: the device in sysfs, the backend's connections, `info`;
//!   feature sets the device must refuse (FEATURES_OK cleared).
//! - `collectives`: `selftest --quick` on 2 VMs (polling) and 4 VMs
//!   (interrupts).
//! - `faults`: a VM killed in a collective (peer lost, a new VM rejoins);
//!   the backend killed and restarted, with the same group id (the guests
//!   never notice) and as a new group (the guests reopen the device).
//! - `kernel_driver`: the virtio_dmlc module (`DMLC_KMOD`, `DMLC_KTEST`
//!   from kernel-driver/build.sh): dmlc-ktest on 2 and 4 VMs, as a non-root
//!   user, a process killed mid-collective, and `dmlc-guest --kernel`.
//! - `killed_driver`: a driver killed mid-collective; its freed hugepages
//!   are never written afterwards.
//! - `pause`: a VM stopped and resumed through QMP in a loop of
//!   collectives; its migration refused.

mod collectives;
mod common;
mod faults;
mod kernel_driver;
mod killed_driver;
mod pause;
mod plumbing;
mod tcp_vs_device;
