//! The virtio-pci capabilities in PCI config space (virtio 1.x, 4.1.4), and
//! where the regions they describe lie in their BARs. Pure functions over
//! bytes, so they are tested on fake config spaces.

/// Offsets and bits of the standard PCI config header.
pub const PCI_VENDOR_ID: usize = 0x00;
pub const PCI_DEVICE_ID: usize = 0x02;
pub const PCI_COMMAND: usize = 0x04;
pub const PCI_STATUS: usize = 0x06;
pub const PCI_CAPABILITY_LIST: usize = 0x34;
/// Command register: respond to memory space accesses.
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: the device may master the bus (DMA).
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Command register: INTx emulation disabled (uio_pci_generic masks with it).
pub const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Status register: the capability list exists.
pub const PCI_STATUS_CAP_LIST: u16 = 1 << 4;

/// Capability ID of vendor-specific capabilities, which virtio uses.
pub const PCI_CAP_ID_VNDR: u8 = 0x09;
/// `cfg_type` values of `struct virtio_pci_cap`.
pub const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
pub const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
pub const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
pub const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;

/// `struct virtio_pci_cap` is 16 bytes; the notify capability adds
/// `notify_off_multiplier`.
const CAP_LEN: usize = 16;
const NOTIFY_CAP_LEN: usize = 20;
/// Capabilities live above the 64-byte standard header, dword aligned; at
/// most this many fit in 256 bytes, so a longer walk is a loop.
const MAX_CAPS: usize = (256 - 0x40) / 4;
/// Size of the common configuration structure up to `queue_device`
/// (virtio 1.0); the driver touches nothing beyond it.
pub const COMMON_CFG_LEN: usize = 0x38;
/// Size of the ISR status byte.
pub const ISR_LEN: usize = 1;

/// Errors of the capability walk and of the region arithmetic.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapError {
    /// Status bit 4 is clear: the device has no capabilities.
    #[error("the device has no PCI capability list")]
    NoCapList,
    /// A capability pointer leads outside the bytes read or into the header.
    #[error("capability pointer {ptr:#x} is outside config space")]
    BadPointer { ptr: usize },
    /// The list does not end.
    #[error("capability list loops")]
    Loop,
    /// A virtio capability is shorter than its structure.
    #[error("virtio capability at {at:#x} has length {len}, {min} needed")]
    Short { at: usize, len: usize, min: usize },
    /// A required structure has no capability.
    #[error("no virtio {0} capability")]
    Missing(&'static str),
    /// A capability names a BAR that does not exist.
    #[error("virtio {what} capability names BAR {bar}")]
    BadBar { what: &'static str, bar: u8 },
    /// A region is too short for what it must hold.
    #[error("virtio {what} region has {len} bytes, {need} needed")]
    RegionTooShort {
        what: &'static str,
        len: u32,
        need: usize,
    },
    /// A region does not lie inside its BAR.
    #[error(
        "virtio {what} region {offset:#x}+{len:#x} lies outside BAR {bar} ({bar_len:#x} bytes)"
    )]
    OutsideBar {
        what: &'static str,
        bar: u8,
        offset: u32,
        len: u32,
        bar_len: usize,
    },
    /// A queue's notify address lies outside the notify region.
    #[error("queue notify offset {queue_notify_off} x {multiplier} lies outside the notify region ({len} bytes)")]
    NotifyOutside {
        queue_notify_off: u16,
        multiplier: u32,
        len: u32,
    },
}

/// One structure a virtio capability points at: `length` bytes at
/// `offset` in BAR `bar`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapRegion {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
}

/// The regions of a modern virtio-pci device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioCaps {
    pub common: CapRegion,
    pub notify: CapRegion,
    /// Bytes between the notify addresses of consecutive `queue_notify_off`
    /// values (0: every queue shares one address).
    pub notify_off_multiplier: u32,
    pub isr: CapRegion,
    pub device: CapRegion,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Walks the capability list of a config space (`config`: at least the
/// 256-byte standard part, as read from sysfs `config` by root) and returns
/// the first virtio capability of each type the driver uses, as the spec
/// tells drivers to. Capabilities of other types (PCI cfg access, shared
/// memory, vendor data) and of other IDs (MSI-X, ...) are skipped.
pub fn parse_virtio_caps(config: &[u8]) -> Result<VirtioCaps, CapError> {
    if config.len() < 0x40 || u16_at(config, PCI_STATUS) & PCI_STATUS_CAP_LIST == 0 {
        return Err(CapError::NoCapList);
    }
    let mut common = None;
    let mut notify = None;
    let mut isr = None;
    let mut device = None;
    let mut ptr = usize::from(config[PCI_CAPABILITY_LIST] & 0xfc);
    let mut seen = 0;
    while ptr != 0 {
        seen += 1;
        if seen > MAX_CAPS {
            return Err(CapError::Loop);
        }
        if ptr < 0x40 || ptr + 2 > config.len() {
            return Err(CapError::BadPointer { ptr });
        }
        let id = config[ptr];
        let next = usize::from(config[ptr + 1] & 0xfc);
        if id == PCI_CAP_ID_VNDR {
            if ptr + CAP_LEN > config.len() {
                return Err(CapError::BadPointer { ptr });
            }
            let len = usize::from(config[ptr + 2]);
            if len < CAP_LEN {
                return Err(CapError::Short {
                    at: ptr,
                    len,
                    min: CAP_LEN,
                });
            }
            let cfg_type = config[ptr + 3];
            let region = CapRegion {
                bar: config[ptr + 4],
                offset: u32_at(config, ptr + 8),
                length: u32_at(config, ptr + 12),
            };
            match cfg_type {
                VIRTIO_PCI_CAP_COMMON_CFG => {
                    common.get_or_insert(region);
                }
                VIRTIO_PCI_CAP_NOTIFY_CFG if notify.is_none() => {
                    if len < NOTIFY_CAP_LEN || ptr + NOTIFY_CAP_LEN > config.len() {
                        return Err(CapError::Short {
                            at: ptr,
                            len,
                            min: NOTIFY_CAP_LEN,
                        });
                    }
                    notify = Some((region, u32_at(config, ptr + 16)));
                }
                VIRTIO_PCI_CAP_ISR_CFG => {
                    isr.get_or_insert(region);
                }
                VIRTIO_PCI_CAP_DEVICE_CFG => {
                    device.get_or_insert(region);
                }
                _ => {}
            }
        }
        ptr = next;
    }
    let common = common.ok_or(CapError::Missing("common config"))?;
    let (notify, notify_off_multiplier) = notify.ok_or(CapError::Missing("notify"))?;
    let isr = isr.ok_or(CapError::Missing("ISR"))?;
    let device = device.ok_or(CapError::Missing("device config"))?;
    for (what, r) in [
        ("common config", &common),
        ("notify", &notify),
        ("ISR", &isr),
        ("device config", &device),
    ] {
        if r.bar > 5 {
            return Err(CapError::BadBar { what, bar: r.bar });
        }
    }
    Ok(VirtioCaps {
        common,
        notify,
        notify_off_multiplier,
        isr,
        device,
    })
}

/// Checks that `region` holds at least `need` bytes and lies inside a BAR of
/// `bar_len` bytes; returns its offset in the BAR and its usable length.
pub fn region_in_bar(
    what: &'static str,
    region: &CapRegion,
    need: usize,
    bar_len: usize,
) -> Result<(usize, usize), CapError> {
    if (region.length as usize) < need {
        return Err(CapError::RegionTooShort {
            what,
            len: region.length,
            need,
        });
    }
    let offset = region.offset as usize;
    let end = offset.checked_add(region.length as usize);
    if end.is_none_or(|end| end > bar_len) {
        return Err(CapError::OutsideBar {
            what,
            bar: region.bar,
            offset: region.offset,
            len: region.length,
            bar_len,
        });
    }
    Ok((offset, region.length as usize))
}

/// Offset, inside the notify region, of the 16-bit doorbell of a queue whose
/// `queue_notify_off` register reads `queue_notify_off`.
pub fn notify_offset(
    notify_len: u32,
    multiplier: u32,
    queue_notify_off: u16,
) -> Result<usize, CapError> {
    let outside = || CapError::NotifyOutside {
        queue_notify_off,
        multiplier,
        len: notify_len,
    };
    let off = u64::from(queue_notify_off) * u64::from(multiplier);
    if off + 2 > u64::from(notify_len) {
        return Err(outside());
    }
    usize::try_from(off).map_err(|_| outside())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds config spaces capability by capability.
    pub(crate) struct FakeConfig(pub Vec<u8>);

    impl FakeConfig {
        pub(crate) fn new() -> Self {
            let mut c = vec![0u8; 256];
            c[0..2].copy_from_slice(&0x1af4u16.to_le_bytes());
            c[2..4].copy_from_slice(&0x107fu16.to_le_bytes());
            c[PCI_STATUS..PCI_STATUS + 2].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
            FakeConfig(c)
        }

        /// Puts a capability at `at` (raw bytes from the ID on) and links it
        /// to `next`.
        pub(crate) fn cap(&mut self, at: usize, next: usize, body: &[u8]) -> &mut Self {
            self.0[at..at + body.len()].copy_from_slice(body);
            self.0[at + 1] = next as u8;
            self
        }

        pub(crate) fn virtio(
            &mut self,
            at: usize,
            next: usize,
            cfg_type: u8,
            r: CapRegion,
            extra: Option<u32>,
        ) -> &mut Self {
            let mut b = vec![PCI_CAP_ID_VNDR, 0, 16, cfg_type, r.bar, 0, 0, 0];
            b.extend(r.offset.to_le_bytes());
            b.extend(r.length.to_le_bytes());
            if let Some(x) = extra {
                b[2] = 20;
                b.extend(x.to_le_bytes());
            }
            self.cap(at, next, &b)
        }

        pub(crate) fn first(&mut self, at: usize) -> &mut Self {
            self.0[PCI_CAPABILITY_LIST] = at as u8;
            self
        }
    }

    fn reg(bar: u8, offset: u32, length: u32) -> CapRegion {
        CapRegion {
            bar,
            offset,
            length,
        }
    }

    /// The layout QEMU's modern virtio-pci gives a device: MSI-X at 0x98,
    /// then the vendor capabilities, BAR 4 with common config at 0, ISR at
    /// 0x1000, device config at 0x2000, notify at 0x3000 (multiplier 4).
    pub(crate) fn qemu_like() -> FakeConfig {
        let mut f = FakeConfig::new();
        f.first(0x98)
            .cap(
                0x98,
                0x84,
                &[0x11, 0, 0x01, 0x00, 0x01, 0, 0, 0, 0x01, 0x08, 0, 0],
            )
            // VIRTIO_PCI_CAP_PCI_CFG (type 5): ignored.
            .virtio(0x84, 0x70, 5, reg(0, 0, 0), Some(0))
            .virtio(
                0x70,
                0x60,
                VIRTIO_PCI_CAP_NOTIFY_CFG,
                reg(4, 0x3000, 0x1000),
                Some(4),
            )
            .virtio(
                0x60,
                0x50,
                VIRTIO_PCI_CAP_DEVICE_CFG,
                reg(4, 0x2000, 0x1000),
                None,
            )
            .virtio(
                0x50,
                0x40,
                VIRTIO_PCI_CAP_ISR_CFG,
                reg(4, 0x1000, 0x1000),
                None,
            )
            .virtio(0x40, 0, VIRTIO_PCI_CAP_COMMON_CFG, reg(4, 0, 0x1000), None);
        f
    }

    #[test]
    fn walks_a_qemu_like_config_space() {
        let caps = parse_virtio_caps(&qemu_like().0).unwrap();
        let r = |offset, length| CapRegion {
            bar: 4,
            offset,
            length,
        };
        assert_eq!(
            caps,
            VirtioCaps {
                common: r(0, 0x1000),
                notify: r(0x3000, 0x1000),
                notify_off_multiplier: 4,
                isr: r(0x1000, 0x1000),
                device: r(0x2000, 0x1000),
            }
        );
    }

    #[test]
    fn first_capability_of_a_type_wins_and_others_are_skipped() {
        let mut f = qemu_like();
        // A second common config in BAR 2, later in the list, and a shared
        // memory capability (type 8) in front.
        f.virtio(
            0x40,
            0xb0,
            VIRTIO_PCI_CAP_COMMON_CFG,
            reg(4, 0, 0x1000),
            None,
        )
        .virtio(0xb0, 0xc4, 8, reg(2, 0, 0x100), Some(0))
        .virtio(
            0xc4,
            0,
            VIRTIO_PCI_CAP_COMMON_CFG,
            reg(2, 0x800, 0x100),
            None,
        );
        let caps = parse_virtio_caps(&f.0).unwrap();
        assert_eq!(caps.common.bar, 4);
        // The 4096-byte sysfs view of an express device works too.
        let mut big = f.0.clone();
        big.resize(4096, 0xff);
        assert_eq!(parse_virtio_caps(&big).unwrap(), caps);
    }

    #[test]
    fn broken_lists_are_refused() {
        let mut f = qemu_like();
        f.0[PCI_STATUS] = 0;
        assert_eq!(parse_virtio_caps(&f.0), Err(CapError::NoCapList));
        assert_eq!(parse_virtio_caps(&[0u8; 32]), Err(CapError::NoCapList));

        let mut f = qemu_like();
        f.0[0x41] = 0x98; // common config points back at MSI-X
        assert_eq!(parse_virtio_caps(&f.0), Err(CapError::Loop));

        let mut f = qemu_like();
        f.0[0x41] = 0x20; // into the standard header
        assert_eq!(
            parse_virtio_caps(&f.0),
            Err(CapError::BadPointer { ptr: 0x20 })
        );

        // A capability running off the end of what was read.
        let mut f = qemu_like();
        f.0[0x41] = 0xf8;
        f.0[0xf8] = PCI_CAP_ID_VNDR;
        assert_eq!(
            parse_virtio_caps(&f.0),
            Err(CapError::BadPointer { ptr: 0xf8 })
        );

        let mut f = qemu_like();
        f.0[0x72] = 16; // notify without its multiplier
        assert_eq!(
            parse_virtio_caps(&f.0),
            Err(CapError::Short {
                at: 0x70,
                len: 16,
                min: 20
            })
        );

        let mut f = qemu_like();
        f.0[0x52] = 8;
        assert!(matches!(
            parse_virtio_caps(&f.0),
            Err(CapError::Short { at: 0x50, .. })
        ));

        let mut f = qemu_like();
        f.0[0x61] = 0x40; // device config -> common config: ISR unlinked
        assert_eq!(parse_virtio_caps(&f.0), Err(CapError::Missing("ISR")));

        let mut f = qemu_like();
        f.0[0x44] = 6; // common config in BAR 6
        assert_eq!(
            parse_virtio_caps(&f.0),
            Err(CapError::BadBar {
                what: "common config",
                bar: 6
            })
        );
    }

    #[test]
    fn regions_must_lie_inside_their_bar() {
        let r = CapRegion {
            bar: 4,
            offset: 0x3000,
            length: 0x1000,
        };
        assert_eq!(region_in_bar("notify", &r, 2, 0x4000), Ok((0x3000, 0x1000)));
        assert_eq!(
            region_in_bar("notify", &r, 2, 0x3fff),
            Err(CapError::OutsideBar {
                what: "notify",
                bar: 4,
                offset: 0x3000,
                len: 0x1000,
                bar_len: 0x3fff
            })
        );
        let short = CapRegion { length: 0x20, ..r };
        assert_eq!(
            region_in_bar("common config", &short, COMMON_CFG_LEN, 0x4000),
            Err(CapError::RegionTooShort {
                what: "common config",
                len: 0x20,
                need: COMMON_CFG_LEN
            })
        );
        let wrap = CapRegion {
            bar: 0,
            offset: u32::MAX,
            length: u32::MAX,
        };
        assert!(matches!(
            region_in_bar("ISR", &wrap, 1, 1 << 20),
            Err(CapError::OutsideBar { .. })
        ));
    }

    #[test]
    fn notify_addresses() {
        assert_eq!(notify_offset(0x1000, 4, 0), Ok(0));
        assert_eq!(notify_offset(0x1000, 4, 3), Ok(12));
        assert_eq!(notify_offset(0x1000, 4, 1023), Ok(4092));
        assert_eq!(notify_offset(0x1000, 4, 1023 + 1).ok(), None);
        // Multiplier 0: every queue rings the same doorbell.
        assert_eq!(notify_offset(2, 0, 500), Ok(0));
        assert_eq!(
            notify_offset(0x1000, 0x1000, 1),
            Err(CapError::NotifyOutside {
                queue_notify_off: 1,
                multiplier: 0x1000,
                len: 0x1000
            })
        );
        assert_eq!(notify_offset(u32::MAX, u32::MAX, u16::MAX).ok(), None);
    }
}
