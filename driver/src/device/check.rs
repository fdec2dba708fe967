//! The local check of a request against the device's rules and limits
//! ([`Device::check`], spec 5.X.6.7.3), and the element counts a request
//! needs ([`Device::buffer_elems`]).

use virtio_dmlc::{bad, too_big, unsupported, BufferElems};

use crate::error::{Error, Result};

use super::queue::for_each_piece;
use super::{BufSlice, Device, Opcode, Request};

/// What the size and length checks of a request need.
pub(super) struct Sizes<'a> {
    /// Elements of each buffer, from the header.
    pub(super) elems: BufferElems,
    /// Bytes of one element (1 for requests without data).
    pub(super) elem_size: u64,
    /// The request moves no data (barrier, comm_split, ...).
    pub(super) no_data: bool,
    pub(super) count: u64,
    /// The in-place flag applies (it has no effect on some members).
    pub(super) in_place: bool,
    pub(super) input: &'a [BufSlice],
    pub(super) output: &'a [BufSlice],
}

fn uses_op(opcode: Opcode) -> bool {
    matches!(
        opcode,
        Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter
    )
}

fn has_root(opcode: Opcode) -> bool {
    matches!(opcode, Opcode::Broadcast | Opcode::Reduce)
}

impl Device {
    /// Checks `req` and its buffers the way the device would, without
    /// posting anything: the checks of spec 5.X.6.7.3 that a driver-built
    /// chain can fail, in the same order and with the same codes, so a
    /// request refused here gets the status and detail the device would
    /// give. Segments are counted (`max_segments`) and checked for element
    /// alignment as descriptors, after the buffers are split where device
    /// memory is not contiguous (at hugepage boundaries on PCI): a buffer
    /// that spans such a boundary is two segments.
    pub fn check(&self, req: &Request, input: &[BufSlice], output: &[BufSlice]) -> Result<()> {
        let c = &self.config;
        let unsupported = |detail| Err(Error::Unsupported { detail });
        // Step 3: known and supported opcode, dtype, op.
        if c.opcodes.get() & (1 << req.opcode.raw()) == 0 {
            return unsupported(unsupported::OPCODE);
        }
        let no_data = !req.opcode.moves_data();
        if !no_data && c.dtypes.get() & (1 << req.dtype.raw()) == 0 {
            return unsupported(unsupported::DTYPE);
        }
        if uses_op(req.opcode) {
            if c.ops.get() & (1 << req.op.raw()) == 0 {
                return unsupported(unsupported::OP);
            }
            // Step 4: op valid for dtype.
            if !req.op.supports(req.dtype) {
                return unsupported(unsupported::OP_FOR_DTYPE);
            }
        }
        // Step 5: flags (a `Request` cannot set reserved ones) and root,
        // in the request's communicator.
        let place = self.comm_info(req.comm)?;
        let world = place.size;
        let root_ok = if has_root(req.opcode) {
            req.root < world
        } else {
            req.root == 0
        };
        if !root_ok {
            return Err(Error::bad_request(bad::ROOT));
        }
        // Step 6: size arithmetic.
        let overflow = || Error::bad_request(bad::OVERFLOW);
        let elems = virtio_dmlc::buffer_elems(
            req.opcode,
            world,
            place.rank,
            req.root,
            req.count,
            req.in_place,
        )
        .ok_or_else(overflow)?;
        let size = if no_data { 1 } else { req.dtype.size() as u64 };
        self.check_sizes(&Sizes {
            elems,
            elem_size: size,
            no_data,
            count: req.count,
            in_place: req.in_place,
            input,
            output,
        })
    }

    /// Steps 6 (the rest of the size arithmetic), 7 (limits) and 8
    /// (lengths) of spec 5.X.6.7.3, shared by [`Self::check`] and
    /// [`Self::check_comm`].
    pub(super) fn check_sizes(&self, z: &Sizes<'_>) -> Result<()> {
        let c = &self.config;
        let overflow = || Error::bad_request(bad::OVERFLOW);
        let size = z.elem_size;
        let in_bytes = z.elems.input.checked_mul(size).ok_or_else(overflow)?;
        let out_bytes = z.elems.output.checked_mul(size).ok_or_else(overflow)?;
        // Step 7: limits, bytes from the header, then segments as the
        // device will see them.
        let max = c.max_bytes.get();
        if in_bytes > max || out_bytes > max {
            return Err(Error::TooBig {
                detail: too_big::BYTES,
            });
        }
        let mut segments = 0u64;
        let mut misaligned = false;
        for s in z.input.iter().chain(z.output) {
            for_each_piece(&s.mem.alloc, s.offset, s.len, &mut |_, len| {
                if len != 0 {
                    segments += 1;
                    misaligned |= !u64::from(len).is_multiple_of(size);
                }
            });
        }
        if segments > u64::from(c.max_segments.get()) {
            return Err(Error::TooBig {
                detail: too_big::SEGMENTS,
            });
        }
        // Step 8: lengths.
        if z.no_data && (z.count != 0 || segments != 0) {
            return Err(Error::bad_request(bad::BARRIER_DATA));
        }
        let total = |s: &[BufSlice]| s.iter().map(|s| s.len as u64).sum::<u64>();
        if z.in_place && total(z.input) != 0 {
            return Err(Error::bad_request(bad::IN_PLACE_INPUT));
        }
        if misaligned {
            return Err(Error::bad_request(bad::SEGMENT_ALIGN));
        }
        if total(z.input) != in_bytes {
            return Err(Error::bad_request(bad::INPUT_LENGTH));
        }
        if total(z.output) != out_bytes {
            return Err(Error::bad_request(bad::OUTPUT_LENGTH));
        }
        Ok(())
    }

    /// Element counts this member must supply for `req`.
    pub fn buffer_elems(&self, req: &Request) -> Result<BufferElems> {
        let place = self.comm_info(req.comm)?;
        virtio_dmlc::buffer_elems(
            req.opcode,
            place.size,
            place.rank,
            req.root,
            req.count,
            req.in_place,
        )
        .ok_or_else(|| Error::bad_request(bad::OVERFLOW))
    }
}
