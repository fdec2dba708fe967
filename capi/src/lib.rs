//! C ABI of the virtio-dmlc guest driver: `libdmlc_guest.so` and `.a`.
//!
//! [`ffi`] is the device API of `include/dmlc_guest.h` (open, DMA buffers,
//! collectives, asynchronous requests); [`ffi_rabit`] is the rabit-style
//! API of `include/dmlc_rabit.h` over `dmlc_comm::rabit`. Both share the
//! error and panic plumbing of `ffi_util`. The Rust APIs they wrap live in
//! `dmlc-driver` and `dmlc-comm`.

pub mod ffi;
pub mod ffi_rabit;
mod ffi_util;
