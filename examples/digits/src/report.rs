//! The JSON summary of one rank's run (`--json FILE`), for the launcher's
//! device-versus-TCP comparison.
//!
//! ```json
//! {"rank":0,"world_size":2,"transport":"device",
//!  "settings":{"steps":100,"lr":1,"l2":0.0001,"batch":0,"seed":42},
//!  "train_samples":1500,"test_samples":297,
//!  "steps":[{"step":0,"loss":2.30,"compute_ms":1.2,"exchange_ms":0.05},...],
//!  "total_ms":310.5,"mean_compute_ms":1.1,"mean_exchange_ms":0.04,
//!  "median_compute_ms":1.0,"median_exchange_ms":0.03,
//!  "test_correct":280,"test_accuracy":0.9427,
//!  "identical_weights":{"pass":true,"fingerprint":"0x...","min":"0x...","max":"0x..."},
//!  "single_process":{"pass":true,"max_abs_diff":1.2e-7,"tolerance":0.0001},
//!  "pass":true}
//! ```
//! Numbers that are not finite are written as `null`.

use std::fmt::Write;

use crate::train::{Identical, Reference, Settings, StepStats};

/// Everything one rank reports.
#[derive(Clone, Debug)]
pub struct Report<'a> {
    pub rank: u32,
    pub world_size: u32,
    /// "device" or "tcp" (as the rabit init chose it).
    pub transport: &'a str,
    pub settings: &'a Settings,
    pub train_samples: usize,
    pub test_samples: usize,
    pub steps: &'a [StepStats],
    /// Wall time of the distributed training, milliseconds.
    pub total_ms: f64,
    /// Where the rank's time went.
    pub phases: Phases,
    pub test_correct: usize,
    pub identical: Identical,
    pub reference: &'a Reference,
}

/// A rank's time by phase, milliseconds: joining the job (for the device:
/// opening it and setting up DMA memory), loading the data, training,
/// and the checks after training.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    pub init_ms: f64,
    pub load_ms: f64,
    pub train_ms: f64,
    pub checks_ms: f64,
}

/// Mean of one per-step quantity (0 if there are no steps).
pub fn mean(steps: &[StepStats], f: impl Fn(&StepStats) -> f64) -> f64 {
    if steps.is_empty() {
        return 0.0;
    }
    steps.iter().map(f).sum::<f64>() / steps.len() as f64
}

/// Median of one per-step quantity (0 if there are no steps): on a busy
/// machine a few slow steps pull the mean far from the typical step.
pub fn median(steps: &[StepStats], f: impl Fn(&StepStats) -> f64) -> f64 {
    let mut v: Vec<f64> = steps.iter().map(f).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

impl Report<'_> {
    /// Test accuracy in [0, 1].
    pub fn accuracy(&self) -> f64 {
        if self.test_samples == 0 {
            return 0.0;
        }
        self.test_correct as f64 / self.test_samples as f64
    }

    /// Both checks passed.
    pub fn passed(&self) -> bool {
        self.identical.passed() && self.reference.passed()
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let s = self.settings;
        let mut o = String::new();
        // Writing to a String cannot fail.
        let _ = write!(
            o,
            "{{\"rank\":{},\"world_size\":{},\"transport\":{},",
            self.rank,
            self.world_size,
            string(self.transport)
        );
        let _ = write!(
            o,
            "\"settings\":{{\"steps\":{},\"lr\":{},\"l2\":{},\"batch\":{},\"seed\":{}}},",
            s.steps,
            number32(s.lr),
            number32(s.l2),
            s.batch,
            s.seed
        );
        let _ = write!(
            o,
            "\"train_samples\":{},\"test_samples\":{},\"steps\":[",
            self.train_samples, self.test_samples
        );
        for (i, st) in self.steps.iter().enumerate() {
            let _ = write!(
                o,
                "{}{{\"step\":{},\"loss\":{},\"compute_ms\":{},\"exchange_ms\":{}}}",
                if i == 0 { "" } else { "," },
                st.step,
                number(st.loss),
                number(st.compute_ms),
                number(st.exchange_ms)
            );
        }
        let _ = write!(
            o,
            "],\"total_ms\":{},\"mean_compute_ms\":{},\"mean_exchange_ms\":{},\"median_compute_ms\":{},\"median_exchange_ms\":{},",
            number(self.total_ms),
            number(mean(self.steps, |s| s.compute_ms)),
            number(mean(self.steps, |s| s.exchange_ms)),
            number(median(self.steps, |s| s.compute_ms)),
            number(median(self.steps, |s| s.exchange_ms))
        );
        let p = &self.phases;
        let _ = write!(
            o,
            "\"phases_ms\":{{\"init\":{},\"load\":{},\"train\":{},\"checks\":{}}},",
            number(p.init_ms),
            number(p.load_ms),
            number(p.train_ms),
            number(p.checks_ms)
        );
        let _ = write!(
            o,
            "\"test_correct\":{},\"test_accuracy\":{},",
            self.test_correct,
            number(self.accuracy())
        );
        let id = &self.identical;
        let _ = write!(
            o,
            "\"identical_weights\":{{\"pass\":{},\"fingerprint\":\"{:#018x}\",\"min\":\"{:#018x}\",\"max\":\"{:#018x}\"}},",
            id.passed(),
            id.fingerprint,
            id.min,
            id.max
        );
        let r = self.reference;
        let _ = write!(
            o,
            "\"single_process\":{{\"pass\":{},\"max_abs_diff\":{},\"tolerance\":{}}},\"pass\":{}}}",
            r.passed(),
            number32(r.max_abs_diff),
            number32(r.tolerance),
            self.passed()
        );
        o
    }
}

/// A JSON number; `null` for NaN and infinities, which JSON lacks.
fn number(v: f64) -> String {
    if v.is_finite() {
        // Display of f64 is the shortest round-trip form, never exponent
        // notation: valid JSON.
        format!("{v}")
    } else {
        "null".to_string()
    }
}

/// An f32 as a JSON number, in its own shortest form (0.0001 rather than
/// the f64 widening's 0.00009999999747378752).
fn number32(v: f32) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".to_string()
    }
}

/// A JSON string literal.
fn string(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;

    #[test]
    fn writes_the_fields() {
        let settings = Settings::default();
        let steps = [
            StepStats {
                step: 0,
                loss: 2.5,
                compute_ms: 1.0,
                exchange_ms: 0.5,
            },
            StepStats {
                step: 1,
                loss: f64::NAN,
                compute_ms: 3.0,
                exchange_ms: 1.5,
            },
        ];
        let reference = Reference {
            model: Model::zeros(1, 1),
            max_abs_diff: 0.25,
            tolerance: 1e-4,
        };
        let r = Report {
            rank: 1,
            world_size: 2,
            transport: "de\"v",
            settings: &settings,
            train_samples: 1500,
            test_samples: 4,
            steps: &steps,
            total_ms: 12.5,
            phases: Phases {
                init_ms: 1.5,
                load_ms: 2.0,
                train_ms: 12.5,
                checks_ms: 0.25,
            },
            test_correct: 3,
            identical: Identical {
                fingerprint: 0xab,
                max: 0xab,
                min: 0xab,
            },
            reference: &reference,
        };
        let j = r.to_json();
        for needle in [
            "{\"rank\":1,\"world_size\":2,\"transport\":\"de\\\"v\",",
            "\"lr\":1,\"l2\":0.0001,",
            "{\"step\":1,\"loss\":null,\"compute_ms\":3,\"exchange_ms\":1.5}",
            "\"mean_compute_ms\":2,\"mean_exchange_ms\":1,\"median_compute_ms\":2,\"median_exchange_ms\":1,",
            "\"phases_ms\":{\"init\":1.5,\"load\":2,\"train\":12.5,\"checks\":0.25},",
            "\"test_correct\":3,\"test_accuracy\":0.75,",
            "\"identical_weights\":{\"pass\":true,\"fingerprint\":\"0x00000000000000ab\"",
            "\"single_process\":{\"pass\":false,\"max_abs_diff\":0.25,",
            "\"pass\":false}",
        ] {
            assert!(j.contains(needle), "{needle} not in {j}");
        }
        assert!(j.ends_with('}'));
        assert!(!r.passed());
    }

    #[test]
    fn mean_and_median() {
        let st = |ms: f64| StepStats {
            step: 0,
            loss: 0.0,
            compute_ms: ms,
            exchange_ms: 0.0,
        };
        let steps = [st(5.0), st(1.0), st(30.0)];
        assert_eq!(mean(&steps, |s| s.compute_ms), 12.0);
        assert_eq!(median(&steps, |s| s.compute_ms), 5.0);
        assert_eq!(median(&steps[..2], |s| s.compute_ms), 3.0);
        assert_eq!(median(&[], |s| s.compute_ms), 0.0);
    }

    #[test]
    fn escapes_control_characters() {
        assert_eq!(string("a\u{1}\tb"), "\"a\\u0001\\tb\"");
        assert_eq!(number(f64::INFINITY), "null");
        assert_eq!(number(-0.125), "-0.125");
    }
}
