//! The models: multinomial softmax regression and a multilayer perceptron,
//! their loss and gradient, and the update step.
//!
//! Both are stacks of dense layers ([`Layer`]) over one flat f32 parameter
//! vector, the layout that goes through the allreduce: for each layer its
//! weights `W[input][output]` row by row, then its biases `b[output]`.
//!
//! - [`Arch::Softmax`]: one layer, `p = softmax(x·W + b)`. The loss of a
//!   sample is `-ln p[y]`, its gradient `x_f (p_c - [c = y])` for `W[f][c]`
//!   and `p_c - [c = y]` for `b[c]`. Computed in f64 (this module).
//! - [`Arch::Mlp`]: three layers, ReLU after the first two, softmax after
//!   the last; the same loss. Computed in f32 (the `mlp` module): SSE does
//!   four f32 operations per instruction against two f64, which halves
//!   the emulated work in a TCG guest, and its million-entry accumulator
//!   is the allreduce buffer itself.
//!
//! The objective is the mean loss plus `l2/2 · |W|²` over every layer's
//! weights (the biases are not regularised).

use crate::data::{Dataset, Fnv};
use crate::mlp;

/// Which model: how many dense layers, how wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Softmax regression: one dense layer from the features to the classes.
    Softmax,
    /// Two hidden ReLU layers of `hidden` units each, then a dense layer to
    /// the classes.
    Mlp { hidden: usize },
}

impl Arch {
    /// The width of every stage, inputs first and classes last.
    pub fn widths(self, features: usize, classes: usize) -> Vec<usize> {
        match self {
            Arch::Softmax => vec![features, classes],
            Arch::Mlp { hidden } => vec![features, hidden, hidden, classes],
        }
    }

    /// Number of parameters of this model on `features` and `classes`.
    pub fn param_count(self, features: usize, classes: usize) -> usize {
        self.widths(features, classes)
            .windows(2)
            .map(|w| (w[0] + 1) * w[1])
            .sum()
    }

    /// The name of the kind, as `--model` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Softmax => "softmax",
            Arch::Mlp { .. } => "mlp",
        }
    }

    /// Identifies the model in the settings' fingerprint.
    pub(crate) fn code(self) -> u64 {
        match self {
            Arch::Softmax => 0,
            // Widths are far below 2^63.
            Arch::Mlp { hidden } => 1 | (hidden as u64) << 1,
        }
    }
}

/// Default hidden width of the MLP: 1,126,410 parameters on the digits,
/// a 4.5 MB gradient.
pub const DEFAULT_HIDDEN: usize = 1024;

/// One dense layer's place in the parameter vector: `inputs * outputs`
/// weights from `w`, then `outputs` biases from `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layer {
    pub inputs: usize,
    pub outputs: usize,
    pub w: usize,
    pub b: usize,
}

impl Layer {
    /// The weights, row `k` (input `k`) at `k * outputs`.
    pub fn weights<'a>(&self, params: &'a [f32]) -> &'a [f32] {
        &params[self.w..self.b]
    }

    /// The biases.
    pub fn biases<'a>(&self, params: &'a [f32]) -> &'a [f32] {
        &params[self.b..self.b + self.outputs]
    }

    /// Weights and biases of the same layer of a gradient, mutable.
    pub fn split_mut<'a>(&self, grad: &'a mut [f32]) -> (&'a mut [f32], &'a mut [f32]) {
        grad[self.w..self.b + self.outputs].split_at_mut(self.b - self.w)
    }
}

/// The layers of a stack of the given widths, in parameter order.
pub fn layers(widths: &[usize]) -> Vec<Layer> {
    let mut at = 0;
    widths
        .windows(2)
        .map(|w| {
            let l = Layer {
                inputs: w[0],
                outputs: w[1],
                w: at,
                b: at + w[0] * w[1],
            };
            at = l.b + l.outputs;
            l
        })
        .collect()
}

/// The seeded generator of the initial weights: xorshift64*, the same on
/// every machine for a seed.
struct Xorshift(u64);

impl Xorshift {
    fn new(seed: u64) -> Self {
        // xorshift needs a non-zero state.
        let s = seed ^ 0x9e37_79b9_7f4a_7c15;
        Xorshift(if s == 0 { 1 } else { s })
    }

    /// A uniform value in [0, 1).
    fn unit(&mut self) -> f32 {
        let s = &mut self.0;
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        // The top 24 bits give a uniform value in [0, 1) exact in f32.
        (r >> 40) as f32 / (1u32 << 24) as f32
    }
}

/// A model: its kind, its shape, and its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub arch: Arch,
    pub features: usize,
    pub classes: usize,
    /// Every layer's weights, then its biases (see [`layers`]).
    pub params: Vec<f32>,
}

impl Model {
    /// A model of kind `arch` with all parameters zero.
    pub fn new(arch: Arch, features: usize, classes: usize) -> Self {
        Model {
            arch,
            features,
            classes,
            params: vec![0.0; arch.param_count(features, classes)],
        }
    }

    /// Softmax regression with all parameters zero.
    pub fn zeros(features: usize, classes: usize) -> Self {
        Model::new(Arch::Softmax, features, classes)
    }

    /// Softmax regression with weights drawn uniformly from [-0.01, 0.01)
    /// (see [`Model::init`]).
    pub fn random(features: usize, classes: usize, seed: u64) -> Self {
        Model::init(Arch::Softmax, features, classes, seed)
    }

    /// A model of kind `arch` with its weights drawn by a seeded generator
    /// (xorshift64*), the same on every machine for a seed, and biases
    /// zero. Softmax: uniform in [-0.01, 0.01). MLP: each layer's weights
    /// uniform in ±1/√inputs, as PyTorch's `nn.Linear` draws them.
    pub fn init(arch: Arch, features: usize, classes: usize, seed: u64) -> Self {
        let mut m = Model::new(arch, features, classes);
        let mut rng = Xorshift::new(seed);
        for l in m.layers() {
            let half = match arch {
                Arch::Softmax => 0.01,
                Arch::Mlp { .. } => 1.0 / (l.inputs as f32).sqrt(),
            };
            for w in &mut m.params[l.w..l.b] {
                *w = (rng.unit() - 0.5) * (2.0 * half);
            }
        }
        m
    }

    /// The dense layers, in parameter order.
    pub fn layers(&self) -> Vec<Layer> {
        layers(&self.arch.widths(self.features, self.classes))
    }

    /// Number of weights over all layers (the rest are biases).
    pub fn weight_count(&self) -> usize {
        self.layers().iter().map(|l| l.b - l.w).sum()
    }

    /// Writes the summed loss gradient of the samples `indices` of `data`
    /// into `out` (same layout as `params`; what was there is overwritten)
    /// and returns the sum of their losses.
    pub fn gradient(
        &self,
        data: &Dataset,
        indices: impl IntoIterator<Item = usize>,
        out: &mut [f32],
    ) -> f64 {
        assert_eq!(data.features, self.features, "feature count differs");
        assert_eq!(out.len(), self.params.len(), "gradient length differs");
        match self.arch {
            Arch::Softmax => {
                let mut grad = vec![0.0f64; self.params.len()];
                let loss = self.accumulate_gradient(data, indices, &mut grad);
                for (o, &g) in out.iter_mut().zip(&grad) {
                    *o = g as f32;
                }
                loss
            }
            Arch::Mlp { .. } => mlp::gradient(self, data, indices, out),
        }
    }

    /// Writes the logits of features `x` into `z` (`classes` values), in
    /// f64: softmax regression only.
    fn logits(&self, x: &[f32], z: &mut [f64]) {
        let (w, b) = self.params.split_at(self.classes * self.features);
        for (zc, &bc) in z.iter_mut().zip(b) {
            *zc = f64::from(bc);
        }
        for (f, &xf) in x.iter().enumerate() {
            if xf == 0.0 {
                continue;
            }
            let xf = f64::from(xf);
            let row = &w[f * self.classes..(f + 1) * self.classes];
            for (zc, &wc) in z.iter_mut().zip(row) {
                *zc += xf * f64::from(wc);
            }
        }
    }

    /// Softmax regression only: adds the loss gradients of the samples
    /// `indices` of `data` to `grad` (same layout as `params`) and returns
    /// the sum of their losses. Accumulates in f64 so that the local sum
    /// adds little rounding of its own before the exchange.
    pub fn accumulate_gradient(
        &self,
        data: &Dataset,
        indices: impl IntoIterator<Item = usize>,
        grad: &mut [f64],
    ) -> f64 {
        assert_eq!(self.arch, Arch::Softmax, "the f64 gradient is softmax's");
        assert_eq!(data.features, self.features, "feature count differs");
        assert_eq!(grad.len(), self.params.len(), "gradient length differs");
        let classes = self.classes;
        let nw = classes * self.features;
        let mut z = vec![0.0f64; classes];
        let mut loss = 0.0f64;
        for i in indices {
            let x = data.row(i);
            let y = usize::from(data.y[i]);
            self.logits(x, &mut z);
            // Softmax with the maximum subtracted, so exp cannot overflow.
            let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut total = 0.0;
            for zc in z.iter_mut() {
                *zc = (*zc - max).exp();
                total += *zc;
            }
            for zc in z.iter_mut() {
                *zc /= total;
            }
            loss -= z[y].max(f64::MIN_POSITIVE).ln();
            // z now holds p; the error term is p - onehot(y).
            z[y] -= 1.0;
            for (f, &xf) in x.iter().enumerate() {
                if xf == 0.0 {
                    continue;
                }
                let xf = f64::from(xf);
                let row = &mut grad[f * classes..(f + 1) * classes];
                for (g, &d) in row.iter_mut().zip(&z) {
                    *g += xf * d;
                }
            }
            for (g, &d) in grad[nw..].iter_mut().zip(&z) {
                *g += d;
            }
        }
        loss
    }

    /// The objective: mean loss plus `l2/2 · |W|²`. With `l2` zero the
    /// weights are not read (a million of them cost a pass of their own in
    /// a guest).
    pub fn objective(&self, loss_sum: f64, count: f64, l2: f32) -> f64 {
        if l2 == 0.0 {
            return loss_sum / count;
        }
        let sq: f64 = self
            .layers()
            .iter()
            .flat_map(|l| l.weights(&self.params))
            .map(|&w| f64::from(w) * f64::from(w))
            .sum();
        loss_sum / count + 0.5 * f64::from(l2) * sq
    }

    /// One gradient-descent step from the summed gradient of `count`
    /// samples: `p -= lr/count · g`, plus `lr · l2 · p` for weights. Done
    /// in f32 in a fixed order, so every rank that holds the same
    /// parameters and the same sum computes bitwise the same result. With
    /// `l2` zero the penalty term is left out rather than added as zero:
    /// two float operations a parameter, which is what the update of a
    /// million parameters costs in a TCG guest.
    pub fn step(&mut self, grad_sum: &[f32], count: f32, lr: f32, l2: f32) {
        assert_eq!(grad_sum.len(), self.params.len(), "gradient length differs");
        let scale = lr / count;
        let decay = lr * l2;
        for l in self.layers() {
            let (w, b) = self.params[l.w..l.b + l.outputs].split_at_mut(l.b - l.w);
            let (gw, gb) = grad_sum[l.w..l.b + l.outputs].split_at(l.b - l.w);
            if l2 == 0.0 {
                descend(w, gw, scale);
            } else {
                for (p, &g) in w.iter_mut().zip(gw) {
                    *p -= scale * g + decay * *p;
                }
            }
            descend(b, gb, scale);
        }
    }

    /// The most likely class of features `x`.
    pub fn predict(&self, x: &[f32]) -> usize {
        match self.arch {
            Arch::Softmax => {
                let mut z = vec![0.0f64; self.classes];
                self.logits(x, &mut z);
                argmax(&z)
            }
            Arch::Mlp { .. } => argmax(&mlp::logits(self, x)),
        }
    }

    /// Correctly classified samples of `data`.
    pub fn correct(&self, data: &Dataset) -> usize {
        (0..data.len())
            .filter(|&i| self.predict(data.row(i)) == usize::from(data.y[i]))
            .count()
    }

    /// A 64-bit FNV-1a hash of the parameters' bit patterns: equal
    /// fingerprints mean (barring a collision) bitwise equal models.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        for p in &self.params {
            h.write(&p.to_bits().to_le_bytes());
        }
        h.finish()
    }

    /// Largest absolute difference between two models' parameters; NaN if
    /// a parameter of either model is NaN (or both are the same infinity):
    /// a NaN anywhere is a difference, and NaN fails every `<=` tolerance.
    /// (`f32::max` would drop it: max(NaN, x) is x.)
    pub fn max_abs_diff(&self, other: &Model) -> f32 {
        assert_eq!(self.params.len(), other.params.len(), "model shapes differ");
        self.params
            .iter()
            .zip(&other.params)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, |m: f32, d| {
                if m.is_nan() || d.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            })
    }
}

/// `p -= scale * g` element by element.
fn descend(p: &mut [f32], g: &[f32], scale: f32) {
    for (p, &g) in p.iter_mut().zip(g) {
        *p -= scale * g;
    }
}

/// Index of the first maximum, so that ties break the same way everywhere.
fn argmax<T: PartialOrd + Copy>(z: &[T]) -> usize {
    let mut best = 0;
    for (c, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = c;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny problem: 3 features, 4 classes, 6 samples.
    fn tiny() -> (Model, Dataset) {
        let mut m = Model::random(3, 4, 7);
        // Larger weights than the initial ones, so the softmax is far from
        // uniform and every gradient term matters.
        for (i, p) in m.params.iter_mut().enumerate() {
            *p = *p * 50.0 + (i as f32 * 0.37).sin() * 0.8;
        }
        let data = Dataset::six_samples();
        (m, data)
    }

    /// The summed loss in f64 with the given parameters.
    fn loss(m: &Model, data: &Dataset) -> f64 {
        let mut g = vec![0.0; m.params.len()];
        m.accumulate_gradient(data, 0..data.len(), &mut g)
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (m, data) = tiny();
        let mut grad = vec![0.0; m.params.len()];
        m.accumulate_gradient(&data, 0..data.len(), &mut grad);
        for (i, &analytic) in grad.iter().enumerate() {
            let h = 1e-3f32;
            let mut plus = m.clone();
            plus.params[i] += h;
            let mut minus = m.clone();
            minus.params[i] -= h;
            // The step actually taken after f32 rounding.
            let dx = f64::from(plus.params[i]) - f64::from(minus.params[i]);
            let numeric = (loss(&plus, &data) - loss(&minus, &data)) / dx;
            let err = (numeric - analytic).abs();
            assert!(
                err <= 1e-5 + 1e-4 * analytic.abs(),
                "parameter {i}: analytic {analytic} numeric {numeric}"
            );
        }
    }

    #[test]
    fn loss_of_zero_model_is_ln_classes() {
        let (_, data) = tiny();
        let m = Model::zeros(3, 4);
        let l = loss(&m, &data) / data.len() as f64;
        assert!((l - 4f64.ln()).abs() < 1e-12, "{l}");
        assert_eq!(m.objective(l * 6.0, 6.0, 0.5), l);
    }

    #[test]
    fn gradient_is_additive_over_shards() {
        let (m, data) = tiny();
        let mut whole = vec![0.0; m.params.len()];
        let lw = m.accumulate_gradient(&data, 0..6, &mut whole);
        let mut parts = vec![0.0; m.params.len()];
        let l0 = m.accumulate_gradient(&data, [0, 2, 4], &mut parts);
        let l1 = m.accumulate_gradient(&data, [1, 3, 5], &mut parts);
        assert!((lw - l0 - l1).abs() < 1e-12);
        for (a, b) in whole.iter().zip(&parts) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn descent_lowers_the_objective_and_fits() {
        let (_, data) = tiny();
        let mut m = Model::zeros(3, 4);
        let n = data.len() as f64;
        let start = m.objective(loss(&m, &data), n, 1e-4);
        for _ in 0..500 {
            let mut g = vec![0.0; m.params.len()];
            m.accumulate_gradient(&data, 0..data.len(), &mut g);
            let g: Vec<f32> = g.iter().map(|&v| v as f32).collect();
            m.step(&g, n as f32, 1.0, 1e-4);
        }
        let end = m.objective(loss(&m, &data), n, 1e-4);
        assert!(end < start * 0.5, "objective {start} -> {end}");
        assert!(m.correct(&data) >= 5, "{} of 6", m.correct(&data));
    }

    #[test]
    fn step_regularises_weights_not_bias() {
        let mut m = Model::zeros(1, 2);
        m.params = vec![1.0, 1.0, 1.0, 1.0];
        m.step(&[0.0; 4], 1.0, 0.5, 0.1);
        assert_eq!(m.params, vec![0.95, 0.95, 1.0, 1.0]);
    }

    #[test]
    fn step_covers_every_layer() {
        // 1 feature, hidden 1, 2 classes: w1 b1 w2 b2 w3[2] b3[2].
        let mut m = Model::new(Arch::Mlp { hidden: 1 }, 1, 2);
        assert_eq!(m.params.len(), 8);
        assert_eq!(m.weight_count(), 4);
        let g: Vec<f32> = (0..8).map(|i| i as f32 * 4.0).collect();
        m.step(&g, 2.0, 0.5, 0.0);
        let want: Vec<f32> = (0..8).map(|i| -(i as f32)).collect();
        assert_eq!(m.params, want);
        // The penalty shrinks the weights of every layer, never a bias.
        m.params = vec![1.0; 8];
        m.step(&[0.0; 8], 1.0, 0.5, 0.1);
        assert_eq!(m.params, [0.95, 1.0, 0.95, 1.0, 0.95, 0.95, 1.0, 1.0]);
        let l = m.layers();
        assert_eq!((l[2].w, l[2].b), (4, 6));
    }

    #[test]
    fn random_init_is_seeded_and_small() {
        let a = Model::random(64, 10, 1);
        assert_eq!(a, Model::random(64, 10, 1));
        assert_ne!(a.fingerprint(), Model::random(64, 10, 2).fingerprint());
        assert!(a.params.iter().all(|p| p.abs() <= 0.01));
        assert!(a.params[..640].iter().any(|&p| p != 0.0));
        assert!(a.params[640..].iter().all(|&p| p == 0.0));
    }

    #[test]
    fn max_abs_diff_and_fingerprint() {
        let a = Model::random(2, 3, 5);
        let mut b = a.clone();
        assert_eq!(a.max_abs_diff(&b), 0.0);
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.params[7] += 0.25; // a bias, zero: the difference is exact
        assert_eq!(a.max_abs_diff(&b), 0.25);
        assert_ne!(a.fingerprint(), b.fingerprint());
        // A NaN anywhere, in either model, is a difference.
        for (i, which) in [(0, 0), (7, 1), (8, 0)] {
            let (mut x, mut y) = (a.clone(), a.clone());
            [&mut x, &mut y][which].params[i] = f32::NAN;
            assert!(x.max_abs_diff(&y).is_nan(), "NaN at {i} in model {which}");
            assert!(y.max_abs_diff(&x).is_nan(), "NaN at {i} in model {which}");
        }
        let mut n = a.clone();
        n.params[0] = f32::NAN;
        assert!(n.max_abs_diff(&n.clone()).is_nan(), "NaN in both");
        n.params[0] = f32::INFINITY;
        assert!(n.max_abs_diff(&n.clone()).is_nan(), "infinity in both");
        // -0.0 and 0.0 compare equal but are different bits.
        let mut c = Model::zeros(1, 1);
        let z = c.fingerprint();
        c.params[0] = -0.0;
        assert_ne!(c.fingerprint(), z);
    }
}
