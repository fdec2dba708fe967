//! Collectives on ordinary memory, copied through a bounce buffer.
//!
//! The device reads and writes only its DMA memory, so data elsewhere is
//! copied into a buffer there, the collective runs in place on it, and the
//! result is copied back. [`Bounce`] is the one implementation of that,
//! used by [`Device`]'s slice conveniences, `dmlc-comm`'s `DeviceComm` and
//! the C ABI: one buffer, reused while it is large enough and free, and
//! data longer than the chunk size cut into several requests.

use std::ops::Range;

use virtio_dmlc::comm::CommOpcode;

use crate::device::{CommRequest, Device, DmaBuf};
use crate::error::{Error, Result};
use crate::{Dtype, ReduceOp};

/// Largest piece one request carries by default: keeps the bounce buffer
/// (and the DMA memory it needs) small while large requests stay cheap.
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 20;

/// Smallest bounce buffer allocated (a zero-length one is not a buffer).
const MIN_BYTES: usize = 64;

/// A reusable bounce buffer and the chunk size of the requests it carries.
///
/// Every member of a group must cut its data at the same places, so the
/// chunk size must be the same on all of them: the default depends only on
/// the group's config (the smaller of the device's `max_bytes` and
/// [`DEFAULT_CHUNK_BYTES`]).
#[derive(Debug)]
pub struct Bounce {
    buf: Option<DmaBuf>,
    chunk_bytes: usize,
}

impl Bounce {
    /// An empty bounce buffer (allocated at first use) for `dev`'s group.
    pub fn new(dev: &Device) -> Bounce {
        let max = usize::try_from(dev.config().max_bytes.get()).unwrap_or(usize::MAX);
        let mut b = Bounce {
            buf: None,
            chunk_bytes: 0,
        };
        b.set_chunk_bytes(max.min(DEFAULT_CHUNK_BYTES));
        b
    }

    /// Largest piece per request (rounded down to a multiple of 8 bytes,
    /// the largest element, and at least 8). Must match on every member.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = (bytes / 8 * 8).max(8);
    }

    /// Largest piece per request.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The buffer, at least `bytes` long, free for a new request.
    fn buffer(&mut self, dev: &Device, bytes: usize) -> Result<&mut DmaBuf> {
        // A request whose wait failed may still hold the old buffer: leave
        // it to that request and take a new one.
        if self
            .buf
            .as_ref()
            .is_none_or(|b| b.len() < bytes || b.is_in_flight())
        {
            self.buf = None; // free the old one before allocating
            self.buf = Some(dev.alloc(bytes.max(MIN_BYTES))?);
        }
        let buf = self.buf.as_mut().expect("bounce buffer just set");
        // `&mut self` proves that the last call's borrows have ended.
        buf.reclaim();
        Ok(buf)
    }

    /// The cached buffer (tests that hold it on the device).
    #[cfg(test)]
    pub(crate) fn cached(&mut self) -> &mut DmaBuf {
        self.buf.as_mut().expect("a bounce buffer was used")
    }

    /// Whole elements of `dtype` per piece.
    fn step(&self, dtype: Dtype) -> usize {
        let size = dtype.size();
        (self.chunk_bytes / size).max(1) * size
    }

    /// Allreduce of `data` in place.
    pub fn allreduce_in_place(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        op: ReduceOp,
        data: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, data.len())?;
        let step = self.step(dtype);
        let mut found = NonFinite::default();
        for (k, piece) in data.chunks_mut(step).enumerate() {
            let buf = self.buffer(dev, piece.len())?;
            buf.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            let done = dev.allreduce_in_place(dtype, op, buf, count(dtype, piece.len()));
            found.take(done, |i| count(dtype, k * step) + i)?;
            piece.copy_from_slice(&buf.as_slice()[..piece.len()]);
        }
        found.result()
    }

    /// Allreduce of `input` into `output` (the same length).
    pub fn allreduce(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        op: ReduceOp,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, input.len())?;
        if input.len() != output.len() {
            return Err(Error::InvalidArgument(format!(
                "allreduce output has {} bytes, the input {}",
                output.len(),
                input.len()
            )));
        }
        let step = self.step(dtype);
        let mut found = NonFinite::default();
        for (k, (src, dst)) in input.chunks(step).zip(output.chunks_mut(step)).enumerate() {
            let buf = self.buffer(dev, src.len())?;
            buf.as_mut_slice()[..src.len()].copy_from_slice(src);
            let done = dev.allreduce_in_place(dtype, op, buf, count(dtype, src.len()));
            found.take(done, |i| count(dtype, k * step) + i)?;
            dst.copy_from_slice(&buf.as_slice()[..src.len()]);
        }
        found.result()
    }

    /// Broadcast of the root's `data` into every member's `data`.
    pub fn broadcast(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        root: u32,
        data: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, data.len())?;
        let is_root = root == dev.rank();
        let step = self.step(dtype);
        for piece in data.chunks_mut(step) {
            let buf = self.buffer(dev, piece.len())?;
            if is_root {
                buf.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            }
            dev.broadcast_in_place(dtype, root, buf, count(dtype, piece.len()))?;
            piece.copy_from_slice(&buf.as_slice()[..piece.len()]);
        }
        Ok(())
    }

    /// Reduce of every member's `data` into the root's `data`; the others'
    /// stays as it was.
    pub fn reduce(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        op: ReduceOp,
        root: u32,
        data: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, data.len())?;
        let is_root = root == dev.rank();
        let step = self.step(dtype);
        let mut found = NonFinite::default();
        for (k, piece) in data.chunks_mut(step).enumerate() {
            let buf = self.buffer(dev, piece.len())?;
            buf.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            let done = dev.reduce_in_place(dtype, op, root, buf, count(dtype, piece.len()));
            found.take(done, |i| count(dtype, k * step) + i)?;
            if is_root {
                piece.copy_from_slice(&buf.as_slice()[..piece.len()]);
            }
        }
        found.result()
    }

    /// `output` gets block `rank` of the reduction of every member's `input`
    /// (`world_size` blocks as long as `output`).
    pub fn reduce_scatter(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        op: ReduceOp,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, output.len())?;
        let world = dev.world_size() as usize;
        let n = output.len();
        if Some(input.len()) != n.checked_mul(world) {
            return Err(Error::InvalidArgument(format!(
                "reduce-scatter input has {} bytes, {n} x {world} needed",
                input.len()
            )));
        }
        let rank = dev.rank() as usize;
        // Each request carries the same slice of every block: `world` slots
        // of `k` bytes, the result landing in slot `rank` (in place).
        let piece_max = (self.chunk_bytes / world / dtype.size()).max(1) * dtype.size();
        let mut found = NonFinite::default();
        let mut off = 0;
        while off < n {
            let k = piece_max.min(n - off);
            let buf = self.buffer(dev, k * world)?;
            for j in 0..world {
                let src = j * n + off;
                buf.as_mut_slice()[j * k..(j + 1) * k].copy_from_slice(&input[src..src + k]);
            }
            let done = dev.reduce_scatter_in_place(dtype, op, buf, count(dtype, k));
            // Element `i` of the request is element `i % kc` of slot
            // `i / kc`, which holds block `j`'s elements from `off`.
            let (kc, nc, offc) = (count(dtype, k), count(dtype, n), count(dtype, off));
            found.take(done, |i| i / kc * nc + offc + i % kc)?;
            output[off..off + k].copy_from_slice(&buf.as_slice()[rank * k..(rank + 1) * k]);
            off += k;
        }
        found.result()
    }

    /// `output` (`world_size` times as long as `input`) gets every member's
    /// `input` in rank order.
    pub fn allgather(
        &mut self,
        dev: &Device,
        dtype: Dtype,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        whole_elements(dtype, input.len())?;
        let world = dev.world_size() as usize;
        if Some(output.len()) != input.len().checked_mul(world) {
            return Err(Error::InvalidArgument(format!(
                "allgather output has {} bytes, {} x {world} needed",
                output.len(),
                input.len()
            )));
        }
        let rank = dev.rank() as usize;
        let size = dtype.size();
        // Each piece takes `world` slots of `n` bytes in the buffer.
        let piece_max = (self.chunk_bytes / world / size).max(1) * size;
        let mut off = 0;
        while off < input.len() {
            let n = piece_max.min(input.len() - off);
            let buf = self.buffer(dev, n * world)?;
            buf.as_mut_slice()[rank * n..(rank + 1) * n].copy_from_slice(&input[off..off + n]);
            dev.allgather_in_place(dtype, buf, count(dtype, n))?;
            for j in 0..world {
                let dst = j * input.len() + off;
                output[dst..dst + n].copy_from_slice(&buf.as_slice()[j * n..(j + 1) * n]);
            }
            off += n;
        }
        Ok(())
    }
}

impl Bounce {
    /// Sends `input` to rank `to` and receives `output` from rank `from` of
    /// the group, both posted before either is waited for, so that a ring
    /// shift cannot deadlock. A message over `max_bytes` goes as pieces of
    /// `max_bytes` (spec 5.X.6.13.4, DRV-COMM-2: where every driver cuts,
    /// [`Device::message_pieces`], not at the chunk size), each one
    /// message with tag 0, so the buffer grows to a piece each way; the
    /// message must fill its piece of `output` exactly: both ends of a
    /// pair pass the same length.
    pub fn sendrecv(
        &mut self,
        dev: &Device,
        to: u32,
        input: &[u8],
        from: u32,
        output: &mut [u8],
    ) -> Result<()> {
        // Where Device::send and Device::recv cut; an empty message is
        // no request here (both ends pass the same length).
        let cut = |bytes: usize| -> Vec<Range<usize>> {
            match bytes {
                0 => Vec::new(),
                n => dev.message_pieces(Dtype::U8, n).collect(),
            }
        };
        let (sends, recvs) = (cut(input.len()), cut(output.len()));
        let end = output.len();
        for k in 0..sends.len().max(recvs.len()) {
            let src = sends.get(k).map_or(&[][..], |p| &input[p.clone()]);
            let dst = recvs.get(k).cloned().unwrap_or(end..end);
            let dst_len = dst.len();
            let buf = self.buffer(dev, src.len() + dst_len)?;
            buf.as_mut_slice()[..src.len()].copy_from_slice(src);
            let message = |opcode, peer, bytes: usize| CommRequest {
                peer,
                ..CommRequest::new(opcode, Dtype::U8, 0, bytes as u64)
            };
            // The receive first: its sender may be waiting for it.
            let recv = (k < recvs.len())
                .then(|| {
                    let req = message(CommOpcode::Recv, from, dst_len);
                    dev.submit_comm(0, &req, &[], &[buf.slice(src.len(), dst_len)])
                })
                .transpose()?;
            let sent = (k < sends.len()).then(|| {
                let req = message(CommOpcode::Send, to, src.len());
                dev.submit_comm(0, &req, &[buf.slice(0, src.len())], &[])
            });
            // Both waited for whatever happened to the other, so that no
            // request outlives the call; the receive's error comes first.
            let received = recv.map(|h| dev.wait(h, None));
            let sent = sent.map(|h| h.and_then(|h| dev.wait(h, None)));
            if let Some(r) = received {
                let got = r?.reply.length;
                if got != dst_len as u64 {
                    return Err(Error::InvalidArgument(format!(
                        "rank {from} sent a piece of {got} bytes where {dst_len} were expected \
                         (both ends of a send/receive pair must pass the same length)"
                    )));
                }
            }
            sent.transpose()?;
            output[dst].copy_from_slice(&buf.as_slice()[src.len()..src.len() + dst_len]);
        }
        Ok(())
    }

    /// Block `j` of `input` goes to member `j`, block `j` of `output`
    /// comes from member `j` (`world_size` equal blocks; `input` and
    /// `output` the same length).
    pub fn alltoall(&mut self, dev: &Device, input: &[u8], output: &mut [u8]) -> Result<()> {
        let world = dev.world_size() as usize;
        if input.len() != output.len() || !input.len().is_multiple_of(world) {
            return Err(Error::InvalidArgument(format!(
                "all-to-all of {} bytes into {}: both must be the same multiple of {world} blocks",
                input.len(),
                output.len()
            )));
        }
        let n = input.len() / world;
        // Each request carries the same slice of every block: `world`
        // slots of `k` bytes in, as many out.
        let piece_max = (self.chunk_bytes / world).max(1);
        let mut off = 0;
        while off < n {
            let k = piece_max.min(n - off);
            let buf = self.buffer(dev, 2 * k * world)?;
            for j in 0..world {
                let src = j * n + off;
                buf.as_mut_slice()[j * k..(j + 1) * k].copy_from_slice(&input[src..src + k]);
            }
            let req = CommRequest::new(CommOpcode::Alltoall, Dtype::U8, 0, k as u64);
            let (ins, outs) = (buf.slice(0, k * world), buf.slice(k * world, k * world));
            dev.comm_call(0, &req, &[ins], &[outs], None)?;
            let got = &buf.as_slice()[k * world..];
            for j in 0..world {
                let dst = j * n + off;
                output[dst..dst + k].copy_from_slice(&got[j * k..(j + 1) * k]);
            }
            off += k;
        }
        Ok(())
    }
}

/// The lowest non-finite input of a collective cut into requests (spec
/// 5.X.6.14): each request's [`Error::NonFinite`] is kept, its index moved
/// into the caller's whole input, and the pieces go on, so that every
/// member runs every piece and the caller's output is whole; the lowest
/// rank, then the lowest index, is reported once all have run.
#[derive(Default)]
struct NonFinite(Option<(u32, u64)>);

impl NonFinite {
    /// Takes one piece's outcome; `whole` maps its element index to the
    /// caller's input. Any other error ends the collective.
    fn take<T>(&mut self, done: Result<T>, whole: impl Fn(u64) -> u64) -> Result<()> {
        match done {
            Ok(_) => Ok(()),
            Err(Error::NonFinite { rank, index }) => {
                let new = (rank, whole(index));
                if self.0.is_none_or(|f| new < f) {
                    self.0 = Some(new);
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn result(self) -> Result<()> {
        match self.0 {
            Some((rank, index)) => Err(Error::NonFinite { rank, index }),
            None => Ok(()),
        }
    }
}

fn whole_elements(dtype: Dtype, bytes: usize) -> Result<()> {
    if bytes.is_multiple_of(dtype.size()) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{bytes} bytes are not whole {dtype} elements"
        )))
    }
}

fn count(dtype: Dtype, bytes: usize) -> u64 {
    (bytes / dtype.size()) as u64
}
