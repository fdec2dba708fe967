//! The JSON summary of one rank's run (`--json FILE`), for the launcher's
//! device-versus-TCP comparison.
//!
//! ```json
//! {"rank":0,"world_size":2,"transport":"device",
//!  "model":{"name":"softmax","widths":[64,10],"params":650},
//!  "settings":{"steps":100,"lr":1.0,"l2":0.0001,"batch":0,"seed":42},
//!  "train_samples":1500,"test_samples":297,
//!  "steps":[{"step":0,"loss":2.30,"compute_ms":1.2,"exchange_ms":0.05,"update_ms":0.01},...],
//!  "total_ms":310.5,"mean_compute_ms":1.1,"mean_exchange_ms":0.04,"mean_update_ms":0.01,
//!  "median_compute_ms":1.0,"median_exchange_ms":0.03,"median_update_ms":0.01,
//!  "test_correct":280,"test_accuracy":0.9427,
//!  "identical_weights":{"pass":true,"fingerprint":"0x...","min":"0x...","max":"0x..."},
//!  "single_process":{"pass":true,"max_abs_diff":1.2e-7,"tolerance":0.0001},
//!  "pass":true}
//! ```
//! Numbers that are not finite are written as `null`.

use serde::Serialize;

use crate::model::Model;
use crate::train::{Identical, Reference, Settings, StepStats};

/// Everything one rank reports.
#[derive(Clone, Debug)]
pub struct Report<'a> {
    pub rank: u32,
    pub world_size: u32,
    /// "device" or "tcp" (as the rabit init chose it).
    pub transport: &'a str,
    /// The trained model (its kind and shape are reported).
    pub model: &'a Model,
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
        let p = &self.phases;
        let id = &self.identical;
        let r = self.reference;
        let doc = ReportJson {
            rank: self.rank,
            world_size: self.world_size,
            transport: self.transport,
            model: ModelJson {
                name: self.model.arch.name(),
                widths: self
                    .model
                    .arch
                    .widths(self.model.features, self.model.classes),
                params: self.model.params.len(),
            },
            settings: SettingsJson {
                steps: s.steps,
                lr: s.lr,
                l2: s.l2,
                batch: s.batch,
                seed: s.seed,
            },
            train_samples: self.train_samples,
            test_samples: self.test_samples,
            steps: self
                .steps
                .iter()
                .map(|st| StepJson {
                    step: st.step,
                    loss: st.loss,
                    compute_ms: st.compute_ms,
                    exchange_ms: st.exchange_ms,
                    update_ms: st.update_ms,
                })
                .collect(),
            total_ms: self.total_ms,
            mean_compute_ms: mean(self.steps, |s| s.compute_ms),
            mean_exchange_ms: mean(self.steps, |s| s.exchange_ms),
            mean_update_ms: mean(self.steps, |s| s.update_ms),
            median_compute_ms: median(self.steps, |s| s.compute_ms),
            median_exchange_ms: median(self.steps, |s| s.exchange_ms),
            median_update_ms: median(self.steps, |s| s.update_ms),
            phases_ms: PhasesJson {
                init: p.init_ms,
                load: p.load_ms,
                train: p.train_ms,
                checks: p.checks_ms,
            },
            test_correct: self.test_correct,
            test_accuracy: self.accuracy(),
            identical_weights: IdenticalJson {
                pass: id.passed(),
                fingerprint: format!("{:#018x}", id.fingerprint),
                min: format!("{:#018x}", id.min),
                max: format!("{:#018x}", id.max),
            },
            single_process: SingleJson {
                pass: r.passed(),
                max_abs_diff: r.max_abs_diff,
                tolerance: r.tolerance,
            },
            pass: self.passed(),
        };
        // Plain structs with string keys: serializing cannot fail (a number
        // that is not finite is written as null).
        serde_json::to_string(&doc).expect("the report serializes")
    }
}

/// The JSON document, in the order of the example above.
#[derive(Serialize)]
struct ReportJson<'a> {
    rank: u32,
    world_size: u32,
    transport: &'a str,
    model: ModelJson,
    settings: SettingsJson,
    train_samples: usize,
    test_samples: usize,
    steps: Vec<StepJson>,
    total_ms: f64,
    mean_compute_ms: f64,
    mean_exchange_ms: f64,
    mean_update_ms: f64,
    median_compute_ms: f64,
    median_exchange_ms: f64,
    median_update_ms: f64,
    phases_ms: PhasesJson,
    test_correct: usize,
    test_accuracy: f64,
    identical_weights: IdenticalJson,
    single_process: SingleJson,
    pass: bool,
}

#[derive(Serialize)]
struct ModelJson {
    name: &'static str,
    /// Inputs, hidden layers, classes.
    widths: Vec<usize>,
    params: usize,
}

/// f32s are written in their own shortest form (0.0001 rather than the
/// f64 widening's 0.00009999999747378752).
#[derive(Serialize)]
struct SettingsJson {
    steps: u32,
    lr: f32,
    l2: f32,
    batch: usize,
    seed: u64,
}

#[derive(Serialize)]
struct StepJson {
    step: u32,
    loss: f64,
    compute_ms: f64,
    exchange_ms: f64,
    update_ms: f64,
}

#[derive(Serialize)]
struct PhasesJson {
    init: f64,
    load: f64,
    train: f64,
    checks: f64,
}

#[derive(Serialize)]
struct IdenticalJson {
    pass: bool,
    fingerprint: String,
    min: String,
    max: String,
}

#[derive(Serialize)]
struct SingleJson {
    pass: bool,
    max_abs_diff: f32,
    tolerance: f32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    #[test]
    fn writes_the_fields() {
        let settings = Settings::default();
        let steps = [
            StepStats {
                step: 0,
                loss: 2.5,
                compute_ms: 1.0,
                exchange_ms: 0.5,
                update_ms: 0.25,
            },
            StepStats {
                step: 1,
                loss: f64::NAN,
                compute_ms: 3.0,
                exchange_ms: 1.5,
                update_ms: 0.75,
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
            transport: "de\"v\u{1}\t",
            model: &Model::new(Arch::Mlp { hidden: 3 }, 2, 4),
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
        // f32s in their own shortest form.
        assert!(j.contains("\"lr\":1.0,\"l2\":0.0001,"), "{j}");
        assert!(!j.contains('\n'), "one line: {j}");
        let doc: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        let want = serde_json::json!({
            "rank": 1,
            "world_size": 2,
            "transport": "de\"v\u{1}\t",
            "model": {"name": "mlp", "widths": [2, 3, 3, 4], "params": 37},
            "settings": {"steps": 100, "lr": 1.0, "l2": 0.0001, "batch": 0, "seed": 42},
            "train_samples": 1500,
            "test_samples": 4,
            "steps": [
                {"step": 0, "loss": 2.5, "compute_ms": 1.0, "exchange_ms": 0.5, "update_ms": 0.25},
                {"step": 1, "loss": null, "compute_ms": 3.0, "exchange_ms": 1.5, "update_ms": 0.75},
            ],
            "total_ms": 12.5,
            "mean_compute_ms": 2.0,
            "mean_exchange_ms": 1.0,
            "mean_update_ms": 0.5,
            "median_compute_ms": 2.0,
            "median_exchange_ms": 1.0,
            "median_update_ms": 0.5,
            "phases_ms": {"init": 1.5, "load": 2.0, "train": 12.5, "checks": 0.25},
            "test_correct": 3,
            "test_accuracy": 0.75,
            "identical_weights": {
                "pass": true,
                "fingerprint": "0x00000000000000ab",
                "min": "0x00000000000000ab",
                "max": "0x00000000000000ab",
            },
            "single_process": {"pass": false, "max_abs_diff": 0.25, "tolerance": 0.0001},
            "pass": false,
        });
        assert_eq!(doc, want, "{j}");
        // In the order of the module's example.
        let keys = [
            "\"rank\"",
            "\"model\"",
            "\"settings\"",
            "\"train_samples\"",
            "\"steps\":[",
            "\"total_ms\"",
            "\"median_exchange_ms\"",
            "\"phases_ms\"",
            "\"test_accuracy\"",
            "\"identical_weights\"",
            "\"single_process\"",
            "\"pass\":false}",
        ];
        let at: Vec<Option<usize>> = keys.iter().map(|k| j.find(k)).collect();
        assert!(at.windows(2).all(|w| w[0].is_some() && w[0] < w[1]), "{j}");
        assert!(!r.passed());
    }

    #[test]
    fn mean_and_median() {
        let st = |ms: f64| StepStats {
            step: 0,
            loss: 0.0,
            compute_ms: ms,
            exchange_ms: 0.0,
            update_ms: 0.0,
        };
        let steps = [st(5.0), st(1.0), st(30.0)];
        assert_eq!(mean(&steps, |s| s.compute_ms), 12.0);
        assert_eq!(median(&steps, |s| s.compute_ms), 5.0);
        assert_eq!(median(&steps[..2], |s| s.compute_ms), 3.0);
        assert_eq!(median(&[], |s| s.compute_ms), 0.0);
    }
}
