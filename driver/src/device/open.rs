//! The [`Device`] struct itself: opening it over a transport (or over the
//! kernel driver), what it reports about the device (rank, queues,
//! features, the config space), and closing it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use virtio_dmlc::comm::{
    VirtioDmlcConfigComm, VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P,
};
use virtio_dmlc::{
    VirtioDmlcConfig, CONFIG_SIZE, VIRTIO_DMLC_F_NONFINITE, VIRTIO_DMLC_F_REQ_TIMEOUT,
    VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use zerocopy::FromBytes;

use crate::bounce::Bounce;
use crate::dma::{DmaAlloc, DmaMemory, DMA_ALIGN};
use crate::error::{Error, Result};
use crate::kernel::KernelFile;
use crate::transport::Transport;
use crate::virtqueue::{SplitQueue, MAX_QUEUE_SIZE};

use super::comms::Comms;
use super::queue::{Queue, QueueState, SLOT_SIZE};
use super::spin::HybridSpin;
use super::{OpenOptions, Wait};

/// One member's handle on the device.
pub struct Device {
    // Declared first so it is dropped first: the device stops using the
    // rings before their memory is freed.
    pub(super) transport: Box<dyn Transport>,
    pub(super) engine: Engine,
    pub(super) mem: Arc<dyn DmaMemory>,
    pub(super) config: VirtioDmlcConfig,
    pub(super) features: u64,
    /// Communicators (feature bit 1, spec 5.X.6.13) this member belongs to,
    /// other than 0; `None` if the bit was not negotiated.
    pub(super) comms: Option<Mutex<Comms>>,
    pub(super) poll: bool,
    /// The hybrid wait's bound (zero: none) and what it has learned.
    pub(super) spin: HybridSpin,
    /// The slice conveniences' bounce buffer, made at first use.
    pub(super) bounce: Mutex<Option<Bounce>>,
    /// Generation and group id as last read from the config space.
    pub(super) known_generation: AtomicU32,
    pub(super) known_group: AtomicU64,
    /// [`WAIT_MARGIN`](super::WAIT_MARGIN), shorter in tests.
    pub(super) wait_margin: Duration,
    /// Every request carries `FLAG_CHECK_FINITE` (feature bit 4, spec
    /// 5.X.6.14): [`Device::set_check_finite`].
    pub(super) check_finite: AtomicBool,
    /// The tag of every later collective that names none:
    /// [`Device::set_tag`].
    pub(super) tag: AtomicU64,
}

/// What carries a device's requests: each operation of [`Device`] that
/// touches requests matches on it.
pub(super) enum Engine {
    /// The driver's own split rings, one per queue (the PCI and host
    /// transports).
    Rings(Box<[Queue]>),
    /// The kernel driver (`crate::kernel`), which owns the rings: one
    /// system call per submit or wait.
    Kernel(KernelFile),
}

pub(super) fn bit(b: u32) -> u64 {
    1u64 << b
}

impl Device {
    /// Opens a device over any transport whose device sees `mem`.
    pub fn open(
        mut transport: Box<dyn Transport>,
        mem: Arc<dyn DmaMemory>,
        opts: &OpenOptions,
    ) -> Result<Device> {
        let size = opts.queue_size;
        if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
            return Err(Error::InvalidArgument(format!(
                "queue size {size} is not a power of two up to {MAX_QUEUE_SIZE}"
            )));
        }
        let mut want = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_DMLC_F_REQ_TIMEOUT)
            | bit(VIRTIO_RING_F_INDIRECT_DESC);
        if opts.event_idx {
            want |= bit(VIRTIO_RING_F_EVENT_IDX);
        }
        // Communicators, send and receive, all-to-all, gather and scatter
        // (spec 5.X.6.13), and non-finite origin (5.X.6.14), when offered;
        // bits 2 to 4 only with bit 1.
        let comm_bits = bit(VIRTIO_DMLC_F_COMM)
            | bit(VIRTIO_DMLC_F_P2P)
            | bit(VIRTIO_DMLC_F_BLOCKS)
            | bit(VIRTIO_DMLC_F_NONFINITE);
        if transport.device_features() & bit(VIRTIO_DMLC_F_COMM) != 0 {
            want |= comm_bits;
        }
        let features = transport.device_features() & want;
        transport.negotiate(features)?;
        let config = read_config(&*transport)?;
        let comms = comms_of(&*transport, features)?;
        let (rank, world) = (config.rank.get(), config.world_size.get());
        if world == 0 || rank >= world {
            return Err(Error::BadConfig(format!(
                "rank {rank} of a group of {world}"
            )));
        }
        let mut nq = u32::from(transport.max_queues()).min(config.num_queues.get());
        if opts.max_queues > 0 {
            nq = nq.min(u32::from(opts.max_queues));
        }
        if nq == 0 {
            return Err(Error::BadConfig("no request queues".into()));
        }
        let event_idx = features & bit(VIRTIO_RING_F_EVENT_IDX) != 0;
        let (poll, spin_cap) = if opts.poll {
            (true, Duration::ZERO)
        } else if !opts.spin_cap.is_zero() && !transport.can_sleep() {
            log::info!("the transport has no interrupt to sleep on: the hybrid wait polls instead");
            (true, Duration::ZERO)
        } else {
            (false, opts.spin_cap)
        };
        let mut queues = Vec::new();
        for index in 0..nq as u16 {
            let size = size.min(transport.max_queue_size(index));
            let mut vq = SplitQueue::new(&mem, size, event_idx)?;
            // Off while polling, and while the hybrid wait spins (it arms
            // them only to sleep).
            vq.set_interrupts(!poll && spin_cap.is_zero());
            let slots = DmaAlloc::new(&mem, usize::from(size) * SLOT_SIZE, DMA_ALIGN)?;
            transport.setup_queue(index, &vq.addrs())?;
            queues.push(Queue {
                index,
                state: Mutex::new(QueueState {
                    vq,
                    slots,
                    in_flight: (0..size).map(|_| None).collect(),
                    done: HashMap::new(),
                    next_serial: 0,
                    sleeping: false,
                    wake: false,
                    scratch: Vec::new(),
                }),
                cond: Condvar::new(),
            });
        }
        transport.driver_ok()?;
        Ok(Device {
            transport,
            engine: Engine::Rings(queues.into_boxed_slice()),
            mem,
            config,
            features,
            comms,
            poll,
            spin: HybridSpin::new(spin_cap),
            bounce: Mutex::new(None),
            known_generation: AtomicU32::new(config.generation.get()),
            known_group: AtomicU64::new(config.group_id.get()),
            wait_margin: opts.wait_margin,
            check_finite: AtomicBool::new(false),
            tag: AtomicU64::new(0),
        })
    }

    /// A device whose queues the kernel driver owns (`crate::kernel::open`).
    pub(crate) fn over_kernel(
        transport: Box<dyn Transport>,
        mem: Arc<dyn DmaMemory>,
        config: VirtioDmlcConfig,
        kernel: KernelFile,
        opts: &OpenOptions,
    ) -> Result<Device> {
        let (rank, world) = (config.rank.get(), config.world_size.get());
        if world == 0 || rank >= world {
            return Err(Error::BadConfig(format!(
                "rank {rank} of a group of {world}"
            )));
        }
        // The module negotiated at probe: what it reports is what it uses.
        let features = transport.device_features();
        let comms = comms_of(&*transport, features)?;
        Ok(Device {
            features,
            comms,
            transport,
            engine: Engine::Kernel(kernel),
            mem,
            config,
            poll: opts.poll,
            spin: HybridSpin::new(if opts.poll {
                Duration::ZERO
            } else {
                opts.spin_cap
            }),
            bounce: Mutex::new(None),
            known_generation: AtomicU32::new(config.generation.get()),
            known_group: AtomicU64::new(config.group_id.get()),
            wait_margin: opts.wait_margin,
            check_finite: AtomicBool::new(false),
            tag: AtomicU64::new(0),
        })
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.config.rank.get()
    }

    /// Number of members.
    pub fn world_size(&self) -> u32 {
        self.config.world_size.get()
    }

    /// Number of queues set up (at most what the device offers).
    pub fn num_queues(&self) -> u16 {
        match &self.engine {
            Engine::Kernel(k) => k.num_queues(),
            Engine::Rings(queues) => queues.len() as u16,
        }
    }

    /// Descriptors per queue (0 over the kernel driver: its own rings).
    pub fn queue_size(&self) -> u16 {
        match &self.engine {
            Engine::Rings(queues) => queues.first().map_or(0, |q| q.lock().vq.size()),
            Engine::Kernel(_) => 0,
        }
    }

    /// True if the device was opened over the kernel driver.
    pub fn is_kernel(&self) -> bool {
        matches!(self.engine, Engine::Kernel(_))
    }

    /// Negotiated feature bits.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Turns the check of non-finite inputs (spec 5.X.6.14) on or off for
    /// every later request: a floating-point reduction whose inputs, on any
    /// member, hold a NaN or an infinity then fails with
    /// [`Error::NonFinite`], naming the lowest such rank and element (its
    /// outputs hold the result all the same); other requests are
    /// unchanged. Fails with [`Error::InvalidArgument`] if feature bit 4
    /// was not negotiated (a device across hosts, or the kernel driver).
    pub fn set_check_finite(&self, on: bool) -> Result<()> {
        if on && self.features & bit(VIRTIO_DMLC_F_NONFINITE) == 0 {
            return Err(Error::InvalidArgument(
                "the device does not offer the check of non-finite inputs \
                 (feature bit 4: not across hosts, not over the kernel driver)"
                    .into(),
            ));
        }
        self.check_finite.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Gives every later collective whose request names tag 0 the tag
    /// `tag` (0: none), so that a trainer can put its step number in the
    /// requests of the step: the device compares the tag between members
    /// (every member must set the same one for a collective), and
    /// `dmlc-ctl freeze --tag T` can name the step (docs/debugging.md).
    /// Sends, receives and comm_create keep their own tag, which matches
    /// them.
    pub fn set_tag(&self, tag: u64) {
        self.tag.store(tag, Ordering::Relaxed);
    }

    /// The tag of [`Device::set_tag`].
    pub fn tag(&self) -> u64 {
        self.tag.load(Ordering::Relaxed)
    }

    /// Whether requests carry the check of [`Device::set_check_finite`].
    pub fn check_finite(&self) -> bool {
        self.check_finite.load(Ordering::Relaxed)
    }

    /// True in poll mode.
    pub fn is_polling(&self) -> bool {
        self.poll
    }

    /// How waits spend their time on this device: the mode asked for, or
    /// `Poll` where a hybrid wait found no interrupt to sleep on.
    pub fn wait_mode(&self) -> Wait {
        OpenOptions {
            poll: self.poll,
            spin_cap: self.spin.cap(),
            ..OpenOptions::default()
        }
        .wait_kind()
    }

    /// The device-visible memory buffers come from.
    pub fn dma_memory(&self) -> &Arc<dyn DmaMemory> {
        &self.mem
    }

    /// The config space, read afresh (the generation changes). If the read
    /// fails, logs why and returns the config read at open;
    /// [`Self::try_config`] reports the failure instead.
    pub fn config(&self) -> VirtioDmlcConfig {
        self.try_config().unwrap_or_else(|e| {
            log::warn!("reading the device config failed: {e}");
            self.config
        })
    }

    /// The config space, read afresh.
    pub fn try_config(&self) -> Result<VirtioDmlcConfig> {
        let c = read_config(&*self.transport)?;
        self.note_group(c.generation.get(), c.group_id.get());
        Ok(c)
    }

    /// Reads `generation` and `group_id` (one config read of 12 bytes).
    pub(super) fn read_group(&self) -> Result<(u32, u64)> {
        let mut raw = [0u8; 12];
        self.transport.read_config(GENERATION_OFFSET, &mut raw)?;
        let generation = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let mut group = [0u8; 8];
        group.copy_from_slice(&raw[4..]);
        let group = u64::from_le_bytes(group);
        self.note_group(generation, group);
        Ok((generation, group))
    }

    fn note_group(&self, generation: u32, group: u64) {
        self.known_generation.store(generation, Ordering::Relaxed);
        self.known_group.store(group, Ordering::Relaxed);
    }

    pub(super) fn queue(&self, queue: u16) -> Result<&Queue> {
        let Engine::Rings(queues) = &self.engine else {
            return Err(Error::InvalidArgument(
                "the kernel driver owns this device's queues".into(),
            ));
        };
        queues.get(usize::from(queue)).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "queue {queue} does not exist (device has {})",
                queues.len()
            ))
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Stop the device before the rings are freed (fields drop after).
        if let Err(e) = self.transport.reset() {
            log::debug!("device reset on close failed: {e}");
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("queues", &self.num_queues())
            .field("kernel", &self.is_kernel())
            .field("poll", &self.poll)
            .finish()
    }
}

fn read_config(transport: &dyn Transport) -> Result<VirtioDmlcConfig> {
    let mut raw = [0u8; CONFIG_SIZE];
    transport.read_config(0, &mut raw)?;
    Ok(VirtioDmlcConfig::read_from_bytes(&raw).unwrap_or_default())
}

/// The communicators' state of a device that negotiated `features`: with
/// feature bit 1 (spec 5.X.6.13), none but the group's yet, and the
/// device's `max_comms`; `None` without it.
fn comms_of(transport: &dyn Transport, features: u64) -> Result<Option<Mutex<Comms>>> {
    if features & bit(VIRTIO_DMLC_F_COMM) == 0 {
        return Ok(None);
    }
    let mut raw = [0u8; 4];
    transport.read_config(MAX_COMMS_OFFSET, &mut raw)?;
    Ok(Some(Mutex::new(Comms::new(u32::from_le_bytes(raw)))))
}

/// Offset of `max_comms` in the config space (feature bit 1).
const MAX_COMMS_OFFSET: usize = std::mem::offset_of!(VirtioDmlcConfigComm, max_comms);

/// Offset of `generation` (followed by `group_id`) in the config space.
const GENERATION_OFFSET: usize = std::mem::offset_of!(VirtioDmlcConfig, generation);
