//! Shared by the tests of comm, tcp and rabit: data of every dtype, and
//! the backend daemon (from dmlc-test-support).

use std::time::Duration;

use virtio_dmlc::{Dtype, ReduceOp};

pub use dmlc_test_support::serial;

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// `count` elements of `dtype` as bytes: floats are small values of
/// mixed sign and magnitude (sums of them round), with an occasional
/// NaN if `nan`; integers are arbitrary bits.
pub fn data(dtype: Dtype, count: usize, seed: u64, nan: bool) -> Vec<u8> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        let r = rng.next();
        let f =
            ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * [1.0, 3.0e-3, 7.0e2][(r % 3) as usize];
        let f = if nan && i % 97 == 13 { f64::NAN } else { f };
        match dtype {
            Dtype::F32 => out.extend((f as f32).to_le_bytes()),
            Dtype::F64 => out.extend(f.to_le_bytes()),
            Dtype::F16 => out.extend(half::f16::from_f64(f).to_le_bytes()),
            Dtype::Bf16 => out.extend(half::bf16::from_f64(f).to_le_bytes()),
            _ => out.extend(&r.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// True if `a` and `b` are bitwise equal, counting any two NaNs as
/// equal (the spec leaves NaN payloads open).
pub fn same(dtype: Dtype, a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let nan = |x: &[u8]| match dtype {
        Dtype::F32 => f32::from_le_bytes(x.try_into().unwrap()).is_nan(),
        Dtype::F64 => f64::from_le_bytes(x.try_into().unwrap()).is_nan(),
        Dtype::F16 => half::f16::from_le_bytes(x.try_into().unwrap()).is_nan(),
        Dtype::Bf16 => half::bf16::from_le_bytes(x.try_into().unwrap()).is_nan(),
        _ => false,
    };
    a.chunks(dtype.size())
        .zip(b.chunks(dtype.size()))
        .all(|(x, y)| x == y || (nan(x) && nan(y)))
}

/// Every (dtype, op) pair the device defines.
pub fn all_pairs() -> impl Iterator<Item = (Dtype, ReduceOp)> {
    Dtype::ALL.iter().flat_map(|&d| {
        ReduceOp::ALL
            .iter()
            .filter(move |op| op.supports(d))
            .map(move |&op| (d, op))
    })
}

/// The scalar reference of dmlc-reduce, written apart from its kernels
/// (f64/i128 arithmetic), on owned inputs in rank order.
pub fn naive(dtype: Dtype, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let inputs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    dmlc_reduce::reference::reduce(dtype, op, inputs.len() as u32, &inputs)
}

/// `n` TCP members over loopback, connected (in rank order).
pub fn tcp_group(n: u32) -> Vec<crate::TcpComm> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback"))
        .collect();
    let peers: Vec<std::net::SocketAddr> =
        listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let peers = &peers;
                s.spawn(move || {
                    crate::TcpComm::with_listener(r as u32, l, peers, Duration::from_secs(20))
                        .expect("tcp group")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f(member)` on a thread per member; results in rank order.
pub fn on_each<C: Send, R: Send>(members: Vec<C>, f: impl Fn(C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = members.into_iter().map(|m| s.spawn(move || f(m))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

pub use dmlc_test_support::Backend;

/// A daemon with `ranks` sockets, quiet, one reduction thread, a long
/// request timeout (parallel tests on two cores can be slow).
pub fn start_backend(tag: &str, ranks: u32) -> Backend {
    Backend::start(
        tag,
        ranks,
        &[
            "--timeout-ms",
            "20000",
            "--reduce-threads",
            "1",
            "--log-level",
            "warn",
        ],
    )
}
