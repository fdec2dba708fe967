//! Collectives through the virtio-dmlc device.

use std::sync::Arc;

use dmlc_driver::bounce::Bounce;
use dmlc_driver::{Device, Dtype, ReduceOp};

use crate::{
    check_allgather, check_allreduce, check_alltoall, check_reduce_scatter, check_root,
    check_sendrecv, Communicator, Result,
};

/// Largest piece one request carries by default.
pub use dmlc_driver::bounce::DEFAULT_CHUNK_BYTES as DEVICE_CHUNK_BYTES;

/// Collectives through the virtio-dmlc device, on ordinary memory copied
/// through a bounce buffer in device-visible memory.
///
/// The bounce buffer is allocated at first use and grown as needed (up to
/// the chunk size), then kept, so repeated collectives cost the copies and
/// the device's work only. Data larger than the chunk size (the smaller of
/// the device's `max_bytes` and [`DEVICE_CHUNK_BYTES`]) runs as several
/// requests; every member cuts at the same places because the chunk size
/// depends only on the group's config.
///
/// The bounce buffer lives in the device-visible memory of the [`Device`]
/// (`OpenOptions::dma_bytes`), which must have room for it: up to the chunk
/// size for allreduce and broadcast, `world_size` times the data (up to the
/// chunk size) for allgather and reduce-scatter, twice that for
/// all-to-all, and for sendrecv the message both ways (pieces of up to
/// the device's `max_bytes`, where the spec has every driver cut).
/// Zero-length collectives return at once without a request.
///
/// For zero copy, allocate buffers with `comm.device().alloc(..)` and call
/// the [`Device`] methods (e.g. [`Device::allreduce_in_place`]) directly.
pub struct DeviceComm {
    dev: Arc<Device>,
    bounce: Bounce,
}

impl DeviceComm {
    /// Wraps an open device (or a shared `Arc<Device>`).
    pub fn new(dev: impl Into<Arc<Device>>) -> Self {
        let dev = dev.into();
        let bounce = Bounce::new(&dev);
        DeviceComm { dev, bounce }
    }

    /// The device, for zero-copy collectives on [`DmaBuf`]s.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Largest piece per request (rounded down to a multiple of 8 bytes,
    /// at least 8). Must be the same on every member.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.bounce.set_chunk_bytes(bytes);
    }

    /// Largest piece per request.
    pub fn chunk_bytes(&self) -> usize {
        self.bounce.chunk_bytes()
    }
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("dev", &self.dev)
            .field("chunk_bytes", &self.bounce.chunk_bytes())
            .finish()
    }
}

impl Communicator for DeviceComm {
    fn rank(&self) -> u32 {
        self.dev.rank()
    }

    fn world_size(&self) -> u32 {
        self.dev.world_size()
    }

    fn transport(&self) -> &'static str {
        "device"
    }

    fn set_tag(&mut self, tag: u64) {
        self.dev.set_tag(tag);
    }

    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> Result<()> {
        check_allreduce(dtype, op, data.len())?;
        Ok(self.bounce.allreduce_in_place(&self.dev, dtype, op, data)?)
    }

    fn broadcast_raw(&mut self, root: u32, data: &mut [u8]) -> Result<()> {
        check_root(root, self.world_size())?;
        Ok(self.bounce.broadcast(&self.dev, Dtype::U8, root, data)?)
    }

    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_allgather(input.len(), output.len(), self.world_size())?;
        Ok(self.bounce.allgather(&self.dev, Dtype::U8, input, output)?)
    }

    fn barrier(&mut self) -> Result<()> {
        Ok(self.dev.barrier()?)
    }

    fn sendrecv_raw(&mut self, to: u32, input: &[u8], from: u32, output: &mut [u8]) -> Result<()> {
        check_sendrecv(to, from, self.rank(), self.world_size())?;
        Ok(self.bounce.sendrecv(&self.dev, to, input, from, output)?)
    }

    fn alltoall_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_alltoall(input.len(), output.len(), self.world_size())?;
        Ok(self.bounce.alltoall(&self.dev, input, output)?)
    }

    fn reduce_raw(&mut self, dtype: Dtype, op: ReduceOp, root: u32, data: &mut [u8]) -> Result<()> {
        check_allreduce(dtype, op, data.len())?;
        check_root(root, self.world_size())?;
        Ok(self.bounce.reduce(&self.dev, dtype, op, root, data)?)
    }

    fn reduce_scatter_raw(
        &mut self,
        dtype: Dtype,
        op: ReduceOp,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        check_allreduce(dtype, op, output.len())?;
        check_reduce_scatter(input.len(), output.len(), self.world_size())?;
        Ok(self
            .bounce
            .reduce_scatter(&self.dev, dtype, op, input, output)?)
    }
}
