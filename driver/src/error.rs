//! Errors of the collective API.
//!
//! One variant per device status (so callers can match on what the device
//! said), plus the driver's own failures. Local checks before posting use
//! the device's own reason codes (`BadRequest`, `Unsupported`, `TooBig`), so
//! a mistake reads the same whether the driver or the device caught it.

use std::fmt;

use virtio_dmlc::{bad, mismatch, too_big, unsupported, NO_PEER};

use crate::dma::DmaError;
use crate::transport::TransportError;
use crate::virtqueue::QueueError;

/// Errors of [`crate::device::Device`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed; `detail` is a `virtio_dmlc::bad` code.
    #[error("bad request: {reason}")]
    BadRequest { detail: u32, reason: &'static str },
    /// The members disagree on this collective; `fields` names the header
    /// fields that differ, `peer` the first member that differs.
    #[error("collective mismatch: {}", MismatchText { fields, peer: *peer })]
    Mismatch { fields: String, peer: u32 },
    /// A member was lost while the collective waited or ran.
    #[error("collective failed: {} was lost", Rank(*peer))]
    PeerLost { peer: u32 },
    /// Not every member arrived within the device's timeout.
    #[error("collective timed out waiting for {}", Rank(*peer))]
    Timeout { peer: u32 },
    /// Opcode, dtype, op or their combination is not supported.
    #[error("unsupported by the device: {}", unsupported_text(*detail))]
    Unsupported { detail: u32 },
    /// The request exceeds the device's `max_bytes` or `max_segments`.
    #[error("request too big: {}", too_big_text(*detail))]
    TooBig { detail: u32 },
    /// The group was reset before the collective completed.
    #[error("collective failed: the group was reset")]
    Reset,
    /// A message was larger than the receive it matched (spec 5.X.6.13.4):
    /// nothing moved. `length` is the other end's size in bytes (on the
    /// receive: the message's; on the send: the receive's room), `peer` the
    /// other end's rank in the communicator.
    #[error("message truncated: the other end ({}) has {length} bytes", Rank(*peer))]
    Truncated { length: u64, peer: u32 },
    /// The check of [`crate::device::Device::set_check_finite`] (spec
    /// 5.X.6.14): the input of `rank` (in the request's communicator) held
    /// a NaN or an infinity at element `index`, the lowest rank and then
    /// the lowest element with one. The outputs hold the result all the
    /// same (NaNs included). The slice forms ([`crate::bounce::Bounce`])
    /// count `index` in the caller's whole input.
    #[error("non-finite input: rank {rank}'s input holds a NaN or an infinity at element {index}")]
    NonFinite { rank: u32, index: u64 },
    /// The device returned the chain without a status (used length 0): it
    /// could not find the response descriptor.
    #[error("device returned the request without a status (no valid response descriptor)")]
    NoStatus,
    /// The device answered with a status this driver does not know.
    #[error("device returned unknown status {status}")]
    UnknownStatus { status: u32 },
    /// [`crate::device::Device::wait`] gave up before the request completed.
    #[error("timed out waiting for the request to complete")]
    WaitTimeout,
    /// The device did not complete the request within its timeout plus a
    /// margin ([`crate::device::WAIT_MARGIN`]): it is stuck or gone. The
    /// request stays in flight (its buffers with it) until the device is
    /// reset.
    #[error(
        "the device has not completed the request within {after:?} (its timeout plus a \
         margin): the device is stuck or gone; reset and reopen it"
    )]
    Unanswered { after: std::time::Duration },
    /// The device's group id changed while the request was in flight, and
    /// the request was not completed: the device implementation restarted
    /// and never will complete it. (A new generation alone does not end a
    /// wait: spec 5.X.7.4.)
    #[error("{}", dropped_text(*generation, *group))]
    RequestDropped {
        /// Generation the request was posted in, and the one seen now.
        generation: (u32, u32),
        /// Group id the request was posted in, and the one seen now.
        group: (u64, u64),
    },
    /// A buffer cannot be used now: a request in flight uses it, or a
    /// borrow of it that would conflict may still be alive (see
    /// [`crate::device::DmaBuf`]).
    #[error("buffer busy: {reason}")]
    BufferBusy { reason: &'static str },
    /// Not enough free descriptors in the queue right now.
    #[error("queue is full")]
    QueueFull,
    /// The device-visible memory is exhausted.
    #[error("out of device-visible memory")]
    OutOfDmaMemory,
    /// The handle was already waited for, or never existed.
    #[error("unknown request handle (already completed or foreign)")]
    UnknownHandle,
    /// A caller mistake the device would never see (bad queue index, buffer
    /// of another device, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device's config space makes no sense.
    #[error("invalid device config: {0}")]
    BadConfig(String),
    /// The transport failed; the message says how (e.g. backend disconnected).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The virtqueue failed (a device that breaks the ring protocol).
    #[error(transparent)]
    Queue(QueueError),
    /// Device-visible memory could not be set up.
    #[error("device memory setup failed")]
    Dma(#[source] DmaError),
}

/// Result of the collective API.
pub type Result<T> = std::result::Result<T, Error>;

impl From<DmaError> for Error {
    fn from(e: DmaError) -> Self {
        match e {
            DmaError::OutOfMemory { .. } => Error::OutOfDmaMemory,
            e => Error::Dma(e),
        }
    }
}

impl From<QueueError> for Error {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Full { .. } => Error::QueueFull,
            QueueError::Dma(e) => e.into(),
            e => Error::Queue(e),
        }
    }
}

impl Error {
    /// A `BadRequest` with the spec's text for `detail`.
    pub fn bad_request(detail: u32) -> Self {
        Error::BadRequest {
            detail,
            reason: bad::describe(detail),
        }
    }

    /// A `Mismatch` naming the fields in `mask` (a `virtio_dmlc::mismatch` mask).
    pub fn mismatch(mask: u32, peer: u32) -> Self {
        let names: Vec<&str> = mismatch::fields(mask).collect();
        Error::Mismatch {
            fields: if names.is_empty() {
                format!("unknown fields {mask:#x}")
            } else {
                names.join(", ")
            },
            peer,
        }
    }
}

struct Rank(u32);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == NO_PEER {
            f.write_str("an unknown rank")
        } else {
            write!(f, "rank {}", self.0)
        }
    }
}

struct MismatchText<'a> {
    fields: &'a str,
    peer: u32,
}

impl fmt::Display for MismatchText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.fields.contains(", ") {
            "differ"
        } else {
            "differs"
        };
        write!(f, "{} {verb} on {}", self.fields, Rank(self.peer))
    }
}

fn dropped_text(generation: (u32, u32), group: (u64, u64)) -> String {
    let change = if group.0 != group.1 {
        format!("group id changed from {:#x} to {:#x}", group.0, group.1)
    } else {
        format!(
            "generation changed from {} to {}",
            generation.0, generation.1
        )
    };
    format!(
        "the device's {change} while the request was in flight, so the request was \
         dropped; the device must be reset and reopened"
    )
}

fn unsupported_text(detail: u32) -> &'static str {
    match detail {
        unsupported::OPCODE => "opcode",
        unsupported::DTYPE => "dtype",
        unsupported::OP => "reduce op",
        unsupported::OP_FOR_DTYPE => "reduce op for this dtype",
        _ => "unknown reason",
    }
}

fn too_big_text(detail: u32) -> &'static str {
    match detail {
        too_big::BYTES => "more bytes than the device's max_bytes",
        too_big::SEGMENTS => "more segments than the device's max_segments",
        virtio_dmlc::comm::TOO_BIG_COMMS => "the device's max_comms communicators are alive",
        _ => "unknown reason",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_went_wrong() {
        assert_eq!(
            Error::mismatch(mismatch::COUNT, 1).to_string(),
            "collective mismatch: count differs on rank 1"
        );
        assert_eq!(
            Error::mismatch(mismatch::DTYPE | mismatch::TAG, 3).to_string(),
            "collective mismatch: dtype, tag differ on rank 3"
        );
        assert_eq!(
            Error::PeerLost { peer: 2 }.to_string(),
            "collective failed: rank 2 was lost"
        );
        assert_eq!(
            Error::Timeout { peer: NO_PEER }.to_string(),
            "collective timed out waiting for an unknown rank"
        );
        assert_eq!(
            Error::bad_request(bad::INPUT_LENGTH).to_string(),
            "bad request: input length does not match count"
        );
        assert_eq!(
            Error::Unsupported {
                detail: unsupported::OP_FOR_DTYPE
            }
            .to_string(),
            "unsupported by the device: reduce op for this dtype"
        );
        let e = Error::from(TransportError::Disconnected {
            during: "waiting for a completion",
        });
        assert_eq!(
            e.to_string(),
            "device backend disconnected (waiting for a completion)"
        );
        assert_eq!(
            Error::RequestDropped {
                generation: (3, 4),
                group: (7, 7)
            }
            .to_string(),
            "the device's generation changed from 3 to 4 while the request was in flight, \
             so the request was dropped; the device must be reset and reopened"
        );
        assert!(Error::RequestDropped {
            generation: (3, 1),
            group: (0x17, 0x2a)
        }
        .to_string()
        .starts_with("the device's group id changed from 0x17 to 0x2a while"));
        assert!(matches!(
            Error::from(DmaError::OutOfMemory {
                requested: 1,
                largest_free: 0
            }),
            Error::OutOfDmaMemory
        ));
    }
}
