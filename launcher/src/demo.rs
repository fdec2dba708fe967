//! `dmlc-qemu demo`: trains the digits example (the MLP or softmax
//! regression) across N VMs with the gradients going through the
//! virtio-dmlc device, then the same job over TCP between the VMs, and
//! prints the two side by side from the trainer's JSON reports.

use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use dmlc_vm as vm;
use serde::Deserialize;

use crate::job::{Job, Outcome, Program, Transport};
use crate::{
    accel, backend_path, check_executable, job_error, prepare, progress, report, sibling,
    usage_error, DemoArgs, DemoModel,
};

/// Where the data goes in the guest (the trainer's default).
const GUEST_DATA: &str = "/data/digits.csv.gz";
/// Where each rank writes its JSON report in the guest.
const GUEST_REPORT: &str = "/root/dmlc-report.json";

/// The MLP's samples per worker and step: few, so that the emulated compute
/// (about 70 ms a sample in a TCG guest) stays small next to the 4.5 MB
/// exchange.
const MLP_SAMPLES_PER_WORKER: usize = 2;
/// Default steps: the MLP's keep both runs to a few minutes under TCG.
const MLP_STEPS: u32 = 40;
const SOFTMAX_STEPS: u32 = 100;

/// Errors of reading the trainer's reports.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("rank {0} sent no JSON report back")]
    Missing(usize),
    #[error("rank {0}'s JSON report is not valid")]
    Json(usize, #[source] serde_json::Error),
}

/// What the demo reads of a trainer's `--json` report (see
/// examples/digits/src/report.rs); other members are ignored. The trainer
/// writes a number that is not finite as null: an optional one reads as NaN.
#[derive(Debug, Deserialize)]
struct Report {
    model: Option<ModelInfo>,
    settings: Option<SettingsInfo>,
    train_samples: Option<usize>,
    steps: Vec<Step>,
    test_accuracy: f64,
    phases_ms: Phases,
    identical_weights: IdenticalWeights,
    single_process: SingleProcess,
}

#[derive(Debug, Deserialize)]
struct ModelInfo {
    name: String,
    widths: Vec<usize>,
    params: usize,
}

#[derive(Debug, Deserialize)]
struct SettingsInfo {
    batch: usize,
}

#[derive(Debug, Deserialize)]
struct Step {
    loss: Option<f64>,
    compute_ms: Option<f64>,
    exchange_ms: Option<f64>,
    update_ms: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct Phases {
    init: f64,
    load: f64,
    train: f64,
    checks: f64,
}

#[derive(Debug, Deserialize)]
struct IdenticalWeights {
    pass: bool,
    fingerprint: String,
}

#[derive(Debug, Deserialize)]
struct SingleProcess {
    pass: bool,
    max_abs_diff: Option<f64>,
    tolerance: Option<f64>,
}

/// The numbers of one run, over all ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Rank 0's model, e.g. "mlp 64-1024-1024-10" (empty if not reported).
    pub model: String,
    /// Its parameter count (0 if not reported).
    pub params: usize,
    /// Samples per step over all ranks (0 if not reported).
    pub batch: usize,
    pub steps: usize,
    /// Median over every step of every rank.
    pub compute_ms: f64,
    pub exchange_ms: f64,
    /// The objective and the update after the exchange.
    pub update_ms: f64,
    /// A whole step: compute, exchange and update.
    pub step_ms: f64,
    /// Median over the steps of the smallest exchange time of the step:
    /// that of the rank that arrived last, which waited for nobody, so
    /// the cost of the exchange itself without the ranks' skew.
    pub exchange_last_ms: f64,
    /// Training time of the slowest rank: the sum of its steps' compute,
    /// exchange and update times. (The trainer's own total_ms also counts
    /// the initial broadcast, which waits for the last VM to boot.)
    pub train_ms: f64,
    /// Rank 0's loss at the last step.
    pub final_loss: f64,
    /// Rank 0's test accuracy, 0 to 1.
    pub accuracy: f64,
    /// Every rank passed its check and every fingerprint is the same.
    pub identical: bool,
    pub fingerprint: String,
    /// Every rank matches the single-process run; the largest difference.
    pub single: bool,
    pub max_abs_diff: f64,
    pub tolerance: f64,
    /// The job's timeline, as the launcher saw it.
    pub times: Times,
    /// Slowest rank's phases inside its program, milliseconds: joining the
    /// job (device: open and DMA setup; TCP: connecting), loading the data,
    /// training (the trainer's total_ms) and the checks after it.
    pub init_ms: f64,
    pub load_ms: f64,
    pub total_ms: f64,
    pub checks_ms: f64,
}

/// Where a run's wall time went, seconds, from the launcher's clock.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Times {
    /// Preparing the guest image (a cache lookup once built).
    pub image_s: f64,
    /// Slowest VM, from QEMU's start to its program's start.
    pub boot_s: f64,
    /// Slowest rank, from its program's start to its exit.
    pub program_s: f64,
    /// From the last exit to the VMs and the backend gone.
    pub shutdown_s: f64,
    pub wall_s: f64,
}

impl Times {
    fn of(outcome: &Outcome) -> Times {
        let slowest = |f: &dyn Fn(&crate::job::RankOutcome) -> Option<Duration>| {
            outcome
                .ranks
                .iter()
                .filter_map(f)
                .max()
                .unwrap_or(Duration::ZERO)
                .as_secs_f64()
        };
        Times {
            image_s: outcome.image.as_secs_f64(),
            boot_s: slowest(&|r| r.boot),
            program_s: slowest(&|r| Some(r.total?.saturating_sub(r.boot?))),
            shutdown_s: outcome.shutdown.as_secs_f64(),
            wall_s: outcome.wall.as_secs_f64(),
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

impl Summary {
    /// Reads the reports (one JSON text per rank, rank order).
    pub fn from_reports(texts: &[String], times: Times) -> Result<Summary, ReportError> {
        let reports = texts
            .iter()
            .enumerate()
            .map(|(rank, text)| {
                serde_json::from_str::<Report>(text).map_err(|e| ReportError::Json(rank, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (mut compute, mut exchange) = (Vec::new(), Vec::new());
        let (mut update, mut whole) = (Vec::new(), Vec::new());
        // Per step, the smallest exchange time over the ranks.
        let mut last_in: Vec<f64> = Vec::new();
        let mut s = Summary {
            model: String::new(),
            params: 0,
            batch: 0,
            steps: 0,
            compute_ms: 0.0,
            exchange_ms: 0.0,
            update_ms: 0.0,
            step_ms: 0.0,
            exchange_last_ms: 0.0,
            train_ms: 0.0,
            final_loss: f64::NAN,
            accuracy: f64::NAN,
            identical: true,
            fingerprint: String::new(),
            single: true,
            max_abs_diff: 0.0,
            tolerance: 0.0,
            times,
            init_ms: 0.0,
            load_ms: 0.0,
            total_ms: 0.0,
            checks_ms: 0.0,
        };
        let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
        for (rank, r) in reports.iter().enumerate() {
            let mut train_ms = 0.0;
            for (i, st) in r.steps.iter().enumerate() {
                let (c, x, u) = (nan(st.compute_ms), nan(st.exchange_ms), nan(st.update_ms));
                compute.push(c);
                exchange.push(x);
                update.push(u);
                whole.push(c + x + u);
                train_ms += c + x + u;
                match last_in.get_mut(i) {
                    Some(m) => *m = m.min(x),
                    None => last_in.push(x),
                }
            }
            if rank == 0 {
                if let Some(m) = &r.model {
                    let widths: Vec<String> = m.widths.iter().map(usize::to_string).collect();
                    s.model = format!("{} {}", m.name, widths.join("-"));
                    s.params = m.params;
                }
                // 0 (or more than there are) means the whole training set.
                let whole_set = r.train_samples.unwrap_or(0);
                s.batch = match r.settings.as_ref().map(|st| st.batch) {
                    Some(b) if b == 0 || b > whole_set => whole_set,
                    Some(b) => b,
                    None => 0,
                };
                s.steps = r.steps.len();
                s.final_loss = nan(r.steps.last().and_then(|st| st.loss));
                s.accuracy = r.test_accuracy;
                s.fingerprint = r.identical_weights.fingerprint.clone();
            }
            // A step without a time leaves the training time unknown
            // (f64::max would drop the NaN).
            s.train_ms = if train_ms.is_nan() || s.train_ms.is_nan() {
                f64::NAN
            } else {
                s.train_ms.max(train_ms)
            };
            s.init_ms = s.init_ms.max(r.phases_ms.init);
            s.load_ms = s.load_ms.max(r.phases_ms.load);
            s.total_ms = s.total_ms.max(r.phases_ms.train);
            s.checks_ms = s.checks_ms.max(r.phases_ms.checks);
            let iw = &r.identical_weights;
            s.identical &= iw.pass && iw.fingerprint == s.fingerprint;
            let sp = &r.single_process;
            s.single &= sp.pass;
            s.max_abs_diff = s.max_abs_diff.max(nan(sp.max_abs_diff));
            s.tolerance = nan(sp.tolerance);
        }
        s.compute_ms = median(&mut compute);
        s.exchange_ms = median(&mut exchange);
        s.update_ms = median(&mut update);
        s.step_ms = median(&mut whole);
        s.exchange_last_ms = median(&mut last_in);
        Ok(s)
    }

    pub fn passed(&self) -> bool {
        self.identical && self.single
    }

    /// The slowest program's time outside the phases it measured itself
    /// (process start, leaving the job, writing and sending the report).
    pub fn program_rest_s(&self) -> f64 {
        let measured = (self.init_ms + self.load_ms + self.total_ms + self.checks_ms) / 1e3;
        (self.times.program_s - measured).max(0.0)
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

/// The side-by-side table.
pub fn table(dev: &Summary, tcp: &Summary, n: usize) -> String {
    let rows: Vec<(String, String, String)> = vec![
        ("steps".into(), dev.steps.to_string(), tcp.steps.to_string()),
        (
            "compute per step (median)".into(),
            format!("{:.3} ms", dev.compute_ms),
            format!("{:.3} ms", tcp.compute_ms),
        ),
        (
            "exchange per step (median)".into(),
            format!("{:.3} ms", dev.exchange_ms),
            format!("{:.3} ms", tcp.exchange_ms),
        ),
        (
            "exchange, last rank to arrive (median)".into(),
            format!("{:.3} ms", dev.exchange_last_ms),
            format!("{:.3} ms", tcp.exchange_last_ms),
        ),
        (
            "update per step (median)".into(),
            format!("{:.3} ms", dev.update_ms),
            format!("{:.3} ms", tcp.update_ms),
        ),
        (
            "step: compute + exchange + update (median)".into(),
            format!("{:.3} ms", dev.step_ms),
            format!("{:.3} ms", tcp.step_ms),
        ),
        (
            "training steps, slowest rank (sum)".into(),
            format!("{:.1} ms", dev.train_ms),
            format!("{:.1} ms", tcp.train_ms),
        ),
        (
            "final loss (rank 0)".into(),
            format!("{:.6}", dev.final_loss),
            format!("{:.6}", tcp.final_loss),
        ),
        (
            "test accuracy".into(),
            format!("{:.2} %", dev.accuracy * 100.0),
            format!("{:.2} %", tcp.accuracy * 100.0),
        ),
        (
            "identical weights on all ranks".into(),
            yes(dev.identical).into(),
            yes(tcp.identical).into(),
        ),
        (
            "matches single process".into(),
            format!("{} ({:.1e})", yes(dev.single), dev.max_abs_diff),
            format!("{} ({:.1e})", yes(tcp.single), tcp.max_abs_diff),
        ),
    ];
    let secs = |v: f64| format!("{v:.1} s");
    let ms_as_secs = |v: f64| format!("{:.1} s", v / 1e3);
    let (d, c) = (&dev.times, &tcp.times);
    let timeline: Vec<(String, String, String)> = vec![
        ("guest image".into(), secs(d.image_s), secs(c.image_s)),
        ("VM boot (slowest)".into(), secs(d.boot_s), secs(c.boot_s)),
        (
            "  join the job (open, DMA / connect)".into(),
            ms_as_secs(dev.init_ms),
            ms_as_secs(tcp.init_ms),
        ),
        (
            "  load the data".into(),
            ms_as_secs(dev.load_ms),
            ms_as_secs(tcp.load_ms),
        ),
        (
            "  training".into(),
            ms_as_secs(dev.total_ms),
            ms_as_secs(tcp.total_ms),
        ),
        (
            "  checks (single-process rerun)".into(),
            ms_as_secs(dev.checks_ms),
            ms_as_secs(tcp.checks_ms),
        ),
        (
            "  rest of the program (start, exit, report)".into(),
            secs(dev.program_rest_s()),
            secs(tcp.program_rest_s()),
        ),
        (
            "program, slowest rank".into(),
            secs(d.program_s),
            secs(c.program_s),
        ),
        ("shutdown".into(), secs(d.shutdown_s), secs(c.shutdown_s)),
        ("whole job (wall)".into(), secs(d.wall_s), secs(c.wall_s)),
    ];
    let rows: Vec<(String, String, String)> = rows.into_iter().chain(timeline).collect();
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(6);
    let w2 = rows.iter().map(|r| r.2.len()).max().unwrap_or(0).max(3);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n== digits{}, {n} VMs: device vs tcp ==",
        model_title(dev)
    );
    let _ = writeln!(t, "{:w0$}  {:>w1$}  {:>w2$}", "", "device", "tcp");
    for (name, d, c) in &rows {
        let _ = writeln!(t, "{name:w0$}  {d:>w1$}  {c:>w2$}");
    }
    let _ = writeln!(
        t,
        "\nexchange time, tcp / device: {:.1}x for the last rank to arrive \
         (the exchange itself), {:.1}x over all ranks (with waiting for the \
         slowest)",
        tcp.exchange_last_ms / dev.exchange_last_ms,
        tcp.exchange_ms / dev.exchange_ms,
    );
    let _ = writeln!(
        t,
        "time, tcp / device: step {:.2}x, training steps {:.2}x, training {:.2}x, \
         whole job {:.2}x",
        tcp.step_ms / dev.step_ms,
        tcp.train_ms / dev.train_ms,
        tcp.total_ms / dev.total_ms,
        tcp.times.wall_s / dev.times.wall_s
    );
    let _ = writeln!(
        t,
        "single-process tolerance {:.0e}; weight fingerprint device {} tcp {}",
        dev.tolerance, dev.fingerprint, tcp.fingerprint
    );
    t
}

/// What the title says of the model: its name and widths, its size and
/// the bytes one step allreduces, and the batch.
fn model_title(s: &Summary) -> String {
    if s.model.is_empty() {
        return String::new();
    }
    // The gradient in f32, plus the loss and the count.
    let bytes = (s.params + 2) * 4;
    let size = if bytes >= 1 << 20 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} KB", bytes as f64 / 1e3)
    };
    format!(
        " {} ({} parameters, {size} allreduced a step; {} samples a step)",
        s.model, s.params, s.batch
    )
}

/// One run of the trainer; `None` when the demo must stop (the exit code
/// is in the error).
fn run_one(job: &Job, qemu: &vm::Qemu) -> Result<(Outcome, Summary), i32> {
    let mut out = io::stdout();
    let outcome = job.run_with(qemu, &mut out).map_err(|e| job_error(&e))?;
    let code = report(&outcome);
    if code != 0 {
        return Err(code);
    }
    let texts: Result<Vec<String>, ReportError> = (0..job.num_workers)
        .map(|rank| {
            outcome
                .fetched(rank, GUEST_REPORT)
                .map(|d| String::from_utf8_lossy(d).into_owned())
                .ok_or(ReportError::Missing(rank))
        })
        .collect();
    if let (Some(dir), Ok(texts)) = (&job.log_dir, &texts) {
        for (rank, text) in texts.iter().enumerate() {
            let _ = std::fs::write(dir.join(format!("rank{rank}.json")), text);
        }
    }
    let summary = texts
        .and_then(|t| Summary::from_reports(&t, Times::of(&outcome)))
        .map_err(|e| job_error(&e))?;
    Ok((outcome, summary))
}

pub fn run(a: DemoArgs) -> i32 {
    let trainer = a
        .trainer
        .clone()
        .or_else(|| sibling("dmlc-train-digits"))
        .unwrap_or_else(|| {
            usage_error(
                "cannot find dmlc-train-digits next to dmlc-qemu; build it with \
                 `cargo build -p dmlc-example-digits` (same profile as dmlc-qemu) \
                 or give --trainer PATH",
            )
        });
    check_executable(&trainer, "trainer");
    let trainer = std::path::absolute(&trainer).unwrap_or(trainer);
    let m = &a.machine;
    crate::check_dma(m);
    let arch = crate::check_arch(m, usize::from(a.num_workers));
    let backend = backend_path(m.backend.as_deref());
    let accel = accel(m.accel);
    let data = match prepare::digits_data() {
        Ok(d) => d,
        Err(e) => return job_error(&e),
    };
    let qemu = match prepare::qemu() {
        Ok(q) => q,
        Err(e) => return job_error(&e),
    };
    let n = usize::from(a.num_workers);
    let (model, steps) = match a.model {
        DemoModel::Mlp => (
            vec![
                "--model".to_owned(),
                "mlp".to_owned(),
                "--batch".to_owned(),
                (MLP_SAMPLES_PER_WORKER * n).to_string(),
            ],
            MLP_STEPS,
        ),
        DemoModel::Softmax => (
            vec!["--model".to_owned(), "softmax".to_owned()],
            SOFTMAX_STEPS,
        ),
    };
    let mut args = vec![
        "--data".to_owned(),
        GUEST_DATA.to_owned(),
        "--steps".to_owned(),
        a.steps.unwrap_or(steps).to_string(),
        "--json".to_owned(),
        GUEST_REPORT.to_owned(),
    ];
    args.extend(model);
    // Last, so that they override the demo's choices.
    args.extend(a.trainer_args.iter().cloned());
    let jobs: Vec<Job> = [Transport::Device, Transport::Tcp]
        .into_iter()
        .map(|transport| Job {
            num_workers: n,
            vcpus: m.vcpus,
            memory_mib: m.memory,
            dma_mib: m.dma,
            accel,
            cpu: m.cpu.clone(),
            transport,
            files: vec![(data.clone(), GUEST_DATA.to_owned())],
            timeout: (m.timeout > 0).then(|| Duration::from_secs(m.timeout)),
            log_dir: m.log_dir.as_ref().map(|d| d.join(transport.as_str())),
            backend: backend.clone(),
            // The TCP run does not use the device: its backend gets none
            // (a --trace-out of the device run would be overwritten).
            backend_args: match transport {
                Transport::Device => m.backend_arg.clone(),
                Transport::Tcp => Vec::new(),
            },
            env: a.env.clone(),
            program: Program::Host(trainer.clone()),
            args: args.clone(),
            fetch: vec![GUEST_REPORT.to_owned()],
            host_root: None,
            tracker: None,
            place: None,
            debug: Default::default(),
            resume: None,
            arch: arch.clone(),
        })
        .collect();
    // Both runs use the same image: build it (if the cache lacks it) before
    // either run's clock starts, so that neither pays for it.
    if let Err(e) = jobs[0].images() {
        return job_error(&e);
    }
    let mut summaries = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let title = match job.transport {
            Transport::Device => "gradients through the virtio-dmlc device",
            Transport::Tcp => "gradients over TCP between the VMs (virtio-net)",
        };
        let what = match a.model {
            DemoModel::Mlp => "the MLP",
            DemoModel::Softmax => "softmax regression",
        };
        progress(&format!("run {}/2: {n} workers, {what}, {title}", i + 1));
        match run_one(job, &qemu) {
            Ok((_, s)) => summaries.push(s),
            Err(code) => {
                progress(&format!(
                    "the {} run failed; stopping the demo",
                    job.transport.as_str()
                ));
                return code;
            }
        }
    }
    print!("{}", table(&summaries[0], &summaries[1], n));
    if summaries.iter().all(Summary::passed) {
        println!("demo: PASS");
        0
    } else {
        println!("demo: FAIL (a check above says NO)");
        1
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn report(rank: u32, fp: &str, exchange: [f64; 3]) -> String {
        let steps: Vec<_> = [(2.3, 1), (1.0, 3), (0.5, 2)]
            .into_iter()
            .zip(exchange)
            .enumerate()
            .map(|(step, ((loss, compute), x))| {
                json!({"step": step, "loss": loss, "compute_ms": compute, "exchange_ms": x,
                       "update_ms": 0.25 * f64::from(compute)})
            })
            .collect();
        json!({
            "rank": rank,
            "world_size": 2,
            "transport": "device",
            "model": {"name": "mlp", "widths": [64, 1024, 1024, 10], "params": 1126410},
            "settings": {"steps": 3, "lr": 0.2, "l2": 0.0, "batch": 4, "seed": 42},
            "train_samples": 1500,
            "steps": steps,
            "total_ms": 10 + rank,
            "test_accuracy": 0.9,
            "phases_ms": {"init": 100, "load": 50, "train": 900, "checks": 200},
            "identical_weights": {"pass": true, "fingerprint": fp},
            "single_process": {"pass": true, "max_abs_diff": 1e-7, "tolerance": 0.0001},
            "pass": true,
        })
        .to_string()
    }

    #[test]
    fn summary_takes_medians_over_all_ranks() {
        let texts = [
            report(0, "0xab", [0.1, 0.2, 0.3]),
            report(1, "0xab", [0.4, 0.5, 0.6]),
        ];
        let times = Times {
            image_s: 0.5,
            boot_s: 4.0,
            program_s: 1.5,
            shutdown_s: 0.5,
            wall_s: 9.0,
        };
        let s = Summary::from_reports(&texts, times).unwrap();
        assert_eq!(s.steps, 3);
        assert_eq!(
            (s.model.as_str(), s.params, s.batch),
            ("mlp 64-1024-1024-10", 1126410, 4)
        );
        assert_eq!(s.compute_ms, 2.0);
        assert!((s.exchange_ms - 0.35).abs() < 1e-12);
        assert_eq!(s.update_ms, 0.5);
        // Steps (c + x + u): rank 0 1.35 3.95 2.8, rank 1 1.65 4.25 3.1.
        assert!((s.step_ms - 2.95).abs() < 1e-12, "{}", s.step_ms);
        // Per step min over the ranks: 0.1 0.2 0.3.
        assert!((s.exchange_last_ms - 0.2).abs() < 1e-12);
        // Rank 1: compute 1+3+2, exchange 0.4+0.5+0.6, update 1.5.
        assert!((s.train_ms - 9.0).abs() < 1e-12);
        assert_eq!(s.final_loss, 0.5);
        assert_eq!(s.accuracy, 0.9);
        assert!(s.identical && s.single && s.passed());
        assert_eq!(s.max_abs_diff, 1e-7);
        let t = table(&s, &s, 2);
        assert!(t.contains("exchange per step (median)"));
        assert!(t.contains("tcp / device: 1.0x for the last rank"));
        assert!(
            t.contains(
                "== digits mlp 64-1024-1024-10 (1126410 parameters, 4.5 MB allreduced a \
                 step; 4 samples a step), 2 VMs"
            ),
            "{t}"
        );
        assert!(
            t.contains("step: compute + exchange + update (median)       2.950 ms"),
            "{t}"
        );
        // Another TCP run, slower in every way.
        let mut slow = s.clone();
        slow.step_ms *= 4.0;
        slow.train_ms *= 3.0;
        slow.total_ms *= 2.5;
        slow.times.wall_s *= 2.0;
        let t = table(&s, &slow, 2);
        assert!(
            t.contains("step 4.00x, training steps 3.00x, training 2.50x, whole job 2.00x"),
            "{t}"
        );
        // 1.5 s of program, 1.25 s of it in measured phases.
        assert!((s.program_rest_s() - 0.25).abs() < 1e-9);
        assert!(t.contains("whole job (wall)"), "{t}");
    }

    #[test]
    fn different_fingerprints_fail_the_identical_check() {
        let texts = [report(0, "0xab", [0.1; 3]), report(1, "0xac", [0.1; 3])];
        let s = Summary::from_reports(&texts, Times::default()).unwrap();
        assert!(!s.identical);
        assert!(!s.passed());
    }

    #[test]
    fn broken_reports_are_errors() {
        assert!(matches!(
            Summary::from_reports(&["{".to_owned()], Times::default()),
            Err(ReportError::Json(0, _))
        ));
        match Summary::from_reports(&["{}".to_owned()], Times::default()) {
            Err(ReportError::Json(0, e)) => assert!(e.to_string().contains("`steps`"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn null_numbers_read_as_nan() {
        let mut v: serde_json::Value = serde_json::from_str(&report(0, "0xab", [0.1; 3])).unwrap();
        v["steps"][2]["loss"] = serde_json::Value::Null;
        v["single_process"]
            .as_object_mut()
            .unwrap()
            .remove("tolerance");
        let s = Summary::from_reports(&[v.to_string()], Times::default()).unwrap();
        assert!(s.final_loss.is_nan());
        assert!(s.tolerance.is_nan());
        assert_eq!(s.steps, 3);
    }

    #[test]
    fn the_model_and_the_update_may_be_missing() {
        let mut v: serde_json::Value = serde_json::from_str(&report(0, "0xab", [0.1; 3])).unwrap();
        let o = v.as_object_mut().unwrap();
        for k in ["model", "settings", "train_samples"] {
            o.remove(k);
        }
        v["steps"][1].as_object_mut().unwrap().remove("update_ms");
        let s = Summary::from_reports(&[v.to_string()], Times::default()).unwrap();
        assert_eq!((s.model.as_str(), s.params, s.batch), ("", 0, 0));
        assert!(s.train_ms.is_nan());
        assert!(table(&s, &s, 1).contains("== digits, 1 VMs: device vs tcp =="));
        // Batch 0 is the whole training set.
        let mut v: serde_json::Value = serde_json::from_str(&report(0, "0xab", [0.1; 3])).unwrap();
        v["settings"]["batch"] = json!(0);
        let s = Summary::from_reports(&[v.to_string()], Times::default()).unwrap();
        assert_eq!(s.batch, 1500);
    }
}
