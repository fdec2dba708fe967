//! Multinomial softmax regression: the model, its loss and gradient, and the
//! update step.
//!
//! Parameters are one flat f32 vector, the layout that goes through the
//! allreduce: weights `W[feature][class]` row by row, then the bias
//! `b[class]`. For one sample, `p = softmax(x·W + b)`, the loss is
//! `-ln p[y]`, and its gradient is `x_f (p_c - [c = y])` for `W[f][c]` and
//! `p_c - [c = y]` for `b[c]`. The objective is the mean loss plus
//! `l2/2 · |W|²` (the bias is not regularised).

use crate::data::{Dataset, Fnv};

/// A softmax regression model.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub features: usize,
    pub classes: usize,
    /// `features * classes` weights, then `classes` biases.
    pub params: Vec<f32>,
}

impl Model {
    /// All parameters zero.
    pub fn zeros(features: usize, classes: usize) -> Self {
        Model {
            features,
            classes,
            params: vec![0.0; (features + 1) * classes],
        }
    }

    /// Weights drawn uniformly from [-0.01, 0.01) by a seeded generator
    /// (xorshift64*), biases zero: the same on every machine for a seed.
    pub fn random(features: usize, classes: usize, seed: u64) -> Self {
        let mut m = Model::zeros(features, classes);
        // xorshift needs a non-zero state.
        let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
        if s == 0 {
            s = 1;
        }
        let n = m.weight_count();
        for w in &mut m.params[..n] {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
            // The top 24 bits give a uniform value in [0, 1) exact in f32.
            let u = (r >> 40) as f32 / (1u32 << 24) as f32;
            *w = (u - 0.5) * 0.02;
        }
        m
    }

    /// Number of weights (the biases follow them).
    pub fn weight_count(&self) -> usize {
        self.features * self.classes
    }

    /// Writes the logits of features `x` into `z` (`classes` values), in f64.
    fn logits(&self, x: &[f32], z: &mut [f64]) {
        let (w, b) = self.params.split_at(self.weight_count());
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

    /// Adds the loss gradients of the samples `indices` of `data` to `grad`
    /// (same layout as `params`) and returns the sum of their losses.
    /// Accumulates in f64 so that the local sum adds little rounding of its
    /// own before the exchange.
    pub fn accumulate_gradient(
        &self,
        data: &Dataset,
        indices: impl IntoIterator<Item = usize>,
        grad: &mut [f64],
    ) -> f64 {
        assert_eq!(data.features, self.features, "feature count differs");
        assert_eq!(grad.len(), self.params.len(), "gradient length differs");
        let classes = self.classes;
        let nw = self.weight_count();
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

    /// The objective: mean loss plus `l2/2 · |W|²`.
    pub fn objective(&self, loss_sum: f64, count: f64, l2: f32) -> f64 {
        let sq: f64 = self.params[..self.weight_count()]
            .iter()
            .map(|&w| f64::from(w) * f64::from(w))
            .sum();
        loss_sum / count + 0.5 * f64::from(l2) * sq
    }

    /// One gradient-descent step from the summed gradient of `count`
    /// samples. Done in f32 in a fixed order, so every rank that holds the
    /// same parameters and the same sum computes bitwise the same result.
    pub fn step(&mut self, grad_sum: &[f32], count: f32, lr: f32, l2: f32) {
        assert_eq!(grad_sum.len(), self.params.len(), "gradient length differs");
        let nw = self.weight_count();
        for (i, (p, &g)) in self.params.iter_mut().zip(grad_sum).enumerate() {
            let mut g = g / count;
            if i < nw {
                g += l2 * *p;
            }
            *p -= lr * g;
        }
    }

    /// The most likely class of features `x`.
    pub fn predict(&self, x: &[f32]) -> usize {
        let mut z = vec![0.0f64; self.classes];
        self.logits(x, &mut z);
        // First maximum wins, so ties break the same way everywhere.
        let mut best = 0;
        for (c, &v) in z.iter().enumerate() {
            if v > z[best] {
                best = c;
            }
        }
        best
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
        let data = Dataset {
            features: 3,
            classes: 4,
            x: vec![
                0.1, 0.9, 0.0, //
                1.0, 0.2, 0.5, //
                0.0, 0.0, 0.0, //
                0.7, 0.7, 0.3, //
                0.25, 0.0, 1.0, //
                0.5, 0.5, 0.5,
            ],
            y: vec![0, 3, 1, 2, 3, 0],
        };
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
