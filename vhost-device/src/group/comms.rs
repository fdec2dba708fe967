//! Communicators (spec 5.X.6.13.3) under the state lock: the live ones and
//! their members, sequence numbers of the communicators other than 0 (those
//! of communicator 0 are the members' own, `Member::seqs`), the order of
//! each member's comm_creates, and what a loss or a reset does to them.

use std::collections::HashMap;
use std::sync::Arc;

use virtio_dmlc::comm::{self, UNDEFINED};
use virtio_dmlc::NO_PEER;

use crate::chain::CommView;

/// One communicator other than 0.
pub(super) struct Comm {
    /// Group ranks, in the communicator's rank order.
    pub(super) members: Arc<[u32]>,
    /// The lost member (group rank) that revoked it, if one did.
    pub(super) revoked: Option<u32>,
    /// By rank in it: the members that freed it alone after a revocation,
    /// or that were lost (a member that comes back is in communicator 0
    /// only). Once all are, nobody can name it any more and it goes.
    pub(super) gone: Vec<bool>,
    /// Next sequence number, by (member's rank in it, queue).
    seqs: HashMap<(u32, u16), u64>,
}

impl Comm {
    fn new(members: Vec<u32>) -> Self {
        let n = members.len();
        Comm {
            members: members.into(),
            revoked: None,
            gone: vec![false; n],
            seqs: HashMap::new(),
        }
    }

    fn contains(&self, world_rank: u32) -> bool {
        self.members.contains(&world_rank)
    }
}

/// What a request on a communicator finds when it is filed.
pub(super) enum Found {
    /// Live: go on.
    Live,
    /// Unknown or freed: `BAD_REQUEST` / `BAD_COMM`.
    Unknown,
    /// Revoked by the loss of this group rank.
    Revoked(u32),
}

/// The registry: every live communicator other than 0.
pub(super) struct Comms {
    live: HashMap<u32, Comm>,
    /// The next id to give: ids are never given twice in the group's life
    /// (spec DEV-COMM-2).
    next_id: u32,
    /// Most live communicators, 0 included.
    max: u32,
    /// Next comm_create order, by (group rank, parent, tag).
    create_order: HashMap<(u32, u32, u64), u64>,
}

impl Comms {
    pub(super) fn new(max: u32) -> Self {
        Comms {
            live: HashMap::new(),
            next_id: 1,
            max: max.max(2),
            create_order: HashMap::new(),
        }
    }

    /// Most live communicators, 0 included (config space's `max_comms`).
    pub(super) fn max(&self) -> u32 {
        self.max
    }

    /// Live communicators other than 0 (revoked ones included until freed).
    pub(super) fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Communicator `id` as group rank `me` sees it, if it is live (or
    /// revoked) and `me` belongs to it (and has not freed it, nor been
    /// lost since it was made).
    pub(super) fn view(&self, id: u32, me: u32) -> Option<CommView> {
        let c = self.live.get(&id)?;
        let rank = c.members.iter().position(|&m| m == me)?;
        if c.gone[rank] {
            return None;
        }
        Some(CommView {
            id,
            rank: rank as u32,
            size: c.members.len() as u32,
            members: Some(c.members.clone()),
        })
    }

    /// What a request of group rank `me` on communicator `id` finds.
    pub(super) fn find(&self, id: u32, me: u32) -> Found {
        if self.view(id, me).is_none() {
            return Found::Unknown;
        }
        match self.live.get(&id) {
            None => Found::Unknown,
            Some(c) => match c.revoked {
                Some(lost) => Found::Revoked(lost),
                None => Found::Live,
            },
        }
    }

    /// Takes the next sequence number of the member of rank `rank` in
    /// communicator `id` on `queue`.
    pub(super) fn next_seq(&mut self, id: u32, rank: u32, queue: u16) -> u64 {
        let Some(c) = self.live.get_mut(&id) else {
            return 0;
        };
        let s = c.seqs.entry((rank, queue)).or_insert(0);
        *s += 1;
        *s - 1
    }

    /// Takes group rank `me`'s next comm_create order for `(parent, tag)`.
    pub(super) fn next_create(&mut self, me: u32, parent: u32, tag: u64) -> u64 {
        let o = self.create_order.entry((me, parent, tag)).or_insert(0);
        *o += 1;
        *o - 1
    }

    /// True if `n` more communicators fit.
    pub(super) fn room_for(&self, n: usize) -> bool {
        // Communicator 0 counts too.
        1 + self.live.len() + n <= self.max as usize
    }

    /// Registers a communicator of these group ranks and returns its id.
    pub(super) fn add(&mut self, members: Vec<u32>) -> u32 {
        let id = self.next_id;
        // 2^32 - 1 communicators in one group's life: after that, ids
        // would repeat, so the registry refuses (TOO_BIG) instead.
        self.next_id = self.next_id.saturating_add(1);
        self.live.insert(id, Comm::new(members));
        id
    }

    /// True if no more ids can be given.
    pub(super) fn ids_exhausted(&self) -> bool {
        self.next_id == u32::MAX
    }

    /// Communicator `id` stops being valid (a comm_free that completed).
    pub(super) fn remove(&mut self, id: u32) {
        self.live.remove(&id);
        self.create_order.retain(|&(_, parent, _), _| parent != id);
    }

    /// A survivor frees revoked communicator `id` alone; it goes once
    /// every member has freed it or been lost.
    pub(super) fn free_revoked(&mut self, id: u32, me: u32) {
        let Some(c) = self.live.get_mut(&id) else {
            return;
        };
        if let Some(p) = c.members.iter().position(|&m| m == me) {
            c.gone[p] = true;
        }
        if c.gone.iter().all(|&g| g) {
            self.remove(id);
        }
    }

    /// True if communicator `id` (0: the group) contains group rank `r`.
    pub(super) fn contains(&self, id: u32, r: u32) -> bool {
        id == comm::COMM_WORLD || self.live.get(&id).is_some_and(|c| c.contains(r))
    }

    /// Group rank `lost` was lost: every communicator that contains it is
    /// revoked and no longer names it, and comm_create orders on
    /// communicator 0 and on those restart. The others keep everything. A
    /// communicator none of whose members can name it any more goes.
    pub(super) fn lose(&mut self, lost: u32) {
        for c in self.live.values_mut() {
            if let Some(p) = c.members.iter().position(|&m| m == lost) {
                c.revoked.get_or_insert(lost);
                c.gone[p] = true;
            }
        }
        let ended: Vec<u32> = self
            .live
            .iter()
            .filter(|(_, c)| c.gone.iter().all(|&g| g))
            .map(|(&id, _)| id)
            .collect();
        for id in ended {
            self.remove(id);
        }
        let live = &self.live;
        self.create_order.retain(|&(_, parent, _), _| {
            parent != comm::COMM_WORLD && live.get(&parent).is_some_and(|c| c.revoked.is_none())
        });
    }

    /// A reset: every communicator other than 0 ends.
    pub(super) fn reset(&mut self) {
        self.live.clear();
        self.create_order.clear();
    }
}

/// The new communicators of a comm_split whose members gave `(color, key)`
/// (indexed by their rank in the parent, whose group ranks are
/// `parent`): per new communicator, its group ranks in its rank order.
pub(super) fn split_groups(parent: &[u32], given: &[(u32, u32)]) -> Vec<(u32, Vec<u32>)> {
    let mut colors: Vec<u32> = given
        .iter()
        .map(|&(c, _)| c)
        .filter(|&c| c != UNDEFINED)
        .collect();
    colors.sort_unstable();
    colors.dedup();
    colors
        .into_iter()
        .map(|color| {
            let mut ranks: Vec<usize> = (0..given.len()).filter(|&p| given[p].0 == color).collect();
            ranks.sort_by_key(|&p| (given[p].1, p));
            (color, ranks.into_iter().map(|p| parent[p]).collect())
        })
        .collect()
}

/// `peer` (a group rank or `NO_PEER`) as a rank of the communicator whose
/// view is `view`, or `NO_PEER` if it is not one of its members.
pub(super) fn peer_in(view: Option<&CommView>, peer: u32) -> u32 {
    match view {
        _ if peer == NO_PEER => NO_PEER,
        Some(v) => v.rank_of(peer).unwrap_or(NO_PEER),
        None => peer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_orders_by_key_then_parent_rank_and_agrees_with_the_abi() {
        let parent = [10, 11, 12, 13, 14];
        let given = [(1, 5), (0, 0), (1, 5), (UNDEFINED, 0), (1, 0)];
        let groups = split_groups(&parent, &given);
        assert_eq!(groups, vec![(0, vec![11]), (1, vec![14, 10, 12])]);
        // Every member's place is the one the ABI crate computes.
        for (p, &(c, _)) in given.iter().enumerate() {
            let place = comm::split_place(&given, p as u32);
            let ours = groups.iter().find(|(color, _)| *color == c).map(|(_, m)| {
                let r = m.iter().position(|&w| w == parent[p]).unwrap();
                (r as u32, m.len() as u32)
            });
            assert_eq!(place, ours);
        }
    }

    #[test]
    fn ids_are_not_given_twice_and_losses_revoke_only_communicators_with_the_member() {
        let mut c = Comms::new(4);
        let a = c.add(vec![0, 1]);
        let b = c.add(vec![2, 3]);
        assert!(!c.room_for(2));
        c.remove(a);
        let d = c.add(vec![1, 2]);
        assert!(d != a && d != b);
        let alone = c.add(vec![1]);
        c.lose(1);
        assert!(matches!(c.find(d, 2), Found::Revoked(1)));
        // The lost member, back, is in communicator 0 only.
        assert!(matches!(c.find(d, 1), Found::Unknown));
        assert!(matches!(c.find(b, 2), Found::Live));
        assert!(matches!(c.find(a, 0), Found::Unknown));
        // Nobody can name it any more: gone, its room given back.
        assert!(matches!(c.find(alone, 1), Found::Unknown));
        assert_eq!(c.live_count(), 2);
        // Freed by the one survivor: gone.
        c.free_revoked(d, 2);
        assert!(matches!(c.find(d, 2), Found::Unknown));
        assert_eq!(c.view(b, 3).map(|v| (v.rank, v.size)), Some((1, 2)));
        assert!(c.view(b, 1).is_none());
    }
}
