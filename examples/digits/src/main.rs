//! `dmlc-train-digits`: data-parallel softmax regression or an MLP on the
//! handwritten-digits data, one process per rank, gradients summed through
//! the dmlc-comm rabit API (the device, or TCP, as the DMLC environment
//! says).

use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use thiserror::Error;

use dmlc_cli_support::error_text;
use dmlc_comm::rabit::{self, Op, RabitError};
use dmlc_example_digits::data::{self, DataError, DEFAULT_TEST_SIZE};
use dmlc_example_digits::model::{Arch, DEFAULT_HIDDEN};
use dmlc_example_digits::report::{median, Phases, Report};
use dmlc_example_digits::train::{
    check_identical, check_single, train, Collective, CommError, InjectNan, Settings, TrainError,
    DEFAULT_TOLERANCE,
};

/// Trains softmax regression or an MLP on the handwritten-digits data across
/// the ranks of a DMLC job (rank and world size from DMLC_TASK_ID /
/// DMLC_NUM_WORKER, transport from DMLC_TRANSPORT), then checks that all
/// ranks hold bitwise identical weights and that they match a
/// single-process run. A later option overrides an earlier one.
#[derive(Debug, Parser)]
#[command(name = "dmlc-train-digits", version, args_override_self = true)]
struct Args {
    /// The digits CSV (gzip-compressed or plain), as fetch-data.sh gets it.
    #[arg(long, value_name = "PATH", default_value = "/data/digits.csv.gz")]
    data: PathBuf,

    /// The model: softmax regression (64x10 weights and 10 biases, 650
    /// parameters), or an MLP with two hidden ReLU layers of --hidden units
    /// (1,126,410 parameters at 1024, a 4.5 MB gradient per step).
    #[arg(long, value_enum, default_value_t = Kind::Softmax)]
    model: Kind,

    /// Width of the MLP's two hidden layers.
    #[arg(long, value_name = "H", default_value_t = DEFAULT_HIDDEN as u32,
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    hidden: u32,

    /// Gradient-descent steps.
    #[arg(long, value_name = "N", default_value_t = 100)]
    steps: u32,

    /// Learning rate [default: softmax 1.0, mlp 0.2].
    #[arg(long, value_name = "RATE")]
    lr: Option<f32>,

    /// L2 penalty on the weights [default: softmax 0.0001, mlp 0].
    #[arg(long, value_name = "LAMBDA")]
    l2: Option<f32>,

    /// Samples per step over all ranks; 0 uses the whole training set every
    /// step [default: softmax 0, mlp 32].
    #[arg(long, value_name = "N")]
    batch: Option<usize>,

    /// Seed of the initial weights (drawn on rank 0 and broadcast).
    #[arg(long, value_name = "N", default_value_t = 42)]
    seed: u64,

    /// The last this many samples are the test set.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_TEST_SIZE)]
    test_size: usize,

    /// Print a step line every this many steps (and the last step).
    #[arg(long, value_name = "K", default_value_t = 10)]
    print_every: u32,

    /// Largest parameter difference to the single-process run that passes.
    #[arg(long, value_name = "X", default_value_t = DEFAULT_TOLERANCE)]
    tolerance: f32,

    /// Write per-step times and the results as JSON here; "{rank}" in the
    /// path is replaced by the rank.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,

    /// Debugging aid: rank R puts a NaN in element I (default 0) of its
    /// gradient at step S, before the allreduce. With DMLC_CHECK_FINITE=1
    /// the device fails that allreduce naming rank R and element I
    /// (docs/debugging.md); without it every rank's weights turn NaN.
    #[arg(long, value_name = "R:S[:I]", value_parser = parse_inject)]
    inject_nan: Option<InjectNan>,

    /// Debugging aid: rank R's process exits with status 3 before step S's
    /// allreduce, as a crash would; the others' allreduce then fails with
    /// PEER_LOST (or, with `dmlc-qemu submit --freeze-on-error`, the job
    /// freezes there: docs/debugging.md).
    #[arg(long, value_name = "R:S", value_parser = parse_crash)]
    crash: Option<(u32, u32)>,
}

/// Parses `--crash R:S`.
fn parse_crash(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?}: expected RANK:STEP, whole numbers");
    let (r, st) = s.split_once(':').ok_or_else(bad)?;
    Ok((
        r.parse().map_err(|_| bad())?,
        st.parse().map_err(|_| bad())?,
    ))
}

/// Parses `--inject-nan R:S[:I]`.
fn parse_inject(s: &str) -> Result<InjectNan, String> {
    let words: Vec<&str> = s.split(':').collect();
    let num = |w: &str| {
        w.parse::<u64>()
            .map_err(|_| format!("{s:?}: expected RANK:STEP[:INDEX], whole numbers"))
    };
    match words.as_slice() {
        [r, st] | [r, st, _] => Ok(InjectNan {
            rank: u32::try_from(num(r)?).map_err(|e| e.to_string())?,
            step: u32::try_from(num(st)?).map_err(|e| e.to_string())?,
            index: words.get(2).map_or(Ok(0), |i| num(i))? as usize,
        }),
        _ => Err(format!("{s:?}: expected RANK:STEP[:INDEX]")),
    }
}

/// The `--model` choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    Softmax,
    Mlp,
}

impl Args {
    /// The model, and the learning rate, L2 penalty and batch: as given,
    /// else the model's defaults.
    fn settings(&self) -> Settings {
        let (model, lr, l2, batch) = match self.model {
            Kind::Softmax => (Arch::Softmax, 1.0, 1e-4, 0),
            Kind::Mlp => (
                Arch::Mlp {
                    hidden: self.hidden as usize,
                },
                0.2,
                0.0,
                32,
            ),
        };
        Settings {
            model,
            steps: self.steps,
            lr: self.lr.unwrap_or(lr),
            l2: self.l2.unwrap_or(l2),
            batch: self.batch.unwrap_or(batch),
            seed: self.seed,
            inject_nan: self.inject_nan,
            crash: self.crash,
        }
    }
}

/// Errors of the program.
#[derive(Debug, Error)]
enum MainError {
    #[error("cannot join the job")]
    Init(#[source] RabitError),
    #[error("cannot leave the job cleanly")]
    Finalize(#[source] RabitError),
    #[error("cannot load the data")]
    Data(#[from] DataError),
    #[error("training failed")]
    Train(#[from] TrainError),
    #[error("cannot write {path}")]
    Json {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The process-wide rabit worker, as a [`Collective`]: the calls a program
/// ported from rabit makes.
struct RabitWorker;

impl Collective for RabitWorker {
    fn rank(&self) -> u32 {
        rabit::get_rank()
    }

    fn world_size(&self) -> u32 {
        rabit::get_world_size()
    }

    fn allreduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        Ok(rabit::allreduce(buf, Op::Sum)?)
    }

    fn set_tag(&mut self, tag: u64) {
        rabit::set_tag(tag);
    }

    fn allreduce_max_u64(&mut self, buf: &mut [u64]) -> Result<(), CommError> {
        Ok(rabit::allreduce(buf, Op::Max)?)
    }

    fn broadcast_f32(&mut self, buf: &mut [f32], root: u32) -> Result<(), CommError> {
        Ok(rabit::broadcast(buf, root)?)
    }
}

/// Joins the job, trains, checks, and leaves; returns whether both checks
/// passed.
fn job(args: &Args) -> Result<bool, MainError> {
    let t = Instant::now();
    rabit::init().map_err(MainError::Init)?;
    let init_ms = ms_since(t);
    let transport = rabit::with(|r| r.transport()).map_err(MainError::Init)?;
    let passed = run(&mut RabitWorker, transport, args, init_ms)?;
    // Waits for every rank, so none leaves while others still talk to it.
    rabit::finalize().map_err(MainError::Finalize)?;
    Ok(passed)
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Runs the job on `comm` (joined in `init_ms`); returns whether both
/// checks passed.
fn run<C: Collective + ?Sized>(
    comm: &mut C,
    transport: &str,
    args: &Args,
    init_ms: f64,
) -> Result<bool, MainError> {
    let rank = comm.rank();
    let ranks = comm.world_size();
    let t = Instant::now();
    let all = data::load(&args.data)?;
    let (train_set, test_set) = all.split(args.test_size)?;
    let load_ms = ms_since(t);
    let settings = args.settings();
    let widths = settings.model.widths(train_set.features, train_set.classes);
    let widths: Vec<String> = widths.iter().map(usize::to_string).collect();
    let shard = (0..train_set.len())
        .filter(|i| i % ranks as usize == rank as usize)
        .count();
    println!(
        "rank {rank} of {ranks} transport {transport} model {} {} ({} parameters) train {} (shard {shard}) test {} steps {} lr {} l2 {} batch {}",
        settings.model.name(),
        widths.join("-"),
        settings
            .model
            .param_count(train_set.features, train_set.classes),
        train_set.len(),
        test_set.len(),
        settings.steps,
        settings.lr,
        settings.l2,
        if settings.batch == 0 { train_set.len() } else { settings.batch }
    );

    let last = settings.steps.saturating_sub(1);
    let every = args.print_every.max(1);
    let t0 = Instant::now();
    let trained = train(comm, &settings, &train_set, |s| {
        if s.step % every == 0 || s.step == last {
            println!(
                "step {} loss {:.6} compute_ms {:.3} exchange_ms {:.3} update_ms {:.3}",
                s.step, s.loss, s.compute_ms, s.exchange_ms, s.update_ms
            );
        }
    })?;
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let steps = &trained.steps;
    let compute: f64 = steps.iter().map(|s| s.compute_ms).sum();
    let exchange: f64 = steps.iter().map(|s| s.exchange_ms).sum();
    let update: f64 = steps.iter().map(|s| s.update_ms).sum();
    println!(
        "time total_ms {total_ms:.1} compute_ms {compute:.1} exchange_ms {exchange:.1} \
         update_ms {update:.1} median_step_compute_ms {:.3} median_step_exchange_ms {:.3} \
         median_step_update_ms {:.3}",
        median(steps, |s| s.compute_ms),
        median(steps, |s| s.exchange_ms),
        median(steps, |s| s.update_ms)
    );

    let t_checks = Instant::now();
    let model = &trained.model;
    let correct = model.correct(&test_set);
    println!(
        "test accuracy {:.4} ({correct}/{})",
        correct as f64 / test_set.len() as f64,
        test_set.len()
    );

    // This rank's own fingerprint, printed before any check that goes
    // through the collective: whoever reads every rank's output can
    // compare them without trusting the device.
    println!(
        "rank {rank} model fingerprint {:#018x}",
        model.fingerprint()
    );
    let identical = check_identical(comm, model)?;
    if identical.passed() {
        println!(
            "PASS identical weights on all {ranks} ranks (fingerprint {:#018x})",
            identical.fingerprint
        );
    } else {
        println!(
            "FAIL identical weights: fingerprints differ across ranks (min {:#018x} max {:#018x}, this rank {:#018x})",
            identical.min, identical.max, identical.fingerprint
        );
    }

    let reference = check_single(&settings, &train_set, model, args.tolerance)?;
    // Not bitwise: the shards' partial sums are added in another order
    // than one process's running sum, so the last bits differ.
    println!(
        "{} matches single-process run: max abs diff {:.3e} (tolerance {:.0e}; not bitwise: the summation order differs)",
        if reference.passed() { "PASS" } else { "FAIL" },
        reference.max_abs_diff,
        reference.tolerance
    );

    let phases = Phases {
        init_ms,
        load_ms,
        train_ms: total_ms,
        checks_ms: ms_since(t_checks),
    };
    println!(
        "phases init_ms {:.1} load_ms {:.1} train_ms {:.1} checks_ms {:.1}",
        phases.init_ms, phases.load_ms, phases.train_ms, phases.checks_ms
    );
    let report = Report {
        rank,
        world_size: ranks,
        transport,
        model,
        settings: &settings,
        train_samples: train_set.len(),
        test_samples: test_set.len(),
        steps: &trained.steps,
        total_ms,
        phases,
        test_correct: correct,
        identical,
        reference: &reference,
    };
    if let Some(pattern) = &args.json {
        let path = pattern.replace("{rank}", &rank.to_string());
        fs::write(&path, report.to_json() + "\n")
            .map_err(|source| MainError::Json { path, source })?;
    }
    Ok(report.passed())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match job(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("dmlc-train-digits: {}", error_text(&e));
            ExitCode::from(2)
        }
    }
}
