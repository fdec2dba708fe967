//! Home crate of the system tests (see `tests/vm/README.md`).
//!
//! The VM harness is `harness.rs`, included by each test with `#[path]` so
//! that tests stay plain files; this library exposes it too, for tools that
//! want to boot VMs the same way.

#[path = "harness.rs"]
pub mod harness;
