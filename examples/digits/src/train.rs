//! Data-parallel training over any [`Collective`], and the two end checks.
//!
//! Every rank holds the whole training set and uses the samples `i` with
//! `i % N == rank` of each step's batch. Each step it sums its shard's
//! gradient locally, the allreduce adds the shards (together with the loss
//! and the sample count, in the same buffer), and every rank divides by the
//! total count and applies the same f32 update. Since every rank receives
//! the same sum, they stay bitwise identical; since the sum is over the same
//! samples whatever N is, the model equals the single-process one up to the
//! rounding of a different summation order.

use std::time::Instant;

use thiserror::Error;

use crate::data::{Dataset, Fnv};
use crate::model::{Arch, Model};

/// What a collective call returns on failure.
pub type CommError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The collectives training needs. Every rank must make the same calls in
/// the same order with the same lengths.
pub trait Collective {
    /// This process's rank, 0..world_size.
    fn rank(&self) -> u32;
    /// Number of ranks.
    fn world_size(&self) -> u32;
    /// Element-wise sum over all ranks, in place; every rank gets bitwise
    /// the same result.
    fn allreduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError>;
    /// Tags the collectives that follow (the step number); by default
    /// nothing does.
    fn set_tag(&mut self, tag: u64) {
        let _ = tag;
    }
    /// Element-wise maximum over all ranks, in place.
    fn allreduce_max_u64(&mut self, buf: &mut [u64]) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast_f32(&mut self, buf: &mut [f32], root: u32) -> Result<(), CommError>;
}

/// One process alone (N = 1): every collective leaves the data as it is.
/// The single-process reference run trains through it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> u32 {
        0
    }

    fn world_size(&self) -> u32 {
        1
    }

    fn allreduce_sum_f32(&mut self, _buf: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }

    fn allreduce_max_u64(&mut self, _buf: &mut [u64]) -> Result<(), CommError> {
        Ok(())
    }

    fn broadcast_f32(&mut self, _buf: &mut [f32], _root: u32) -> Result<(), CommError> {
        Ok(())
    }
}

/// Errors of training.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error("{what} failed")]
    Comm {
        what: &'static str,
        #[source]
        source: CommError,
    },
    #[error("step {step}: the gradient allreduce failed")]
    Step {
        step: u32,
        #[source]
        source: CommError,
    },
    #[error("ranks disagree on the training data or the settings")]
    Inconsistent,
    #[error("step {step}: the exchange summed {got} samples, expected {expected}")]
    Count {
        step: u32,
        got: f32,
        expected: usize,
    },
}

fn comm(what: &'static str) -> impl FnOnce(CommError) -> TrainError {
    move |source| TrainError::Comm { what, source }
}

/// Training settings; every rank must use the same.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The model trained.
    pub model: Arch,
    /// Gradient-descent steps.
    pub steps: u32,
    /// Learning rate.
    pub lr: f32,
    /// L2 penalty on the weights.
    pub l2: f32,
    /// Samples per step over all ranks; 0 (or at least the training set's
    /// size) means the whole training set every step.
    pub batch: usize,
    /// Seed of rank 0's initial weights.
    pub seed: u64,
    /// A NaN put in one rank's gradient at one step, to debug with
    /// (docs/debugging.md).
    pub inject_nan: Option<InjectNan>,
    /// `(rank, step)`: that rank's process exits (status 3) before that
    /// step's allreduce, as a crash would (docs/debugging.md).
    pub crash: Option<(u32, u32)>,
}

/// Where `--inject-nan` puts its NaN: element `index` of rank `rank`'s
/// gradient at step `step`, before the allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectNan {
    pub rank: u32,
    pub step: u32,
    pub index: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            model: Arch::Softmax,
            steps: 100,
            lr: 1.0,
            l2: 1e-4,
            batch: 0,
            seed: 42,
            inject_nan: None,
            crash: None,
        }
    }
}

impl Settings {
    /// Hash of the settings, for the consistency check at the start.
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.write(&self.model.code().to_le_bytes());
        h.write(&self.steps.to_le_bytes());
        h.write(&self.lr.to_bits().to_le_bytes());
        h.write(&self.l2.to_bits().to_le_bytes());
        h.write(&(self.batch as u64).to_le_bytes());
        h.write(&self.seed.to_le_bytes());
        if let Some(i) = self.inject_nan {
            h.write(&i.rank.to_le_bytes());
            h.write(&i.step.to_le_bytes());
            h.write(&(i.index as u64).to_le_bytes());
        }
        if let Some((r, s)) = self.crash {
            h.write(&r.to_le_bytes());
            h.write(&s.to_le_bytes());
        }
        h.finish()
    }
}

/// The global sample indices of step `step`: the whole set, or `batch`
/// consecutive samples that wrap around the end.
pub fn batch_indices(step: u32, batch: usize, n: usize) -> impl Iterator<Item = usize> + Clone {
    let (start, len) = if batch == 0 || batch >= n {
        (0, n)
    } else {
        ((step as usize % n) * batch % n, batch)
    };
    (0..len).map(move |j| (start + j) % n)
}

/// What one step measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Step number, from 0.
    pub step: u32,
    /// The objective on this step's batch at the weights before the step.
    pub loss: f64,
    /// Milliseconds spent on the local gradient.
    pub compute_ms: f64,
    /// Milliseconds spent in the allreduce.
    pub exchange_ms: f64,
    /// Milliseconds spent after it: the objective and the update.
    pub update_ms: f64,
}

/// A finished training run.
#[derive(Clone, Debug)]
pub struct Trained {
    pub model: Model,
    pub steps: Vec<StepStats>,
}

/// Trains on `data` (the whole training set, the same on every rank),
/// calling `on_step` after every step.
pub fn train<C: Collective + ?Sized>(
    comm_: &mut C,
    settings: &Settings,
    data: &Dataset,
    mut on_step: impl FnMut(&StepStats),
) -> Result<Trained, TrainError> {
    let rank = comm_.rank() as usize;
    let ranks = comm_.world_size() as usize;

    // A rank with other data or settings would silently train something
    // else (or hang on a different step count): check first.
    let fp = data.fingerprint() ^ settings.fingerprint().rotate_left(1);
    let mut agree = [fp, !fp];
    comm_
        .allreduce_max_u64(&mut agree)
        .map_err(comm("the consistency check"))?;
    // max(fp) == fp and max(!fp) == !fp, i.e. min(fp) == fp, on every rank.
    if agree != [fp, !fp] {
        return Err(TrainError::Inconsistent);
    }

    let arch = settings.model;
    let mut model = if rank == 0 {
        Model::init(arch, data.features, data.classes, settings.seed)
    } else {
        Model::new(arch, data.features, data.classes)
    };
    comm_
        .broadcast_f32(&mut model.params, 0)
        .map_err(comm("broadcasting the initial weights"))?;

    let np = model.params.len();
    // Gradient, then the loss sum and the sample count.
    let mut buf = vec![0.0f32; np + 2];
    let mut steps = Vec::with_capacity(settings.steps as usize);
    for step in 0..settings.steps {
        let t0 = Instant::now();
        let batch = batch_indices(step, settings.batch, data.len());
        let expected = batch.clone().count();
        let mine = batch.filter(|i| i % ranks == rank);
        let count = mine.clone().count();
        let loss = model.gradient(data, mine, &mut buf[..np]);
        buf[np] = loss as f32;
        buf[np + 1] = count as f32;
        if let Some(i) = settings.inject_nan {
            if (i.rank as usize, i.step) == (rank, step) && i.index < buf.len() {
                buf[i.index] = f32::NAN;
            }
        }
        let compute = t0.elapsed();
        if settings.crash == Some((rank as u32, step)) {
            eprintln!("rank {rank}: exits at step {step} (--crash)");
            std::process::exit(3);
        }

        let t1 = Instant::now();
        // The step's allreduce carries the step number as its tag, for
        // `dmlc-qemu submit --freeze-tag STEP` (docs/debugging.md).
        comm_.set_tag(u64::from(step));
        comm_
            .allreduce_sum_f32(&mut buf)
            .map_err(|source| TrainError::Step { step, source })?;
        let exchange = t1.elapsed();

        // Counts are small integers, exact in f32.
        let total = buf[np + 1];
        if total != expected as f32 {
            return Err(TrainError::Count {
                step,
                got: total,
                expected,
            });
        }
        let t2 = Instant::now();
        let loss = model.objective(f64::from(buf[np]), f64::from(total), settings.l2);
        model.step(&buf[..np], total, settings.lr, settings.l2);
        let stats = StepStats {
            step,
            loss,
            compute_ms: compute.as_secs_f64() * 1e3,
            exchange_ms: exchange.as_secs_f64() * 1e3,
            update_ms: t2.elapsed().as_secs_f64() * 1e3,
        };
        on_step(&stats);
        steps.push(stats);
    }
    // The checks after training are no step's.
    comm_.set_tag(0);
    Ok(Trained { model, steps })
}

/// Whether all ranks hold bitwise the same model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identical {
    /// This rank's fingerprint.
    pub fingerprint: u64,
    /// Largest and smallest fingerprint over the ranks.
    pub max: u64,
    pub min: u64,
}

impl Identical {
    pub fn passed(&self) -> bool {
        self.max == self.min
    }
}

/// Compares the models' fingerprints over all ranks: one Max allreduce of
/// (fp, !fp) gives max(fp) and !min(fp).
pub fn check_identical<C: Collective + ?Sized>(
    comm_: &mut C,
    model: &Model,
) -> Result<Identical, TrainError> {
    let fp = model.fingerprint();
    let mut v = [fp, !fp];
    comm_
        .allreduce_max_u64(&mut v)
        .map_err(comm("the identical-weights check"))?;
    Ok(Identical {
        fingerprint: fp,
        max: v[0],
        min: !v[1],
    })
}

/// The single-process comparison.
#[derive(Clone, Debug)]
pub struct Reference {
    /// The model trained by one process on all the data.
    pub model: Model,
    /// Largest absolute parameter difference to the distributed model.
    pub max_abs_diff: f32,
    /// Allowed difference.
    pub tolerance: f32,
}

impl Reference {
    pub fn passed(&self) -> bool {
        // A NaN difference fails.
        self.max_abs_diff <= self.tolerance
    }
}

/// Default tolerance of the single-process comparison. The distributed sum
/// adds per-rank partial sums (each rounded to f32) instead of one running
/// sum over all samples, so results differ in the last bits of each step's
/// gradient (relative 1e-7); over 100 steps of a contracting descent the
/// parameters (of size about 1) drift apart by far less than this.
pub const DEFAULT_TOLERANCE: f32 = 1e-4;

/// Trains the same settings in this process alone on all of `data` and
/// compares with `distributed`. Every rank runs it (in parallel, so no rank
/// waits in a collective for another's reference run).
pub fn check_single(
    settings: &Settings,
    data: &Dataset,
    distributed: &Model,
    tolerance: f32,
) -> Result<Reference, TrainError> {
    let single = train(&mut Single, settings, data, |_| {})?;
    Ok(Reference {
        max_abs_diff: single.model.max_abs_diff(distributed),
        model: single.model,
        tolerance,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::Threads;
    use std::thread;

    /// Ten well-separated blobs in 8 features.
    fn blobs(n: usize) -> Dataset {
        let features = 8;
        let mut x = Vec::new();
        let mut y = Vec::new();
        for i in 0..n {
            let c = (i * 7) % 10;
            for f in 0..features {
                let centre = if f == c % features { 0.8 } else { 0.1 };
                let wobble = ((i * 31 + f * 17) % 13) as f32 / 13.0 * 0.2;
                x.push(centre + wobble + if c >= 8 && f == 0 { 0.5 } else { 0.0 });
            }
            y.push(c as u8);
        }
        Dataset {
            features,
            classes: 10,
            x,
            y,
        }
    }

    fn run_group(n: u32, settings: &Settings, data: &Dataset) -> Vec<Result<Trained, String>> {
        let handles: Vec<_> = Threads::group(n)
            .into_iter()
            .map(|mut c| {
                let s = settings.clone();
                let d = data.clone();
                thread::spawn(move || train(&mut c, &s, &d, |_| {}).map_err(|e| e.to_string()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_agree_and_match_single_process() {
        let data = blobs(203);
        let models = [(Arch::Softmax, 1.0), (Arch::Mlp { hidden: 12 }, 0.2)];
        for ((model, lr), batch) in models.into_iter().flat_map(|m| [(m, 0), (m, 64)]) {
            let settings = Settings {
                model,
                steps: 60,
                lr,
                batch,
                ..Settings::default()
            };
            let single = train(&mut Single, &settings, &data, |_| {}).unwrap();
            for n in [1, 2, 3] {
                let runs = run_group(n, &settings, &data);
                let models: Vec<Model> = runs.into_iter().map(|r| r.unwrap().model).collect();
                for m in &models[1..] {
                    assert_eq!(m.fingerprint(), models[0].fingerprint(), "n={n}");
                }
                assert_eq!(models[0].arch, model);
                let diff = single.model.max_abs_diff(&models[0]);
                assert!(
                    diff <= DEFAULT_TOLERANCE,
                    "{model:?} n={n} batch={batch} diff={diff}"
                );
                if n == 1 {
                    assert_eq!(diff, 0.0);
                }
            }
        }
    }

    #[test]
    fn training_lowers_the_loss_and_learns() {
        let data = blobs(300);
        let mut seen = Vec::new();
        let t = train(&mut Single, &Settings::default(), &data, |s| seen.push(*s)).unwrap();
        assert_eq!(seen.len(), 100);
        assert_eq!(seen, t.steps);
        assert!(seen[99].loss < seen[0].loss * 0.5, "{seen:?}");
        assert!(t.model.correct(&data) >= 270, "{}", t.model.correct(&data));
        let r = check_single(&Settings::default(), &data, &t.model, DEFAULT_TOLERANCE).unwrap();
        assert!(r.passed());
        assert_eq!(r.max_abs_diff, 0.0);
        // A distributed model with one NaN parameter fails the comparison.
        let mut bad = t.model.clone();
        bad.params[3] = f32::NAN;
        let r = check_single(&Settings::default(), &data, &bad, DEFAULT_TOLERANCE).unwrap();
        assert!(r.max_abs_diff.is_nan() && !r.passed(), "{}", r.max_abs_diff);
    }

    #[test]
    fn the_mlp_learns_in_minibatches() {
        let data = blobs(300);
        let settings = Settings {
            model: Arch::Mlp { hidden: 16 },
            steps: 150,
            lr: 0.2,
            l2: 0.0,
            batch: 8,
            seed: 5,
            inject_nan: None,
            crash: None,
        };
        let t = train(&mut Single, &settings, &data, |_| {}).unwrap();
        let first: f64 = t.steps[..10].iter().map(|s| s.loss).sum();
        let last: f64 = t.steps[140..].iter().map(|s| s.loss).sum();
        assert!(last < first * 0.5, "{:?}", t.steps);
        assert!(t.model.correct(&data) >= 270, "{}", t.model.correct(&data));
        assert!(t
            .steps
            .iter()
            .all(|s| s.update_ms >= 0.0 && s.compute_ms > 0.0));
    }

    #[test]
    fn disagreement_is_detected() {
        let other_steps = Settings {
            steps: 7,
            ..Settings::default()
        };
        let mlp = |hidden| Settings {
            model: Arch::Mlp { hidden },
            ..Settings::default()
        };
        for (s0, s1) in [(Settings::default(), other_steps), (mlp(5), mlp(4))] {
            let data = blobs(50);
            let mut group = Threads::group(2);
            let mut c1 = group.pop().unwrap();
            let mut c0 = group.pop().unwrap();
            let d1 = data.clone();
            let h = thread::spawn(move || train(&mut c1, &s1, &d1, |_| {}).map(|_| ()));
            let r0 = train(&mut c0, &s0, &data, |_| {}).map(|_| ());
            assert!(matches!(r0, Err(TrainError::Inconsistent)), "{r0:?}");
            assert!(matches!(h.join().unwrap(), Err(TrainError::Inconsistent)));
        }
    }

    #[test]
    fn identical_check_sees_a_different_rank() {
        let mut group = Threads::group(2);
        let mut c1 = group.pop().unwrap();
        let mut c0 = group.pop().unwrap();
        let a = Model::random(4, 3, 1);
        let mut b = a.clone();
        let h = thread::spawn(move || check_identical(&mut c1, &a).unwrap());
        let same = check_identical(&mut c0, &b.clone()).unwrap();
        assert!(same.passed() && h.join().unwrap().passed());
        b.params[0] = f32::from_bits(b.params[0].to_bits() ^ 1);
        let mut group = Threads::group(2);
        let mut c1 = group.pop().unwrap();
        let mut c0 = group.pop().unwrap();
        let a = Model::random(4, 3, 1);
        let h = thread::spawn(move || check_identical(&mut c1, &a).unwrap());
        let differ = check_identical(&mut c0, &b).unwrap();
        assert!(!differ.passed());
        assert!(!h.join().unwrap().passed());
    }

    #[test]
    fn batches_wrap_and_cover() {
        let v: Vec<usize> = batch_indices(0, 0, 5).collect();
        assert_eq!(v, vec![0, 1, 2, 3, 4]);
        let v: Vec<usize> = batch_indices(1, 3, 5).collect();
        assert_eq!(v, vec![3, 4, 0]);
        let v: Vec<usize> = batch_indices(2, 3, 5).collect();
        assert_eq!(v, vec![1, 2, 3]);
        let v: Vec<usize> = batch_indices(9, 10, 5).collect();
        assert_eq!(v, vec![0, 1, 2, 3, 4]);
    }
}
