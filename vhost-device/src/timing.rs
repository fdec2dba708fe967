//! Timing model and impairments: when a collective completes, and what is
//! injected into it on purpose.
//!
//! Without a timing file (`--timing`), none of this runs: collectives
//! complete as soon as their data has moved. With one, the group engine
//! ([`crate::group`]) asks [`Timing`] three things under its state lock:
//!
//! - how long each member's arrival is held back ([`Timing::delay`]):
//!   an injected straggler. The member's arrival counts at `arrival +
//!   delay` (its *effective* arrival); its data is there already, so
//!   nothing waits on the data path;
//! - how long the collective takes on the modelled cluster
//!   ([`Model::time`]). It completes at `max(last effective arrival, end
//!   of the previous collective on the same queue) + modelled time`, but
//!   never before its data has moved (then it is counted as late: the
//!   host was too slow to honour the model);
//! - whether it fails on purpose ([`Timing::failure`]).
//!
//! The formulas of every model, per opcode, are in docs/latency-experiments.md,
//! and the file format in the same place. Random draws are made from a
//! counter-based generator (SplitMix64 over the seed, the rank, the queue,
//! the arrival's number and the rule), so a run with the same seed and the
//! same requests gets the same delays whatever the threads' timing.
//!
//! The module's files, one concern each: `schema` (the file as written,
//! how it is read and checked, and the errors), `formulas` (how long a
//! collective takes on the model), `impairments` (the checked
//! configuration and what it injects: delays, bandwidth, failures, the
//! random draws), and `tests`.

mod formulas;
mod impairments;
mod schema;
#[cfg(test)]
mod tests;

pub use formulas::{Algo, Model};
pub use impairments::{
    BandwidthRule, DelayRule, Dist, FailRule, Slowdown, Timing, Window, WithholdRule,
};
pub use schema::{BandwidthSpec, DelaySpec, FailSpec, ModelSpec, TimingError, TimingFile};
