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
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostUserProtocolFeatures, VhostUserVirtioFeatures, VHOST_USER_CONFIG_SIZE,
};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use zerocopy::IntoBytes;

use crate::group::{Completion, Group};
use crate::GuestMem;

/// The guest memory handle vhost-user-backend shares with every vring.
pub type AtomicMem = GuestMemoryAtomic<GuestMem>;
/// One virtqueue as vhost-user-backend hands it to the backend.
pub type Vring = VringRwLock<AtomicMem>;

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
