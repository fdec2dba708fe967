//! Matching helpers: which header fields of two members' requests for one
//! collective differ.

use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{mismatch, Opcode, VirtioDmlcReq};

use crate::chain::{Code, Request};

/// Fields in which `b`'s header differs from the reference `a`'s, as a
/// `mismatch::*` mask: the fields that the reference's opcode uses.
pub(super) fn mismatch_mask(a: &Request, b: &Request) -> u32 {
    header_mismatch(&a.header, &b.header)
}

/// The fields of `hb` that differ from reference `ha` (`mismatch::*`),
/// among those the reference's opcode uses.
pub(super) fn header_mismatch(ha: &VirtioDmlcReq, hb: &VirtioDmlcReq) -> u32 {
    let raw = ha.opcode.get();
    let code = match (Opcode::from_raw(raw), CommOpcode::from_raw(raw)) {
        (Some(o), _) => Some(Code::Base(o)),
        (None, Some(o)) => Some(Code::Comm(o)),
        (None, None) => None,
    };
    let uses_dtype = code.is_none_or(Code::moves_data);
    let uses_op = matches!(
        code,
        Some(Code::Base(
            Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter
        ))
    );
    // The v forms carry each member's own count (5.X.6.13.5): their
    // tables are compared instead.
    let uses_count = !matches!(
        code,
        Some(Code::Comm(
            CommOpcode::Alltoallv | CommOpcode::Gatherv | CommOpcode::Scatterv
        ))
    );
    let mut m = 0;
    let mut differs = |field: u32, d: bool| {
        if d {
            m |= field;
        }
    };
    differs(mismatch::OPCODE, ha.opcode != hb.opcode);
    differs(mismatch::DTYPE, uses_dtype && ha.dtype != hb.dtype);
    differs(mismatch::OP, uses_op && ha.op != hb.op);
    differs(mismatch::COUNT, uses_count && ha.count != hb.count);
    differs(mismatch::ROOT, ha.root != hb.root);
    differs(mismatch::TAG, ha.tag != hb.tag);
    m
}
