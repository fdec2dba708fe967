//! The collective API: one [`Device`] per member, requests posted as
//! descriptor chains `[header (R)] [inputs (R)*] [outputs (W)*] [response (W)]`.
//!
//! Buffers live in device-visible memory ([`DmaBuf`]) so the device reads and
//! writes them in place (zero copy); the `*_slice` conveniences copy through a
//! bounce buffer instead. [`Device::submit`] checks a request against the
//! buffer rules (`virtio_dmlc::buffer_elems`) and the device's limits before
//! posting, so obvious mistakes fail locally with the same error the device
//! would give; [`Device::submit_raw`] posts any chain unchecked, to exercise
//! the device's own checks.
//!
//! Concurrency: every queue has its own lock; `Device` is `Send + Sync`.
//! [`Device::submit`] never blocks: on a full queue it returns
//! [`Error::QueueFull`]. The blocking conveniences wait for room instead.
//! Every handle must be passed to [`Device::wait`] once; until then its
//! result is kept (a few bytes), its buffers are released at completion.
//!
//! The module's files: `options.rs` ([`OpenOptions`], [`Wait`], [`Request`]),
//! `buffer.rs` ([`DmaBuf`], [`BufSlice`], [`Element`], the leases), `open.rs`
//! (the [`Device`] struct: open, accessors, close), `check.rs` (the local
//! check), `post.rs` (submit, call), `wait.rs` (waiting), `queue.rs` (the
//! queue engine under each queue's lock), `collectives.rs` (the blocking
//! collectives and slice conveniences), `comms.rs` (communicators, send and
//! receive, all-to-all, gather and scatter: spec 5.X.6.13); the tests (`tests.rs`) run over a
//! fake transport (`fake.rs`).
//!
//! [`Error::QueueFull`]: crate::Error::QueueFull

mod buffer;
mod check;
mod collectives;
mod comms;
mod open;
mod options;
mod post;
mod queue;
mod spin;
mod wait;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

pub use virtio_dmlc::{Dtype, Opcode, ReduceOp};

pub(crate) use buffer::Lease;
pub use buffer::{le_in_place, BufSlice, DmaBuf, Element};
pub use comms::{counts_table, CommInfo, CommRequest, Received};
pub use open::Device;
pub use options::{
    OpenOptions, Request, UnknownWait, Wait, ASSUMED_DEFAULT_TIMEOUT, HYBRID_SPIN_CAP, WAIT_MARGIN,
};
pub(crate) use queue::{completion_result, Completion, Header};
pub use queue::{Done, Handle, RawDesc, Reply};
