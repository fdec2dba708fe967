//! Runs the backend's chain parser on one popped chain and checks what it
//! returns against the spec model ([`crate::oracle`]) and against the
//! guest memory: every segment of an accepted request must lie inside
//! guest memory, inside the descriptor it came from, in chain order, and
//! only writable descriptors may give output segments; with feature bit 1,
//! an accepted request names the communicator, peer, key and table the
//! header and the member's communicators give.

use std::collections::HashMap;
use std::sync::OnceLock;

use vhost_device_dmlc::chain::{parse_in, Bounce, Code, Limits, Request};
use vhost_device_dmlc::datapath::HostSeg;
use vhost_device_dmlc::GuestMem;
use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{Dtype, Opcode, ReduceOp};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::guest::DESC_TABLE;
use crate::oracle::{expect, walk, Expected, Model};
use crate::oracle_comm::{Comms, F_COMM};

/// How one chain came out, for the seed checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted, with this many bounce copies.
    Valid { bounces: usize },
    /// Rejected, with a status or (`None`) without one.
    Rejected(Option<(virtio_dmlc::Status, u32)>),
}

/// Whether the deviations from the spec that the backend once had (D1 to
/// D4 in [`crate::oracle`], all fixed) are tolerated: set
/// `DMLC_FUZZ_LENIENT` (to anything) to triage a run that finds one of
/// them again; by default every deviation fails the run.
fn strict() -> bool {
    static STRICT: OnceLock<bool> = OnceLock::new();
    *STRICT.get_or_init(|| std::env::var_os("DMLC_FUZZ_LENIENT").is_none())
}

/// Parses `chain` (popped from `mem`, from the harness queue of
/// `queue_size` entries) for a member that belongs to no communicator but
/// 0, and panics if the result breaks an invariant.
pub fn check(
    mem: &GuestMem,
    chain: DescriptorChain<&GuestMem>,
    queue_size: u16,
    limits: &Limits,
) -> Outcome {
    check_in(mem, chain, queue_size, limits, &Comms::default()).0
}

/// As [`check`], for a member that may have negotiated feature bit 1 and
/// belongs to the communicators of `comms`. Returns the outcome and the
/// model whose answer the backend gave: [`Model::SPEC`], or the known
/// deviation(s) it showed.
pub fn check_in(
    mem: &GuestMem,
    chain: DescriptorChain<&GuestMem>,
    queue_size: u16,
    limits: &Limits,
    comms: &Comms,
) -> (Outcome, Model) {
    let head = chain.head_index();
    // The spec's walk, done by the model itself from the tables in guest
    // memory (the backend walks with virtio-queue's iterator).
    let walked = walk(mem, DESC_TABLE, queue_size, head);
    let lookup = |id: u32| comms.view(id, limits.rank);
    let got = parse_in(chain, limits, &lookup);
    let got_verdict = match &got {
        Ok(req) => (Ok(()), Some(req.code)),
        Err(rej) => (Err(rej.error.status_detail()), rej.code),
    };
    // The spec's answer; where the backend gives another status (or knows
    // the opcode where the spec does not), the answer of the spec with the
    // backend's known deviations, if that is the backend's.
    let mut model = Model::SPEC;
    let mut want = expect(&walked, mem, limits, comms, model);
    if want.verdict() != got_verdict && !strict() {
        for m in Model::known() {
            let known = expect(&walked, mem, limits, comms, m);
            if known.verdict() == got_verdict {
                (model, want) = (m, known);
                break;
            }
        }
    }
    let with_comm = limits.features & (1 << F_COMM) != 0;
    let descs = walked.descs;
    let outcome = match (got, want) {
        (
            Err(rej),
            Expected::Rejected {
                response,
                writable_len,
                code,
                status,
            },
        ) => {
            assert_eq!(rej.head, head, "rejected chain keeps its head");
            assert_eq!(rej.error.status_detail(), status, "status of {descs:?}");
            assert_eq!(rej.response.map(|a| a.0), response, "response address");
            if response.is_some() {
                assert_eq!(rej.writable_len, writable_len, "used length");
            }
            assert_eq!(rej.code, code, "opcode of a rejected request");
            assert_eq!(rej.comm_response, with_comm, "response layout");
            Outcome::Rejected(status)
        }
        (
            Ok(req),
            Expected::Valid {
                header,
                code,
                sizes,
                comm,
            },
        ) => {
            assert_eq!(req.head, head, "request keeps its head");
            assert_eq!(req.header, header, "header read from guest memory");
            assert_eq!(req.code, code);
            check_fields(&req, limits);
            match (&req.comm, &comm) {
                (None, None) => {}
                (Some(got), Some(want)) => {
                    let view = &got.view;
                    assert_eq!(view.id, want.comm.id, "communicator");
                    assert_eq!((view.rank, view.size), (want.comm.rank, want.comm.size));
                    assert_eq!(view.members.as_deref(), want.comm.members.as_deref());
                    assert_eq!((got.peer, got.key), (want.peer, want.key));
                    assert_eq!(got.table, want.table, "table read from guest memory");
                }
                (got, want) => panic!("communicator fields: {got:?}, expected {want:?}"),
            }
            if req.code.moves_data() {
                assert_eq!(req.elem_size() as u64, sizes.elem, "element size");
            }
            let total = |s: &[HostSeg]| s.iter().map(|s| s.len as u64).sum::<u64>();
            assert_eq!(total(&req.inputs), sizes.input, "input bytes");
            assert_eq!(total(&req.outputs), sizes.output, "output bytes");
            let offset = req.in_place_offset.map(|o| o as u64);
            match sizes.in_place {
                // The place of an empty block is not the spec's business.
                Some((off, 0)) => assert!(offset.is_none_or(|o| o == off), "in-place offset"),
                Some((off, _)) => assert_eq!(offset, Some(off), "in-place offset"),
                None => assert_eq!(offset, None, "in-place offset"),
            }
            // Inside the buffer, except for a gatherv's or scatterv's
            // root, whose own count may disagree with its table entry:
            // that is a MISMATCH of the collective, not a local check.
            let v_form = matches!(
                req.code,
                Code::Comm(CommOpcode::Gatherv | CommOpcode::Scatterv)
            );
            if let (Some((off, len)), false) = (sizes.in_place, v_form) {
                assert!(off + len <= sizes.output, "in-place input inside the output");
            }
            // Accepted sizes are within the limits.
            assert!(sizes.input.max(sizes.output) <= limits.max_bytes);
            // `count` elements are one of the buffers, so within
            // `max_bytes` (`Request::count_bytes` relies on it), except
            // where `count` is no buffer's size: an alltoallv's (its table
            // gives the sizes) and an in-place gatherv's or scatterv's
            // root's (its buffer is the sum of its table). There it is
            // unchecked (see `comm_header`'s tests), so `count_bytes`,
            // which may overflow, is not called.
            let count_is_a_buffer = match req.code {
                Code::Comm(CommOpcode::Alltoallv) => false,
                Code::Comm(CommOpcode::Gatherv | CommOpcode::Scatterv) => sizes.in_place.is_none(),
                code => code.moves_data(),
            };
            if count_is_a_buffer {
                assert!(req.count_bytes() as u64 <= limits.max_bytes);
            }
            let last = descs.last().expect("a valid chain has descriptors");
            assert_eq!(req.response, last.addr(), "response address");
            let writable: u64 = descs
                .iter()
                .filter(|d| d.is_write_only())
                .map(|d| u64::from(d.len()))
                .sum();
            assert_eq!(u64::from(req.writable_len), writable, "used length");
            let data: Vec<Descriptor> = descs[1..descs.len() - 1]
                .iter()
                .copied()
                .filter(|d| d.len() != 0)
                .collect();
            assert!(data.len() as u64 <= u64::from(limits.max_segments));
            check_segments(mem, &req, &data);
            Outcome::Valid {
                bounces: req.bounces.len(),
            }
        }
        (got, want) => panic!(
            "backend and spec disagree on {descs:?} with {limits:?}, {comms:?}:\n backend: {:?}\n spec: {want:?}",
            got.map(|r| (r.code, r.count)).map_err(|e| e.error)
        ),
    };
    (outcome, model)
}

/// The decoded header fields agree with the raw header.
fn check_fields(req: &Request, limits: &Limits) {
    let h = &req.header;
    assert_eq!(req.count, h.count.get());
    assert_eq!(req.root, h.root.get());
    if req.code.moves_data() {
        assert_eq!(req.dtype, Dtype::from_raw(h.dtype));
    } else {
        assert_eq!((req.dtype, req.op, req.count), (None, None, 0));
    }
    match req.code {
        Code::Base(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter) => {
            assert_eq!(req.op, ReduceOp::from_raw(h.op));
        }
        _ => assert_eq!(req.op, None),
    }
    // Ranks are those of the request's communicator.
    let size = req.comm.as_ref().map_or(limits.world_size, |c| c.view.size);
    let rooted = matches!(
        req.code,
        Code::Base(Opcode::Broadcast | Opcode::Reduce)
            | Code::Comm(
                CommOpcode::Gather
                    | CommOpcode::Gatherv
                    | CommOpcode::Scatter
                    | CommOpcode::Scatterv
            )
    );
    if rooted {
        assert!(req.root < size);
    } else {
        assert_eq!(req.root, 0);
    }
}

/// Walks the data descriptors of one direction in chain order and matches
/// them, byte for byte, with the request's segment list.
fn check_segments(mem: &GuestMem, req: &Request, data: &[Descriptor]) {
    let elem = req.elem_size().max(1);
    let bounces: HashMap<*mut u8, &Bounce> = req.bounces.iter().map(|b| (b.ptr(), b)).collect();
    assert_eq!(
        bounces.len(),
        req.bounces.len(),
        "bounce copies are distinct"
    );
    let mut used = 0;
    for (segs, writable) in [(&req.inputs, false), (&req.outputs, true)] {
        let mut it = segs.iter();
        for d in data.iter().filter(|d| d.is_write_only() == writable) {
            let mut off = 0u64;
            while off < u64::from(d.len()) {
                let s = it.next().expect("segments cover every data descriptor");
                assert!(s.len > 0 && s.len % elem == 0, "whole elements: {s:?}");
                let guest = d.addr().0 + off;
                assert!(
                    off + s.len as u64 <= u64::from(d.len()),
                    "segment stays inside its descriptor"
                );
                if let Some(b) = bounces.get(&s.ptr) {
                    assert_eq!(s.len, elem, "a bounce copy holds one element");
                    assert_eq!(b.output, writable, "bounce direction");
                    check_bounce(mem, b, guest, elem);
                    used += 1;
                } else {
                    let (region, raddr) = mem
                        .to_region_addr(GuestAddress(guest))
                        .expect("segment is in guest memory");
                    assert!(
                        raddr.0 + s.len as u64 <= region.len(),
                        "segment stays in one region"
                    );
                    let host = region.get_host_address(raddr).expect("mapped");
                    assert_eq!(s.ptr, host, "segment maps guest address {guest:#x}");
                }
                off += s.len as u64;
            }
        }
        assert!(it.next().is_none(), "no segment beyond the descriptors");
    }
    assert_eq!(used, req.bounces.len(), "every bounce copy is in a list");
}

/// A bounce copy stands for the element at guest `[guest, guest + elem)`,
/// which must cross a region boundary; filling it reads exactly those
/// bytes and flushing it writes exactly those bytes.
fn check_bounce(mem: &GuestMem, b: &Bounce, guest: u64, elem: usize) {
    let split = mem
        .to_region_addr(GuestAddress(guest))
        .is_some_and(|(r, a)| a.0 + elem as u64 > r.len());
    assert!(split, "bounce copy only for an element cut by a boundary");
    let at = |i: usize| GuestAddress(guest + i as u64);
    let around = |g: u64| -> Vec<Option<u8>> {
        (g.saturating_sub(16)..g.saturating_add(elem as u64 + 16))
            .map(|a| mem.read_obj::<u8>(GuestAddress(a)).ok())
            .collect()
    };
    let saved: Vec<u8> = (0..elem).map(|i| mem.read_obj(at(i)).unwrap()).collect();
    for i in 0..elem {
        mem.write_obj(0x40 + i as u8, at(i)).unwrap();
    }
    let before = around(guest);
    // SAFETY: the guest memory is mapped for the whole process (leaked),
    // and this single-threaded check is the only user of the copy.
    unsafe { b.fill() };
    // SAFETY: `ptr` is the copy's own buffer of at least `elem` bytes.
    let copy = unsafe { std::slice::from_raw_parts(b.ptr(), elem) };
    let pattern: Vec<u8> = (0..elem).map(|i| 0x40 + i as u8).collect();
    assert_eq!(copy, &pattern[..], "fill reads the element");
    for i in 0..elem {
        // SAFETY: as above; nothing else holds the buffer.
        unsafe { b.ptr().add(i).write(0xb0 + i as u8) };
    }
    // SAFETY: as for `fill`.
    unsafe { b.flush() };
    let after = around(guest);
    let lo = guest.saturating_sub(16);
    for (k, (x, y)) in before.iter().zip(&after).enumerate() {
        let a = lo + k as u64;
        if a >= guest && a < guest + elem as u64 {
            assert_eq!(
                *y,
                Some(0xb0 + (a - guest) as u8),
                "flush writes the element"
            );
        } else {
            assert_eq!(x, y, "flush writes nothing else ({a:#x})");
        }
    }
    for (i, v) in saved.iter().enumerate() {
        mem.write_obj(*v, at(i)).unwrap();
    }
}
