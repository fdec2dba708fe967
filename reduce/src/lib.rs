//! The reduction arithmetic of virtio-dmlc: every element-wise reduction in
//! the project, the backend's over guest memory and the communicators' over
//! host buffers, is computed here.
//!
//! - [`Kernel`] and [`Scratch`]: the SIMD kernels over raw memory (chosen
//!   for the CPU at run time, see [`Isa`]) and the per-thread accumulator
//!   they fold into, one chunk of [`CHUNK_BYTES`] at a time, in the passes
//!   of [`groups`]; the backend's data path drives them over
//!   scatter-gather lists.
//! - [`reduce_into`] and [`reduce_in_place`]: the same kernels driven the
//!   same way over safe host buffers, for the TCP and self communicators,
//!   so that their results equal the device's bit for bit.
//! - [`Stores`] and [`fence`]: how results are written out, ordinary or
//!   non-temporal (streaming) stores, from [`STREAM_FROM`] output bytes
//!   on ([`Kernel::write`], and [`Kernel::through`], the last pass of a
//!   reduction, which writes its results straight to the outputs).
//! - `reference` (with the `reference` feature, and in this crate's
//!   tests): the independent scalar reduction all of them are tested
//!   against.
//!
//! # Semantics
//!
//! As docs/spec.md defines them: integer sum and prod wrap; avg is the sum
//! divided by the world size (integers: wrapping sum, then division
//! truncating toward zero; floats: division in the accumulator type); f16 and
//! bf16 accumulate in f32 and round to nearest-even once, at the end; float
//! min and max give the first NaN in rank order (quieted) if any input is
//! NaN, and between equal values (such as -0 and +0) keep the lower rank's.
//!
//! NaN results are always quiet, for every float dtype, op and world size:
//! min and max (which select an input) and a lone input (a world of one)
//! set the quiet bit themselves; sum, prod and avg get a quiet NaN from the
//! IEEE 754 arithmetic of the CPU (x86-64 SSE/AVX, AArch64), which quiets
//! a signalling NaN operand; the narrowing to f16 and bf16 quiets too. The
//! tests check every path on the CPU they run on.
//!
//! Each chunk is read from every input before any of its result is
//! written, so an output may be the very memory of an input (in place).

mod host;
mod kernel;
#[cfg(any(test, feature = "reference"))]
pub mod reference;
mod scratch;
mod store;

pub use host::{reduce_in_place, reduce_into, ReduceError};
pub use kernel::{groups, lowest, Isa, Kernel, NonFinite, CHUNK_BYTES, MAX_GROUP};
pub use scratch::Scratch;
pub use store::{fence, Stores, STREAM_CHUNK_BYTES, STREAM_FROM};
