//! Errors of the collectives and of the TCP transport (here, not in
//! `tcp`, so that the communicator API does not depend on one transport).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use dmlc_driver::{Dtype, ReduceOp};

/// Errors of the collectives.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The device failed the collective (the message says how).
    #[error(transparent)]
    Device(#[from] dmlc_driver::Error),
    /// The TCP transport failed (the message says how).
    #[error(transparent)]
    Tcp(#[from] TcpError),
    /// The host-side reduction refused its arguments (a bug: they are
    /// checked before anything is sent).
    #[error(transparent)]
    Reduce(#[from] dmlc_reduce::ReduceError),
    /// A caller mistake found before anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// band, bor and bxor are not defined on floating-point types.
    #[error("reduce op {op} is not defined for {dtype}")]
    OpForDtype { op: ReduceOp, dtype: Dtype },
}

/// Result of the collectives.
pub type Result<T> = std::result::Result<T, CommError>;

/// Errors of the TCP transport.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// The peer list could not be parsed.
    #[error("invalid peer list: {0}")]
    Peers(String),
    /// The rank is outside the peer list.
    #[error("rank {rank} is not in a group of {world}")]
    Rank { rank: u32, world: u32 },
    /// The listening socket could not be opened.
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// A lower rank could not be reached before the connect timeout.
    #[error("cannot reach rank {rank} at {addr} within {} s", secs(*waited))]
    Connect {
        rank: u32,
        addr: SocketAddr,
        waited: Duration,
        #[source]
        source: io::Error,
    },
    /// A higher rank did not connect before the connect timeout.
    #[error("rank {rank} ({addr}) did not connect within {} s{}", secs(*waited),
            if *more > 0 { format!(" (and {more} more ranks)") } else { String::new() })]
    NotConnected {
        rank: u32,
        addr: SocketAddr,
        more: usize,
        waited: Duration,
    },
    /// The hello exchange found a peer that is not what the list says.
    #[error("handshake with {addr} failed: {reason}")]
    Handshake { addr: SocketAddr, reason: String },
    /// A peer closed its connection (it exited or crashed).
    #[error("rank {rank} closed the connection")]
    PeerClosed { rank: u32 },
    /// The connection to a peer failed.
    #[error("connection to rank {rank} failed")]
    Io {
        rank: u32,
        #[source]
        source: io::Error,
    },
    /// A peer sent nothing for longer than the I/O timeout.
    #[error("timed out after {} s waiting for rank {rank}", secs(*waited))]
    Timeout { rank: u32, waited: Duration },
    /// The members called different collectives.
    #[error("collective mismatch: {field} differs on rank {rank} ({theirs} there, {ours} here)")]
    Mismatch {
        field: &'static str,
        rank: u32,
        ours: u64,
        theirs: u64,
    },
    /// A peer sent bytes that are not a message of this protocol.
    #[error("rank {rank} sent a malformed message")]
    BadFrame { rank: u32 },
    /// An earlier collective failed; the streams are out of step.
    #[error("communicator unusable after an earlier failure")]
    Broken,
    /// The reduction of the received data refused its arguments (a bug:
    /// they are checked before anything is sent).
    #[error(transparent)]
    Reduce(#[from] dmlc_reduce::ReduceError),
    /// poll(2) failed.
    #[error("waiting for the sockets failed")]
    Poll(#[source] nix::Error),
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 10.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}
