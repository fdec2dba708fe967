//! vhost-user backend of the virtio-dmlc allreduce device.
//!
//! One process serves every member of a group: the VM on socket `i` is rank
//! `i`. Requests popped from each member's virtqueues are matched into
//! collectives by [`group::Group`], and the last member to arrive runs the
//! collective straight over the members' guest memory ([`datapath`]).
//!
//! Module map:
//! - [`datapath`]: chunked single-copy reduce and copy over scatter-gather
//!   lists (the arithmetic is `dmlc_reduce`'s kernels);
//! - [`chain`]: parsing and checking one descriptor chain into a request;
//! - [`fault`]: fault injection for tests (`DMLC_TEST_FAULTS`);
//! - [`group`]: matching, ordering, generations, timeouts, running collectives;
//! - [`metrics`]: counters and their Prometheus text form;
//! - [`backend`]: the `VhostUserBackend` of one member;
//! - [`spare_cpu`]: whether busy-polling would take a CPU from the ranks;
//! - [`timing`]: the timing model and impairments (`--timing`);
//! - [`trace`]: the flight recorder and its Chrome trace dump (`--trace-out`);
//! - [`config`]: command-line options and the daemon's configuration;
//! - [`control`]: the control socket (`--control-socket`, `dmlc-ctl`);
//! - [`daemon`]: the per-socket serve loops and the metrics endpoint.

pub mod backend;
pub mod chain;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod fault;
pub mod group;
pub mod metrics;
#[cfg(feature = "mpi")]
pub mod multihost;
pub mod spare_cpu;
pub mod timing;
pub mod trace;

/// Guest memory as the backend sees it (no dirty-page bitmap).
pub type GuestMem = vm_memory::GuestMemoryMmap<()>;
