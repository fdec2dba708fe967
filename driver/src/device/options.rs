//! How a device is opened and how its waits spend their time
//! ([`OpenOptions`], [`Wait`], [`HYBRID_SPIN_CAP`], and the bounds every wait
//! gets: [`ASSUMED_DEFAULT_TIMEOUT`], [`WAIT_MARGIN`]), and the [`Request`]
//! that describes one collective.

use std::time::Duration;

use virtio_dmlc::{Dtype, Opcode, ReduceOp, VirtioDmlcReq, FLAG_IN_PLACE};

/// How to open a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenOptions {
    /// Busy-poll the used ring (true), or sleep until the device signals a
    /// completion (false, the default: [`Wait::default`] says why; after
    /// the spin of `spin_cap`).
    pub poll: bool,
    /// Descriptors per queue (a power of two; default 256).
    pub queue_size: u16,
    /// Negotiate `VIRTIO_F_EVENT_IDX` if offered (default true).
    pub event_idx: bool,
    /// Device-visible memory to set aside for buffers and rings (default 256 MiB).
    pub dma_bytes: usize,
    /// Set up at most this many queues; 0 (the default) = all the device has.
    pub max_queues: u16,
    /// With `poll` false: busy-poll for a while before sleeping (the hybrid
    /// wait), at most this long: the whole bound while most recent waits
    /// ended within it, a twentieth of it while most did not (with a probe
    /// of the whole bound now and then; see `device/spin.rs`). Zero: sleep
    /// at once. The default, [`HYBRID_SPIN_CAP`], makes `poll: false` the
    /// hybrid wait; on a transport that cannot sleep on an interrupt
    /// ([`Transport::can_sleep`]) the hybrid wait polls.
    ///
    /// [`Transport::can_sleep`]: crate::transport::Transport::can_sleep
    pub spin_cap: Duration,
    /// How long past a request's own timeout a wait gives up on an
    /// unanswered request ([`WAIT_MARGIN`] by default; tests of that bound
    /// shorten it).
    pub wait_margin: Duration,
}

/// The hybrid wait's bound that `--hybrid` (and `DMLC_POLL=hybrid`) use:
/// several times a TCG round trip (about 30 us), and little next to a wait
/// for a late peer (milliseconds).
pub const HYBRID_SPIN_CAP: Duration = Duration::from_micros(200);

/// The longest collective timeout the driver assumes for a request that
/// leaves it to the device's default (`timeout_ms == 0`, or the timeout
/// feature not negotiated): the default is a device setting the driver
/// cannot read.
pub const ASSUMED_DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Added to a request's timeout to bound every wait for it: a collective
/// whose members all arrived runs to completion, moving its data, after the
/// timeout no longer applies.
pub const WAIT_MARGIN: Duration = Duration::from_secs(60);

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            poll: Wait::default() == Wait::Poll,
            queue_size: 256,
            event_idx: true,
            dma_bytes: 256 << 20,
            max_queues: 0,
            spin_cap: HYBRID_SPIN_CAP,
            wait_margin: WAIT_MARGIN,
        }
    }
}

/// How a wait for a completion spends its time; [`OpenOptions::wait`] sets
/// `poll` and `spin_cap` for it. The one encoding of the wait mode: every
/// client names it by [`Wait::name`] (`DMLC_POLL`, the CLI's output, the
/// Python package's `poll=`) and the C ABI numbers it by [`Wait::code`]
/// (`DMLC_WAIT_*`).
///
/// The default is [`Wait::Hybrid`], chosen by the rule of issue 34 (the
/// lowest DDP step in 2 TCG VMs, unless its 4 B p50 is over 1.5x the best):
/// it gave the lowest DDP step, with a 4 B p50 within 1.1x of polling's
/// (docs/benchmarks.md, "The driver's waits in 2 TCG VMs, and the
/// default"). It spins briefly and then gives the CPU back, so it also
/// suits VMs that outnumber the host's CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Wait {
    /// Busy-poll the used ring.
    Poll,
    /// Sleep on the interrupt at once.
    Interrupt,
    /// Spin up to [`HYBRID_SPIN_CAP`], then sleep (the default).
    #[default]
    Hybrid,
}

impl Wait {
    /// Every mode, in the order of their codes.
    pub const ALL: [Wait; 3] = [Wait::Interrupt, Wait::Poll, Wait::Hybrid];

    /// The mode's name: `poll`, `interrupt` or `hybrid`.
    pub const fn name(self) -> &'static str {
        match self {
            Wait::Poll => "poll",
            Wait::Interrupt => "interrupt",
            Wait::Hybrid => "hybrid",
        }
    }

    /// The C ABI's number for the mode (`DMLC_WAIT_INTERRUPT` 0,
    /// `DMLC_WAIT_POLL` 1, `DMLC_WAIT_HYBRID` 2).
    pub const fn code(self) -> i32 {
        match self {
            Wait::Interrupt => 0,
            Wait::Poll => 1,
            Wait::Hybrid => 2,
        }
    }
}

impl std::fmt::Display for Wait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A wait mode's name that is none of [`Wait::name`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown wait mode {0:?}: expected poll, interrupt or hybrid (or 1 for poll, 0 for interrupt)"
)]
pub struct UnknownWait(pub String);

impl std::str::FromStr for Wait {
    type Err = UnknownWait;

    /// A mode by its name; `1` and `0` are the older spellings of `poll`
    /// and `interrupt` that `DMLC_POLL` has always taken.
    fn from_str(text: &str) -> Result<Wait, UnknownWait> {
        match text {
            "poll" | "1" => Ok(Wait::Poll),
            "interrupt" | "0" => Ok(Wait::Interrupt),
            "hybrid" => Ok(Wait::Hybrid),
            _ => Err(UnknownWait(text.to_string())),
        }
    }
}

impl OpenOptions {
    /// These options with `wait`'s way of waiting.
    pub fn wait(self, wait: Wait) -> OpenOptions {
        let (poll, spin_cap) = match wait {
            Wait::Poll => (true, Duration::ZERO),
            Wait::Interrupt => (false, Duration::ZERO),
            Wait::Hybrid => (false, HYBRID_SPIN_CAP),
        };
        OpenOptions {
            poll,
            spin_cap,
            ..self
        }
    }

    /// The way of waiting these options ask for.
    pub fn wait_kind(&self) -> Wait {
        match (self.poll, self.spin_cap.is_zero()) {
            (true, _) => Wait::Poll,
            (false, true) => Wait::Interrupt,
            (false, false) => Wait::Hybrid,
        }
    }
}

/// One collective request (the header fields, in Rust types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub opcode: Opcode,
    pub dtype: Dtype,
    /// Used by allreduce, reduce and reduce-scatter; ignored otherwise.
    pub op: ReduceOp,
    /// Root of broadcast and reduce; 0 otherwise.
    pub root: u32,
    /// Elements per member block (see `Opcode` for buffer sizes).
    pub count: u64,
    /// Caller's tag; must be equal on every member.
    pub tag: u64,
    /// No input segments; the output holds this member's input.
    pub in_place: bool,
    /// Collective timeout in ms, 0 = device default (honoured if the device
    /// offers `VIRTIO_DMLC_F_REQ_TIMEOUT`).
    pub timeout_ms: u32,
    /// The communicator (spec 5.X.6.13): 0, the whole group, or one made by
    /// [`Device::comm_split`](super::Device::comm_split) or
    /// [`Device::comm_create`](super::Device::comm_create); `root` and the
    /// buffer sizes are then in its ranks and size.
    pub comm: u32,
}

impl Request {
    /// A request with root 0, tag 0, out of place, default timeout.
    pub fn new(opcode: Opcode, dtype: Dtype, op: ReduceOp, count: u64) -> Self {
        Request {
            opcode,
            dtype,
            op,
            root: 0,
            count,
            tag: 0,
            in_place: false,
            timeout_ms: 0,
            comm: 0,
        }
    }

    /// The wire header.
    pub fn header(&self) -> VirtioDmlcReq {
        VirtioDmlcReq {
            opcode: self.opcode.raw().into(),
            dtype: self.dtype.raw(),
            op: self.op.raw(),
            root: self.root.into(),
            count: self.count.into(),
            tag: self.tag.into(),
            flags: if self.in_place { FLAG_IN_PLACE } else { 0 }.into(),
            timeout_ms: self.timeout_ms.into(),
        }
    }
}
