//! The PCI device as sysfs shows it: finding it, taking it from kernel
//! drivers, its config space file, mapping its BARs, and the lock that keeps
//! a second driver process away.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use super::PciError;

/// Where the kernel lists PCI devices and drivers.
pub const SYSFS_PCI: &str = "/sys/bus/pci";
/// The kernel driver that gives userspace a device's INTx interrupt.
pub const UIO_DRIVER: &str = "uio_pci_generic";

/// Normalises a PCI address: `bb:dd.f` gets domain `0000`; hex digits are
/// lower-cased. Returns `None` if `addr` is not `[dddd:]bb:dd.f`.
pub fn normalize_bdf(addr: &str) -> Option<String> {
    let addr = addr.trim().to_ascii_lowercase();
    let full = if addr.len() == 7 {
        format!("0000:{addr}")
    } else {
        addr
    };
    let b = full.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    let ok = b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11]);
    ok.then_some(full)
}

/// One PCI device as sysfs lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDeviceInfo {
    /// Address, `dddd:bb:dd.f`.
    pub bdf: String,
    pub vendor: u16,
    pub device: u16,
    /// Class code (base class, subclass, programming interface).
    pub class: u32,
    /// Name of the bound driver, if any.
    pub driver: Option<String>,
    /// `/sys/bus/pci/devices/<bdf>` (or its stand-in in tests).
    pub path: PathBuf,
}

impl fmt::Display for PciDeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:04x}:{:04x} class {:06x} driver {}",
            self.bdf,
            self.vendor,
            self.device,
            self.class,
            self.driver.as_deref().unwrap_or("none")
        )
    }
}

fn sysfs_error(path: &Path) -> impl FnOnce(io::Error) -> PciError + '_ {
    move |source| PciError::Sysfs {
        path: path.display().to_string(),
        source,
    }
}

fn read_hex(path: &Path) -> Result<u32, PciError> {
    let text = std::fs::read_to_string(path).map_err(sysfs_error(path))?;
    let t = text.trim();
    u32::from_str_radix(t.strip_prefix("0x").unwrap_or(t), 16).map_err(|_| PciError::Sysfs {
        path: path.display().to_string(),
        source: io::Error::new(io::ErrorKind::InvalidData, format!("not hex: {t:?}")),
    })
}

fn write_str(path: &Path, value: &str) -> Result<(), PciError> {
    std::fs::write(path, value).map_err(sysfs_error(path))
}

/// The PCI bus in sysfs. `root` is `/sys/bus/pci` except in tests.
#[derive(Clone, Debug)]
pub struct PciBus {
    root: PathBuf,
}

impl PciBus {
    /// The system's PCI bus.
    pub fn system() -> PciBus {
        PciBus {
            root: PathBuf::from(SYSFS_PCI),
        }
    }

    /// A bus rooted elsewhere (a fake tree in tests).
    pub fn at(root: impl Into<PathBuf>) -> PciBus {
        PciBus { root: root.into() }
    }

    /// Every device, sorted by address.
    pub fn devices(&self) -> Result<Vec<PciDeviceInfo>, PciError> {
        let dir = self.root.join("devices");
        let entries = std::fs::read_dir(&dir).map_err(sysfs_error(&dir))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(sysfs_error(&dir))?;
            let bdf = entry.file_name().to_string_lossy().into_owned();
            out.push(self.info(&bdf)?);
        }
        out.sort_by(|a, b| a.bdf.cmp(&b.bdf));
        Ok(out)
    }

    /// The device at `bdf` (already normalised).
    pub fn info(&self, bdf: &str) -> Result<PciDeviceInfo, PciError> {
        let path = self.root.join("devices").join(bdf);
        let driver = std::fs::read_link(path.join("driver"))
            .ok()
            .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
        Ok(PciDeviceInfo {
            bdf: bdf.to_string(),
            vendor: read_hex(&path.join("vendor"))? as u16,
            device: read_hex(&path.join("device"))? as u16,
            class: read_hex(&path.join("class"))?,
            driver,
            path,
        })
    }

    /// The device at `addr`, which must be a `vendor:device`; or, with no
    /// address, the first such device.
    pub fn find(
        &self,
        addr: Option<&str>,
        vendor: u16,
        device: u16,
    ) -> Result<PciDeviceInfo, PciError> {
        let matches = |d: &PciDeviceInfo| d.vendor == vendor && d.device == device;
        let not_found = |devices: Vec<PciDeviceInfo>, wanted: String| PciError::NoDevice {
            wanted,
            found: devices.iter().map(ToString::to_string).collect(),
        };
        match addr {
            Some(a) => {
                let bdf = normalize_bdf(a).ok_or_else(|| PciError::BadAddress(a.to_string()))?;
                if !self.root.join("devices").join(&bdf).exists() {
                    return Err(not_found(self.devices()?, format!("device {bdf}")));
                }
                let info = self.info(&bdf)?;
                if !matches(&info) {
                    return Err(PciError::NotDmlc {
                        bdf,
                        vendor: info.vendor,
                        device: info.device,
                    });
                }
                Ok(info)
            }
            None => {
                let devices = self.devices()?;
                match devices.iter().find(|d| matches(d)) {
                    Some(d) => Ok(d.clone()),
                    None => Err(not_found(
                        devices,
                        format!("virtio-dmlc device ({vendor:04x}:{device:04x})"),
                    )),
                }
            }
        }
    }

    /// Makes sure no kernel driver but `uio_pci_generic` holds the device.
    ///
    /// A foreign driver (virtio-pci) is unbound. If the device is free and
    /// uio_pci_generic is loaded, the device is bound to it, whatever the
    /// wait mode: an open file of its uio device ties bus mastering to the
    /// process (uio_pci_generic turns it off when the file is closed, also
    /// when the process is killed), and in interrupt mode it delivers INTx.
    /// Otherwise `driver_override` is set to `none` so that no driver takes
    /// the device later. Returns the uio device node if the device ends up
    /// bound to uio_pci_generic. (`want_irq` only changes the warning when
    /// uio_pci_generic is not loaded.)
    pub fn take_over(
        &self,
        dev: &PciDeviceInfo,
        want_irq: bool,
    ) -> Result<Option<PathBuf>, PciError> {
        match dev.driver.as_deref() {
            Some(UIO_DRIVER) => return self.uio_node(dev).map(Some),
            Some(other) => {
                log::info!("unbinding {} from kernel driver {other}", dev.bdf);
                write_str(&dev.path.join("driver").join("unbind"), &dev.bdf)?;
            }
            None => {}
        }
        let override_path = dev.path.join("driver_override");
        let uio = self.root.join("drivers").join(UIO_DRIVER);
        if uio.exists() {
            write_str(&override_path, UIO_DRIVER)?;
            match write_str(&uio.join("bind"), &dev.bdf) {
                Ok(()) => return self.uio_node(dev).map(Some),
                Err(e) => log::warn!("cannot bind {} to {UIO_DRIVER}: {e}", dev.bdf),
            }
        } else if want_irq {
            log::warn!(
                "{UIO_DRIVER} is not loaded: interrupt mode falls back to sleeping polls \
                 (load it, or boot with dmlc.bind={UIO_DRIVER})"
            );
        }
        let current = std::fs::read_to_string(&override_path).unwrap_or_default();
        if current.trim() != "none" {
            write_str(&override_path, "none")?;
        }
        Ok(None)
    }

    /// `/dev/uioN` of a device bound to uio_pci_generic (from its sysfs
    /// `uio/uioN` entry); waits briefly for devtmpfs to create the node
    /// after a fresh bind.
    pub fn uio_node(&self, dev: &PciDeviceInfo) -> Result<PathBuf, PciError> {
        let dir = dev.path.join("uio");
        let name = std::fs::read_dir(&dir)
            .map_err(sysfs_error(&dir))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("uio"))
            .ok_or_else(|| PciError::Sysfs {
                path: dir.display().to_string(),
                source: io::Error::new(io::ErrorKind::NotFound, "no uio device"),
            })?;
        let node = self.dev_dir().join(&name);
        let start = Instant::now();
        while !node.exists() && start.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(node)
    }

    /// `/dev`, or `dev` beside the fake tree in tests.
    fn dev_dir(&self) -> PathBuf {
        if self.root == Path::new(SYSFS_PCI) {
            PathBuf::from("/dev")
        } else {
            self.root.join("dev")
        }
    }
}

/// The device's config space through sysfs `config` (root sees all of it).
#[derive(Debug)]
pub struct ConfigFile {
    file: File,
    path: PathBuf,
}

impl ConfigFile {
    pub fn open(dev: &PciDeviceInfo) -> Result<ConfigFile, PciError> {
        let path = dev.path.join("config");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(sysfs_error(&path))?;
        Ok(ConfigFile { file, path })
    }

    /// Reads the config space: up to 4096 bytes for PCI Express devices,
    /// 256 for conventional ones.
    pub fn read_all(&self) -> Result<Vec<u8>, PciError> {
        let mut buf = vec![0u8; 4096];
        let mut got = 0;
        while got < buf.len() {
            match self.file.read_at(&mut buf[got..], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(sysfs_error(&self.path)(e)),
            }
        }
        buf.truncate(got);
        if got < 256 {
            return Err(PciError::Sysfs {
                path: self.path.display().to_string(),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{got} bytes of config space readable (root sees 256)"),
                ),
            });
        }
        Ok(buf)
    }

    pub fn read_u16(&self, offset: usize) -> Result<u16, PciError> {
        let mut b = [0u8; 2];
        self.file
            .read_exact_at(&mut b, offset as u64)
            .map_err(sysfs_error(&self.path))?;
        Ok(u16::from_le_bytes(b))
    }

    pub fn write_u16(&self, offset: usize, value: u16) -> Result<(), PciError> {
        self.file
            .write_all_at(&value.to_le_bytes(), offset as u64)
            .map_err(sysfs_error(&self.path))
    }
}

/// One BAR mapped through sysfs `resourceN`.
#[derive(Debug)]
pub struct BarMap {
    pub index: u8,
    ptr: NonNull<u8>,
    len: usize,
    /// The resource file the mapping was made from.
    _file: File,
}

// SAFETY: the mapping is owned by this value; accesses through it are
// volatile MMIO done by the transport, which serialises what must be.
unsafe impl Send for BarMap {}
// SAFETY: as above.
unsafe impl Sync for BarMap {}

impl BarMap {
    /// Maps all of BAR `index` shared. The file size of `resourceN` is the
    /// BAR size.
    pub fn map(dev: &PciDeviceInfo, index: u8) -> Result<BarMap, PciError> {
        let path = dev.path.join(format!("resource{index}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_SYNC | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| PciError::BarMap {
                bar: index,
                path: path.display().to_string(),
                source,
            })?;
        let len = file
            .metadata()
            .map_err(|source| PciError::BarMap {
                bar: index,
                path: path.display().to_string(),
                source,
            })?
            .len() as usize;
        if len == 0 {
            return Err(PciError::BarMap {
                bar: index,
                path: path.display().to_string(),
                source: io::Error::new(io::ErrorKind::InvalidData, "BAR has size 0"),
            });
        }
        // SAFETY: a fresh shared mapping of the resource file (no MAP_FIXED);
        // the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(PciError::BarMap {
                bar: index,
                path: path.display().to_string(),
                source: io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| PciError::BarMap {
            bar: index,
            path: path.display().to_string(),
            source: io::Error::other("mmap returned a null pointer"),
        })?;
        Ok(BarMap {
            index,
            ptr,
            len,
            _file: file,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the BAR has no bytes (never: mapping refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for BarMap {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map` with this length; the
        // transport that used it is being dropped.
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
            log::warn!(
                "munmap of BAR {} failed: {}",
                self.index,
                io::Error::last_os_error()
            );
        }
    }
}

/// Takes the device lock: an exclusive `flock` on the device's
/// `resource<bar>` file (the BAR with the common config), held as long as
/// the returned file is open. Fails with [`PciError::InUse`] if another
/// process holds the lock or has that BAR mapped.
pub fn lock_device(dev: &PciDeviceInfo, bar: u8) -> Result<File, PciError> {
    let path = dev.path.join(format!("resource{bar}"));
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(sysfs_error(&path))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(PciError::InUse {
                bdf: dev.bdf.clone(),
                holders: holders_of(&path),
            });
        }
        return Err(sysfs_error(&path)(e));
    }
    // A program that maps the BAR without taking the lock (a debugging
    // tool, another driver) shows up in /proc/PID/maps.
    let holders = holders_of(&path);
    if !holders.is_empty() {
        return Err(PciError::InUse {
            bdf: dev.bdf.clone(),
            holders,
        });
    }
    Ok(file)
}

/// Other processes that map `path` (`pid (comm)` each), from /proc/*/maps.
pub fn holders_of(path: &Path) -> Vec<String> {
    let Ok(real) = std::fs::canonicalize(path) else {
        return Vec::new();
    };
    let real = real.to_string_lossy().into_owned();
    let me = std::process::id().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.filter_map(|e| e.ok()) {
        let pid = p.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(maps) = std::fs::read_to_string(p.path().join("maps")) else {
            continue;
        };
        if maps.lines().any(|l| l.ends_with(real.as_str())) {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push(format!("{pid} ({})", comm.trim()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_normalise() {
        assert_eq!(normalize_bdf("00:03.0").as_deref(), Some("0000:00:03.0"));
        assert_eq!(
            normalize_bdf(" 0000:0A:1f.7\n").as_deref(),
            Some("0000:0a:1f.7")
        );
        for bad in [
            "",
            "0000:00:03",
            "00:03.8",
            "0000:00:03.0.1",
            "g000:00:03.0",
            "00-03.0",
        ] {
            assert_eq!(normalize_bdf(bad), None, "{bad:?}");
        }
    }

    /// A fake /sys/bus/pci with three devices and two drivers.
    struct FakeBus {
        root: PathBuf,
    }

    impl FakeBus {
        fn new(name: &str) -> FakeBus {
            let root =
                std::env::temp_dir().join(format!("dmlc-pcibus-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for d in ["devices", "drivers/virtio-pci", "dev"] {
                std::fs::create_dir_all(root.join(d)).unwrap();
            }
            std::fs::write(root.join("drivers/virtio-pci/unbind"), "").unwrap();
            let bus = FakeBus { root };
            bus.device("0000:00:00.0", 0x8086, 0x29c0, 0x060000, None);
            bus.device("0000:00:02.0", 0x1af4, 0x107f, 0xff0000, Some("virtio-pci"));
            bus.device("0000:00:01.0", 0x1af4, 0x1041, 0x020000, Some("virtio-pci"));
            bus
        }

        fn device(&self, bdf: &str, vendor: u16, device: u16, class: u32, driver: Option<&str>) {
            let d = self.root.join("devices").join(bdf);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("vendor"), format!("0x{vendor:04x}\n")).unwrap();
            std::fs::write(d.join("device"), format!("0x{device:04x}\n")).unwrap();
            std::fs::write(d.join("class"), format!("0x{class:06x}\n")).unwrap();
            std::fs::write(d.join("driver_override"), "(null)\n").unwrap();
            if let Some(drv) = driver {
                std::os::unix::fs::symlink(self.root.join("drivers").join(drv), d.join("driver"))
                    .unwrap();
            }
        }

        fn bus(&self) -> PciBus {
            PciBus::at(&self.root)
        }

        fn read(&self, rel: &str) -> String {
            std::fs::read_to_string(self.root.join(rel)).unwrap()
        }
    }

    impl Drop for FakeBus {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn finds_the_device_or_lists_what_exists() {
        let fake = FakeBus::new("find");
        let bus = fake.bus();
        let devs = bus.devices().unwrap();
        assert_eq!(
            devs.iter().map(|d| d.bdf.as_str()).collect::<Vec<_>>(),
            ["0000:00:00.0", "0000:00:01.0", "0000:00:02.0"]
        );
        let d = bus.find(None, 0x1af4, 0x107f).unwrap();
        assert_eq!(d.bdf, "0000:00:02.0");
        assert_eq!(d.driver.as_deref(), Some("virtio-pci"));
        assert_eq!(bus.find(Some("00:02.0"), 0x1af4, 0x107f).unwrap(), d);

        let err = bus.find(None, 0x1af4, 0x10ff).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("1af4:10ff"), "{text}");
        assert!(
            text.contains("0000:00:01.0 1af4:1041 class 020000 driver virtio-pci"),
            "{text}"
        );
        assert!(text.contains("0000:00:00.0 8086:29c0"), "{text}");

        assert!(matches!(
            bus.find(Some("00:01.0"), 0x1af4, 0x107f),
            Err(PciError::NotDmlc {
                vendor: 0x1af4,
                device: 0x1041,
                ..
            })
        ));
        assert!(matches!(
            bus.find(Some("00:09.0"), 0x1af4, 0x107f),
            Err(PciError::NoDevice { .. })
        ));
        assert!(matches!(
            bus.find(Some("nonsense"), 0x1af4, 0x107f),
            Err(PciError::BadAddress(_))
        ));
    }

    #[test]
    fn take_over_unbinds_a_foreign_driver_and_blocks_rebinding() {
        let fake = FakeBus::new("unbind");
        let bus = fake.bus();
        let d = bus.find(None, 0x1af4, 0x107f).unwrap();
        // No uio_pci_generic: interrupt mode is refused softly.
        assert_eq!(bus.take_over(&d, true).unwrap(), None);
        assert_eq!(fake.read("drivers/virtio-pci/unbind"), "0000:00:02.0");
        assert_eq!(fake.read("devices/0000:00:02.0/driver_override"), "none");
    }

    #[test]
    fn take_over_binds_uio_for_interrupts() {
        let fake = FakeBus::new("uio");
        let uio = fake.root.join("drivers").join(UIO_DRIVER);
        std::fs::create_dir_all(&uio).unwrap();
        std::fs::write(uio.join("bind"), "").unwrap();
        // What the kernel would create when the bind succeeds.
        let dev = fake.root.join("devices/0000:00:02.0");
        std::fs::create_dir_all(dev.join("uio/uio3")).unwrap();
        std::fs::write(fake.root.join("dev/uio3"), "").unwrap();
        std::fs::remove_file(dev.join("driver")).unwrap();
        let bus = fake.bus();
        let d = bus.find(None, 0x1af4, 0x107f).unwrap();
        assert_eq!(d.driver, None);
        // Poll mode binds it too: the uio file ties bus mastering to the
        // process.
        let node = bus.take_over(&d, false).unwrap().unwrap();
        assert_eq!(node, fake.root.join("dev/uio3"));
        std::fs::write(fake.root.join(format!("drivers/{UIO_DRIVER}/bind")), "").unwrap();
        // So does interrupt mode.
        let node = bus.take_over(&d, true).unwrap().unwrap();
        assert_eq!(node, fake.root.join("dev/uio3"));
        assert_eq!(
            fake.read("devices/0000:00:02.0/driver_override"),
            UIO_DRIVER
        );
        assert_eq!(
            fake.read(&format!("drivers/{UIO_DRIVER}/bind")),
            "0000:00:02.0"
        );
        // Already bound to uio: kept as it is.
        std::os::unix::fs::symlink(&uio, dev.join("driver")).unwrap();
        let d = bus.find(None, 0x1af4, 0x107f).unwrap();
        assert_eq!(bus.take_over(&d, false).unwrap(), Some(node));
    }

    #[test]
    fn uio_node_is_found_from_the_sysfs_entry() {
        let fake = FakeBus::new("uionode");
        let uio = fake.root.join("drivers").join(UIO_DRIVER);
        std::fs::create_dir_all(&uio).unwrap();
        let dev = fake.root.join("devices/0000:00:02.0");
        std::fs::remove_file(dev.join("driver")).unwrap();
        std::os::unix::fs::symlink(&uio, dev.join("driver")).unwrap();
        let bus = fake.bus();
        let d = bus.find(None, 0x1af4, 0x107f).unwrap();
        assert_eq!(d.driver.as_deref(), Some(UIO_DRIVER));
        // Bound, but sysfs lists no uio device: an error naming the folder.
        let err = bus.take_over(&d, false).unwrap_err().to_string();
        assert!(err.contains("0000:00:02.0/uio"), "{err}");
        // Other entries of the folder are not uio devices.
        std::fs::create_dir_all(dev.join("uio/power")).unwrap();
        assert!(bus.uio_node(&d).is_err());
        std::fs::create_dir_all(dev.join("uio/uio7")).unwrap();
        std::fs::write(fake.root.join("dev/uio7"), "").unwrap();
        assert_eq!(bus.uio_node(&d).unwrap(), fake.root.join("dev/uio7"));
        // Kept bound, in either mode, and nothing is unbound or overridden.
        assert_eq!(
            bus.take_over(&d, false).unwrap(),
            Some(fake.root.join("dev/uio7"))
        );
        assert_eq!(fake.read("drivers/virtio-pci/unbind"), "");
        assert_eq!(
            fake.read("devices/0000:00:02.0/driver_override"),
            "(null)\n"
        );
    }

    #[test]
    fn holders_are_found_in_proc_maps() {
        assert!(holders_of(Path::new("/nonexistent/resource4")).is_empty());
        let me = std::fs::read_link("/proc/self/exe").unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        // Once `sleep` has exec'd, it maps its own binary and must show up
        // as a holder of it (among any other `sleep` running on the
        // machine).
        let pid = child.id().to_string();
        let mut found = Vec::new();
        for _ in 0..200 {
            if let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) {
                if exe != me {
                    found = holders_of(&exe);
                    if found.iter().any(|h| h.starts_with(&format!("{pid} "))) {
                        break;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            found.iter().any(|h| h.starts_with(&format!("{pid} "))),
            "{found:?}"
        );
    }
}
