//! PCI transport: drives the virtio-dmlc PCI device (1af4:107f) from
//! userspace inside a guest, with no kernel driver.
//!
//! What it does, in order ([`PciTransport::open`]):
//!
//! 1. finds the device in `/sys/bus/pci/devices` ([`sysfs::PciBus`]);
//! 2. reads config space from sysfs `config` and walks the virtio vendor
//!    capabilities ([`caps::parse_virtio_caps`]): common config, notify
//!    (with its multiplier), ISR, device config;
//! 3. takes an exclusive `flock` on the `resourceN` file of the common
//!    config BAR, so a second driver process fails with [`PciError::InUse`]
//!    (as does one that has the BAR mapped without the lock);
//! 4. takes the device from kernel drivers: a foreign one (virtio-pci) is
//!    unbound; the device is bound to `uio_pci_generic` if that is loaded
//!    (or kept there), in every wait mode, and a file of its `/dev/uioN`
//!    is opened and held (see below); otherwise `driver_override` is set
//!    to `none`; then maps the BARs the capabilities point at (sysfs `resourceN`,
//!    `MAP_SHARED`);
//! 5. sets memory space and bus mastering in the command register;
//! 6. resets the device (writes status 0 and waits until it reads 0), then
//!    ACKNOWLEDGE and DRIVER.
//!
//! [`crate::Device::open`] continues with the [`Transport`] calls: features
//! (`FEATURES_OK` is read back), queues through the common config
//! (`queue_select`, `queue_size`, ring addresses, `queue_enable`), then
//! `DRIVER_OK`. Notifying writes the queue index at notify base +
//! `queue_notify_off` x multiplier. Device-visible memory comes from
//! [`crate::hugepage::HugepageMemory`]: guest-physical addresses, since the
//! guest has no IOMMU.
//!
//! A killed driver must not leave DMA in flight: whenever uio_pci_generic is
//! loaded the device is bound to it (in poll mode too), and a file of its
//! `/dev/uioN` is held open for the life of the transport. The kernel closes
//! it when the process dies, uio_pci_generic then turns bus mastering off,
//! and QEMU stops the device, so a pending collective cannot write into
//! hugepages that another process owns next. Without uio_pci_generic
//! nothing ties bus mastering to the process: the transport says so in a
//! warning (once) and carries on.
//!
//! In interrupt mode and in the hybrid wait (the default), with the device
//! bound to uio_pci_generic, a waiter sleeps on `/dev/uioN` (INTx; one file
//! per queue so that every queue's waiter sees every interrupt), reads the
//! ISR to clear it, and unmasks INTx in the command register again
//! (uio_pci_generic masks it in its handler and has no `irqcontrol`).
//!
//! A backend that restarts or a device that fails shows in
//! [`Transport::check_alive`] as [`TransportError::Disconnected`]:
//! `DEVICE_NEEDS_RESET` set, `DRIVER_OK` gone (a reset, or bus mastering
//! turned off, which QEMU answers by clearing `DRIVER_OK`), or the group id
//! in config space changed (a new backend process). The device must then be
//! initialised again: drop the [`crate::Device`] (which resets it) and open it
//! again, or, inside the Device, reset the transport and repeat the
//! `negotiate`, `setup_queue`, `driver_ok` calls with fresh rings (this
//! transport's `negotiate` starts over from reset when needed).

pub mod caps;
pub mod sysfs;

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::{
    VirtioDmlcConfig, CONFIG_SIZE, PCI_DEVICE_ID_DMLC, PCI_VENDOR_ID_VIRTIO, VIRTIO_F_VERSION_1,
};

use crate::device::{Device, OpenOptions};
use crate::error::Result;
use crate::hugepage::HugepageMemory;
use crate::transport::{QueueAddrs, Transport, TransportError};

use caps::{
    notify_offset, parse_virtio_caps, region_in_bar, CapError, CapRegion, VirtioCaps,
    COMMON_CFG_LEN, ISR_LEN, PCI_COMMAND, PCI_COMMAND_INTX_DISABLE, PCI_COMMAND_MASTER,
    PCI_COMMAND_MEMORY,
};
use sysfs::{BarMap, ConfigFile, PciBus, PciDeviceInfo};

/// Device status bits (virtio 1.x, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    pub const FAILED: u8 = 0x80;
}

/// Register offsets of `struct virtio_pci_common_cfg`.
mod common {
    pub const DEVICE_FEATURE_SELECT: usize = 0x00;
    pub const DEVICE_FEATURE: usize = 0x04;
    pub const DRIVER_FEATURE_SELECT: usize = 0x08;
    pub const DRIVER_FEATURE: usize = 0x0c;
    pub const CONFIG_MSIX_VECTOR: usize = 0x10;
    pub const NUM_QUEUES: usize = 0x12;
    pub const DEVICE_STATUS: usize = 0x14;
    pub const CONFIG_GENERATION: usize = 0x15;
    pub const QUEUE_SELECT: usize = 0x16;
    pub const QUEUE_SIZE: usize = 0x18;
    pub const QUEUE_MSIX_VECTOR: usize = 0x1a;
    pub const QUEUE_ENABLE: usize = 0x1c;
    pub const QUEUE_NOTIFY_OFF: usize = 0x1e;
    pub const QUEUE_DESC: usize = 0x20;
    pub const QUEUE_DRIVER: usize = 0x28;
    pub const QUEUE_DEVICE: usize = 0x30;
    /// "No MSI-X vector": interrupts go through INTx and the ISR.
    pub const NO_VECTOR: u16 = 0xffff;
}

/// How long the device may take to read back status 0 after a reset.
pub const RESET_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest single sleep on the interrupt, so that the caller's liveness
/// checks run even when nothing completes.
const MAX_IRQ_SLEEP: Duration = Duration::from_millis(50);
/// Sleep between ring checks in interrupt mode without an interrupt source.
const FALLBACK_NAP: Duration = Duration::from_micros(100);
/// How often [`Transport::check_alive`] re-reads the group id (a config
/// read is a round trip to the backend).
const GROUP_CHECK: Duration = Duration::from_millis(250);
/// Offset of `group_id` in the config space.
const GROUP_ID_OFFSET: usize = std::mem::offset_of!(VirtioDmlcConfig, group_id);

/// Errors of the PCI transport.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// sysfs config space, BARs and physical addresses need root.
    #[error("the PCI transport needs root (running as uid {uid})")]
    NotRoot { uid: u32 },
    /// No matching device.
    #[error("{wanted} not found; PCI devices: {}", list(found))]
    NoDevice { wanted: String, found: Vec<String> },
    /// The address given is not a PCI address.
    #[error("{0:?} is not a PCI address (expected dddd:bb:dd.f or bb:dd.f)")]
    BadAddress(String),
    /// The device at the address given is something else.
    #[error("{bdf} is {vendor:04x}:{device:04x}, not a virtio-dmlc device (1af4:107f)")]
    NotDmlc {
        bdf: String,
        vendor: u16,
        device: u16,
    },
    /// Another process drives the device.
    #[error("{bdf} is in use by another process{}", in_use_by(holders))]
    InUse { bdf: String, holders: Vec<String> },
    /// A sysfs file could not be read or written.
    #[error("cannot access {path}")]
    Sysfs {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The capabilities are missing or malformed.
    #[error("bad virtio-pci capabilities")]
    Caps(#[from] CapError),
    /// A BAR could not be mapped.
    #[error("cannot map BAR {bar} ({path})")]
    BarMap {
        bar: u8,
        path: String,
        #[source]
        source: io::Error,
    },
    /// The device does not come out of reset.
    #[error("device status reads {status:#04x}, not 0, {after:?} after a reset")]
    ResetTimeout { status: u8, after: Duration },
    /// The device did not keep FEATURES_OK.
    #[error("device refused features {features:#x} (FEATURES_OK not kept)")]
    FeaturesRefused { features: u64 },
    /// The device lacks a feature the transport needs.
    #[error("device does not offer {0}")]
    MissingFeature(&'static str),
    /// The device set DEVICE_NEEDS_RESET.
    #[error("device needs a reset (status {status:#04x})")]
    NeedsReset { status: u8 },
    /// A queue's size is not acceptable to the device.
    #[error("queue {queue}: size {size} is above the device's maximum {max}")]
    QueueSize { queue: u16, size: u16, max: u16 },
    /// The uio device could not be used.
    #[error("cannot use {path}")]
    Uio {
        path: String,
        #[source]
        source: io::Error,
    },
    /// A config read fell outside the device config region.
    #[error(
        "config read of {len} bytes at {offset} is outside the {size}-byte device config region"
    )]
    ConfigRange {
        offset: usize,
        len: usize,
        size: usize,
    },
    /// The config generation changed on every try.
    #[error("config space kept changing while read")]
    ConfigUnstable,
}

fn list(found: &[String]) -> String {
    if found.is_empty() {
        "none".into()
    } else {
        found.join("; ")
    }
}

fn in_use_by(holders: &[String]) -> String {
    if holders.is_empty() {
        String::new()
    } else {
        format!(" (mapped by {})", holders.join(", "))
    }
}

impl From<PciError> for TransportError {
    fn from(e: PciError) -> Self {
        TransportError::Protocol {
            during: "PCI device setup",
            source: Box::new(e),
        }
    }
}

fn protocol(during: &'static str) -> impl FnOnce(PciError) -> TransportError {
    move |e| TransportError::Protocol {
        during,
        source: Box::new(e),
    }
}

/// Orders this thread's earlier stores to ordinary memory (the rings, the
/// request headers) before its next store to device memory, as Linux's
/// `writel` does. Why: a notify (virtio 1.2 2.7.13.4) must reach the device
/// after the `avail.idx` it announces (2.7.13.3), and `DRIVER_OK` after the
/// rings it enables (3.1.1). The `SeqCst` fence of
/// [`crate::virtqueue::SplitQueue::needs_notify`] does not cover it
/// everywhere: on RISC-V `fence rw,rw` leaves device output (`o`)
/// unordered; on AArch64 `dmb ish` covers only the inner-shareable domain,
/// where `writel` uses `dmb oshst`. On x86-64 stores stay in order, uncached
/// device stores included: only the compiler must not move them.
#[inline(always)]
fn io_wmb() {
    // SAFETY: a barrier instruction only: it touches no register or memory
    // of the program (it may not be moved across memory accesses, hence no
    // `nomem`).
    #[cfg(target_arch = "aarch64")]
    unsafe {
        std::arch::asm!("dmb oshst", options(nostack, preserves_flags))
    };
    // SAFETY: as above.
    #[cfg(target_arch = "riscv64")]
    unsafe {
        std::arch::asm!("fence w,o", options(nostack, preserves_flags))
    };
    #[cfg(target_arch = "x86_64")]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(any(
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "x86_64"
    )))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// A window of device memory inside a mapped BAR. Accessors are volatile,
/// little-endian, naturally aligned, and bounds-checked; every store is
/// ordered after the thread's earlier stores to memory ([`io_wmb`]).
#[derive(Clone, Copy, Debug)]
struct Mmio {
    base: NonNull<u8>,
    len: usize,
}

impl Mmio {
    /// # Safety
    ///
    /// `base..base + len` must be mapped device memory (or plain memory in
    /// tests) that stays mapped as long as this value is used.
    unsafe fn new(base: NonNull<u8>, len: usize) -> Mmio {
        Mmio { base, len }
    }

    fn at<T>(&self, offset: usize) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!(
            offset.is_multiple_of(size) && offset + size <= self.len,
            "MMIO access of {size} bytes at {offset:#x} outside a {:#x}-byte region",
            self.len
        );
        // SAFETY: checked above to lie inside the region.
        unsafe { self.base.as_ptr().add(offset).cast() }
    }

    fn r8(&self, offset: usize) -> u8 {
        // SAFETY: `at` checked the bounds and alignment; the region is mapped.
        unsafe { self.at::<u8>(offset).read_volatile() }
    }

    fn r16(&self, offset: usize) -> u16 {
        // SAFETY: as in `r8`.
        u16::from_le(unsafe { self.at::<u16>(offset).read_volatile() })
    }

    fn r32(&self, offset: usize) -> u32 {
        // SAFETY: as in `r8`.
        u32::from_le(unsafe { self.at::<u32>(offset).read_volatile() })
    }

    fn w8(&self, offset: usize, v: u8) {
        io_wmb();
        // SAFETY: as in `r8`.
        unsafe { self.at::<u8>(offset).write_volatile(v) }
    }

    fn w16(&self, offset: usize, v: u16) {
        io_wmb();
        // SAFETY: as in `r8`.
        unsafe { self.at::<u16>(offset).write_volatile(v.to_le()) }
    }

    fn w32(&self, offset: usize, v: u32) {
        io_wmb();
        // SAFETY: as in `r8`.
        unsafe { self.at::<u32>(offset).write_volatile(v.to_le()) }
    }

    /// 64-bit registers as two 32-bit writes, low half first (virtio 4.1.3.1).
    fn w64(&self, offset: usize, v: u64) {
        self.w32(offset, v as u32);
        self.w32(offset + 4, (v >> 32) as u32);
    }
}

/// The virtio register protocol over the mapped regions; separate from the
/// sysfs side so that it can be tested on plain memory.
struct Regs {
    common: Mmio,
    notify: Mmio,
    notify_multiplier: u32,
    isr: Mmio,
    device: Mmio,
    /// Serialises sequences through the select registers.
    select: Mutex<()>,
}

impl Regs {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.select.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn status(&self) -> u8 {
        self.common.r8(common::DEVICE_STATUS)
    }

    fn set_status(&self, v: u8) {
        self.common.w8(common::DEVICE_STATUS, v);
    }

    fn add_status(&self, bits: u8) {
        self.set_status(self.status() | bits);
    }

    /// Writes 0 and waits for the device to read back 0 (virtio 4.1.4.3.2).
    fn reset(&self) -> std::result::Result<(), PciError> {
        self.set_status(0);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = self.status();
            if s == 0 {
                return Ok(());
            }
            if start.elapsed() >= RESET_TIMEOUT {
                return Err(PciError::ResetTimeout {
                    status: s,
                    after: RESET_TIMEOUT,
                });
            }
            spins += 1;
            if spins > 100 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Reset, ACKNOWLEDGE, DRIVER.
    fn begin(&self) -> std::result::Result<(), PciError> {
        self.reset()?;
        self.add_status(status::ACKNOWLEDGE);
        self.add_status(status::DRIVER);
        // Config changes are not signalled by MSI-X: they show in the ISR.
        self.common
            .w16(common::CONFIG_MSIX_VECTOR, common::NO_VECTOR);
        Ok(())
    }

    fn device_features(&self) -> u64 {
        let _g = self.lock();
        let mut f = 0u64;
        for sel in 0..2u32 {
            self.common.w32(common::DEVICE_FEATURE_SELECT, sel);
            f |= u64::from(self.common.r32(common::DEVICE_FEATURE)) << (32 * sel);
        }
        f
    }

    /// Writes the driver features and sets FEATURES_OK; fails if the device
    /// does not keep it.
    fn write_features(&self, features: u64) -> std::result::Result<(), PciError> {
        {
            let _g = self.lock();
            for sel in 0..2u32 {
                self.common.w32(common::DRIVER_FEATURE_SELECT, sel);
                self.common
                    .w32(common::DRIVER_FEATURE, (features >> (32 * sel)) as u32);
            }
        }
        self.add_status(status::FEATURES_OK);
        if self.status() & status::FEATURES_OK == 0 {
            self.add_status(status::FAILED);
            return Err(PciError::FeaturesRefused { features });
        }
        Ok(())
    }

    fn num_queues(&self) -> u16 {
        self.common.r16(common::NUM_QUEUES)
    }

    fn queue_max(&self, queue: u16) -> u16 {
        let _g = self.lock();
        self.common.w16(common::QUEUE_SELECT, queue);
        self.common.r16(common::QUEUE_SIZE)
    }

    /// Programs and enables one queue; returns the offset of its doorbell
    /// in the notify region.
    fn setup_queue(&self, queue: u16, a: &QueueAddrs) -> std::result::Result<usize, PciError> {
        let _g = self.lock();
        let c = &self.common;
        c.w16(common::QUEUE_SELECT, queue);
        let max = c.r16(common::QUEUE_SIZE);
        if a.size > max {
            return Err(PciError::QueueSize {
                queue,
                size: a.size,
                max,
            });
        }
        c.w16(common::QUEUE_SIZE, a.size);
        c.w16(common::QUEUE_MSIX_VECTOR, common::NO_VECTOR);
        c.w64(common::QUEUE_DESC, a.desc.paddr);
        c.w64(common::QUEUE_DRIVER, a.avail.paddr);
        c.w64(common::QUEUE_DEVICE, a.used.paddr);
        let off = notify_offset(
            self.notify.len as u32,
            self.notify_multiplier,
            c.r16(common::QUEUE_NOTIFY_OFF),
        )?;
        c.w16(common::QUEUE_ENABLE, 1);
        Ok(off)
    }

    /// Reads the device config consistently: retried while
    /// `config_generation` changes underneath.
    fn read_config(&self, offset: usize, buf: &mut [u8]) -> std::result::Result<(), PciError> {
        let size = self.device.len;
        let end =
            offset
                .checked_add(buf.len())
                .filter(|&e| e <= size)
                .ok_or(PciError::ConfigRange {
                    offset,
                    len: buf.len(),
                    size,
                })?;
        for _ in 0..64 {
            let before = self.common.r8(common::CONFIG_GENERATION);
            // Dword reads where the region allows (each read of the device
            // config may be a round trip to the backend), bytes at the edges.
            let mut pos = offset;
            while pos < end {
                if pos.is_multiple_of(4) && pos + 4 <= end {
                    let v = self.device.r32(pos).to_le_bytes();
                    buf[pos - offset..pos - offset + 4].copy_from_slice(&v);
                    pos += 4;
                } else {
                    buf[pos - offset] = self.device.r8(pos);
                    pos += 1;
                }
            }
            if self.common.r8(common::CONFIG_GENERATION) == before {
                return Ok(());
            }
        }
        Err(PciError::ConfigUnstable)
    }

    fn notify(&self, doorbell: usize, queue: u16) {
        self.notify.w16(doorbell, queue);
    }

    /// Reads (and so clears) the ISR status; bit 0: a queue interrupt,
    /// bit 1: a config change.
    fn read_isr(&self) -> u8 {
        self.isr.r8(0)
    }
}

/// The uio device of uio_pci_generic.
///
/// `guard` is opened at open and held for the life of the transport in
/// every wait mode: uio_pci_generic turns bus mastering off when a file of
/// it is closed, and the kernel closes it when the process dies (SIGKILL
/// included), so a killed driver cannot leave the device doing DMA into
/// hugepages that another process may own next (QEMU stops the device when
/// bus mastering goes off). In interrupt mode there is also one open file
/// per queue, each a separate listener that sees every interrupt.
struct Uio {
    node: PathBuf,
    _guard: File,
    /// Open the per-queue listeners (interrupt mode).
    listen: bool,
    files: Vec<Option<File>>,
}

/// The "no uio device" warning is given once per process.
static NO_UIO_WARNED: AtomicBool = AtomicBool::new(false);

impl Uio {
    fn open_listener(&self) -> std::result::Result<File, PciError> {
        open_uio(&self.node)
    }
}

fn open_uio(node: &Path) -> std::result::Result<File, PciError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(node)
        .map_err(|source| PciError::Uio {
            path: node.display().to_string(),
            source,
        })
}

/// A virtio-dmlc device driven through sysfs from userspace (see the
/// module documentation).
pub struct PciTransport {
    info: PciDeviceInfo,
    caps: VirtioCaps,
    config: ConfigFile,
    regs: Regs,
    device_features: u64,
    features: u64,
    num_queues: u16,
    /// Doorbell offset in the notify region, per queue set up.
    doorbells: Vec<Option<usize>>,
    uio: Option<Uio>,
    /// DRIVER_OK was set and not reset since.
    live: AtomicBool,
    /// Group id read at DRIVER_OK, to recognise a restarted backend.
    group_id: AtomicU64,
    last_group_check: Mutex<Instant>,
    /// Serialises read-modify-writes of the command register.
    command: Mutex<()>,
    // Declared last so they are dropped last: the regions point into them.
    _bars: Vec<BarMap>,
    /// The flocked resource file: the device lock, released on close.
    _lock: File,
}

impl PciTransport {
    /// Finds and claims the device (see the module documentation); `addr`
    /// is a PCI address (`0000:00:03.0` or `00:03.0`), `None` takes the
    /// first virtio-dmlc device. With `interrupts`, binds the device to
    /// uio_pci_generic when that driver is loaded so that
    /// [`Transport::wait_interrupt`] sleeps on INTx.
    pub fn open(
        addr: Option<&str>,
        interrupts: bool,
    ) -> std::result::Result<PciTransport, PciError> {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(PciError::NotRoot { uid });
        }
        let bus = PciBus::system();
        let info = bus.find(addr, PCI_VENDOR_ID_VIRTIO, PCI_DEVICE_ID_DMLC)?;
        let config = ConfigFile::open(&info)?;
        let caps = parse_virtio_caps(&config.read_all()?)?;
        // Lock first, then take the device from kernel drivers, then map:
        // a driver that still claims the BARs could have the kernel revoke
        // a mapping made before it lets go.
        let lock = sysfs::lock_device(&info, caps.common.bar)?;
        let uio_node = bus.take_over(&info, interrupts)?;
        // Held from before bus mastering is turned on until the transport
        // is dropped (see `Uio`).
        let uio = match uio_node {
            Some(node) => {
                let guard = open_uio(&node)?;
                Some(Uio {
                    node,
                    _guard: guard,
                    listen: interrupts,
                    files: Vec::new(),
                })
            }
            None => {
                if !NO_UIO_WARNED.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "{}: not bound to {}: no file ties bus mastering to this process, so \
                         if it is killed with requests in flight the device may still write \
                         into its hugepages after another process got them (load {} to \
                         prevent that)",
                        info.bdf,
                        sysfs::UIO_DRIVER,
                        sysfs::UIO_DRIVER
                    );
                }
                None
            }
        };
        let mut bars: Vec<BarMap> = Vec::new();
        for bar in [
            caps.common.bar,
            caps.notify.bar,
            caps.isr.bar,
            caps.device.bar,
        ] {
            if !bars.iter().any(|b| b.index == bar) {
                bars.push(BarMap::map(&info, bar)?);
            }
        }
        let region = |what, cap: &CapRegion, need| -> std::result::Result<Mmio, PciError> {
            let bar = bars
                .iter()
                .find(|b| b.index == cap.bar)
                .expect("every capability's BAR was mapped");
            let (offset, len) = region_in_bar(what, cap, need, bar.len())?;
            let base = NonNull::new(bar.as_ptr().wrapping_add(offset))
                .expect("a mapping does not wrap to null");
            // SAFETY: `region_in_bar` checked that the window lies inside the
            // mapped BAR, which the transport keeps until it is dropped.
            Ok(unsafe { Mmio::new(base, len) })
        };
        let regs = Regs {
            common: region("common config", &caps.common, COMMON_CFG_LEN)?,
            notify: region("notify", &caps.notify, 2)?,
            notify_multiplier: caps.notify_off_multiplier,
            isr: region("ISR", &caps.isr, ISR_LEN)?,
            device: region("device config", &caps.device, CONFIG_SIZE)?,
            select: Mutex::new(()),
        };
        let mut t = PciTransport {
            info,
            caps,
            config,
            regs,
            device_features: 0,
            features: 0,
            num_queues: 0,
            doorbells: Vec::new(),
            uio,
            live: AtomicBool::new(false),
            group_id: AtomicU64::new(0),
            last_group_check: Mutex::new(Instant::now()),
            command: Mutex::new(()),
            _bars: bars,
            _lock: lock,
        };
        t.update_command(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER, 0)?;
        t.regs.begin()?;
        t.device_features = t.regs.device_features();
        t.num_queues = t.regs.num_queues();
        t.doorbells = vec![None; usize::from(t.num_queues)];
        if let Some(uio) = &mut t.uio {
            uio.files = (0..t.num_queues).map(|_| None).collect();
        }
        // A previous user may have left INTx masked.
        if t.uio.is_some() {
            t.update_command(0, PCI_COMMAND_INTX_DISABLE)?;
        }
        log::info!(
            "{}: virtio-dmlc over PCI, {} queues, features {:#x}, {}",
            t.info.bdf,
            t.num_queues,
            t.device_features,
            match &t.uio {
                Some(u) if u.listen => format!("interrupts through {}", u.node.display()),
                Some(u) => format!("polling, bus mastering tied to {}", u.node.display()),
                None => "no interrupt source (polling), no uio device".into(),
            }
        );
        Ok(t)
    }

    /// The device's PCI address.
    pub fn bdf(&self) -> &str {
        &self.info.bdf
    }

    /// The device as sysfs listed it at open.
    pub fn info(&self) -> &PciDeviceInfo {
        &self.info
    }

    /// The virtio capabilities found.
    pub fn caps(&self) -> &VirtioCaps {
        &self.caps
    }

    /// `/dev/uioN` when interrupts come through uio_pci_generic.
    pub fn uio_node(&self) -> Option<&Path> {
        self.uio.as_ref().map(|u| u.node.as_path())
    }

    /// The device status register now (see [`status`]).
    pub fn device_status(&self) -> u8 {
        self.regs.status()
    }

    /// Feature bits negotiated (0 before [`Transport::negotiate`]).
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Resets the device and offers it `features` as they are, without the
    /// driver's own check (VIRTIO_F_VERSION_1 required); returns whether
    /// the device kept FEATURES_OK. A refusal leaves FAILED set until the
    /// next reset. For conformance probes (`pci_probe --features-check`);
    /// drivers use [`Transport::negotiate`].
    pub fn offer_features_unchecked(
        &mut self,
        features: u64,
    ) -> std::result::Result<bool, PciError> {
        self.live.store(false, Ordering::Relaxed);
        self.features = 0;
        self.regs.begin()?;
        match self.regs.write_features(features) {
            Ok(()) => {
                self.features = features;
                Ok(true)
            }
            Err(PciError::FeaturesRefused { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sets `set` and clears `clear` in the PCI command register.
    fn update_command(&self, set: u16, clear: u16) -> std::result::Result<(), PciError> {
        let _g = self.command.lock().unwrap_or_else(|e| e.into_inner());
        let cmd = self.config.read_u16(PCI_COMMAND)?;
        let new = (cmd | set) & !clear;
        if new != cmd {
            self.config.write_u16(PCI_COMMAND, new)?;
        }
        Ok(())
    }

    fn doorbell(&self, queue: u16) -> std::result::Result<usize, TransportError> {
        self.doorbells
            .get(usize::from(queue))
            .copied()
            .flatten()
            .ok_or(TransportError::NoSuchQueue {
                queue,
                max: self.num_queues,
            })
    }

    fn check_group(&self) -> std::result::Result<(), TransportError> {
        {
            let mut last = self
                .last_group_check
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if last.elapsed() < GROUP_CHECK {
                return Ok(());
            }
            *last = Instant::now();
        }
        let mut raw = [0u8; 8];
        self.regs
            .read_config(GROUP_ID_OFFSET, &mut raw)
            .map_err(protocol("reading the group id"))?;
        if u64::from_le_bytes(raw) != self.group_id.load(Ordering::Relaxed) {
            return Err(TransportError::Disconnected {
                during: "the backend restarted: the group id changed",
            });
        }
        Ok(())
    }
}

impl Transport for PciTransport {
    fn device_features(&self) -> u64 {
        self.device_features
    }

    fn negotiate(&mut self, features: u64) -> std::result::Result<(), TransportError> {
        if features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(protocol("feature negotiation")(PciError::MissingFeature(
                "VIRTIO_F_VERSION_1",
            )));
        }
        // After a reset (re-initialisation) start over from ACKNOWLEDGE.
        if self.regs.status() != status::ACKNOWLEDGE | status::DRIVER {
            self.live.store(false, Ordering::Relaxed);
            self.regs.begin().map_err(protocol("device reset"))?;
        }
        self.regs
            .write_features(features)
            .map_err(protocol("feature negotiation"))?;
        self.features = features;
        Ok(())
    }

    fn max_queues(&self) -> u16 {
        self.num_queues
    }

    fn max_queue_size(&self, queue: u16) -> u16 {
        if queue >= self.num_queues {
            return 0;
        }
        self.regs.queue_max(queue)
    }

    fn read_config(
        &self,
        offset: usize,
        buf: &mut [u8],
    ) -> std::result::Result<(), TransportError> {
        self.regs
            .read_config(offset, buf)
            .map_err(protocol("reading the device config"))
    }

    fn setup_queue(
        &mut self,
        queue: u16,
        addrs: &QueueAddrs,
    ) -> std::result::Result<(), TransportError> {
        if queue >= self.num_queues {
            return Err(TransportError::NoSuchQueue {
                queue,
                max: self.num_queues,
            });
        }
        let index = usize::from(queue);
        if let Some(uio) = self.uio.as_mut().filter(|u| u.listen) {
            // Opened once and kept: closing a uio file makes
            // uio_pci_generic turn bus mastering off.
            if uio.files[index].is_none() {
                uio.files[index] = Some(uio.open_listener().map_err(protocol("queue setup"))?);
            }
        }
        let bell = self
            .regs
            .setup_queue(queue, addrs)
            .map_err(protocol("queue setup"))?;
        self.doorbells[index] = Some(bell);
        Ok(())
    }

    fn driver_ok(&mut self) -> std::result::Result<(), TransportError> {
        // Opening the uio files may have raced with another process closing
        // one (which clears bus mastering): make sure it is on.
        self.update_command(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER, 0)?;
        self.regs.add_status(status::DRIVER_OK);
        let s = self.regs.status();
        if s & status::DEVICE_NEEDS_RESET != 0 || s & status::DRIVER_OK == 0 {
            return Err(protocol("DRIVER_OK")(PciError::NeedsReset { status: s }));
        }
        let mut raw = [0u8; 8];
        self.read_config(GROUP_ID_OFFSET, &mut raw)?;
        self.group_id
            .store(u64::from_le_bytes(raw), Ordering::Relaxed);
        self.live.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn notify(&self, queue: u16) -> std::result::Result<(), TransportError> {
        let bell = self.doorbell(queue)?;
        self.regs.notify(bell, queue);
        Ok(())
    }

    fn can_sleep(&self) -> bool {
        self.uio.as_ref().is_some_and(|u| u.listen)
    }

    fn wait_interrupt(
        &self,
        queue: u16,
        timeout: Option<Duration>,
    ) -> std::result::Result<bool, TransportError> {
        self.doorbell(queue)?;
        let nap = timeout.map_or(MAX_IRQ_SLEEP, |t| t.min(MAX_IRQ_SLEEP));
        let Some(file) = self
            .uio
            .as_ref()
            .and_then(|u| u.files[usize::from(queue)].as_ref())
        else {
            // No interrupt source: a short sleep stands in for one.
            std::thread::sleep(nap.min(FALLBACK_NAP));
            return Ok(true);
        };
        let mut fds = [libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let ms = i32::try_from(nap.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        if crate::transport::poll_fds(&mut fds, ms, "polling the uio device")? == 0 {
            // Not the caller's timeout necessarily; it re-checks the ring
            // and the device and comes back.
            return Ok(false);
        }
        let mut count = [0u8; 4];
        match (&*file).read(&mut count) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(source) => {
                return Err(TransportError::Io {
                    during: "reading the uio device",
                    source,
                })
            }
        }
        // Clear the ISR first (that lowers INTx), then unmask INTx, which
        // uio_pci_generic masked in its interrupt handler.
        self.regs.read_isr();
        self.update_command(0, PCI_COMMAND_INTX_DISABLE)
            .map_err(protocol("unmasking INTx"))?;
        Ok(true)
    }

    fn check_alive(&self) -> std::result::Result<(), TransportError> {
        let s = self.regs.status();
        if s & status::DEVICE_NEEDS_RESET != 0 {
            return Err(TransportError::Disconnected {
                during: "the device set DEVICE_NEEDS_RESET",
            });
        }
        if self.live.load(Ordering::Relaxed) {
            if s & status::DRIVER_OK == 0 {
                return Err(TransportError::Disconnected {
                    during: "the device was reset behind the driver: DRIVER_OK cleared",
                });
            }
            self.check_group()?;
        }
        Ok(())
    }

    fn reset(&mut self) -> std::result::Result<(), TransportError> {
        self.live.store(false, Ordering::Relaxed);
        self.doorbells.iter_mut().for_each(|d| *d = None);
        self.regs.reset().map_err(protocol("device reset"))
    }
}

impl Drop for PciTransport {
    fn drop(&mut self) {
        // The device must not touch the rings once their memory is freed.
        if self.regs.status() != 0 {
            if let Err(e) = self.regs.reset() {
                log::warn!("{}: reset on close failed: {e}", self.info.bdf);
            }
        }
    }
}

// SAFETY: the raw pointers in the register windows point into BAR mappings
// that the transport owns; the select and command sequences are serialised
// by mutexes, and single register accesses are atomic on the bus.
unsafe impl Send for PciTransport {}
// SAFETY: as above.
unsafe impl Sync for PciTransport {}

/// Opens the virtio-dmlc PCI device from inside a guest: `addr` is its
/// PCI address (`0000:00:03.0`), `None` takes the first one. Needs root,
/// and `opts.dma_bytes` worth of free 2 MiB hugepages. The device is
/// bound to uio_pci_generic when that is loaded, in either wait mode, and
/// a file of its uio device is held open so that bus mastering ends with
/// the process (a killed driver leaves no DMA in flight); without
/// uio_pci_generic a warning says that nothing does, and interrupt mode
/// polls with short sleeps.
pub fn open(addr: Option<&str>, opts: &OpenOptions) -> Result<Device> {
    let transport = PciTransport::open(addr, !opts.poll).map_err(TransportError::from)?;
    let mem = HugepageMemory::new(opts.dma_bytes).map_err(|e| TransportError::Protocol {
        during: "DMA memory setup",
        source: Box::new(e),
    })?;
    Device::open(Box::new(transport), Arc::new(mem), opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::RingAddr;

    /// Plain memory standing in for the four register windows. Writes read
    /// back as written, so the register protocol can be checked but not
    /// the device's side effects.
    struct FakeRegs {
        _mem: Vec<u64>,
        regs: Regs,
    }

    fn fake_regs(device_len: usize) -> FakeRegs {
        let mut mem = vec![0u64; 0x4000 / 8];
        let base = mem.as_mut_ptr().cast::<u8>();
        let window = |off: usize, len: usize| {
            // SAFETY: `off + len <= 0x4000`, inside `mem`, which outlives
            // the windows (both live in the returned value).
            unsafe { Mmio::new(NonNull::new(base.add(off)).unwrap(), len) }
        };
        let regs = Regs {
            common: window(0, 0x1000),
            isr: window(0x1000, 0x1000),
            device: window(0x2000, device_len),
            notify: window(0x3000, 0x1000),
            notify_multiplier: 4,
            select: Mutex::new(()),
        };
        FakeRegs { _mem: mem, regs }
    }

    #[test]
    fn queue_setup_programs_the_common_config() {
        let f = fake_regs(0x1000);
        let r = &f.regs;
        // The device's maximum for the selected queue, and its notify offset.
        r.common.w16(common::QUEUE_SIZE, 256);
        r.common.w16(common::QUEUE_NOTIFY_OFF, 3);
        let ring = |paddr| RingAddr { vaddr: 0, paddr };
        let addrs = QueueAddrs {
            size: 128,
            desc: ring(0x1_2340_0000),
            avail: ring(0x5000),
            used: ring(0xdead_b000_0000_1000),
        };
        let bell = r.setup_queue(3, &addrs).unwrap();
        assert_eq!(bell, 12);
        let c = &r.common;
        assert_eq!(c.r16(common::QUEUE_SELECT), 3);
        assert_eq!(c.r16(common::QUEUE_SIZE), 128);
        assert_eq!(c.r16(common::QUEUE_MSIX_VECTOR), common::NO_VECTOR);
        assert_eq!(c.r32(common::QUEUE_DESC), 0x2340_0000);
        assert_eq!(c.r32(common::QUEUE_DESC + 4), 1);
        assert_eq!(c.r32(common::QUEUE_DRIVER), 0x5000);
        assert_eq!(c.r32(common::QUEUE_DEVICE), 0x0000_1000);
        assert_eq!(c.r32(common::QUEUE_DEVICE + 4), 0xdead_b000);
        assert_eq!(c.r16(common::QUEUE_ENABLE), 1);
        r.notify(bell, 3);
        assert_eq!(r.notify.r16(12), 3);
        // A size above the device's maximum is refused.
        let big = QueueAddrs { size: 512, ..addrs };
        r.common.w16(common::QUEUE_SIZE, 256);
        assert!(matches!(
            r.setup_queue(0, &big),
            Err(PciError::QueueSize {
                queue: 0,
                size: 512,
                max: 256
            })
        ));
        // A notify offset beyond the notify region.
        r.common.w16(common::QUEUE_NOTIFY_OFF, 1024);
        assert!(matches!(
            r.setup_queue(0, &addrs),
            Err(PciError::Caps(CapError::NotifyOutside { .. }))
        ));
    }

    #[test]
    fn init_sequence_and_features() {
        let f = fake_regs(0x1000);
        let r = &f.regs;
        r.set_status(status::DRIVER_OK | status::FEATURES_OK);
        r.begin().unwrap();
        assert_eq!(r.status(), status::ACKNOWLEDGE | status::DRIVER);
        r.write_features(0x1_2000_0001).unwrap();
        assert_eq!(
            r.status(),
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK
        );
        // The last select written was 1: the high half is in the register.
        assert_eq!(r.common.r32(common::DRIVER_FEATURE_SELECT), 1);
        assert_eq!(r.common.r32(common::DRIVER_FEATURE), 1);
        // Device features: plain memory reads back the same word for both
        // selects.
        r.common.w32(common::DEVICE_FEATURE, 0x8000_0001);
        assert_eq!(r.device_features(), 0x8000_0001_8000_0001);
    }

    #[test]
    fn config_reads_are_bounded_and_byte_exact() {
        let f = fake_regs(CONFIG_SIZE);
        let r = &f.regs;
        for i in 0..CONFIG_SIZE / 4 {
            let b = (4 * i) as u8;
            r.device
                .w32(4 * i, u32::from_le_bytes([b, b + 1, b + 2, b + 3]));
        }
        let mut all = [0u8; CONFIG_SIZE];
        r.read_config(0, &mut all).unwrap();
        assert!(all.iter().enumerate().all(|(i, &b)| b == i as u8));
        // Unaligned start and end.
        let mut mid = [0u8; 7];
        r.read_config(3, &mut mid).unwrap();
        assert_eq!(mid, [3, 4, 5, 6, 7, 8, 9]);
        let mut over = [0u8; 8];
        assert!(matches!(
            r.read_config(CONFIG_SIZE - 4, &mut over),
            Err(PciError::ConfigRange { .. })
        ));
        assert!(matches!(
            r.read_config(usize::MAX, &mut over),
            Err(PciError::ConfigRange { .. })
        ));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn mmio_accesses_are_bounds_checked() {
        let f = fake_regs(CONFIG_SIZE);
        f.regs.device.r32(CONFIG_SIZE);
    }

    #[test]
    fn errors_read_well() {
        let e = PciError::NoDevice {
            wanted: "virtio-dmlc device (1af4:107f)".into(),
            found: vec![],
        };
        assert_eq!(
            e.to_string(),
            "virtio-dmlc device (1af4:107f) not found; PCI devices: none"
        );
        let e = PciError::InUse {
            bdf: "0000:00:01.0".into(),
            holders: vec!["42 (dmlc-guest)".into()],
        };
        assert_eq!(
            e.to_string(),
            "0000:00:01.0 is in use by another process (mapped by 42 (dmlc-guest))"
        );
        let t = TransportError::from(PciError::NotRoot { uid: 1000 });
        assert_eq!(t.to_string(), "PCI device setup failed");
        let src = std::error::Error::source(&t).unwrap().to_string();
        assert_eq!(src, "the PCI transport needs root (running as uid 1000)");
    }
}
