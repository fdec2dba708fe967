//! Skeleton: the interface between the vhost-user glue and the group engine.

use std::sync::Arc;
use std::time::Duration;

use virtio_queue::DescriptorChain;

use crate::metrics::Metrics;
use crate::GuestMem;

/// Settings of one group, fixed for the daemon's life.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub world_size: u32,
    pub num_queues: u16,
    pub max_segments: u32,
    pub max_bytes: u64,
    pub timeout: Duration,
    pub reduce_threads: usize,
    pub group_id: u64,
}

/// How the engine hands a finished request back to its member's virtqueue.
pub trait Completion: Send + Sync {
    /// Puts `head` with `written` bytes in the used ring of `queue` and
    /// notifies the driver if it asked to be notified.
    fn complete(&self, queue: u16, head: u16, written: u32);
}

/// The collective state shared by every member of the group.
pub struct Group {
    _private: (),
}

impl Group {
    pub fn new(config: GroupConfig) -> Arc<Group> {
        let _ = config;
        todo!("Group::new")
    }

    /// The config space that member `rank` reads.
    pub fn config_space(&self, rank: u32) -> virtio_dmlc::VirtioDmlcConfig {
        let _ = rank;
        todo!()
    }

    pub fn metrics(&self) -> &Metrics {
        todo!()
    }

    /// Whether the driver negotiated `VIRTIO_DMLC_F_REQ_TIMEOUT`.
    pub fn set_member_features(&self, rank: u32, acked: u64) {
        let _ = (rank, acked);
        todo!()
    }

    /// Member `rank` disconnected or reset its device: its own pending
    /// requests are dropped, the others' collectives that need it fail with
    /// PEER_LOST, and the generation changes.
    pub fn member_lost(&self, rank: u32) {
        let _ = rank;
        todo!()
    }

    /// Takes one chain popped from `queue` of member `rank`. Exactly one
    /// `done.complete(queue, head, len)` follows, now or later, from any
    /// thread, unless the member is lost first.
    pub fn submit(
        &self,
        rank: u32,
        queue: u16,
        mem: &Arc<GuestMem>,
        chain: DescriptorChain<&GuestMem>,
        done: &Arc<dyn Completion>,
    ) {
        let _ = (rank, queue, mem, chain, done);
        todo!()
    }
}
