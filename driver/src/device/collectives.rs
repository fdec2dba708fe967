//! The blocking collectives: on [`DmaBuf`]s on queue 0 ([`Device::run`]
//! and allreduce, broadcast, reduce, allgather, reduce-scatter, each out of
//! place and in place; barrier; nop), and on ordinary slices through the
//! bounce buffer; the helpers that build their requests and chains.

use virtio_dmlc::bad;

use crate::bounce::Bounce;
use crate::error::{Error, Result};

use super::buffer::{bytes_of, bytes_of_mut, le_in_place};
use super::{BufSlice, Device, DmaBuf, Done, Dtype, Element, Opcode, RawDesc, ReduceOp, Request};

impl Device {
    // Blocking conveniences on DmaBufs (queue 0). Each takes the first
    // bytes of each buffer that the request needs.

    /// Runs one collective on queue 0 and waits for it.
    pub fn run(
        &self,
        req: &Request,
        input: Option<&DmaBuf>,
        output: Option<&DmaBuf>,
    ) -> Result<Done> {
        let elems = self.buffer_elems(req)?;
        let size = if !req.opcode.moves_data() {
            1
        } else {
            req.dtype.size() as u64
        };
        let take = |buf: Option<&DmaBuf>, n: u64, what: &str| -> Result<Vec<BufSlice>> {
            if n == 0 {
                return Ok(Vec::new());
            }
            let bytes = n
                .checked_mul(size)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| Error::bad_request(bad::OVERFLOW))?;
            match buf {
                Some(b) if b.len() >= bytes => Ok(vec![b.slice(0, bytes)]),
                Some(b) => Err(Error::InvalidArgument(format!(
                    "{what} buffer has {} bytes, the request needs {bytes}",
                    b.len()
                ))),
                None => Err(Error::InvalidArgument(format!(
                    "{what} buffer missing, the request needs {bytes} bytes"
                ))),
            }
        };
        let input = take(input, elems.input, "input")?;
        let output = take(output, elems.output, "output")?;
        self.call(0, req, &input, &output, None)
    }

    /// Every member's `output` gets the reduction of all `input`s.
    pub fn allreduce(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::Allreduce, dtype, op, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Allreduce with `buf` as input and output.
    pub fn allreduce_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(Request::new(Opcode::Allreduce, dtype, op, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Every member's `output` gets the root's `input` (read on the root only).
    pub fn broadcast(
        &self,
        dtype: Dtype,
        root: u32,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = rooted(
            Request::new(Opcode::Broadcast, dtype, ReduceOp::Sum, count),
            root,
        );
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Broadcast of the root's `buf` into every member's `buf`.
    pub fn broadcast_in_place(
        &self,
        dtype: Dtype,
        root: u32,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(rooted(
            Request::new(Opcode::Broadcast, dtype, ReduceOp::Sum, count),
            root,
        ));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// The root's `output` gets the reduction (written on the root only).
    pub fn reduce(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        root: u32,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = rooted(Request::new(Opcode::Reduce, dtype, op, count), root);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Reduce in place: every member's `buf` is its input, the root's gets
    /// the result, the others' stay unchanged.
    pub fn reduce_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        root: u32,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(rooted(Request::new(Opcode::Reduce, dtype, op, count), root));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// `output` (`world_size * count` elements) gets every member's `input`
    /// in rank order.
    pub fn allgather(
        &self,
        dtype: Dtype,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::Allgather, dtype, ReduceOp::Sum, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Allgather in place: this member's block of `buf` (at `rank * count`)
    /// is its input.
    pub fn allgather_in_place(&self, dtype: Dtype, buf: &DmaBuf, count: u64) -> Result<()> {
        let req = in_place(Request::new(Opcode::Allgather, dtype, ReduceOp::Sum, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Member r's `output` (`count` elements) gets block r of the reduction
    /// of all `input`s (`world_size * count` elements each).
    pub fn reduce_scatter(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::ReduceScatter, dtype, op, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Reduce-scatter in place on `buf` (`world_size * count` elements);
    /// see `Opcode::ReduceScatter` for where the result lands.
    pub fn reduce_scatter_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(Request::new(Opcode::ReduceScatter, dtype, op, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Returns once every member has arrived.
    pub fn barrier(&self) -> Result<()> {
        let req = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
        self.run(&req, None, None).map(drop)
    }

    /// The device's own round trip: a request it answers at once for this
    /// member alone, whatever the other members do.
    pub fn nop(&self) -> Result<()> {
        let req = Request::new(Opcode::Nop, Dtype::U8, ReduceOp::Sum, 0);
        self.run(&req, None, None).map(drop)
    }

    // Conveniences on ordinary slices, through a bounce buffer.

    /// Runs `f` on the device's bounce buffer, or on a fresh one if
    /// another thread is using it.
    fn with_bounce<R>(&self, f: impl FnOnce(&mut Bounce) -> Result<R>) -> Result<R> {
        match self.bounce.try_lock() {
            Ok(mut cached) => f(cached.get_or_insert_with(|| Bounce::new(self))),
            Err(_) => f(&mut Bounce::new(self)),
        }
    }

    /// Allreduce of `data` in place.
    pub fn allreduce_slice<T: Element>(&self, op: ReduceOp, data: &mut [T]) -> Result<()> {
        // The device reduces little-endian elements (spec 5.X.6.5.1); a
        // no-op on a little-endian CPU.
        le_in_place(data);
        let r = self.with_bounce(|b| b.allreduce_in_place(self, T::DTYPE, op, bytes_of_mut(data)));
        le_in_place(data);
        r
    }

    /// Broadcast of the root's `data` into every member's `data`.
    pub fn broadcast_slice<T: Element>(&self, root: u32, data: &mut [T]) -> Result<()> {
        self.with_bounce(|b| b.broadcast(self, T::DTYPE, root, bytes_of_mut(data)))
    }

    /// `output` (`world_size` times as long as `input`) gets every
    /// member's `input` in rank order.
    pub fn allgather_slice<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.with_bounce(|b| b.allgather(self, T::DTYPE, bytes_of(input), bytes_of_mut(output)))
    }
}

fn in_place(mut req: Request) -> Request {
    req.in_place = true;
    req
}

fn rooted(mut req: Request, root: u32) -> Request {
    req.root = root;
    req
}

pub(super) fn standard_chain(input: &[BufSlice], output: &[BufSlice]) -> Vec<RawDesc> {
    let mut chain = Vec::with_capacity(input.len() + output.len() + 2);
    chain.push(RawDesc::Header);
    chain.extend(input.iter().cloned().map(RawDesc::Read));
    chain.extend(output.iter().cloned().map(RawDesc::Write));
    chain.push(RawDesc::Response);
    chain
}
