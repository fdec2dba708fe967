//! The `VhostUserBackend` of one group member (one socket, one VM).
//!
//! A [`MemberBackend`] lives for one frontend connection: the daemon makes a
//! fresh one for every connection of rank `i`, so no ring state survives a
//! reconnect. It pops the chains the driver makes available and hands each to
//! [`Group::submit`]; the group later puts the chain in the used ring through
//! a [`VringCompletion`], from whatever thread finished the collective.
//!
//! Threads: vhost-user-backend runs one epoll worker per entry of
//! [`VhostUserBackend::queues_per_thread`]; this backend asks for one worker
//! per queue, so worker `q` serves queue `q` alone and a slow queue never
//! delays another. Frontend messages (features, config, memory table,
//! `GET_VRING_BASE` -> `stop_vring`) arrive on the connection's own thread.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostUserProtocolFeatures, VhostUserVirtioFeatures, VHOST_USER_CONFIG_SIZE,
};
use vhost_user_backend::{
    VhostUserBackend, VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT,
};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{
    Address, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use zerocopy::IntoBytes;

use crate::group::{Completion, Group};
use crate::GuestMem;

/// The guest memory handle vhost-user-backend shares with every vring.
pub type AtomicMem = GuestMemoryAtomic<GuestMem>;
/// One virtqueue as vhost-user-backend hands it to the backend: the
/// library's vring, which refuses to start with a size that is not a
/// power of two.
///
/// The library passes SET_VRING_NUM on to virtio-queue, which keeps its
/// previous size (the maximum, on a fresh connection) when the new one is
/// not a power of two, and says so only in a log line. The device would
/// then read and write the rings of a queue of another size than the
/// driver's, that is, guest memory outside the rings. Such a ring is kept
/// stopped instead (never served, nothing read or written) until the
/// frontend sets a valid size and starts it again.
#[derive(Clone)]
pub struct Vring {
    inner: VringRwLock<AtomicMem>,
    /// The frontend's last SET_VRING_NUM was not a power of two.
    bad_size: Arc<AtomicBool>,
}

impl<'a> VringStateGuard<'a, AtomicMem> for Vring {
    type G = RwLockReadGuard<'a, VringState<AtomicMem>>;
}

impl<'a> VringStateMutGuard<'a, AtomicMem> for Vring {
    type G = RwLockWriteGuard<'a, VringState<AtomicMem>>;
}

impl VringT<AtomicMem> for Vring {
    fn new(mem: AtomicMem, max_queue_size: u16) -> Result<Self, virtio_queue::Error> {
        Ok(Vring {
            inner: VringRwLock::new(mem, max_queue_size)?,
            bad_size: Arc::new(AtomicBool::new(false)),
        })
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, AtomicMem>>::G {
        self.inner.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, AtomicMem>>::G {
        self.inner.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), virtio_queue::Error> {
        self.inner.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.inner.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, virtio_queue::Error> {
        self.inner.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), virtio_queue::Error> {
        self.inner.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, virtio_queue::Error> {
        self.inner.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.inner.set_enabled(enabled);
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), virtio_queue::Error> {
        self.inner.set_queue_info(desc_table, avail_ring, used_ring)
    }

    fn queue_next_avail(&self) -> u16 {
        self.inner.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.inner.set_queue_next_avail(base);
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.inner.set_queue_next_used(idx);
    }

    fn queue_used_idx(&self) -> Result<u16, virtio_queue::Error> {
        self.inner.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        let bad = !num.is_power_of_two();
        self.bad_size.store(bad, Ordering::Release);
        if bad {
            warn!("virtqueue size {num} is not a power of two: queue not started");
            self.inner.set_queue_ready(false);
        }
        self.inner.set_queue_size(num);
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.inner.set_queue_event_idx(enabled);
    }

    fn set_queue_ready(&self, ready: bool) {
        self.inner
            .set_queue_ready(ready && !self.bad_size.load(Ordering::Acquire));
    }

    fn set_kick(&self, file: Option<std::fs::File>) {
        self.inner.set_kick(file);
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.inner.read_kick()
    }

    fn set_call(&self, file: Option<std::fs::File>) {
        self.inner.set_call(file);
    }

    fn set_err(&self, file: Option<std::fs::File>) {
        self.inner.set_err(file);
    }
}

const fn bit(n: u32) -> u64 {
    1 << n
}

/// Virtio and vhost-user feature bits the device offers.
pub const DEVICE_FEATURES: u64 = bit(virtio_dmlc::VIRTIO_F_VERSION_1)
    | bit(virtio_dmlc::VIRTIO_RING_F_EVENT_IDX)
    | bit(virtio_dmlc::VIRTIO_RING_F_INDIRECT_DESC)
    | bit(virtio_dmlc::VIRTIO_DMLC_F_REQ_TIMEOUT)
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// vhost-user protocol features the device offers: CONFIG so that the
/// frontend reads config space with GET_CONFIG, MQ for several request
/// queues, REPLY_ACK and RESET_DEVICE because the library implements them.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
}

/// Largest GET_CONFIG payload vhost-user allows.
const MAX_CONFIG_READ: usize = VHOST_USER_CONFIG_SIZE as usize;

/// Settings of one member's backend.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    pub rank: u32,
    pub num_queues: u16,
    pub queue_size: u16,
    /// How long to keep polling a queue after it ran dry; zero: never.
    pub poll: Duration,
}

/// Per-queue state of one connection.
struct QueueSlot {
    /// Held while chains are popped and submitted, so that a member that is
    /// being lost waits until no submission is under way. It also caches
    /// the completion of the current activation.
    gate: Mutex<Option<Arc<VringCompletion>>>,
    /// A broken ring is reported once at warn, then at debug.
    warned: AtomicBool,
}

/// The vhost-user backend of one member for one frontend connection.
pub struct MemberBackend {
    cfg: BackendConfig,
    group: Arc<Group>,
    mem: RwLock<AtomicMem>,
    /// True between the driver's feature negotiation and the member's loss
    /// (device reset, a stopped vring, or the connection closing): only an
    /// active member submits requests.
    active: AtomicBool,
    /// Counts activations; a completion of an earlier one is dropped.
    epoch: Arc<AtomicU64>,
    queues: Vec<QueueSlot>,
}

impl MemberBackend {
    /// A backend for a new connection of member `cfg.rank`. `mem` must be
    /// the handle given to `VhostUserDaemon::new` with it.
    pub fn new(cfg: BackendConfig, group: Arc<Group>, mem: AtomicMem) -> Self {
        let queues = (0..cfg.num_queues)
            .map(|_| QueueSlot {
                gate: Mutex::new(None),
                warned: AtomicBool::new(false),
            })
            .collect();
        MemberBackend {
            cfg,
            group,
            mem: RwLock::new(mem),
            active: AtomicBool::new(false),
            epoch: Arc::new(AtomicU64::new(0)),
            queues,
        }
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.cfg.rank
    }

    /// Whether the member takes requests (features negotiated, not lost).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Marks the member lost, if it was active: no further submission from
    /// this connection, completions still in flight are dropped, and the
    /// group fails the collectives that waited for it. Returns whether it
    /// was active.
    pub fn lose(&self, why: &str) -> bool {
        if !self.active.swap(false, Ordering::AcqRel) {
            return false;
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
        // Wait for submissions under way on the workers to finish, so the
        // group sees none from this member after `member_lost`.
        for slot in &self.queues {
            *lock(&slot.gate) = None;
        }
        self.group.member_lost(self.cfg.rank);
        debug!("rank {}: member lost ({why})", self.cfg.rank);
        true
    }

    fn memory(&self) -> Arc<GuestMem> {
        self.mem
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .memory()
            .into_inner()
    }

    /// Reports a broken ring: the first time at warn, later at debug.
    fn ring_error(&self, queue: u16, err: &virtio_queue::Error) {
        let rank = self.cfg.rank;
        let first = self
            .queues
            .get(usize::from(queue))
            .is_some_and(|slot| !slot.warned.swap(true, Ordering::Relaxed));
        if first {
            warn!("rank {rank} queue {queue}: malformed virtqueue, requests ignored: {err}");
        } else {
            debug!("rank {rank} queue {queue}: malformed virtqueue: {err}");
        }
    }

    /// Serves `queue` after a kick: drains it, polls it for a while if told
    /// to, and re-enables notifications without losing a request that
    /// arrived in between.
    fn process_queue(&self, queue: u16, vring: &Vring) {
        let mut empty_rounds = 0;
        loop {
            if let Err(e) = vring.disable_notification() {
                self.ring_error(queue, &e);
            }
            let mut handled = self.drain(queue, vring);
            if !self.cfg.poll.is_zero() {
                handled += self.poll(queue, vring);
            }
            match vring.enable_notification() {
                // Requests arrived while notifications were off. One extra
                // empty round covers a race; more means the ring is stuck
                // (a bad avail index, or an inactive member) and the next
                // kick will bring us back.
                Ok(true) if handled > 0 || empty_rounds == 0 => {
                    empty_rounds = if handled > 0 { 0 } else { empty_rounds + 1 };
                }
                Ok(_) => break,
                Err(e) => {
                    self.ring_error(queue, &e);
                    break;
                }
            }
        }
    }

    /// Pops every available chain of `queue` and submits it. Returns how
    /// many it submitted.
    fn drain(&self, queue: u16, vring: &Vring) -> usize {
        let Some(slot) = self.queues.get(usize::from(queue)) else {
            return 0;
        };
        let mut gate = lock(&slot.gate);
        if !self.is_active() {
            return 0;
        }
        // The group keeps this snapshot of the memory map alive for as long
        // as a request needs it, whatever the frontend changes meanwhile.
        let mem = &self.memory();
        let done: Arc<dyn Completion> = self.completion(&mut gate, queue, vring);
        let mut submitted = 0;
        // The active flag is re-read for every chain: `lose` waits on the
        // gate, so once it holds the gate nothing more is submitted.
        while self.is_active() {
            let chain = {
                let mut state = vring.get_mut();
                match state.get_queue_mut().iter(&**mem) {
                    Ok(mut avail) => avail.next(),
                    // The frontend stopped the ring; nothing to do.
                    Err(virtio_queue::Error::QueueNotReady) => None,
                    Err(e) => {
                        self.ring_error(queue, &e);
                        None
                    }
                }
            };
            // The vring lock is released before submitting: the group may
            // complete the request at once, on this thread.
            let Some(chain) = chain else { break };
            self.group.submit(self.cfg.rank, queue, mem, chain, &done);
            submitted += 1;
        }
        submitted
    }

    /// Spins on `queue` with notifications off, draining whatever arrives,
    /// until it has been idle for the poll time. Returns how many chains it
    /// submitted.
    fn poll(&self, queue: u16, vring: &Vring) -> usize {
        let mut submitted = 0;
        let mut deadline = Instant::now() + self.cfg.poll;
        while self.is_active() && Instant::now() < deadline {
            if avail_pending(vring, &self.memory()) {
                submitted += self.drain(queue, vring);
                deadline = Instant::now() + self.cfg.poll;
            } else {
                std::hint::spin_loop();
            }
        }
        submitted
    }

    /// The completion for `queue` in the current activation, made once.
    fn completion(
        &self,
        cached: &mut Option<Arc<VringCompletion>>,
        queue: u16,
        vring: &Vring,
    ) -> Arc<VringCompletion> {
        let epoch = self.epoch.load(Ordering::Acquire);
        match cached {
            Some(done) if done.epoch == epoch => done.clone(),
            _ => {
                let done = Arc::new(VringCompletion {
                    rank: self.cfg.rank,
                    queue,
                    vring: vring.clone(),
                    epoch,
                    current: self.epoch.clone(),
                });
                *cached = Some(done.clone());
                done
            }
        }
    }
}

/// A memory table the daemon cannot map safely.
#[derive(Debug, thiserror::Error)]
pub enum MemoryTableError {
    #[error("region at {gpa:#x} needs {end:#x} bytes of its file, which has {file_size:#x}")]
    PastEndOfFile { gpa: u64, end: u64, file_size: u64 },
    #[error("cannot inspect the file of the region at {gpa:#x}")]
    Stat {
        gpa: u64,
        #[source]
        source: io::Error,
    },
}

/// Checks that every region backed by a regular file lies inside that file.
/// A shared mapping that extends past the end of its file raises SIGBUS
/// where it is touched, and that would kill the daemon and with it every
/// member's device. (A frontend that shrinks the file later can still do
/// it; QEMU seals its memfd guest RAM against that by default.)
pub fn check_regions_backed(mem: &GuestMem) -> Result<(), MemoryTableError> {
    for region in mem.iter() {
        let Some(fo) = region.file_offset() else {
            continue;
        };
        let gpa = region.start_addr().raw_value();
        let meta = fo
            .file()
            .metadata()
            .map_err(|source| MemoryTableError::Stat { gpa, source })?;
        // Device files (DAX) have no meaningful length.
        if !meta.file_type().is_file() {
            continue;
        }
        let end = fo.start().saturating_add(region.len());
        if end > meta.len() {
            return Err(MemoryTableError::PastEndOfFile {
                gpa,
                end,
                file_size: meta.len(),
            });
        }
    }
    Ok(())
}

/// True if the driver made chains available that are not popped yet.
fn avail_pending(vring: &Vring, mem: &GuestMem) -> bool {
    let state = vring.get_ref();
    let queue = state.get_queue();
    queue.ready()
        && queue
            .avail_idx(mem, Ordering::Acquire)
            .is_ok_and(|idx| idx.0 != queue.next_avail())
}

/// Locks `m`, ignoring poisoning: the guarded state stays consistent even
/// if a holder panicked (it is a cache that is rebuilt on demand).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Returns finished chains of one queue to the driver.
pub struct VringCompletion {
    rank: u32,
    queue: u16,
    vring: Vring,
    /// The activation this completion belongs to.
    epoch: u64,
    current: Arc<AtomicU64>,
}

impl Completion for VringCompletion {
    fn complete(&self, queue: u16, head: u16, written: u32) {
        let rank = self.rank;
        if queue != self.queue {
            warn!(
                "rank {rank}: completion for queue {queue} given to queue {}",
                self.queue
            );
            return;
        }
        let mut state = self.vring.get_mut();
        // The member was lost (or its ring stopped) since the request was
        // popped: the ring may already belong to a new driver.
        if self.current.load(Ordering::Acquire) != self.epoch || !state.get_queue().ready() {
            debug!("rank {rank} queue {queue}: dropped completion of chain {head}");
            return;
        }
        if let Err(e) = state.add_used(head, written) {
            warn!("rank {rank} queue {queue}: cannot return chain {head}: {e}");
            return;
        }
        // A driver's broken used_event costs an interrupt, not a request.
        let notify = state.needs_notification().unwrap_or(true);
        if notify {
            if let Err(e) = state.signal_used_queue() {
                warn!("rank {rank} queue {queue}: cannot notify the driver: {e}");
            }
        }
    }
}

impl VhostUserBackend for MemberBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        usize::from(self.cfg.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.cfg.queue_size)
    }

    fn features(&self) -> u64 {
        DEVICE_FEATURES
    }

    fn acked_features(&self, features: u64) {
        self.group.set_member_features(self.cfg.rank, features);
        // The frontend sends SET_FEATURES each time it starts the device,
        // so this is where a member (re)joins after a loss.
        if !self.active.swap(true, Ordering::AcqRel) {
            self.group.member_ready(self.cfg.rank);
            debug!(
                "rank {}: features {features:#x} acked, member ready",
                self.cfg.rank
            );
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        protocol_features()
    }

    fn reset_device(&self) {
        if self.lose("device reset") {
            info!("rank {}: device reset, member lost", self.cfg.rank);
        }
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The library sets EVENT_IDX on every vring itself, and the
        // notification calls below work the same either way.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.group.config_space(self.cfg.rank);
        let bytes = space.as_bytes();
        let (offset, size) = (offset as usize, size as usize);
        if offset > bytes.len() || size > MAX_CONFIG_READ {
            // An empty reply tells the frontend the read failed.
            warn!(
                "rank {}: config read of {size} bytes at {offset} is out of range",
                self.cfg.rank
            );
            return Vec::new();
        }
        // Bytes past the end of the structure read as zero, so a frontend
        // that rounds the config size up still gets an answer.
        let mut out = vec![0; size];
        let end = bytes.len().min(offset + size);
        out[..end - offset].copy_from_slice(&bytes[offset..end]);
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Config space is read-only. The write is ignored rather than
        // refused: an error would make the library close the connection.
        debug!(
            "rank {}: ignored a config write of {} bytes at {offset}",
            self.cfg.rank,
            buf.len()
        );
        Ok(())
    }

    fn update_memory(&self, mem: AtomicMem) -> io::Result<()> {
        let checked = check_regions_backed(&mem.memory());
        if let Err(e) = checked {
            // The library installed the map before asking us: take it out
            // again, so that no worker touches it before the connection
            // closes (the error makes the library close it).
            mem.lock()
                .map_err(|e| io::Error::other(e.to_string()))?
                .replace(GuestMem::new());
            warn!("rank {}: memory table refused: {e}", self.cfg.rank);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, e));
        }
        *self.mem.write().unwrap_or_else(|e| e.into_inner()) = mem;
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.cfg.num_queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without an exit event a worker never ends and dropping the daemon
        // would wait forever. A fresh pair each time: the library never
        // consumes a fired one, so reusing it would stop the next
        // connection's workers at once.
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => Some(pair),
            Err(e) => {
                log::error!("rank {}: cannot create an exit event: {e}", self.cfg.rank);
                None
            }
        }
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if self.lose("vring stopped") {
            info!(
                "rank {}: queue {queue_index} stopped, member lost",
                self.cfg.rank
            );
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        // Never return an error here: it would end this worker for good.
        if !evset.contains(EventSet::IN) {
            debug!("rank {}: unexpected event set {evset:?}", self.cfg.rank);
            return Ok(());
        }
        // One queue per worker: the worker's index is the queue's index.
        let (Some(vring), Ok(queue)) = (
            vrings.get(usize::from(device_event)),
            u16::try_from(thread_id),
        ) else {
            debug!(
                "rank {}: event {device_event} on worker {thread_id} has no queue",
                self.cfg.rank
            );
            return Ok(());
        };
        self.process_queue(queue, vring);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use vm_memory::{FileOffset, GuestAddress};

    use vhost_user_backend::VringT;
    use virtio_queue::QueueT;

    use super::{check_regions_backed, AtomicMem, MemoryTableError, Vring};
    use crate::GuestMem;

    /// A scratch file of `len` bytes.
    fn file(name: &str, len: u64) -> File {
        let path = std::env::temp_dir().join(format!("dmlc-backend-{}-{name}", std::process::id()));
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f.set_len(len).unwrap();
        f
    }

    fn mem(f: File, offset: u64, size: usize) -> GuestMem {
        GuestMem::from_ranges_with_files([(
            GuestAddress(0x1000),
            size,
            Some(FileOffset::new(f, offset)),
        )])
        .unwrap()
    }

    #[test]
    fn a_ring_whose_size_is_not_a_power_of_two_never_starts() {
        let mem = AtomicMem::new(GuestMem::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap());
        let vring = Vring::new(mem, 256).unwrap();
        vring.set_queue_size(64);
        vring.set_queue_ready(true);
        assert!(vring.get_ref().get_queue().ready());
        assert_eq!(vring.get_ref().get_queue().size(), 64);
        // virtio-queue keeps 64; the ring must not run with it.
        vring.set_queue_size(48);
        assert!(!vring.get_ref().get_queue().ready());
        vring.set_queue_ready(true);
        assert!(!vring.get_ref().get_queue().ready());
        // A valid size again, and the frontend starts the ring.
        vring.set_queue_size(32);
        vring.set_queue_ready(true);
        assert!(vring.get_ref().get_queue().ready());
        assert_eq!(vring.get_ref().get_queue().size(), 32);
    }

    #[test]
    fn regions_must_lie_inside_their_files() {
        check_regions_backed(&mem(file("fits", 8192), 0, 8192)).unwrap();
        check_regions_backed(&mem(file("offset-fits", 8192), 4096, 4096)).unwrap();
        for (name, offset, size) in [("longer", 0, 16384), ("offset", 4096, 8192)] {
            let err = check_regions_backed(&mem(file(name, 8192), offset, size)).unwrap_err();
            assert!(
                matches!(
                    err,
                    MemoryTableError::PastEndOfFile {
                        gpa: 0x1000,
                        file_size: 8192,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
        // Anonymous memory has no file to check.
        check_regions_backed(&GuestMem::from_ranges(&[(GuestAddress(0), 4096)]).unwrap()).unwrap();
    }
}
