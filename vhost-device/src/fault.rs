//! Fault injection for tests: a plan of faults the group engine makes
//! happen on purpose, so that tests can check what members observe when
//! the device itself goes wrong.
//!
//! The plan comes from the environment variable [`FAULTS_ENV`]
//! (`DMLC_TEST_FAULTS`), read once by the daemon at start
//! ([`faults_from_env`]); without it there is no fault, and the engine's
//! only cost is one relaxed atomic load per collective that moves data.
//!
//! Syntax: comma-separated items (spaces around items are ignored):
//!
//! - `panic-reduce:N`: the data movement of the N-th collective that moves
//!   data (0-based, counting every such collective the group runs since
//!   the daemon started, in the order they start) panics inside one of its
//!   parts, as a bug in a reduction kernel would.
//! - `skip-write:R:N`: the N-th collective that moves data completes with
//!   OK for every member, but rank R's output buffers are left unwritten
//!   (the device "forgets" one write).
//! - `drop-input:R:N`: from the N-th collective that moves data on, every
//!   reduction leaves out rank R's input and completes with OK: every
//!   member gets the same wrong result (with R = 1 of 2, rank 0's input),
//!   which ranks comparing their results with each other cannot see.
//!   Copies (broadcast, allgather) are left alone.
//!
//! Collectives that move no data (barriers, zero counts, mismatches) are
//! not counted.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The environment variable that holds the fault plan.
pub const FAULTS_ENV: &str = "DMLC_TEST_FAULTS";

/// One planned fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The data movement of collective `nth` panics.
    PanicReduce { nth: u64 },
    /// Collective `nth` leaves rank `rank`'s outputs unwritten.
    SkipWrite { rank: u32, nth: u64 },
    /// Reductions of collective `from` and every later one leave out rank
    /// `rank`'s input.
    DropInput { rank: u32, from: u64 },
}

impl Fault {
    /// The last collective number the fault fires on (`u64::MAX`: every
    /// one from its first).
    fn last(self) -> u64 {
        match self {
            Fault::PanicReduce { nth } | Fault::SkipWrite { nth, .. } => nth,
            Fault::DropInput { .. } => u64::MAX,
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::PanicReduce { nth } => write!(f, "panic-reduce:{nth}"),
            Fault::SkipWrite { rank, nth } => write!(f, "skip-write:{rank}:{nth}"),
            Fault::DropInput { rank, from } => write!(f, "drop-input:{rank}:{from}"),
        }
    }
}

/// A fault plan (default: no fault).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    items: Vec<Fault>,
}

/// Why a fault plan does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FaultSpecError {
    #[error(
        "{FAULTS_ENV}: empty item in {spec:?}; expected comma-separated \
         panic-reduce:N, skip-write:RANK:N or drop-input:RANK:N"
    )]
    EmptyItem { spec: String },
    #[error(
        "{FAULTS_ENV}: unknown fault {name:?} in {item:?}; the faults are \
         panic-reduce:N, skip-write:RANK:N and drop-input:RANK:N"
    )]
    UnknownFault { item: String, name: String },
    #[error("{FAULTS_ENV}: {item:?} takes {want}, separated by ':'")]
    Arity { item: String, want: &'static str },
    #[error("{FAULTS_ENV}: {field} {value:?} in {item:?} is not a non-negative integer")]
    Number {
        item: String,
        field: &'static str,
        value: String,
    },
    #[error("{FAULTS_ENV} is not valid UTF-8")]
    NotUnicode,
}

impl Faults {
    /// No fault.
    pub fn none() -> Faults {
        Faults::default()
    }

    /// A plan of the given faults.
    pub fn of(items: &[Fault]) -> Faults {
        Faults {
            items: items.to_vec(),
        }
    }

    /// True if nothing is planned.
    pub fn is_none(&self) -> bool {
        self.items.is_empty()
    }

    /// The planned faults, in the order given.
    pub fn items(&self) -> &[Fault] {
        &self.items
    }

    /// Parses a plan (see the module documentation); an empty or
    /// all-blank string is no fault.
    pub fn parse(spec: &str) -> Result<Faults, FaultSpecError> {
        if spec.trim().is_empty() {
            return Ok(Faults::none());
        }
        let items = spec
            .split(',')
            .map(|item| parse_item(spec, item.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Faults { items })
    }
}

impl std::str::FromStr for Faults {
    type Err = FaultSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Faults::parse(s)
    }
}

fn parse_item(spec: &str, item: &str) -> Result<Fault, FaultSpecError> {
    if item.is_empty() {
        return Err(FaultSpecError::EmptyItem { spec: spec.into() });
    }
    let fields: Vec<&str> = item.split(':').collect();
    let number = |field: &'static str, value: &str| {
        value.parse::<u64>().map_err(|_| FaultSpecError::Number {
            item: item.into(),
            field,
            value: value.into(),
        })
    };
    match fields[0] {
        "panic-reduce" => match fields[1..] {
            [n] => Ok(Fault::PanicReduce {
                nth: number("N", n)?,
            }),
            _ => Err(FaultSpecError::Arity {
                item: item.into(),
                want: "one number (panic-reduce:N)",
            }),
        },
        "skip-write" | "drop-input" => match fields[1..] {
            [r, n] => {
                let rank = number("RANK", r)?;
                let rank = u32::try_from(rank).map_err(|_| FaultSpecError::Number {
                    item: item.into(),
                    field: "RANK",
                    value: r.into(),
                })?;
                let nth = number("N", n)?;
                Ok(if fields[0] == "skip-write" {
                    Fault::SkipWrite { rank, nth }
                } else {
                    Fault::DropInput { rank, from: nth }
                })
            }
            _ => Err(FaultSpecError::Arity {
                item: item.into(),
                want: if fields[0] == "skip-write" {
                    "a rank and a number (skip-write:RANK:N)"
                } else {
                    "a rank and a number (drop-input:RANK:N)"
                },
            }),
        },
        name => Err(FaultSpecError::UnknownFault {
            item: item.into(),
            name: name.into(),
        }),
    }
}

/// The plan in [`FAULTS_ENV`]; no fault if the variable is unset or empty.
/// The daemon calls this once at start and puts the plan in
/// [`crate::group::GroupConfig::faults`].
pub fn faults_from_env() -> Result<Faults, FaultSpecError> {
    faults_from_value(std::env::var_os(FAULTS_ENV))
}

/// The plan in a value of [`FAULTS_ENV`] (`None`: unset).
fn faults_from_value(value: Option<std::ffi::OsString>) -> Result<Faults, FaultSpecError> {
    match value {
        None => Ok(Faults::none()),
        Some(v) => Faults::parse(v.to_str().ok_or(FaultSpecError::NotUnicode)?),
    }
}

/// What the engine must do to one collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fired {
    /// Panic inside the data movement.
    pub panic: bool,
    /// Leave this rank's outputs unwritten.
    pub skip_write: Option<u32>,
    /// Leave this rank's input out of every reduction.
    pub drop_input: Option<u32>,
}

/// A plan being carried out: counts the collectives that move data while
/// some fault is still to come.
#[derive(Debug)]
pub(crate) struct FaultState {
    plan: Faults,
    /// False once no planned fault is left (or none was planned).
    armed: AtomicBool,
    /// Data-moving collectives started so far (counted while armed).
    started: AtomicU64,
    /// The largest collective number a planned fault fires on.
    last: u64,
}

impl FaultState {
    pub fn new(plan: Faults) -> FaultState {
        let last = plan.items.iter().map(|f| f.last()).max().unwrap_or(0);
        FaultState {
            armed: AtomicBool::new(!plan.is_none()),
            started: AtomicU64::new(0),
            last,
            plan,
        }
    }

    /// Called once per collective that moves data, as it starts: what to
    /// do to it. One relaxed load when nothing is planned.
    #[inline]
    pub fn next(&self) -> Option<(u64, Fired)> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        self.next_slow()
    }

    #[cold]
    #[inline(never)]
    fn next_slow(&self) -> Option<(u64, Fired)> {
        let nth = self.started.fetch_add(1, Ordering::Relaxed);
        if nth >= self.last {
            self.armed.store(false, Ordering::Relaxed);
        }
        let mut fired = Fired::default();
        for f in &self.plan.items {
            match *f {
                Fault::PanicReduce { nth: n } if n == nth => fired.panic = true,
                Fault::SkipWrite { rank, nth: n } if n == nth => fired.skip_write = Some(rank),
                Fault::DropInput { rank, from } if nth >= from => fired.drop_input = Some(rank),
                _ => {}
            }
        }
        (fired != Fired::default()).then_some((nth, fired))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse() {
        assert_eq!(Faults::parse(""), Ok(Faults::none()));
        assert_eq!(Faults::parse("  "), Ok(Faults::none()));
        assert_eq!(
            Faults::parse("panic-reduce:3"),
            Ok(Faults::of(&[Fault::PanicReduce { nth: 3 }]))
        );
        assert_eq!(
            "skip-write:1:0, panic-reduce:0 ,skip-write:4294967295:18446744073709551615"
                .parse::<Faults>(),
            Ok(Faults::of(&[
                Fault::SkipWrite { rank: 1, nth: 0 },
                Fault::PanicReduce { nth: 0 },
                Fault::SkipWrite {
                    rank: u32::MAX,
                    nth: u64::MAX
                },
            ]))
        );
        assert_eq!(
            Faults::parse("drop-input:1:3"),
            Ok(Faults::of(&[Fault::DropInput { rank: 1, from: 3 }]))
        );
        assert_eq!(
            Faults::parse("drop-input:1:3").unwrap().items()[0].to_string(),
            "drop-input:1:3"
        );
        let f = Faults::parse("skip-write:2:7").unwrap();
        assert_eq!(f.items()[0].to_string(), "skip-write:2:7");
        assert!(!f.is_none());
    }

    #[test]
    fn malformed_plans_are_refused_with_the_item_named() {
        let cases: [(&str, &str); 11] = [
            ("panic-reduce", "takes one number"),
            ("panic-reduce:1:2", "takes one number"),
            ("panic-reduce:-1", "N \"-1\" in \"panic-reduce:-1\""),
            ("panic-reduce:x", "is not a non-negative integer"),
            ("skip-write:1", "takes a rank and a number"),
            ("skip-write:4294967296:1", "RANK \"4294967296\""),
            ("skip-write:a:1", "RANK \"a\""),
            (
                "drop-input:1",
                "takes a rank and a number (drop-input:RANK:N)",
            ),
            ("panic-reduce:1,,skip-write:0:1", "empty item"),
            ("panic-reduce:1,", "empty item"),
            ("explode:3", "unknown fault \"explode\""),
        ];
        for (spec, want) in cases {
            let e = Faults::parse(spec).expect_err(spec).to_string();
            assert!(e.contains(want), "{spec}: {e}");
            assert!(e.starts_with(FAULTS_ENV), "{spec}: {e}");
        }
    }

    #[test]
    fn a_dropped_input_fires_on_every_collective_from_its_first() {
        let s = FaultState::new(Faults::parse("drop-input:1:2,panic-reduce:3").unwrap());
        let fired: Vec<Option<(u64, Fired)>> = (0..6).map(|_| s.next()).collect();
        assert_eq!(fired[..2], [None, None]);
        for (nth, f) in fired.iter().enumerate().skip(2) {
            let want = Fired {
                panic: nth == 3,
                skip_write: None,
                drop_input: Some(1),
            };
            assert_eq!(*f, Some((nth as u64, want)), "collective {nth}");
        }
    }

    #[test]
    fn faults_fire_once_at_their_collective_then_disarm() {
        let s =
            FaultState::new(Faults::parse("skip-write:1:2,panic-reduce:2,panic-reduce:4").unwrap());
        let fired: Vec<Option<(u64, Fired)>> = (0..7).map(|_| s.next()).collect();
        assert_eq!(fired[0], None);
        assert_eq!(fired[1], None);
        assert_eq!(
            fired[2],
            Some((
                2,
                Fired {
                    panic: true,
                    skip_write: Some(1),
                    drop_input: None,
                }
            ))
        );
        assert_eq!(fired[3], None);
        assert_eq!(
            fired[4],
            Some((
                4,
                Fired {
                    panic: true,
                    skip_write: None,
                    drop_input: None,
                }
            ))
        );
        assert!(!s.armed.load(Ordering::Relaxed));
        // Once disarmed, collectives are no longer counted.
        assert_eq!(s.started.load(Ordering::Relaxed), 5);
        let none = FaultState::new(Faults::none());
        assert_eq!(none.next(), None);
        assert_eq!(none.started.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_environment_value_carries_the_plan() {
        use std::os::unix::ffi::OsStringExt;
        let of = |s: &str| faults_from_value(Some(s.into()));
        assert_eq!(
            of("panic-reduce:5"),
            Ok(Faults::of(&[Fault::PanicReduce { nth: 5 }]))
        );
        assert!(matches!(
            of("panic-reduce:five"),
            Err(FaultSpecError::Number { .. })
        ));
        assert_eq!(of(""), Ok(Faults::none()));
        assert_eq!(faults_from_value(None), Ok(Faults::none()));
        let not_utf8 = std::ffi::OsString::from_vec(vec![b'p', 0xff]);
        assert_eq!(
            faults_from_value(Some(not_utf8)),
            Err(FaultSpecError::NotUnicode)
        );
    }
}
