//! Matching helpers: which header fields of two members' requests for one
//! collective differ.

use virtio_dmlc::{mismatch, Opcode, VirtioDmlcReq};

use crate::chain::Request;

/// Fields in which `b`'s header differs from the reference `a`'s, as a
/// `mismatch::*` mask: the fields that the reference's opcode uses.
pub(super) fn mismatch_mask(a: &Request, b: &Request) -> u32 {
    header_mismatch(&a.header, &b.header)
}

/// The fields of `hb` that differ from reference `ha` (`mismatch::*`),
/// among those the reference's opcode uses.
pub(super) fn header_mismatch(ha: &VirtioDmlcReq, hb: &VirtioDmlcReq) -> u32 {
    let opcode = Opcode::from_raw(ha.opcode.get());
    let uses_dtype = opcode != Some(Opcode::Barrier);
    let uses_op = matches!(
        opcode,
        Some(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter)
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
    differs(mismatch::COUNT, ha.count != hb.count);
    differs(mismatch::ROOT, ha.root != hb.root);
    differs(mismatch::TAG, ha.tag != hb.tag);
    m
}
