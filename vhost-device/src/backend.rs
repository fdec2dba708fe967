//! The `VhostUserBackend` of one group member (one socket, one VM).
//!
//! A [`MemberBackend`] lives for one frontend connection: the daemon makes a
//! fresh one for every connection of rank `i`, so no ring state survives a
//! reconnect. It pops the chains the driver makes available and hands each to
//! [`Group::submit`]; the group later puts the chain in the used ring through
//! a [`VringCompletion`], from whatever thread finished the collective.
//! A queue has at most its size of chains in flight in the daemon: a driver
//! that offers more (a chain again before it was used) gets the queue
//! stopped until it resets the device, so it cannot make the daemon hold
//! requests without bound.
//!
//! Pause and loss: QEMU stops the rings (GET_VRING_BASE) both when the VM
//! is paused and when the driver goes away; in the second case the patched
//! QEMU sends RESET_DEVICE once the rings have stopped (sent before, it
//! would make the daemon refuse the stop). So a stopped ring alone is a
//! pause: the member stays in the group, its popped requests stay pending,
//! and a completion made while the ring is stopped is kept and put in the
//! used ring once the frontend starts the ring again. RESET_DEVICE, or the
//! connection closing, loses the member.
//!
//! Threads: vhost-user-backend runs one epoll worker per entry of
//! [`VhostUserBackend::queues_per_thread`]; this backend asks for one worker
//! per queue, so worker `q` serves queue `q` alone and a slow queue never
//! delays another. Frontend messages (features, config, memory table,
//! `GET_VRING_BASE` -> `stop_vring`) arrive on the connection's own thread.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures, VHOST_USER_CONFIG_SIZE,
};
use vhost_user_backend::{
    VhostUserBackend, VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT,
};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
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

mod state;

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
    /// Completions made while the ring was stopped (a paused VM), to be
    /// put in the used ring when it runs again. Locked after the vring
    /// state, never before it.
    deferred: Arc<Mutex<Deferred>>,
    /// The guest memory the ring lives in.
    mem: AtomicMem,
    /// Chains that were available when the ring first started on this
    /// connection, not yet popped: the driver made them available before
    /// this connection (a frontend handing its rings to a restarted
    /// daemon). `None` until the first start.
    earlier: Arc<Mutex<Option<u16>>>,
    /// A copy of the frontend's kick eventfd: a ring that starts is looked
    /// at once (chains a restored backend serves again wait for no kick).
    kick: Arc<Mutex<Option<std::fs::File>>>,
}

/// Completions waiting for a stopped ring to start again.
#[derive(Default)]
struct Deferred {
    /// `(head, len, epoch)` of each chain, in completion order.
    chains: Vec<(u16, u32, u64)>,
    /// The member's activation counter: a chain of an earlier activation
    /// is dropped, its driver is gone.
    current: Option<Arc<AtomicU64>>,
    /// Chains were put in the used ring while the ring had no call
    /// eventfd: the driver is signalled once it has one.
    unsignalled: bool,
    /// Where the ring was when it stopped: ring addresses and next
    /// available index. A restart elsewhere is not a resume.
    stopped_at: Option<RingPlace>,
}

/// A ring's addresses and next available index.
type RingPlace = (u64, u64, u64, u16);

fn ring_place(queue: &impl QueueT) -> RingPlace {
    (
        queue.desc_table(),
        queue.avail_ring(),
        queue.used_ring(),
        queue.next_avail(),
    )
}

impl Vring {
    /// Puts the completions kept while the ring was stopped in the used
    /// ring, if it runs again (ready and enabled), and signals the driver
    /// when it can.
    fn flush_deferred(&self) {
        let mut state = self.inner.get_mut();
        if !state.get_queue().ready() || !state.is_enabled() {
            return;
        }
        let mut deferred = lock(&self.deferred);
        let place = ring_place(state.get_queue());
        if let Some(at) = deferred.stopped_at.take() {
            if at != place && !deferred.chains.is_empty() {
                // Not the driver that was paused: the guest set the rings up
                // again without the reset that would have told us so (a
                // frontend without the RESET_DEVICE patch). Its old chains
                // must not land in the new rings.
                warn!(
                    "a ring restarted at {place:x?} after stopping at {at:x?}: \
                     {} completion(s) kept for it dropped",
                    deferred.chains.len()
                );
                deferred.chains.clear();
            }
        }
        let current = deferred.current.as_ref().map(|c| c.load(Ordering::Acquire));
        let chains = std::mem::take(&mut deferred.chains);
        let mut added = false;
        for (head, len, epoch) in chains {
            if Some(epoch) != current {
                continue;
            }
            match state.add_used(head, len) {
                Ok(()) => added = true,
                Err(e) => warn!("cannot return chain {head} after the ring restarted: {e}"),
            }
        }
        if added || deferred.unsignalled {
            if state.get_call().is_some() {
                deferred.unsignalled = false;
                if let Err(e) = state.signal_used_queue() {
                    warn!("cannot notify the driver after the ring restarted: {e}");
                }
            } else {
                deferred.unsignalled = true;
            }
        }
    }

    /// At the ring's first start on this connection, counts the chains the
    /// driver made available before it.
    fn note_first_start(&self) {
        let state = self.inner.get_ref();
        let queue = state.get_queue();
        let mem = self.mem.memory();
        // A ring without valid addresses yet is not started; its checks
        // come when it is served.
        if !queue.ready() || !queue.is_valid(&*mem) {
            return;
        }
        let mut earlier = lock(&self.earlier);
        if earlier.is_none() {
            let avail = queue
                .avail_idx(&*mem, Ordering::Acquire)
                .map_or(0, |idx| idx.0.wrapping_sub(queue.next_avail()));
            // More than the queue holds: a broken ring, left to the checks
            // that serve it.
            *earlier = Some(if avail <= queue.size() { avail } else { 0 });
        }
    }

    /// True if the next chain popped was made available before this
    /// connection (counted by [`Self::note_first_start`]).
    fn take_earlier(&self) -> bool {
        match &mut *lock(&self.earlier) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// Forgets the kept completions (the member was lost).
    fn drop_deferred(&self) {
        let mut deferred = lock(&self.deferred);
        deferred.chains.clear();
        deferred.unsignalled = false;
    }
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
            inner: VringRwLock::new(mem.clone(), max_queue_size)?,
            bad_size: Arc::new(AtomicBool::new(false)),
            deferred: Arc::new(Mutex::new(Deferred::default())),
            mem,
            earlier: Arc::new(Mutex::new(None)),
            kick: Arc::new(Mutex::new(None)),
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
        if enabled {
            self.flush_deferred();
            // One look at the ring now (a spurious wake-up finds nothing).
            if let Some(k) = &*lock(&self.kick) {
                use std::io::Write;
                if let Err(e) = (&*k).write_all(&1u64.to_ne_bytes()) {
                    debug!("cannot wake the queue's worker: {e}");
                }
            }
        }
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
        if !ready {
            let state = self.inner.get_ref();
            let queue = state.get_queue();
            if queue.ready() {
                lock(&self.deferred).stopped_at = Some(ring_place(queue));
            }
        }
        self.inner
            .set_queue_ready(ready && !self.bad_size.load(Ordering::Acquire));
        if ready {
            self.note_first_start();
            self.flush_deferred();
        }
    }

    fn set_kick(&self, file: Option<std::fs::File>) {
        *lock(&self.kick) = file.as_ref().and_then(|f| f.try_clone().ok());
        self.inner.set_kick(file);
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.inner.read_kick()
    }

    fn set_call(&self, file: Option<std::fs::File>) {
        let some = file.is_some();
        self.inner.set_call(file);
        if some {
            self.flush_deferred();
        }
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
/// queues, REPLY_ACK and RESET_DEVICE because the library implements them,
/// DEVICE_STATE for the snapshot of a frozen job (`backend/state.rs`).
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::DEVICE_STATE
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
    /// Poll even when no CPU is spare ([`crate::spare_cpu`]).
    pub poll_anyway: bool,
    /// Join the group at the driver's first request rather than at
    /// SET_FEATURES. The daemon sets it after a connection of this rank
    /// failed before its first request (a ring the daemon refused, say):
    /// QEMU reconnects every second with the same setup, and each such
    /// connection would otherwise be one more loss for the peers.
    pub defer_activation: bool,
    /// Serve the requests that a frontend's rings hold when they first
    /// start on a connection (made available before it: QEMU hands its
    /// rings to a restarted daemon) rather than complete them with RESET.
    /// Right when the daemon restarts with the same fixed group id, so
    /// that a restart is transparent to the drivers.
    pub serve_earlier_requests: bool,
}

/// Per-queue state of one connection.
struct QueueSlot {
    /// Held while chains are popped and submitted, so that a member that is
    /// being lost waits until no submission is under way. It also caches
    /// the completion of the current activation.
    gate: Mutex<Option<Arc<VringCompletion>>>,
    /// A broken ring is reported once at warn, then at debug.
    warned: AtomicBool,
    /// The queue's ring, once served: a snapshot reads it (`state.rs`).
    vring: Mutex<Option<Vring>>,
    /// A restored ring's index to pop from again, before its first pop.
    rewind: Mutex<Option<u16>>,
}

/// The vhost-user backend of one member for one frontend connection.
pub struct MemberBackend {
    cfg: BackendConfig,
    group: Arc<Group>,
    mem: RwLock<AtomicMem>,
    /// True between the driver's feature negotiation and the member's loss
    /// (device reset or the connection closing; a stopped vring alone is a
    /// pause): only an
    /// active member submits requests.
    active: AtomicBool,
    /// Features were acked on this connection but, with
    /// `defer_activation`, the member joins at its first request.
    armed: AtomicBool,
    /// A chain was submitted on this connection.
    submitted: AtomicBool,
    /// Counts activations; a completion of an earlier one is dropped.
    epoch: Arc<AtomicU64>,
    queues: Vec<QueueSlot>,
    /// A saved state being read from QEMU (`state.rs`).
    loading: Mutex<Option<std::thread::JoinHandle<io::Result<Vec<u8>>>>>,
}

impl MemberBackend {
    /// A backend for a new connection of member `cfg.rank`. `mem` must be
    /// the handle given to `VhostUserDaemon::new` with it.
    pub fn new(cfg: BackendConfig, group: Arc<Group>, mem: AtomicMem) -> Self {
        let queues = (0..cfg.num_queues)
            .map(|_| QueueSlot {
                gate: Mutex::new(None),
                warned: AtomicBool::new(false),
                vring: Mutex::new(None),
                rewind: Mutex::new(None),
            })
            .collect();
        MemberBackend {
            cfg,
            group,
            mem: RwLock::new(mem),
            active: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            submitted: AtomicBool::new(false),
            epoch: Arc::new(AtomicU64::new(0)),
            queues,
            loading: Mutex::new(None),
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

    /// Whether the driver submitted any chain on this connection.
    pub fn submitted_any(&self) -> bool {
        self.submitted.load(Ordering::Acquire)
    }

    /// Makes the member active (it joins the group), if it was not.
    fn activate(&self, why: &str) {
        if !self.active.swap(true, Ordering::AcqRel) {
            self.group.member_ready(self.cfg.rank);
            debug!("rank {}: {why}, member ready", self.cfg.rank);
        }
    }

    /// Marks the member lost, if it was active: no further submission from
    /// this connection, completions still in flight are dropped, and the
    /// group fails the collectives that waited for it. Returns whether it
    /// was active. It returns once no worker of this connection is inside
    /// [`Group::submit`] and no collective (run by any member's thread)
    /// still reads or writes the member's buffers, so that the reset or
    /// stop it answers means the device is done with the driver's memory.
    pub fn lose(&self, why: &str) -> bool {
        self.armed.store(false, Ordering::Release);
        if !self.active.swap(false, Ordering::AcqRel) {
            // Never active, or a second notice of a loss already made (a
            // second queue stopped): answered under the same promise, at
            // once unless a collective from before that loss still runs.
            self.group.wait_untouched(self.cfg.rank);
            return false;
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
        // Tell the group first: it fails the others' waiting collectives at
        // once, then waits for the collectives already running that
        // include this member (on any thread, this member's workers
        // included) to move their last byte. The group drops whatever this
        // member submits from here on (its gate is closed; a submission that
        // read the gate before is dropped under the state lock).
        self.group.member_lost(self.cfg.rank);
        // Then wait for the workers to leave `drain`, so that nothing of
        // this connection is still under way when the member comes back.
        // Completions kept for a stopped ring belong to the driver that is
        // gone (none is added any more: the group made none after
        // `member_lost`).
        for slot in &self.queues {
            if let Some(done) = lock(&slot.gate).take() {
                done.vring.drop_deferred();
            }
        }
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
        self.note_ring(queue, vring);
        if !self.is_active() {
            if !self.armed.swap(false, Ordering::AcqRel) {
                return 0;
            }
            self.activate("first request after a refused connection");
        }
        // The group keeps this snapshot of the memory map alive for as long
        // as a request needs it, whatever the frontend changes meanwhile.
        let mem = &self.memory();
        let ring = self.completion(&mut gate, queue, vring);
        if ring.overrun.load(Ordering::Acquire) {
            return 0;
        }
        let done: Arc<dyn Completion> = ring.clone();
        let mut submitted = 0;
        // The active flag is re-read for every chain: `lose` waits on the
        // gate, so once it holds the gate nothing more is submitted.
        while self.is_active() {
            let next = {
                let mut state = vring.get_mut();
                let q = state.get_queue_mut();
                let size = u32::from(q.size());
                // Only this thread adds to the count (completions take from
                // it), so a count below the size stays below it until the
                // pop below.
                let full = || ring.in_flight.load(Ordering::Acquire) >= size;
                let at_bound = full();
                let more = at_bound
                    && q.ready()
                    && q.avail_idx(&**mem, Ordering::Acquire)
                        .is_ok_and(|idx| idx.0 != q.next_avail());
                if at_bound && !more {
                    Next::Idle
                } else if more && full() {
                    // A driver has at most `size` chains in flight, and the
                    // count was read again after the avail index: a
                    // completion that made room for the chain offered is
                    // seen. So the driver offered a chain again before the
                    // device returned it.
                    Next::Overrun(q.size())
                } else {
                    match q.iter(&**mem) {
                        Ok(mut avail) => avail.next().map_or(Next::Idle, Next::Chain),
                        // The frontend stopped the ring; nothing to do.
                        Err(virtio_queue::Error::QueueNotReady) => Next::Idle,
                        Err(e) => {
                            self.ring_error(queue, &e);
                            Next::Idle
                        }
                    }
                }
            };
            // The vring lock is released before submitting: the group may
            // complete the request at once, on this thread.
            match next {
                Next::Chain(chain) => {
                    self.submitted.store(true, Ordering::Release);
                    ring.in_flight.fetch_add(1, Ordering::AcqRel);
                    let earlier = vring.take_earlier();
                    if earlier && !self.cfg.serve_earlier_requests {
                        // Made available to the group before this one: its
                        // sequence number means nothing here.
                        self.group
                            .refuse_earlier(self.cfg.rank, queue, mem, chain, &done);
                    } else {
                        self.group.submit(self.cfg.rank, queue, mem, chain, &done);
                    }
                    submitted += 1;
                }
                Next::Overrun(size) => {
                    self.overrun(queue, &ring, size);
                    break;
                }
                Next::Idle => break,
            }
        }
        submitted
    }

    /// Stops serving `queue` for the rest of this activation: its driver
    /// had more chains in flight than the queue holds. Requests already
    /// taken complete as usual; each of the others would hold daemon
    /// memory until its collective ended, without bound.
    fn overrun(&self, queue: u16, ring: &VringCompletion, size: u16) {
        if ring.overrun.swap(true, Ordering::AcqRel) {
            return;
        }
        self.group.metrics().queue_overrun();
        warn!(
            "rank {} queue {queue}: more than {size} requests in flight (chains made available \
             again before they were used), queue stopped until the device is reset",
            self.cfg.rank
        );
    }

    /// Spins on `queue` with notifications off, draining whatever arrives,
    /// until it has been idle for the poll time. Returns how many chains it
    /// submitted.
    fn poll(&self, queue: u16, vring: &Vring) -> usize {
        // With every CPU busy, the next kick comes sooner if this thread
        // sleeps than if it spins. Asked on every turn, not only on entry:
        // each request served extends the deadline, so a poll begun while a
        // CPU was free could otherwise spin on for as long as requests keep
        // coming, after the CPU stopped being free (the answer is cached
        // for 10 ms, so asking costs a clock read).
        let spare = || self.cfg.poll_anyway || crate::spare_cpu::spare_cpu();
        let mut submitted = 0;
        let mut deadline = Instant::now() + self.cfg.poll;
        while self.is_active() && Instant::now() < deadline && spare() {
            if avail_pending(vring, &self.memory()) {
                let n = self.drain(queue, vring);
                // A ring that has chains but serves none (broken, or
                // stopped) must not keep the worker spinning.
                if n > 0 {
                    submitted += n;
                    deadline = Instant::now() + self.cfg.poll;
                }
            } else {
                // Give the CPU to any thread that can run: on a machine
                // with no spare CPU, a plain spin keeps the ranks (or
                // vCPUs) that would post the next request off it for the
                // whole poll time. With a spare CPU this returns at once.
                std::thread::yield_now();
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
                    in_flight: AtomicU32::new(0),
                    overrun: AtomicBool::new(false),
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

/// What [`MemberBackend::drain`] found next on a ring.
enum Next<'a> {
    Chain(DescriptorChain<&'a GuestMem>),
    /// More chains in flight than the queue size (the size is given).
    Overrun(u16),
    Idle,
}

/// Returns finished chains of one queue to the driver, and counts the
/// chains of the queue in flight, for one activation.
pub struct VringCompletion {
    rank: u32,
    queue: u16,
    vring: Vring,
    /// The activation this completion belongs to.
    epoch: u64,
    current: Arc<AtomicU64>,
    /// Chains taken from the ring and not yet put in the used ring.
    in_flight: AtomicU32,
    /// The driver had more chains in flight than the queue size: the ring
    /// is not served again in this activation.
    overrun: AtomicBool,
}

impl Completion for VringCompletion {
    fn put(&self, queue: u16, head: u16, written: u32) -> bool {
        let rank = self.rank;
        if queue != self.queue {
            warn!(
                "rank {rank}: completion for queue {queue} given to queue {}",
                self.queue
            );
            return false;
        }
        // Before the used element is visible: once the driver sees it, it
        // may offer the chain again, and the count must have room for it.
        let _ = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
        let mut state = self.vring.get_mut();
        // The member was lost since the request was popped: the ring may
        // already belong to a new driver.
        if self.current.load(Ordering::Acquire) != self.epoch {
            debug!("rank {rank} queue {queue}: dropped completion of chain {head}");
            return false;
        }
        // The ring is stopped (a paused VM): the frontend owns it until it
        // starts it again, and the chain goes in the used ring then. Under
        // the vring lock, so that a restart either sees it or came first.
        if !state.get_queue().ready() || !state.is_enabled() {
            let mut deferred = lock(&self.vring.deferred);
            deferred.current = Some(self.current.clone());
            deferred.chains.push((head, written, self.epoch));
            debug!("rank {rank} queue {queue}: chain {head} kept until the ring runs again");
            return false;
        }
        if let Err(e) = state.add_used(head, written) {
            warn!("rank {rank} queue {queue}: cannot return chain {head}: {e}");
            return false;
        }
        // A driver's broken used_event costs an interrupt, not a request.
        state.needs_notification().unwrap_or(true)
    }

    fn notify(&self, queue: u16) {
        // A driver gone since the put has a new call eventfd, or none.
        if self.current.load(Ordering::Acquire) != self.epoch {
            return;
        }
        if let Err(e) = self.vring.get_ref().signal_used_queue() {
            warn!(
                "rank {} queue {queue}: cannot notify the driver: {e}",
                self.rank
            );
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
        DEVICE_FEATURES | self.group.comm_features()
    }

    fn acked_features(&self, features: u64) {
        self.group.set_member_features(self.cfg.rank, features);
        // The frontend sends SET_FEATURES each time it starts the device
        // (QEMU: when the driver sets DRIVER_OK, and again when a paused VM
        // runs), so this is where a member (re)joins after a loss.
        if self.cfg.defer_activation {
            if !self.is_active() {
                self.armed.store(true, Ordering::Release);
            }
        } else {
            self.activate(&format!("features {features:#x} acked"));
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

    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        file: std::fs::File,
    ) -> io::Result<Option<std::fs::File>> {
        let save = matches!(direction, VhostTransferStateDirection::SAVE);
        self.transfer_state(save, file).map(|()| None)
    }

    fn check_device_state(&self) -> io::Result<()> {
        self.check_state()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // A pause, not a loss (see the module comment): requests stay
        // pending, and completions wait for the ring to run again.
        if self.is_active() {
            info!(
                "rank {}: queue {queue_index} stopped (VM paused?), its requests stay pending",
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
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use vm_memory::{Bytes, FileOffset, GuestAddress, GuestAddressSpace};

    use vhost_user_backend::{VhostUserBackend, VringT};
    use virtio_dmlc::{
        Dtype, Opcode, ReduceOp, Status, VirtioDmlcResp, REQ_HEADER_SIZE, RESP_SIZE,
    };
    use virtio_queue::QueueT;
    use zerocopy::{FromBytes, IntoBytes};

    use super::{
        check_regions_backed, lock, AtomicMem, BackendConfig, MemberBackend, MemoryTableError,
        Vring, DEVICE_FEATURES,
    };
    use crate::group::harness::{config, hdr, Desc, World};
    use crate::group::Group;
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

    fn backend(rank: u32, queue_size: u16, group: &Arc<Group>, mem: AtomicMem) -> MemberBackend {
        let cfg = BackendConfig {
            rank,
            num_queues: 1,
            queue_size,
            poll: Duration::ZERO,
            poll_anyway: false,
            defer_activation: false,
            serve_earlier_requests: false,
        };
        MemberBackend::new(cfg, group.clone(), mem)
    }

    /// The device offers VIRTIO_F_VERSION_1; of the device-specific bits
    /// 1 to 23 (spec 5.X.3), bits 1 to 3 (communicators, send and receive,
    /// all-to-all, gather and scatter) and 4 (non-finite origin) on one
    /// host (none across hosts: `group/tests/comms.rs`), the rest
    /// reserved; and not the ring features it must not offer:
    /// ACCESS_PLATFORM (33), RING_PACKED (34) and IN_ORDER (35).
    #[test]
    fn offered_features_are_the_specs() {
        let offered = DEVICE_FEATURES | 0b1111 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM;
        assert_ne!(offered & (1 << virtio_dmlc::VIRTIO_F_VERSION_1), 0);
        for reserved in 5..=23 {
            assert_eq!(offered & (1 << reserved), 0, "bit {reserved}");
        }
        for forbidden in [33, 34, 35] {
            assert_eq!(offered & (1 << forbidden), 0, "bit {forbidden}");
        }
        let b = backend(
            0,
            256,
            &World::new(config(2)).group,
            AtomicMem::new(GuestMem::new()),
        );
        assert_eq!(b.features(), offered);
    }

    /// Config space is read-only: a driver's write is accepted (an error
    /// would close the connection) and changes nothing the driver reads.
    #[test]
    fn config_writes_are_ignored() {
        let w = World::new(config(2));
        let b = backend(1, 256, &w.group, AtomicMem::new(GuestMem::new()));
        let size = std::mem::size_of::<virtio_dmlc::comm::VirtioDmlcConfigComm>() as u32;
        let before = b.get_config(0, size);
        assert_eq!(before.len(), size as usize);
        for offset in [0, 0x04, 0x24, 0x28] {
            b.set_config(offset, &[0xff; 8]).unwrap();
        }
        b.set_config(0, &vec![0xff; size as usize]).unwrap();
        assert_eq!(b.get_config(0, size), before);
        assert_eq!(w.group.config_space(1).as_bytes(), &before[..]);
    }

    /// A member whose worker is inside `drain` (as when it runs a
    /// collective that its last arrival completed) is reported lost to the
    /// group at once: the others' waiting collectives fail before the
    /// worker is done, and `lose` returns only after it is.
    #[test]
    fn a_loss_is_reported_before_the_worker_leaves_drain() {
        let mut w = World::new(config(2));
        let b = backend(1, 256, &w.group, AtomicMem::new(GuestMem::new()));
        b.acked_features(0);
        let descs = {
            let m = &mut w.members[0];
            vec![
                m.header(&hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 7, 0, 0)),
                m.response(),
            ]
        };
        let barrier = w.submit(0, 0, &descs);
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let returned = AtomicBool::new(false);
        let bk = &b;
        std::thread::scope(|s| {
            // Stands for a worker that holds the queue's gate in `drain`.
            s.spawn(move || {
                let _gate = lock(&bk.queues[0].gate);
                held_tx.send(()).unwrap();
                let _ = release_rx.recv_timeout(Duration::from_secs(20));
            });
            held_rx.recv().unwrap();
            s.spawn(|| {
                assert!(b.lose("test"));
                returned.store(true, Ordering::SeqCst);
            });
            let t = Instant::now();
            let done = w.wait_for(&barrier, Duration::from_secs(5));
            let waited = t.elapsed();
            let early = !returned.load(Ordering::SeqCst);
            release_tx.send(()).unwrap();
            assert!(done.is_some(), "no PEER_LOST while the worker was busy");
            assert!(
                waited < Duration::from_secs(2),
                "PEER_LOST after {waited:?}"
            );
            assert!(early, "lose returned while the worker was in drain");
        });
        assert!(returned.load(Ordering::SeqCst));
        let r =
            VirtioDmlcResp::read_from_bytes(&w.members[0].read(barrier.resp, RESP_SIZE)).unwrap();
        assert_eq!(Status::from_raw(r.status.get()), Some(Status::PeerLost));
        assert_eq!(r.peer.get(), 1);
        assert_eq!(w.group.generation(), 2);
    }

    /// A reset of a member whose buffers a collective run by another
    /// member's thread is writing is answered only once that collective is
    /// done with them: after `lose` the device no longer touches them.
    #[test]
    fn lose_returns_once_a_running_collective_is_done_with_the_members_buffers() {
        // A busy machine can delay this thread until the collective is
        // over (in an optimized build): then try again.
        let in_the_middle = (0..5).any(|_| lose_during_a_collective_of_the_other_member());
        assert!(in_the_middle, "the loss never came in the middle");
    }

    /// One try of the test above: false if the loss came too late.
    fn lose_during_a_collective_of_the_other_member() -> bool {
        const BYTES: usize = 16 << 20;
        let mut w = World::with_region(config(2), 20 << 20);
        let b = backend(1, 256, &w.group, AtomicMem::new(GuestMem::new()));
        b.acked_features(0);
        let h = hdr(
            Opcode::Allreduce.raw(),
            Dtype::I32.raw(),
            ReduceOp::Sum.raw(),
            0,
            (BYTES / 4) as u64,
            5,
            0,
            0,
        );
        let chains: Vec<(Vec<Desc>, Desc)> = (1..=2i32)
            .map(|v| {
                let m = &mut w.members[v as usize - 1];
                let input: Vec<u8> = v.to_le_bytes().repeat(BYTES / 4);
                let mut d = vec![m.header(&h)];
                d.extend(m.segments(&input, &[], false));
                let out = m.segments(&vec![0x5a; BYTES], &[], true)[0];
                d.extend([out, m.response()]);
                (d, out)
            })
            .collect();
        let out1 = chains[1].1;
        w.submit(1, 0, &chains[1].0);
        let (group, _hub, mut parts) = w.into_parts();
        let mem1 = parts[1].0.mem.clone();
        let (mut m0, done0) = parts.swap_remove(0);
        let descs0 = chains[0].0.clone();
        let runner = {
            let group = group.clone();
            std::thread::spawn(move || {
                m0.submit(&group, 0, 0, &descs0, &done0);
            })
        };
        while group.metrics().skew_count() == 0 {
            std::thread::yield_now();
        }
        let read_out1 = || {
            let mut v = vec![0; BYTES];
            mem1.read_slice(&mut v, GuestAddress(out1.addr)).unwrap();
            v
        };
        let last: i32 = mem1
            .read_obj(GuestAddress(out1.addr + BYTES as u64 - 4))
            .unwrap();
        if last == 3 {
            runner.join().unwrap();
            return false;
        }
        let want = 3i32.to_le_bytes().repeat(BYTES / 4);
        assert!(b.lose("device reset"));
        let at_return = read_out1();
        runner.join().unwrap();
        assert!(at_return == want, "written after the reset was answered");
        assert!(read_out1() == at_return);
        // A second notice of the same loss returns at once.
        assert!(!b.lose("vring stopped"));
        true
    }

    /// One split ring in guest memory, as a driver lays it out, holding a
    /// barrier chain at descriptors 0 and 1.
    struct Ring {
        mem: Arc<GuestMem>,
        vring: Vring,
        size: u16,
        avail_idx: u16,
    }

    const DESC: u64 = 0;
    const AVAIL: u64 = 0x1000;
    const USED: u64 = 0x2000;
    const HEADER: u64 = 0x4000;
    const RESPONSE: u64 = 0x5000;

    impl Ring {
        fn new(mem: &AtomicMem, size: u16) -> Ring {
            let guest = mem.memory().into_inner();
            let vring = Vring::new(mem.clone(), size).unwrap();
            vring.set_queue_size(size);
            vring.set_queue_info(DESC, AVAIL, USED).unwrap();
            vring.set_queue_ready(true);
            vring.set_enabled(true);
            let h = hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 9, 0, 0);
            guest
                .write_slice(h.as_bytes(), GuestAddress(HEADER))
                .unwrap();
            let chain = [
                Desc::r(HEADER, REQ_HEADER_SIZE as u32),
                Desc::w(RESPONSE, RESP_SIZE as u32),
            ];
            for (i, d) in chain.iter().enumerate() {
                let at = DESC + 16 * i as u64;
                let (flags, next) = if d.write { (2u16, 0u16) } else { (1, 1) };
                guest.write_obj(d.addr.to_le(), GuestAddress(at)).unwrap();
                guest
                    .write_obj(d.len.to_le(), GuestAddress(at + 8))
                    .unwrap();
                guest
                    .write_obj(flags.to_le(), GuestAddress(at + 12))
                    .unwrap();
                guest
                    .write_obj(next.to_le(), GuestAddress(at + 14))
                    .unwrap();
            }
            Ring {
                mem: guest,
                vring,
                size,
                avail_idx: 0,
            }
        }

        /// Makes head 0 available `n` more times (the same chain again and
        /// again, as a hostile driver may).
        fn offer(&mut self, n: u16) {
            for _ in 0..n {
                let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % self.size);
                self.mem.write_obj(0u16, GuestAddress(slot)).unwrap();
                self.avail_idx = self.avail_idx.wrapping_add(1);
            }
            self.mem
                .write_obj(self.avail_idx.to_le(), GuestAddress(AVAIL + 2))
                .unwrap();
        }

        fn used_idx(&self) -> u16 {
            u16::from_le(self.mem.read_obj(GuestAddress(USED + 2)).unwrap())
        }
    }

    fn ring_memory() -> AtomicMem {
        AtomicMem::new(GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap())
    }

    /// A driver may have at most queue-size chains in flight. The device
    /// serves that many, and stops serving the queue (until the member is
    /// lost and comes back) when the driver offers more: a chain offered
    /// again and again holds no more than that in the engine.
    #[test]
    fn more_chains_in_flight_than_the_queue_size_stop_the_queue() {
        const SIZE: u16 = 16;
        let group = Group::new(config(2));
        let mem = ring_memory();
        let mut ring = Ring::new(&mem, SIZE);
        let b = backend(0, SIZE, &group, mem);
        b.acked_features(0);
        let metrics = group.metrics();
        // Exactly the queue size in flight: all taken, all waiting for rank 1.
        ring.offer(SIZE);
        b.process_queue(0, &ring.vring);
        assert_eq!(metrics.pending(), u64::from(SIZE));
        assert_eq!(metrics.queue_overruns(), 0);
        // One more while they are all in flight.
        ring.offer(1);
        b.process_queue(0, &ring.vring);
        assert_eq!(metrics.pending(), u64::from(SIZE));
        assert_eq!(metrics.queue_overruns(), 1);
        // Ten times the queue size more: nothing taken, counted once.
        for _ in 0..10 {
            ring.offer(SIZE / 2);
            b.process_queue(0, &ring.vring);
        }
        assert_eq!(metrics.pending(), u64::from(SIZE));
        assert_eq!(metrics.queue_overruns(), 1);
        assert_eq!(ring.used_idx(), 0);
        // A loss drops the member's requests; when it comes back the queue
        // is served again.
        assert!(b.lose("test"));
        assert_eq!(metrics.pending(), 0);
        b.acked_features(0);
        ring.vring
            .set_queue_next_avail(ring.avail_idx.wrapping_sub(3));
        b.process_queue(0, &ring.vring);
        assert_eq!(metrics.pending(), 3);
        assert_eq!(metrics.queue_overruns(), 1);
    }

    /// A driver that keeps the queue full, offering each chain again as
    /// soon as it is used, never trips the bound: completions make room
    /// before the driver can see them.
    #[test]
    fn a_full_queue_that_is_served_never_overruns() {
        const SIZE: u16 = 8;
        let group = Group::new(config(1));
        let mem = ring_memory();
        let mut ring = Ring::new(&mem, SIZE);
        let b = backend(0, SIZE, &group, mem);
        b.acked_features(0);
        for _ in 0..50 {
            let used = ring.used_idx();
            let in_flight = ring.avail_idx.wrapping_sub(used);
            ring.offer(SIZE - in_flight);
            b.process_queue(0, &ring.vring);
        }
        assert_eq!(ring.used_idx(), 50 * SIZE);
        assert_eq!(group.metrics().queue_overruns(), 0);
        assert_eq!(group.metrics().pending(), 0);
        let r = VirtioDmlcResp::read_from_bytes(
            &ring
                .mem
                .read_obj::<[u8; RESP_SIZE]>(GuestAddress(RESPONSE))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(Status::from_raw(r.status.get()), Some(Status::Ok));
    }
}
