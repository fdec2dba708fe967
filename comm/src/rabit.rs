//! # rabit-style API
//!
//! For programs written for [rabit](https://github.com/dmlc/rabit) or
//! xgboost's `collective` module: the same names, over the virtio-dmlc
//! device (or TCP, for comparison). A worker calls [`init`], which reads
//! the DMLC environment the launcher (`dmlc-qemu submit`, `dmlc-guest
//! local`) sets, then [`get_rank`], [`get_world_size`], [`allreduce`],
//! [`broadcast`] and [`tracker_print`], and finally [`finalize`].
//!
//! ```no_run
//! use dmlc_comm::rabit::{self, Op};
//!
//! fn main() -> Result<(), rabit::RabitError> {
//!     rabit::init()?; // DMLC_TASK_ID, DMLC_NUM_WORKER, DMLC_DEVICE=pci, ...
//!     let (rank, world) = (rabit::get_rank(), rabit::get_world_size());
//!     let mut grads = vec![rank as f32; 4];
//!     rabit::allreduce(&mut grads, Op::Sum)?; // every rank gets the sum
//!     let mut best = [0.5f64 * f64::from(rank)];
//!     rabit::allreduce(&mut best, Op::Max)?;
//!     let mut model = if rank == 0 { String::from("weights v1") } else { String::new() };
//!     rabit::broadcast_string(&mut model, 0)?; // lengths need not match
//!     rabit::tracker_print(&format!("rank {rank} of {world}: sum {}", grads[0]));
//!     rabit::finalize()
//! }
//! ```
//!
//! ## Names
//!
//! | rabit / xgboost.collective | here |
//! |---|---|
//! | `rabit::Init(argc, argv)`, `collective::Init(config)` | [`init`] (from the environment), [`init_with`] |
//! | `rabit::Finalize()` | [`finalize`] |
//! | `rabit::GetRank()`, `GetWorldSize()` | [`get_rank`], [`get_world_size`] |
//! | `rabit::IsDistributed()` | [`is_distributed`] |
//! | `rabit::Allreduce<op::Sum>(buf, n)` | [`allreduce`]`(buf, Op::Sum)` |
//! | `rabit::Broadcast(buf, size, root)`, `Broadcast(std::string*, root)` | [`broadcast`], [`broadcast_bytes`], [`broadcast_string`] |
//! | `rabit::TrackerPrint(msg)` | [`tracker_print`] |
//! | (MPI-style extras) | [`allgather`], [`barrier`] |
//!
//! Ops ([`Op`]): `Max`, `Min`, `Sum`, `BitOR` as in rabit, `BitAND` and
//! `BitXOR` as in xgboost, and the device's `Prod` and `Avg`. Element types:
//! every [`Element`] (f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64). Results are
//! bitwise identical on every rank and on every transport (a fold in rank
//! order; see [`crate::reduce_rank_order`]).
//!
//! ## Environment read by [`init`]
//!
//! [`Config::from_env`] is the one reader of a job's environment: the C
//! ABI's `dmlc_open_env` (and through it the Python package and its torch
//! backend) opens the device with it and [`open_device`].
//!
//! | Variable | Meaning |
//! |---|---|
//! | `DMLC_ROLE` | `worker` (or unset); other roles are refused |
//! | `DMLC_TASK_ID` (or torchrun's `RANK`) | this worker's rank; checked against the device's (both set: they must agree) |
//! | `DMLC_NUM_WORKER` (or torchrun's `WORLD_SIZE`) | number of workers; checked against the device's |
//! | `DMLC_TRANSPORT` | `device` (default) or `tcp` |
//! | `DMLC_DEVICE` | `pci` (the first virtio-dmlc PCI device, inside a VM) or `pci:0000:00:04.0`; `kernel` (the `virtio_dmlc` module's /dev/dmlc0, no root needed) or `kernel:/dev/dmlcN` |
//! | `DMLC_SOCKET` | path of a backend socket: this process plays the VM (host transport) |
//! | `DMLC_SOCKET_PREFIX` | the backend's socket prefix: socket `PREFIX<rank>` (the daemon's naming) |
//! | `DMLC_DMA_BYTES` | device-visible memory to set aside, e.g. `16M` (default 256M; in a VM it comes from hugepages) |
//! | `DMLC_POLL` | a [`Wait`] by name: `hybrid` (the default) spins up to 200 us (while recent waits mostly ended within that) and then sleeps on interrupts, `poll` (or `1`) busy-polls for completions, `interrupt` (or `0`) sleeps at once |
//! | `DMLC_TCP_PEERS` | TCP only: `ip:port,...` of every worker in rank order |
//! | `DMLC_TCP_CONNECT_TIMEOUT_S` | TCP only: how long to wait for slow peers (default 60) |
//! | `DMLC_TCP_IO_TIMEOUT_S` | TCP only: how long a collective waits for a silent peer (default 120, 0 = forever) |
//! | `DMLC_CHECK_FINITE` | `1`: the device checks every floating-point reduction's inputs for NaN and infinity and fails it naming the lowest such rank and element (spec 5.X.6.14; not across hosts, not over the kernel driver); `0` (the default): off |
//!
//! With neither `DMLC_DEVICE` nor `DMLC_SOCKET` and at most one worker, the
//! program runs alone (world size 1, [`is_distributed`] false), as rabit does
//! outside a job.
//!
//! ## Global and local use
//!
//! The free functions use one process-wide [`Rabit`] (behind a mutex), which
//! the C API shares. Before [`init`], [`get_rank`] is 0 and
//! [`get_world_size`] 1, and collectives fail with
//! [`RabitError::NotInitialized`]. [`Rabit`] itself is an ordinary value for
//! programs (and tests) that want several, or no global state.
//!
//! ## tracker_print
//!
//! [`tracker_print`] writes the message to stderr as whole lines in one
//! write (so lines of concurrent threads do not mix). The launchers prefix
//! every line of a worker's output with its rank (`[rank 1] ...`), which
//! plays the role of rabit's tracker.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::tcp::{self, TcpComm};
use crate::{CommError, Communicator, CommunicatorExt, DeviceComm, SelfComm};
use dmlc_driver::device::{UnknownWait, Wait};
use dmlc_driver::{Device, Dtype, ReduceOp};
use dmlc_driver::{Element, OpenOptions};

/// Reduce operations, with rabit's names.
#[allow(clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Max,
    Min,
    Sum,
    /// Bitwise or (integer types only).
    BitOR,
    /// Bitwise and (integer types only).
    BitAND,
    /// Bitwise xor (integer types only).
    BitXOR,
    Prod,
    /// Sum divided by the world size (integers truncate toward zero).
    Avg,
}

impl From<Op> for ReduceOp {
    fn from(op: Op) -> ReduceOp {
        match op {
            Op::Max => ReduceOp::Max,
            Op::Min => ReduceOp::Min,
            Op::Sum => ReduceOp::Sum,
            Op::BitOR => ReduceOp::Bor,
            Op::BitAND => ReduceOp::Band,
            Op::BitXOR => ReduceOp::Bxor,
            Op::Prod => ReduceOp::Prod,
            Op::Avg => ReduceOp::Avg,
        }
    }
}

impl From<ReduceOp> for Op {
    fn from(op: ReduceOp) -> Op {
        match op {
            ReduceOp::Max => Op::Max,
            ReduceOp::Min => Op::Min,
            ReduceOp::Sum => Op::Sum,
            ReduceOp::Bor => Op::BitOR,
            ReduceOp::Band => Op::BitAND,
            ReduceOp::Bxor => Op::BitXOR,
            ReduceOp::Prod => Op::Prod,
            ReduceOp::Avg => Op::Avg,
        }
    }
}

/// Errors of the rabit-style API.
#[derive(Debug, thiserror::Error)]
pub enum RabitError {
    /// An environment variable has a value that cannot be used.
    #[error("invalid {var}={value:?}: {reason}")]
    BadEnv {
        var: &'static str,
        value: String,
        reason: String,
    },
    /// A variable the chosen setup needs is not set.
    #[error("{var} is not set ({why})")]
    MissingEnv {
        var: &'static str,
        why: &'static str,
    },
    /// A multi-worker job without a way to reach the others.
    #[error(
        "no device for a job of {world} workers: set DMLC_DEVICE=pci or DMLC_SOCKET=PATH, \
         or DMLC_TRANSPORT=tcp with DMLC_TCP_PEERS"
    )]
    NoDevice { world: u32 },
    /// The device's group does not match the environment.
    #[error("the device says {what} {device}, but {var} is {env}")]
    DeviceDisagrees {
        what: &'static str,
        device: u32,
        var: &'static str,
        env: u32,
    },
    /// The device could not be opened.
    #[error("cannot open the device ({which})")]
    Open {
        which: String,
        #[source]
        source: dmlc_driver::Error,
    },
    /// The TCP group could not be formed.
    #[error("cannot join the tcp group")]
    Connect(#[source] tcp::TcpError),
    /// A collective failed (the message says how).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A broadcast string is not UTF-8 (the root's was).
    #[error("broadcast string is not valid UTF-8")]
    NotUtf8,
    /// A collective was called before [`init`].
    #[error("rabit is not initialized: call init() first")]
    NotInitialized,
    /// [`init`] was called twice without [`finalize`].
    #[error("rabit is already initialized")]
    AlreadyInitialized,
}

/// Result of the rabit-style API.
pub type Result<T> = std::result::Result<T, RabitError>;

/// Which path the collectives take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// The virtio-dmlc device.
    Device,
    /// TCP between the workers.
    Tcp,
}

/// How to reach the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The PCI device at this address (`None`: the first one).
    Pci(Option<String>),
    /// The kernel driver's device node (`None`: /dev/dmlc0).
    Kernel(Option<PathBuf>),
    /// The host transport: a backend socket.
    Host(PathBuf),
}

/// What [`init`] reads from the environment.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `DMLC_TASK_ID` (or torchrun's `RANK`).
    pub rank: Option<u32>,
    /// `DMLC_NUM_WORKER` (or torchrun's `WORLD_SIZE`).
    pub world_size: Option<u32>,
    /// The variables `rank` and `world_size` were read from, for errors.
    pub rank_var: &'static str,
    pub world_var: &'static str,
    /// `DMLC_TRANSPORT`.
    pub transport: TransportKind,
    /// `DMLC_DEVICE` or `DMLC_SOCKET`.
    pub device: Option<DeviceSpec>,
    /// `DMLC_DMA_BYTES` and `DMLC_POLL`.
    pub open: OpenOptions,
    /// `DMLC_TCP_PEERS`.
    pub tcp_peers: Vec<SocketAddr>,
    /// `DMLC_TCP_CONNECT_TIMEOUT_S`.
    pub connect_timeout: Duration,
    /// `DMLC_TCP_IO_TIMEOUT_S` (`None`: forever).
    pub io_timeout: Option<Duration>,
    /// `DMLC_CHECK_FINITE=1`: the device checks every floating-point
    /// reduction's inputs for NaN and infinity (spec 5.X.6.14,
    /// `Device::set_check_finite`); `0` or unset: off.
    pub check_finite: bool,
}

fn bad(var: &'static str, value: &str, reason: impl Into<String>) -> RabitError {
    RabitError::BadEnv {
        var,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn parse_u32(var: &'static str, value: &str) -> Result<u32> {
    value
        .trim()
        .parse()
        .map_err(|_| bad(var, value, "not a non-negative integer"))
}

fn parse_secs(var: &'static str, value: &str) -> Result<Duration> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| bad(var, value, "not a number of seconds"))
}

/// A size of at least one byte: `16M`, `1G`, `4096`, `512K`, `16MiB`
/// (the grammar of [`dmlc_cli_support::parse_size`], powers of 1024).
fn parse_bytes(var: &'static str, value: &str) -> Result<usize> {
    let n = dmlc_cli_support::parse_size(value).map_err(|e| bad(var, value, e.reason()))?;
    match usize::try_from(n) {
        Ok(0) => Err(bad(var, value, "not a size of at least one byte")),
        Ok(n) => Ok(n),
        Err(_) => Err(bad(var, value, "too large a size for this machine")),
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (for tests and embedders).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        if let Some(role) = var("DMLC_ROLE") {
            if role != "worker" {
                return Err(bad(
                    "DMLC_ROLE",
                    &role,
                    "only workers run collectives (no servers or schedulers here)",
                ));
            }
        }
        // The launcher's names and torchrun's: either, or both if they
        // agree. The value comes with the name it was read from, for errors.
        let either =
            |ours: &'static str, torchrun: &'static str| -> Result<Option<(u32, &'static str)>> {
                let a = var(ours).map(|v| parse_u32(ours, &v)).transpose()?;
                let b = var(torchrun).map(|v| parse_u32(torchrun, &v)).transpose()?;
                match (a, b) {
                    (Some(x), Some(y)) if x != y => {
                        Err(bad(ours, &x.to_string(), format!("but {torchrun} is {y}")))
                    }
                    _ => Ok(a.map(|x| (x, ours)).or(b.map(|y| (y, torchrun)))),
                }
            };
        let rank_from = either("DMLC_TASK_ID", "RANK")?;
        let world_from = either("DMLC_NUM_WORKER", "WORLD_SIZE")?;
        if let Some((0, name)) = world_from {
            return Err(bad(name, "0", "a job has at least one worker"));
        }
        if let (Some((r, rank_var)), Some((w, world_var))) = (rank_from, world_from) {
            if r >= w {
                return Err(bad(
                    rank_var,
                    &r.to_string(),
                    format!("not below {world_var}={w}"),
                ));
            }
        }
        let rank = rank_from.map(|(r, _)| r);
        let world_size = world_from.map(|(w, _)| w);
        let rank_var = rank_from.map_or("DMLC_TASK_ID", |(_, v)| v);
        let world_var = world_from.map_or("DMLC_NUM_WORKER", |(_, v)| v);
        let transport = match var("DMLC_TRANSPORT").as_deref() {
            None | Some("device") => TransportKind::Device,
            Some("tcp") => TransportKind::Tcp,
            Some(other) => return Err(bad("DMLC_TRANSPORT", other, "expected device or tcp")),
        };
        // DMLC_SOCKET_PREFIX: one socket per rank, PREFIX0, PREFIX1, ...
        let socket = match (var("DMLC_SOCKET"), var("DMLC_SOCKET_PREFIX")) {
            (Some(_), Some(p)) => {
                return Err(bad(
                    "DMLC_SOCKET_PREFIX",
                    &p,
                    "DMLC_SOCKET is set too; set only one",
                ))
            }
            (None, Some(p)) => Some(format!(
                "{p}{}",
                rank.ok_or(RabitError::MissingEnv {
                    var: "DMLC_TASK_ID",
                    why: "DMLC_SOCKET_PREFIX needs this worker's rank (DMLC_TASK_ID or RANK)",
                })?
            )),
            (s, None) => s,
        };
        let device = match (var("DMLC_DEVICE"), socket) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "DMLC_DEVICE",
                    &var("DMLC_DEVICE").unwrap_or_default(),
                    "DMLC_SOCKET is set too; set only one",
                ))
            }
            (Some(d), None) => Some(match d.as_str() {
                "pci" => DeviceSpec::Pci(None),
                "kernel" => DeviceSpec::Kernel(None),
                s => match (s.strip_prefix("pci:"), s.strip_prefix("kernel:")) {
                    (Some(addr), _) if !addr.is_empty() => DeviceSpec::Pci(Some(addr.to_string())),
                    (_, Some(node)) if !node.is_empty() => {
                        DeviceSpec::Kernel(Some(PathBuf::from(node)))
                    }
                    _ => {
                        return Err(bad(
                            "DMLC_DEVICE",
                            s,
                            "expected pci, pci:DOMAIN:BUS:SLOT.FN, kernel or kernel:/dev/dmlcN",
                        ))
                    }
                },
            }),
            (None, Some(path)) => Some(DeviceSpec::Host(PathBuf::from(path))),
            (None, None) => None,
        };
        let mut open = OpenOptions::default();
        if let Some(v) = var("DMLC_DMA_BYTES") {
            open.dma_bytes = parse_bytes("DMLC_DMA_BYTES", &v)?;
        }
        if let Some(v) = var("DMLC_POLL") {
            let wait: Wait = v
                .parse()
                .map_err(|e: UnknownWait| bad("DMLC_POLL", &v, e.to_string()))?;
            open = open.wait(wait);
        }
        let tcp_peers = match var(tcp::PEERS_ENV) {
            Some(list) => {
                tcp::parse_peers(&list).map_err(|e| bad(tcp::PEERS_ENV, &list, e.to_string()))?
            }
            None => Vec::new(),
        };
        let connect_timeout = match var("DMLC_TCP_CONNECT_TIMEOUT_S") {
            Some(v) => parse_secs("DMLC_TCP_CONNECT_TIMEOUT_S", &v)?,
            None => tcp::DEFAULT_CONNECT_TIMEOUT,
        };
        let io_timeout = match var("DMLC_TCP_IO_TIMEOUT_S") {
            Some(v) => Some(parse_secs("DMLC_TCP_IO_TIMEOUT_S", &v)?).filter(|d| !d.is_zero()),
            None => Some(tcp::DEFAULT_IO_TIMEOUT),
        };
        let check_finite = match var("DMLC_CHECK_FINITE").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => return Err(bad("DMLC_CHECK_FINITE", other, "expected 0 or 1")),
        };
        Ok(Config {
            rank,
            world_size,
            rank_var,
            world_var,
            transport,
            device,
            open,
            tcp_peers,
            connect_timeout,
            io_timeout,
            check_finite,
        })
    }
}

/// One worker's handle: a [`Communicator`] with rabit's names.
pub struct Rabit {
    comm: Box<dyn Communicator>,
}

impl std::fmt::Debug for Rabit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rabit")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("transport", &self.comm.transport())
            .finish()
    }
}

fn agree(what: &'static str, device: u32, var: &'static str, env: Option<u32>) -> Result<()> {
    match env {
        Some(env) if env != device => Err(RabitError::DeviceDisagrees {
            what,
            device,
            var,
            env,
        }),
        _ => Ok(()),
    }
}

/// Opens the device `cfg` names and checks that its rank and world size
/// are the environment's: the one way every client (this API, the C ABI's
/// `dmlc_open_env`, and through it the Python package) opens a device from
/// a job's environment.
pub fn open_device(cfg: &Config) -> Result<Device> {
    let dev =
        match &cfg.device {
            None => {
                return Err(RabitError::MissingEnv {
                    var: "DMLC_DEVICE",
                    why: "set DMLC_DEVICE=pci or DMLC_DEVICE=kernel inside a guest, or \
                      DMLC_SOCKET=PATH for the host transport",
                })
            }
            Some(DeviceSpec::Host(path)) => {
                dmlc_driver::host::open(path, &cfg.open).map_err(|source| RabitError::Open {
                    which: format!("socket {}", path.display()),
                    source,
                })?
            }
            Some(DeviceSpec::Kernel(node)) => dmlc_driver::kernel::open(node.as_deref(), &cfg.open)
                .map_err(|source| RabitError::Open {
                    which: format!(
                        "kernel driver node {}",
                        node.as_deref()
                            .map_or(dmlc_driver::kernel::DEFAULT_NODE.into(), |p| p
                                .display()
                                .to_string())
                    ),
                    source,
                })?,
            Some(DeviceSpec::Pci(addr)) => dmlc_driver::pci::open(addr.as_deref(), &cfg.open)
                .map_err(|source| RabitError::Open {
                    which: format!("PCI {}", addr.as_deref().unwrap_or("first device")),
                    source,
                })?,
        };
    agree("rank", dev.rank(), cfg.rank_var, cfg.rank)?;
    agree(
        "world size",
        dev.world_size(),
        cfg.world_var,
        cfg.world_size,
    )?;
    if cfg.check_finite {
        dev.set_check_finite(true)
            .map_err(|e| bad("DMLC_CHECK_FINITE", "1", e.to_string()))?;
    }
    Ok(dev)
}

impl Rabit {
    /// Joins the job described by the environment (see the module docs).
    pub fn init() -> Result<Rabit> {
        Self::with_config(&Config::from_env()?)
    }

    /// Joins the job described by `cfg`.
    pub fn with_config(cfg: &Config) -> Result<Rabit> {
        let comm: Box<dyn Communicator> = match cfg.transport {
            TransportKind::Tcp => {
                if cfg.tcp_peers.is_empty() {
                    return Err(RabitError::MissingEnv {
                        var: tcp::PEERS_ENV,
                        why: "DMLC_TRANSPORT=tcp needs every worker's address",
                    });
                }
                let world = cfg.tcp_peers.len() as u32;
                if let Some(w) = cfg.world_size.filter(|&w| w != world) {
                    return Err(bad(
                        tcp::PEERS_ENV,
                        &format!("{} addresses", world),
                        format!("DMLC_NUM_WORKER is {w}"),
                    ));
                }
                let rank = cfg.rank.ok_or(RabitError::MissingEnv {
                    var: "DMLC_TASK_ID",
                    why: "DMLC_TRANSPORT=tcp needs this worker's rank",
                })?;
                let mut c = TcpComm::connect(rank, &cfg.tcp_peers, cfg.connect_timeout)
                    .map_err(RabitError::Connect)?;
                c.set_io_timeout(cfg.io_timeout);
                Box::new(c)
            }
            TransportKind::Device => {
                if cfg.device.is_none() {
                    let world = cfg.world_size.unwrap_or(1);
                    if world > 1 {
                        return Err(RabitError::NoDevice { world });
                    }
                    return Ok(Rabit::new(Box::new(SelfComm)));
                }
                Box::new(DeviceComm::new(open_device(cfg)?))
            }
        };
        Ok(Rabit::new(comm))
    }

    /// Wraps any communicator.
    pub fn new(comm: Box<dyn Communicator>) -> Rabit {
        Rabit { comm }
    }

    /// This worker's rank.
    pub fn get_rank(&self) -> u32 {
        self.comm.rank()
    }

    /// Number of workers.
    pub fn get_world_size(&self) -> u32 {
        self.comm.world_size()
    }

    /// True if there is more than one worker.
    pub fn is_distributed(&self) -> bool {
        self.comm.world_size() > 1
    }

    /// Tags every later collective ([`Communicator::set_tag`]).
    pub fn set_tag(&mut self, tag: u64) {
        self.comm.set_tag(tag);
    }

    /// "device", "tcp" or "self".
    pub fn transport(&self) -> &'static str {
        self.comm.transport()
    }

    /// The communicator underneath.
    pub fn comm(&mut self) -> &mut dyn Communicator {
        &mut *self.comm
    }

    /// Every worker's `buf` becomes the element-wise reduction of all
    /// workers' `buf`s (equal lengths everywhere).
    pub fn allreduce<T: Element>(&mut self, buf: &mut [T], op: Op) -> Result<()> {
        Ok(self.comm.allreduce(op.into(), buf)?)
    }

    /// [`Self::allreduce`] on raw little-endian bytes of `dtype` (for the C
    /// API).
    pub fn allreduce_raw(&mut self, dtype: Dtype, op: Op, buf: &mut [u8]) -> Result<()> {
        Ok(self.comm.allreduce_raw(dtype, op.into(), buf)?)
    }

    /// Every worker's `buf` gets the root's (equal lengths everywhere).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: u32) -> Result<()> {
        Ok(self.comm.broadcast(root, buf)?)
    }

    /// Every worker's `buf` becomes a copy of the root's, whatever its
    /// length was (rabit's `Broadcast(std::string*, root)`).
    pub fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: u32) -> Result<()> {
        let mut len = [buf.len() as u64];
        self.comm.broadcast(root, &mut len)?;
        let len = usize::try_from(len[0])
            .map_err(|_| CommError::InvalidArgument(format!("broadcast of {} bytes", len[0])))?;
        buf.resize(len, 0);
        Ok(self.comm.broadcast_raw(root, buf)?)
    }

    /// [`Self::broadcast_bytes`] for a string.
    pub fn broadcast_string(&mut self, s: &mut String, root: u32) -> Result<()> {
        let mut bytes = std::mem::take(s).into_bytes();
        self.broadcast_bytes(&mut bytes, root)?;
        *s = String::from_utf8(bytes).map_err(|_| RabitError::NotUtf8)?;
        Ok(())
    }

    /// `output` (`world_size` times as long as `input`) gets every worker's
    /// `input` in rank order.
    pub fn allgather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        Ok(self.comm.allgather(input, output)?)
    }

    /// Returns once every worker has arrived.
    pub fn barrier(&mut self) -> Result<()> {
        Ok(self.comm.barrier()?)
    }

    /// Prints `msg` for the launcher (see [`tracker_print`]).
    pub fn tracker_print(&self, msg: &str) {
        tracker_print(msg);
    }

    /// Leaves the job: waits until every worker has arrived here (so no
    /// worker exits while others still talk to it), then closes.
    pub fn finalize(mut self) -> Result<()> {
        self.barrier()
    }
}

/// Writes `msg` to stderr as whole lines, in one write (a newline is added
/// if missing). The launcher shows every line with the worker's rank.
pub fn tracker_print(msg: &str) {
    let mut err = std::io::stderr().lock();
    // Nowhere to report a failed write to stderr.
    let _ = err.write_all(tracker_line(msg).as_bytes());
    let _ = err.flush();
}

fn tracker_line(msg: &str) -> String {
    let mut line = String::with_capacity(msg.len() + 1);
    line.push_str(msg);
    if !line.ends_with('\n') {
        line.push('\n');
    }
    line
}

static GLOBAL: Mutex<Option<Rabit>> = Mutex::new(None);

fn global() -> MutexGuard<'static, Option<Rabit>> {
    // A panic inside a collective leaves the communicator as it was (a
    // TCP one marks itself broken), so the state is still usable.
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Initializes the process-wide worker from the environment.
pub fn init() -> Result<()> {
    let mut g = global();
    if g.is_some() {
        return Err(RabitError::AlreadyInitialized);
    }
    *g = Some(Rabit::init()?);
    Ok(())
}

/// Installs `rabit` as the process-wide worker.
pub fn init_with(rabit: Rabit) -> Result<()> {
    let mut g = global();
    if g.is_some() {
        return Err(RabitError::AlreadyInitialized);
    }
    *g = Some(rabit);
    Ok(())
}

/// True between [`init`] and [`finalize`].
pub fn is_initialized() -> bool {
    global().is_some()
}

/// Leaves the job ([`Rabit::finalize`]) and drops the process-wide worker.
pub fn finalize() -> Result<()> {
    let r = global().take().ok_or(RabitError::NotInitialized)?;
    r.finalize()
}

/// Runs `f` on the process-wide worker (for the C API and for calls not
/// listed here).
pub fn with<R>(f: impl FnOnce(&mut Rabit) -> R) -> Result<R> {
    let mut g = global();
    let r = g.as_mut().ok_or(RabitError::NotInitialized)?;
    Ok(f(r))
}

/// This worker's rank (0 before [`init`]).
pub fn get_rank() -> u32 {
    global().as_ref().map_or(0, Rabit::get_rank)
}

/// Number of workers (1 before [`init`]).
pub fn get_world_size() -> u32 {
    global().as_ref().map_or(1, Rabit::get_world_size)
}

/// True if there is more than one worker.
pub fn is_distributed() -> bool {
    get_world_size() > 1
}

/// Tags every later collective with `tag` (0: none), e.g. the step
/// number ([`Communicator::set_tag`]); before [`init`] it does nothing.
pub fn set_tag(tag: u64) {
    if let Some(r) = global().as_mut() {
        r.set_tag(tag);
    }
}

/// [`Rabit::allreduce`] on the process-wide worker.
pub fn allreduce<T: Element>(buf: &mut [T], op: Op) -> Result<()> {
    with(|r| r.allreduce(buf, op))?
}

/// [`Rabit::allreduce_raw`] on the process-wide worker (for the C API).
pub fn allreduce_raw(dtype: Dtype, op: Op, buf: &mut [u8]) -> Result<()> {
    with(|r| r.allreduce_raw(dtype, op, buf))?
}

/// [`Rabit::broadcast`] on the process-wide worker.
pub fn broadcast<T: Element>(buf: &mut [T], root: u32) -> Result<()> {
    with(|r| r.broadcast(buf, root))?
}

/// [`Rabit::broadcast_bytes`] on the process-wide worker.
pub fn broadcast_bytes(buf: &mut Vec<u8>, root: u32) -> Result<()> {
    with(|r| r.broadcast_bytes(buf, root))?
}

/// [`Rabit::broadcast_string`] on the process-wide worker.
pub fn broadcast_string(s: &mut String, root: u32) -> Result<()> {
    with(|r| r.broadcast_string(s, root))?
}

/// [`Rabit::allgather`] on the process-wide worker.
pub fn allgather<T: Element>(input: &[T], output: &mut [T]) -> Result<()> {
    with(|r| r.allgather(input, output))?
}

/// [`Rabit::barrier`] on the process-wide worker.
pub fn barrier() -> Result<()> {
    with(Rabit::barrier)?
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::net::TcpListener;

    use half::bf16;

    use super::*;
    use crate::testutil::{on_each, serial, start_backend};

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn the_environment_is_read_and_checked() {
        let c = cfg(&[]).unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.transport, c.device.clone()),
            (None, None, TransportKind::Device, None)
        );
        assert_eq!(c.open, OpenOptions::default());
        assert_eq!(c.connect_timeout, Duration::from_secs(60));
        let c = cfg(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_TASK_ID", "1"),
            ("DMLC_NUM_WORKER", "4"),
            ("DMLC_DEVICE", "pci:0000:00:04.0"),
            ("DMLC_DMA_BYTES", "16M"),
            ("DMLC_POLL", "0"),
            ("DMLC_TCP_IO_TIMEOUT_S", "0"),
            ("DMLC_TCP_CONNECT_TIMEOUT_S", "2.5"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.world_size), (Some(1), Some(4)));
        assert_eq!(c.device, Some(DeviceSpec::Pci(Some("0000:00:04.0".into()))));
        assert_eq!(
            (c.open.dma_bytes, c.open.poll, c.open.spin_cap),
            (16 << 20, false, Duration::ZERO)
        );
        assert_eq!(c.io_timeout, None);
        assert_eq!(c.connect_timeout, Duration::from_millis(2500));
        assert!(!c.check_finite);
        assert!(cfg(&[("DMLC_CHECK_FINITE", "1")]).unwrap().check_finite);
        assert!(!cfg(&[("DMLC_CHECK_FINITE", "0")]).unwrap().check_finite);
        assert!(cfg(&[("DMLC_CHECK_FINITE", "yes")])
            .unwrap_err()
            .to_string()
            .contains("DMLC_CHECK_FINITE"));
        let c = cfg(&[
            ("DMLC_TRANSPORT", "tcp"),
            ("DMLC_TCP_PEERS", "127.0.0.1:1,127.0.0.1:2"),
            ("DMLC_SOCKET", "/tmp/x"),
        ])
        .unwrap();
        assert_eq!(c.transport, TransportKind::Tcp);
        assert_eq!(c.tcp_peers.len(), 2);
        assert_eq!(c.device, Some(DeviceSpec::Host("/tmp/x".into())));
        assert_eq!(
            cfg(&[("DMLC_DEVICE", "pci")]).unwrap().device,
            Some(DeviceSpec::Pci(None))
        );
        assert_eq!(
            cfg(&[("DMLC_DEVICE", "kernel")]).unwrap().device,
            Some(DeviceSpec::Kernel(None))
        );
        assert_eq!(
            cfg(&[("DMLC_DEVICE", "kernel:/dev/dmlc1")]).unwrap().device,
            Some(DeviceSpec::Kernel(Some("/dev/dmlc1".into())))
        );

        let err = |vars: &[(&str, &str)]| cfg(vars).unwrap_err().to_string();
        assert_eq!(
            err(&[("DMLC_ROLE", "server")]),
            "invalid DMLC_ROLE=\"server\": only workers run collectives (no servers or schedulers here)"
        );
        assert_eq!(
            err(&[("DMLC_TASK_ID", "x")]),
            "invalid DMLC_TASK_ID=\"x\": not a non-negative integer"
        );
        assert_eq!(
            err(&[("DMLC_TASK_ID", "2"), ("DMLC_NUM_WORKER", "2")]),
            "invalid DMLC_TASK_ID=\"2\": not below DMLC_NUM_WORKER=2"
        );
        assert!(err(&[("DMLC_NUM_WORKER", "0")]).contains("at least one worker"));
        assert!(err(&[("DMLC_TRANSPORT", "rdma")]).contains("expected device or tcp"));
        assert!(err(&[("DMLC_DEVICE", "pci"), ("DMLC_SOCKET", "/s")]).contains("set only one"));
        assert!(err(&[("DMLC_DEVICE", "usb")]).contains("expected pci"));
        assert!(err(&[("DMLC_DEVICE", "kernel:")]).contains("kernel:/dev/dmlcN"));
        assert!(err(&[("DMLC_DMA_BYTES", "lots")]).contains("not a size"));
        assert!(err(&[("DMLC_DMA_BYTES", "0")]).contains("at least one byte"));
        assert_eq!(
            cfg(&[("DMLC_DMA_BYTES", "16MiB")]).unwrap().open.dma_bytes,
            16 << 20
        );
        assert!(err(&[("DMLC_POLL", "maybe")]).contains("expected poll, interrupt or hybrid"));
        // torchrun's names, alone or agreeing with the launcher's.
        let c = cfg(&[("RANK", "2"), ("WORLD_SIZE", "3"), ("DMLC_NUM_WORKER", "3")]).unwrap();
        assert_eq!((c.rank, c.world_size), (Some(2), Some(3)));
        assert_eq!(
            err(&[("DMLC_TASK_ID", "1"), ("RANK", "0")]),
            "invalid DMLC_TASK_ID=\"1\": but RANK is 0"
        );
        assert_eq!(
            err(&[("RANK", "3"), ("WORLD_SIZE", "3")]),
            "invalid RANK=\"3\": not below WORLD_SIZE=3"
        );
        // One socket per rank, named as the daemon names them.
        assert_eq!(
            cfg(&[("DMLC_SOCKET_PREFIX", "/run/d.sock"), ("RANK", "1")])
                .unwrap()
                .device,
            Some(DeviceSpec::Host("/run/d.sock1".into()))
        );
        assert!(err(&[("DMLC_SOCKET_PREFIX", "/run/d.sock")]).contains("needs this worker's rank"));
        assert!(
            err(&[("DMLC_SOCKET_PREFIX", "/p"), ("DMLC_SOCKET", "/s")]).contains("set only one")
        );
        assert!(err(&[("DMLC_TCP_PEERS", "nowhere")]).starts_with("invalid DMLC_TCP_PEERS"));
        assert!(err(&[("DMLC_TCP_IO_TIMEOUT_S", "-1")]).contains("seconds"));
    }

    /// DMLC_POLL's settings and the wait mode each names: the same table as
    /// the Python package's test (python/tests/ranks.py, WAIT_BY_DMLC_POLL),
    /// which opens devices through the C ABI's dmlc_open_env.
    #[test]
    fn every_dmlc_poll_names_one_wait_mode() {
        let table = [
            (None, Wait::Hybrid),
            (Some("hybrid"), Wait::Hybrid),
            (Some("poll"), Wait::Poll),
            (Some("1"), Wait::Poll),
            (Some("interrupt"), Wait::Interrupt),
            (Some("0"), Wait::Interrupt),
        ];
        for (setting, mode) in table {
            let vars: Vec<(&str, &str)> = setting.map(|v| ("DMLC_POLL", v)).into_iter().collect();
            assert_eq!(cfg(&vars).unwrap().open.wait_kind(), mode, "{setting:?}");
        }
        for mode in Wait::ALL {
            assert_eq!(mode.name().parse::<Wait>(), Ok(mode));
        }
        let err = cfg(&[("DMLC_POLL", "true")]).unwrap_err().to_string();
        assert!(
            err.contains("DMLC_POLL") && err.contains("expected poll, interrupt or hybrid"),
            "{err}"
        );
    }

    #[test]
    fn setups_that_cannot_work_are_refused() {
        let open = |vars: &[(&str, &str)]| Rabit::with_config(&cfg(vars).unwrap()).unwrap_err();
        assert_eq!(
            open(&[("DMLC_NUM_WORKER", "2")]).to_string(),
            "no device for a job of 2 workers: set DMLC_DEVICE=pci or DMLC_SOCKET=PATH, \
             or DMLC_TRANSPORT=tcp with DMLC_TCP_PEERS"
        );
        assert!(matches!(
            open(&[("DMLC_TRANSPORT", "tcp")]),
            RabitError::MissingEnv {
                var: "DMLC_TCP_PEERS",
                ..
            }
        ));
        assert!(matches!(
            open(&[("DMLC_TRANSPORT", "tcp"), ("DMLC_TCP_PEERS", "127.0.0.1:1")]),
            RabitError::MissingEnv {
                var: "DMLC_TASK_ID",
                ..
            }
        ));
        let e = open(&[
            ("DMLC_TRANSPORT", "tcp"),
            ("DMLC_TCP_PEERS", "127.0.0.1:1"),
            ("DMLC_NUM_WORKER", "2"),
        ]);
        assert!(e.to_string().contains("DMLC_NUM_WORKER is 2"), "{e}");
        let e = open(&[("DMLC_SOCKET", "/nonexistent/dmlc.sock")]);
        assert!(
            e.to_string()
                .starts_with("cannot open the device (socket /nonexistent/dmlc.sock)"),
            "{e}"
        );
        // Alone, without a device: rabit's behaviour outside a job.
        let mut r = Rabit::with_config(&cfg(&[]).unwrap()).unwrap();
        assert_eq!(
            (r.get_rank(), r.get_world_size(), r.is_distributed()),
            (0, 1, false)
        );
        assert_eq!(r.transport(), "self");
        let mut v = [1u8, 2];
        r.allreduce(&mut v, Op::BitOR).unwrap();
        assert_eq!(v, [1, 2]);
        r.finalize().unwrap();
    }

    fn exercise(r: &mut Rabit) {
        let rank = r.get_rank();
        let world = r.get_world_size();
        assert!(r.is_distributed());
        let mut v = [rank as f32 + 1.0, 0.5];
        r.allreduce(&mut v, Op::Sum).unwrap();
        let n = world as f32;
        assert_eq!(v, [n * (n + 1.0) / 2.0, 0.5 * n]);
        let mut m = [rank as i32 * 10 - 5];
        r.allreduce(&mut m, Op::Max).unwrap();
        assert_eq!(m, [world as i32 * 10 - 15]);
        r.allreduce(&mut m, Op::Min).unwrap();
        assert_eq!(m, [world as i32 * 10 - 15]);
        let mut bits = [1u64 << rank];
        r.allreduce(&mut bits, Op::BitOR).unwrap();
        assert_eq!(bits, [(1 << world) - 1]);
        let mut x = [0xffu8 ^ (1 << rank)];
        r.allreduce(&mut x, Op::BitAND).unwrap();
        assert_eq!(x, [0xff ^ ((1 << world) - 1)]);
        r.allreduce(&mut x, Op::BitXOR).unwrap();
        let mut a = [bf16::from_f32(rank as f32)];
        r.allreduce(&mut a, Op::Avg).unwrap();
        assert_eq!(a, [bf16::from_f32((n - 1.0) / 2.0)]);
        let mut p = [2i64];
        r.allreduce(&mut p, Op::Prod).unwrap();
        assert_eq!(p, [1 << world]);
        let mut s = if rank == 1 {
            "model: ⟨w⟩ = 0.25".to_string()
        } else {
            "x".repeat(rank as usize * 3)
        };
        r.broadcast_string(&mut s, 1).unwrap();
        assert_eq!(s, "model: ⟨w⟩ = 0.25");
        let mut blob = if rank == 0 {
            vec![9u8; 70_000]
        } else {
            Vec::new()
        };
        r.broadcast_bytes(&mut blob, 0).unwrap();
        assert_eq!(blob, vec![9u8; 70_000]);
        let mut f = [rank as f64; 3];
        r.broadcast(&mut f, world - 1).unwrap();
        assert_eq!(f, [f64::from(world - 1); 3]);
        let mut all = vec![0u32; world as usize];
        r.allgather(&[rank], &mut all).unwrap();
        assert_eq!(all, (0..world).collect::<Vec<_>>());
        r.barrier().unwrap();
        assert!(matches!(
            r.allreduce(&mut [1.0f32], Op::BitOR),
            Err(RabitError::Comm(CommError::OpForDtype { .. }))
        ));
    }

    #[test]
    fn init_from_the_environment_with_the_host_transport() {
        let _serial = serial();
        let backend = start_backend("rabit", 2);
        let envs: Vec<Vec<(String, String)>> = (0..2u32)
            .map(|r| {
                vec![
                    ("DMLC_ROLE".into(), "worker".into()),
                    ("DMLC_TASK_ID".into(), r.to_string()),
                    ("DMLC_NUM_WORKER".into(), "2".into()),
                    (
                        "DMLC_SOCKET".into(),
                        backend.socket(r).display().to_string(),
                    ),
                    ("DMLC_DMA_BYTES".into(), "8M".into()),
                    ("DMLC_POLL".into(), "0".into()),
                ]
            })
            .collect();
        on_each(envs, |env| {
            let vars: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let mut r = Rabit::with_config(&cfg(&vars).unwrap()).unwrap();
            assert_eq!(r.transport(), "device");
            exercise(&mut r);
            r.finalize().unwrap();
        });
        // The environment must agree with the device.
        let one = start_backend("rabit1", 1);
        let socket = one.socket(0).display().to_string();
        let e = Rabit::with_config(
            &cfg(&[("DMLC_SOCKET", &socket), ("DMLC_NUM_WORKER", "2")]).unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the device says world size 1, but DMLC_NUM_WORKER is 2"
        );
        // Named by the variable the value came from: torchrun's here.
        let e = Rabit::with_config(
            &cfg(&[("DMLC_SOCKET", &socket), ("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "the device says rank 0, but RANK is 1");
    }

    #[test]
    fn init_from_the_environment_over_tcp() {
        let _serial = serial();
        let ports: Vec<String> = (0..3)
            .map(|_| {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().to_string()
            })
            .collect();
        let peers = ports.join(",");
        on_each((0..3u32).collect(), |rank| {
            let id = rank.to_string();
            let c = cfg(&[
                ("DMLC_TRANSPORT", "tcp"),
                ("DMLC_TASK_ID", &id),
                ("DMLC_NUM_WORKER", "3"),
                ("DMLC_TCP_PEERS", &peers),
                ("DMLC_TCP_CONNECT_TIMEOUT_S", "20"),
            ])
            .unwrap();
            let mut r = Rabit::with_config(&c).unwrap();
            assert_eq!((r.get_rank(), r.transport()), (rank, "tcp"));
            exercise(&mut r);
            r.finalize().unwrap();
        });
    }

    #[test]
    fn the_process_wide_worker() {
        // The only test that touches the global state.
        assert!(!is_initialized());
        assert_eq!(
            (get_rank(), get_world_size(), is_distributed()),
            (0, 1, false)
        );
        assert!(matches!(
            allreduce(&mut [1.0f32], Op::Sum),
            Err(RabitError::NotInitialized)
        ));
        assert!(matches!(finalize(), Err(RabitError::NotInitialized)));
        init_with(Rabit::new(Box::new(crate::SelfComm))).unwrap();
        assert!(matches!(
            init_with(Rabit::new(Box::new(crate::SelfComm))),
            Err(RabitError::AlreadyInitialized)
        ));
        assert!(matches!(init(), Err(RabitError::AlreadyInitialized)));
        assert!(is_initialized());
        let mut v = [2.0f64, 3.0];
        allreduce(&mut v, Op::Prod).unwrap();
        assert_eq!(v, [2.0, 3.0]);
        let mut s = String::from("hello");
        broadcast_string(&mut s, 0).unwrap();
        assert_eq!(s, "hello");
        let mut b = vec![1u8, 2];
        broadcast_bytes(&mut b, 0).unwrap();
        let mut raw = 7i32.to_le_bytes();
        allreduce_raw(Dtype::I32, Op::Avg, &mut raw).unwrap();
        assert_eq!(raw, 7i32.to_le_bytes());
        broadcast(&mut v, 0).unwrap();
        let mut g = [0.0f64; 2];
        allgather(&v, &mut g).unwrap();
        barrier().unwrap();
        assert_eq!(with(|r| r.transport()).unwrap(), "self");
        tracker_print("the_process_wide_worker: tracker_print works");
        finalize().unwrap();
        assert!(!is_initialized());
    }

    #[test]
    fn tracker_lines_end_once() {
        assert_eq!(tracker_line("loss 0.5"), "loss 0.5\n");
        assert_eq!(tracker_line("a\nb\n"), "a\nb\n");
        assert_eq!(tracker_line(""), "\n");
    }

    #[test]
    fn ops_map_to_the_device_ops() {
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from(Op::from(*op)), *op);
        }
        assert_eq!(ReduceOp::from(Op::BitOR), ReduceOp::Bor);
    }
}
