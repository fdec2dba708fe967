//! A member's state for a snapshot of a frozen job (spec 5.X.6.15), moved
//! through vhost-user's device state transfer (`SET_DEVICE_STATE_FD`,
//! `CHECK_DEVICE_STATE`): QEMU saves it with the VM and hands it to the
//! new backend of a restored VM, before the member's rings start.
//!
//! What is saved is the group's part ([`MemberState`]: group id,
//! generation, sequence numbers, the requests in flight) and, per queue,
//! where to pop from again: the requests in flight are the last ones
//! popped, and the saved ring index (QEMU's, from `GET_VRING_BASE`) is past
//! them, so the new backend moves its next available index back by their
//! number ([`QueueSlot::rewind`]) and serves them again, under the same
//! sequence numbers.

use std::fs::File;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

use super::{lock, MemberBackend, Vring};
use crate::group::snapshot::MemberState;

/// What one member's backend hands over.
#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    member: MemberState,
    /// Per queue: the next available index to pop from again.
    rewind: Vec<Option<u16>>,
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Heads `from..to` (ring indices, wrapping) of `vring`'s available ring.
fn avail_heads(vring: &Vring, from: u16, to: u16) -> io::Result<Vec<u16>> {
    let state = vring.get_ref();
    let queue = state.get_queue();
    let mem = vring.mem.memory();
    let (ring, size) = (queue.avail_ring(), queue.size());
    let mut heads = Vec::new();
    let mut i = from;
    while i != to {
        // The avail ring: flags, idx, then `size` u16 entries.
        let at = GuestAddress(ring + 4 + 2 * u64::from(i % size));
        let head: u16 = mem
            .read_obj(at)
            .map_err(|e| invalid(format!("cannot read the available ring: {e}")))?;
        heads.push(u16::from_le(head));
        i = i.wrapping_add(1);
    }
    Ok(heads)
}

impl MemberBackend {
    /// The member's state, as the saving side writes it; refused unless
    /// the job is frozen and every request in flight is among the last
    /// ones popped from its ring.
    fn saved(&self) -> io::Result<Saved> {
        let rank = self.cfg.rank;
        let member = self
            .group
            .member_state(rank)
            .map_err(|e| io::Error::other(format!("rank {rank}: {e}")))?;
        let mut rewind = Vec::with_capacity(member.in_flight.len());
        for (q, heads) in member.in_flight.iter().enumerate() {
            if heads.is_empty() {
                rewind.push(None);
                continue;
            }
            let vring = lock(&self.queues[q].vring).clone().ok_or_else(|| {
                io::Error::other(format!("rank {rank}, queue {q}: requests but no ring"))
            })?;
            let next = vring.queue_next_avail();
            let from = next.wrapping_sub(heads.len() as u16);
            let popped = avail_heads(&vring, from, next)?;
            if &popped != heads {
                return Err(io::Error::other(format!(
                    "rank {rank}, queue {q}: the requests in flight {heads:?} are not the last \
                     ones popped {popped:?}: a snapshot cannot serve them again"
                )));
            }
            rewind.push(Some(from));
        }
        Ok(Saved { member, rewind })
    }

    /// `SET_DEVICE_STATE_FD`: saves the member's state into `file` (a pipe
    /// QEMU reads once this returns; the state is far smaller than a pipe
    /// holds), or starts reading a saved one from it.
    pub(super) fn transfer_state(&self, save: bool, file: File) -> io::Result<()> {
        if save {
            let saved = self.saved().inspect_err(|e| {
                log::warn!("rank {}: snapshot refused: {e}", self.cfg.rank);
            })?;
            let text = serde_json::to_vec(&saved).map_err(io::Error::other)?;
            (&file).write_all(&text)?;
            log::info!(
                "rank {}: state saved for a snapshot (sequence numbers {:?})",
                self.cfg.rank,
                saved.member.seqs
            );
            return Ok(());
        }
        // QEMU writes the state after the reply: read it on a thread, and
        // take it back in `check_state`.
        let reader = std::thread::Builder::new()
            .name(format!("dmlc-state-{}", self.cfg.rank))
            .spawn(move || {
                let mut text = Vec::new();
                (&file).take(1 << 20).read_to_end(&mut text)?;
                Ok(text)
            })?;
        *lock(&self.loading) = Some(reader);
        Ok(())
    }

    /// `CHECK_DEVICE_STATE`: after a load, takes the state back (the
    /// group's part, and where each ring pops from again).
    pub(super) fn check_state(&self) -> io::Result<()> {
        let Some(reader) = lock(&self.loading).take() else {
            return Ok(());
        };
        let text = reader
            .join()
            .map_err(|_| io::Error::other("the state reader panicked"))??;
        let saved: Saved = serde_json::from_slice(&text)
            .map_err(|e| invalid(format!("not a saved member state: {e}")))?;
        let rank = self.cfg.rank;
        if saved.member.rank != rank || saved.rewind.len() != self.queues.len() {
            return Err(invalid(format!(
                "the saved state is rank {}'s with {} queues; this socket is rank {rank}'s \
                 with {}",
                saved.member.rank,
                saved.rewind.len(),
                self.queues.len()
            )));
        }
        self.group.adopt_member(&saved.member).map_err(|e| {
            log::warn!("rank {rank}: saved state refused: {e}");
            io::Error::other(e)
        })?;
        for (slot, to) in self.queues.iter().zip(&saved.rewind) {
            *lock(&slot.rewind) = *to;
        }
        Ok(())
    }

    /// Before a queue's first pop on this connection: keeps its ring for
    /// a later save, and moves a restored ring back to the requests it
    /// must serve again.
    pub(super) fn note_ring(&self, queue: u16, vring: &Vring) {
        let Some(slot) = self.queues.get(usize::from(queue)) else {
            return;
        };
        lock(&slot.vring).get_or_insert_with(|| vring.clone());
        if let Some(to) = lock(&slot.rewind).take() {
            let from = vring.queue_next_avail();
            vring.set_queue_next_avail(to);
            log::info!(
                "rank {}, queue {queue}: restored ring serves again from index {to} \
                 (saved at {from})",
                self.cfg.rank
            );
        }
    }
}
