//! Userspace driver and collective API for the virtio-dmlc allreduce device.
//!
//! The driver core is small separate pieces shared by every transport:
//! [`dma`] (device-visible memory), [`transport`] (how the device is
//! reached), [`virtqueue`] (split ring, driver side). [`host`] is the host
//! transport: this process plays the VM over vhost-user. [`device`] is the
//! collective API on top; its types are re-exported here.
//!
//! ```no_run
//! use dmlc_guest::{Device, OpenOptions, ReduceOp};
//! let dev = Device::open_host("/tmp/dmlc.sock0".as_ref(), &OpenOptions::default())?;
//! let mut grads = vec![1.0f32; 1024];
//! dev.allreduce_slice(ReduceOp::Sum, &mut grads)?;
//! # Ok::<(), dmlc_guest::Error>(())
//! ```

pub mod device;
pub mod dma;
pub mod error;
pub mod ffi;
pub mod ffi_rabit;
mod ffi_util;
pub mod host;
pub mod transport;
pub mod virtqueue;

pub use device::{BufSlice, Device, DmaBuf, Done, Element, Handle, OpenOptions, RawDesc, Request};
pub use error::{Error, Result};
pub use virtio_dmlc::{Dtype, Opcode, ReduceOp};
pub mod comm;
pub mod hugepage;
pub mod pci;
pub mod rabit;
pub mod tcp;
