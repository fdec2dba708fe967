//! Userspace driver core of the virtio-dmlc allreduce device.
//!
//! The core knows no transport: [`dma`] (device-visible memory),
//! [`transport`] (the [`transport::Transport`] trait: how the device is
//! reached), [`virtqueue`] (split ring, driver side) and [`device`] (the
//! [`Device`]: requests, waits, noticing resets and losses); [`bounce`] copies ordinary
//! memory through DMA memory for collectives on it. Transports plug in from their
//! own modules, each behind a feature: [`host`] (vhost-user: this process
//! plays the VM) and [`pci`] (from inside a guest, with [`hugepage`] DMA
//! memory); [`kernel`] (from inside a guest, through the `virtio_dmlc`
//! module's /dev/dmlcN: no root, no hugepages) needs no feature. Collectives over a [`Device`] or TCP live in `dmlc-comm`.
//!
//! ```no_run
//! use dmlc_driver::{host, OpenOptions, ReduceOp};
//! let dev = host::open("/tmp/dmlc.sock0".as_ref(), &OpenOptions::default())?;
//! let mut grads = vec![1.0f32; 1024];
//! dev.allreduce_slice(ReduceOp::Sum, &mut grads)?;
//! # Ok::<(), dmlc_driver::Error>(())
//! ```

pub mod bounce;
pub mod device;
pub mod dma;
pub mod error;
pub mod kernel;
pub mod transport;
pub mod virtqueue;

#[cfg(feature = "host")]
pub mod host;
#[cfg(feature = "pci")]
pub mod hugepage;
#[cfg(feature = "pci")]
pub mod pci;

pub use device::{
    counts_table, le_in_place, BufSlice, CommInfo, CommRequest, Device, DmaBuf, Done, Element,
    Handle, OpenOptions, RawDesc, Received, Reply, Request,
};
pub use error::{Error, Result};
pub use virtio_dmlc::{Dtype, Opcode, ReduceOp};
