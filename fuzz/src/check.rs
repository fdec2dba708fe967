//! Runs the backend's chain parser on one popped chain and checks what it
//! returns against the spec model ([`crate::oracle`]) and against the
//! guest memory: every segment of an accepted request must lie inside
//! guest memory, inside the descriptor it came from, in chain order, and
//! only writable descriptors may give output segments.

use std::collections::HashMap;

use vhost_device_dmlc::chain::{parse, Bounce, Limits, Request};
use vhost_device_dmlc::datapath::HostSeg;
use vhost_device_dmlc::GuestMem;
use virtio_dmlc::{Dtype, Opcode, ReduceOp};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::guest::DESC_TABLE;
use crate::oracle::{expect, walk, Expected};

/// How one chain came out, for the seed checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted, with this many bounce copies.
    Valid { bounces: usize },
    /// Rejected, with a status or (`None`) without one.
    Rejected(Option<(virtio_dmlc::Status, u32)>),
}

/// Parses `chain` (popped from `mem`, from the harness queue of
/// `queue_size` entries) and panics if the result breaks an invariant.
pub fn check(
    mem: &GuestMem,
    chain: DescriptorChain<&GuestMem>,
    queue_size: u16,
    limits: &Limits,
) -> Outcome {
    let head = chain.head_index();
    // The spec's walk, done by the model itself from the tables in guest
    // memory (the backend walks with virtio-queue's iterator).
    let walked = walk(mem, DESC_TABLE, queue_size, head);
    let want = expect(&walked, mem, limits);
    let descs = walked.descs;
    match (parse(chain, limits), want) {
        (
            Err(rej),
            Expected::Rejected {
                response,
                writable_len,
                opcode,
                status,
            },
        ) => {
            assert_eq!(rej.head, head, "rejected chain keeps its head");
            assert_eq!(rej.error.status_detail(), status, "status of {descs:?}");
            assert_eq!(rej.response.map(|a| a.0), response, "response address");
            if response.is_some() {
                assert_eq!(rej.writable_len, writable_len, "used length");
            }
            assert_eq!(rej.opcode, opcode, "opcode of a rejected request");
            Outcome::Rejected(status)
        }
        (
            Ok(req),
            Expected::Valid {
                header,
                opcode,
                sizes,
            },
        ) => {
            assert_eq!(req.head, head, "request keeps its head");
            assert_eq!(req.header, header, "header read from guest memory");
            assert_eq!(req.opcode, opcode);
            check_fields(&req, limits);
            if !matches!(opcode, Opcode::Barrier | Opcode::Nop) {
                assert_eq!(req.elem_size() as u64, sizes.elem, "element size");
            }
            let total = |s: &[HostSeg]| s.iter().map(|s| s.len as u64).sum::<u64>();
            assert_eq!(total(&req.inputs), sizes.input, "input bytes");
            assert_eq!(total(&req.outputs), sizes.output, "output bytes");
            assert_eq!(
                req.in_place_offset.map(|o| o as u64),
                sizes.in_place.map(|(o, _)| o),
                "in-place offset"
            );
            if let Some((off, len)) = sizes.in_place {
                assert!(off + len <= sizes.output, "in-place input inside the output");
            }
            // Accepted sizes are within the limits.
            assert!(sizes.input.max(sizes.output) <= limits.max_bytes);
            assert!(req.count_bytes() as u64 <= limits.max_bytes);
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
            "backend and spec disagree on {descs:?} with {limits:?}:\n backend: {:?}\n spec: {want:?}",
            got.map(|r| (r.opcode, r.count)).map_err(|e| e.error)
        ),
    }
}

/// The decoded header fields agree with the raw header.
fn check_fields(req: &Request, limits: &Limits) {
    let h = &req.header;
    assert_eq!(req.count, h.count.get());
    assert_eq!(req.root, h.root.get());
    match req.opcode {
        Opcode::Barrier | Opcode::Nop => {
            assert_eq!((req.dtype, req.op, req.count), (None, None, 0));
        }
        _ => assert_eq!(req.dtype, Dtype::from_raw(h.dtype)),
    }
    match req.opcode {
        Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter => {
            assert_eq!(req.op, ReduceOp::from_raw(h.op));
        }
        _ => assert_eq!(req.op, None),
    }
    if matches!(req.opcode, Opcode::Broadcast | Opcode::Reduce) {
        assert!(req.root < limits.world_size);
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
