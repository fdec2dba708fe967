//! A member's part of the group in a snapshot of a frozen job (spec
//! 5.X.6.15, `dmlc-ctl snapshot`): which requests of the member a new
//! backend must serve again, and under which sequence numbers, group id
//! and generation. The member's backend hands it over to QEMU through
//! vhost-user's device state transfer, so it travels in the VM's saved
//! state; a new backend started with the same `--group-id` takes it back
//! ([`Group::adopt_member`]) before the member's rings start.

use serde::{Deserialize, Serialize};
use virtio_dmlc::comm::COMM_WORLD;

use super::freeze::Phase;
use super::state::{generation_of, lock, Slot, SlotKey};
use super::Group;

/// What the group knows of one member at a frozen point.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberState {
    pub group_id: u64,
    pub generation: u32,
    pub world_size: u32,
    pub rank: u32,
    /// Per queue: the sequence number (on communicator 0) of the member's
    /// oldest request still in flight, or of its next one if none is.
    pub seqs: Vec<u64>,
    /// Per queue: the head indices of the member's requests in flight, in
    /// the order of their sequence numbers (the order they were popped).
    pub in_flight: Vec<Vec<u16>>,
}

impl Group {
    /// Member `rank`'s state for a snapshot; refused unless the job is
    /// frozen (the launcher stopped every VM), and when the group holds
    /// what a snapshot does not carry yet.
    pub fn member_state(&self, rank: u32) -> Result<MemberState, String> {
        let sh = &self.shared;
        let st = lock(&sh.state);
        match &st.freeze.held {
            Some(h) if h.lost() => {
                return Err("a member was lost: a snapshot cannot bring it back".into())
            }
            Some(h) if h.phase == Phase::Frozen => {}
            _ => {
                return Err(
                    "the job is not frozen: freeze it first (dmlc-ctl freeze, and a \
                            launcher that stops every VM), then snapshot"
                        .into(),
                )
            }
        }
        if st.comms.live_count() > 0 {
            return Err(
                "communicators other than 0 are live: a snapshot does not carry them".into(),
            );
        }
        if st.p2p.len() > 0 {
            return Err("sends or receives are waiting: a snapshot does not carry them".into());
        }
        let m = st
            .members
            .get(rank as usize)
            .ok_or_else(|| format!("no member {rank}"))?;
        let queues = usize::from(sh.num_queues);
        let mut mine: Vec<Vec<(u64, u16)>> = vec![Vec::new(); queues];
        for (key, slot) in &st.slots {
            let Slot::Waiting(w) = slot else { continue };
            let Some(a) = w.arrivals.iter().flatten().find(|a| a.rank == rank) else {
                continue;
            };
            match *key {
                SlotKey::Coll {
                    comm: COMM_WORLD,
                    queue,
                    seq,
                } => mine[usize::from(queue)].push((seq, a.req.head)),
                _ => return Err("a comm_create is waiting: a snapshot does not carry it".into()),
            }
        }
        let mut seqs = Vec::with_capacity(queues);
        let mut in_flight = Vec::with_capacity(queues);
        for (q, mut reqs) in mine.into_iter().enumerate() {
            reqs.sort_unstable();
            let next = m.seqs[q];
            let first = reqs.first().map_or(next, |r| r.0);
            // Served again from `first` on, they must be every sequence
            // number from there to the next.
            if reqs.iter().map(|r| r.0).ne(first..next) {
                return Err(format!(
                    "rank {rank}, queue {q}: requests in flight are not the last ones made \
                     (sequence numbers {:?}, next {next})",
                    reqs.iter().map(|r| r.0).collect::<Vec<_>>()
                ));
            }
            seqs.push(first);
            in_flight.push(reqs.into_iter().map(|r| r.1).collect());
        }
        Ok(MemberState {
            group_id: sh.cfg.group_id,
            generation: generation_of(st.era),
            world_size: sh.world,
            rank,
            seqs,
            in_flight,
        })
    }

    /// Takes back member `s.rank`'s state from a snapshot, in a new group
    /// (nothing run yet) started with the snapshot's group id: its sequence
    /// numbers, and the generation (the same for every member).
    pub fn adopt_member(&self, s: &MemberState) -> Result<(), String> {
        let sh = &self.shared;
        if s.group_id != sh.cfg.group_id || s.world_size != sh.world {
            return Err(format!(
                "the saved state is of group {:#x} of {} members, this backend serves group \
                 {:#x} of {}: start it with --group-id {:#x}",
                s.group_id, s.world_size, sh.cfg.group_id, sh.world, s.group_id
            ));
        }
        if s.seqs.len() != usize::from(sh.num_queues) || s.rank >= sh.world {
            return Err(format!(
                "the saved state has {} queues for rank {}, this backend {} queues",
                s.seqs.len(),
                s.rank,
                sh.num_queues
            ));
        }
        let mut st = lock(&sh.state);
        // Another member, restored first, may have filed its requests
        // already; none may have run.
        let filed = st.slots.values().any(|slot| match slot {
            Slot::Waiting(w) => w.arrivals.iter().flatten().any(|a| a.rank == s.rank),
            Slot::TimedOut(_) => true,
        });
        if st.next_run > 0 || filed {
            return Err("this backend has run collectives already: restore into a new one".into());
        }
        let era = u64::from(s.generation.max(1) - 1);
        if st.era != era {
            if st.era != 0 {
                return Err(format!(
                    "members of the snapshot disagree on the generation ({} and {})",
                    generation_of(st.era),
                    s.generation
                ));
            }
            st.era = era;
            st.published = era;
            let g = generation_of(era);
            sh.generation.store(g, std::sync::atomic::Ordering::Release);
            sh.resp_generation
                .store(g, std::sync::atomic::Ordering::Release);
            sh.metrics.set_generation(g);
        }
        st.members[s.rank as usize].seqs.clone_from(&s.seqs);
        log::info!(
            "rank {}: restored at sequence numbers {:?} of generation {}",
            s.rank,
            s.seqs,
            s.generation
        );
        Ok(())
    }
}
