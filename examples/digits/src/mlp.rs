//! The forward and backward pass of [`Arch::Mlp`](crate::model::Arch::Mlp),
//! in f32.
//!
//! Written for a guest under TCG, where every float instruction is
//! emulated: the inner loops are an `axpy` (`y += a·x`) over one weight row
//! and a `dot` of one weight row with a vector, both streaming the rows in
//! memory order, and both vectorised to packed SSE (four f32 an
//! instruction; `dot` keeps eight partial sums in a fixed order, so its
//! result is the same on every machine). Rows whose input is zero (a blank
//! pixel, an inactive ReLU, about half of the hidden units) are skipped in
//! both passes: they add nothing to the output and get a zero gradient.

use crate::data::Dataset;
use crate::model::{Layer, Model};

/// `y += a * x`, element by element.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The dot product of two equally long vectors: eight interleaved partial
/// sums, added in a fixed order, then the tail.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One dense layer: `out = input·W + b`, then ReLU if `relu`. A NaN stays
/// a NaN through the ReLU (so divergence shows in the loss).
fn dense(params: &[f32], l: &Layer, input: &[f32], out: &mut [f32], relu: bool) {
    let w = l.weights(params);
    out.copy_from_slice(l.biases(params));
    for (row, &v) in w.chunks_exact(l.outputs).zip(input) {
        if v != 0.0 {
            axpy(out, v, row);
        }
    }
    if relu {
        for o in out.iter_mut() {
            if *o < 0.0 {
                *o = 0.0;
            }
        }
    }
}

/// The forward pass of features `x`: `acts[l]` gets layer `l`'s output
/// (after the ReLU for hidden layers; the logits for the last).
fn forward(m: &Model, layers: &[Layer], x: &[f32], acts: &mut [Vec<f32>]) {
    let last = layers.len() - 1;
    for (l, layer) in layers.iter().enumerate() {
        let (before, rest) = acts.split_at_mut(l);
        let input: &[f32] = if l == 0 { x } else { &before[l - 1] };
        dense(&m.params, layer, input, &mut rest[0], l < last);
    }
}

/// Activations of every layer, for one sample at a time.
fn buffers(layers: &[Layer]) -> Vec<Vec<f32>> {
    layers.iter().map(|l| vec![0.0; l.outputs]).collect()
}

/// The logits of features `x`.
pub(crate) fn logits(m: &Model, x: &[f32]) -> Vec<f32> {
    let layers = m.layers();
    let mut acts = buffers(&layers);
    forward(m, &layers, x, &mut acts);
    acts.pop().expect("a model has layers")
}

/// Writes the summed gradient of the samples `indices` of `data` into `out`
/// and returns the sum of their losses (see [`Model::gradient`]). The
/// softmax and the loss of the ten logits are computed in f64; everything
/// else in f32, accumulated straight into `out`.
pub(crate) fn gradient(
    m: &Model,
    data: &Dataset,
    indices: impl IntoIterator<Item = usize>,
    out: &mut [f32],
) -> f64 {
    let layers = m.layers();
    let widest = layers.iter().map(|l| l.outputs).max().unwrap_or(0);
    let mut acts = buffers(&layers);
    // The error at a layer's output, and at its input (the previous one's
    // output) while it is computed.
    let (mut delta, mut back) = (vec![0.0f32; widest], vec![0.0f32; widest]);
    let mut p = vec![0.0f64; m.classes];
    out.fill(0.0);
    let mut loss = 0.0f64;
    for i in indices {
        let x = data.row(i);
        let y = usize::from(data.y[i]);
        forward(m, &layers, x, &mut acts);
        let z = acts.last().expect("a model has layers");
        // Softmax with the maximum subtracted, so exp cannot overflow.
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for (pc, &zc) in p.iter_mut().zip(z) {
            *pc = (f64::from(zc) - f64::from(max)).exp();
            total += *pc;
        }
        for pc in p.iter_mut() {
            *pc /= total;
        }
        loss -= p[y].max(f64::MIN_POSITIVE).ln();
        // The error at the logits: p - onehot(y).
        for (c, (d, &pc)) in delta.iter_mut().zip(&p).enumerate() {
            *d = (pc - if c == y { 1.0 } else { 0.0 }) as f32;
        }
        for (l, layer) in layers.iter().enumerate().rev() {
            let input: &[f32] = if l == 0 { x } else { &acts[l - 1] };
            let d = &delta[..layer.outputs];
            let (gw, gb) = layer.split_mut(out);
            for (grow, &v) in gw.chunks_exact_mut(layer.outputs).zip(input) {
                if v != 0.0 {
                    axpy(grow, v, d);
                }
            }
            axpy(gb, 1.0, d);
            if l > 0 {
                // Through the weights, then the previous layer's ReLU: its
                // derivative is 1 where its output is positive, else 0.
                let w = layer.weights(&m.params);
                for ((b, row), &v) in back
                    .iter_mut()
                    .zip(w.chunks_exact(layer.outputs))
                    .zip(input)
                {
                    *b = if v > 0.0 { dot(row, d) } else { 0.0 };
                }
                std::mem::swap(&mut delta, &mut back);
            }
        }
    }
    loss
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::Arch;

    /// A tiny MLP (3 features, two hidden layers of 5, 4 classes) with
    /// weights large enough that the softmax is far from uniform, and 6
    /// samples. (Seed 49 puts every hidden unit's input at least 0.038
    /// from the ReLU's kink, on both sides of it.)
    fn tiny() -> (Model, Dataset) {
        let mut m = Model::init(Arch::Mlp { hidden: 5 }, 3, 4, 49);
        for (i, p) in m.params.iter_mut().enumerate() {
            *p = *p * 2.0 + (i as f32 * 0.71).sin() * 0.3;
        }
        let data = Dataset::six_samples();
        (m, data)
    }

    fn grad(m: &Model, data: &Dataset, idx: impl IntoIterator<Item = usize>) -> (Vec<f32>, f64) {
        let mut g = vec![f32::NAN; m.params.len()];
        let loss = m.gradient(data, idx, &mut g);
        (g, loss)
    }

    /// Every hidden unit's input before the ReLU, over all samples.
    fn pre_activations(m: &Model, data: &Dataset) -> Vec<f32> {
        let layers = m.layers();
        let mut all = Vec::new();
        for i in 0..data.len() {
            let mut input = data.row(i).to_vec();
            for l in &layers[..layers.len() - 1] {
                let mut z = vec![0.0; l.outputs];
                dense(&m.params, l, &input, &mut z, false);
                all.extend_from_slice(&z);
                input = z.iter().map(|&v| v.max(0.0)).collect();
            }
        }
        all
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (m, data) = tiny();
        assert_eq!(m.params.len(), (3 + 1) * 5 + (5 + 1) * 5 + (5 + 1) * 4);
        // Central differences are only valid away from a ReLU's kink: every
        // hidden pre-activation is far from 0 compared to what a step of h
        // moves it, and both sides of the kink occur.
        let h = 1e-3f32;
        let pre = pre_activations(&m, &data);
        assert!(pre.iter().all(|z| z.abs() > 0.02), "{pre:?}");
        assert!(pre.iter().any(|&z| z < 0.0) && pre.iter().any(|&z| z > 0.0));
        let (g, _) = grad(&m, &data, 0..data.len());
        let mut zeros = 0;
        for (i, &analytic) in g.iter().enumerate() {
            let mut plus = m.clone();
            plus.params[i] += h;
            let mut minus = m.clone();
            minus.params[i] -= h;
            // The step actually taken after f32 rounding.
            let dx = f64::from(plus.params[i]) - f64::from(minus.params[i]);
            let numeric = (grad(&plus, &data, 0..6).1 - grad(&minus, &data, 0..6).1) / dx;
            let analytic = f64::from(analytic);
            let err = (numeric - analytic).abs();
            assert!(
                err <= 2e-4 + 2e-3 * analytic.abs(),
                "parameter {i}: analytic {analytic} numeric {numeric}"
            );
            zeros += usize::from(analytic == 0.0);
        }
        // Inactive units give zero gradients, but every layer learns.
        assert!(zeros > 0);
        for l in m.layers() {
            assert!(l.weights(&g).iter().any(|&v| v != 0.0), "{l:?}");
            assert!(l.biases(&g).iter().any(|&v| v != 0.0), "{l:?}");
        }
    }

    #[test]
    fn gradient_is_additive_over_shards() {
        let (m, data) = tiny();
        let (whole, lw) = grad(&m, &data, 0..6);
        let (a, la) = grad(&m, &data, [0, 2, 4]);
        let (b, lb) = grad(&m, &data, [1, 3, 5]);
        assert!((lw - la - lb).abs() < 1e-5, "{lw} {la} {lb}");
        for (i, (w, (x, y))) in whole.iter().zip(a.iter().zip(&b)).enumerate() {
            assert!(
                (w - (x + y)).abs() <= 1e-5 * (1.0 + w.abs()),
                "{i}: {w} {x} {y}"
            );
        }
        // One sample per shard: the shards' sum is the two-sample gradient
        // bit for bit (0 + a + b either way), as the demo's batch has it.
        let (two, _) = grad(&m, &data, [1, 3]);
        let (a, _) = grad(&m, &data, [1]);
        let (b, _) = grad(&m, &data, [3]);
        for (i, (t, (x, y))) in two.iter().zip(a.iter().zip(&b)).enumerate() {
            assert_eq!(*t, x + y, "{i}");
        }
        // What was in the buffer does not matter.
        let mut g = vec![7.0; m.params.len()];
        m.gradient(&data, 0..6, &mut g);
        assert_eq!(g, whole);
    }

    #[test]
    fn descent_lowers_the_objective_and_fits() {
        let (_, data) = tiny();
        let mut m = Model::init(Arch::Mlp { hidden: 16 }, 3, 4, 3);
        let n = data.len() as f64;
        let (_, l) = grad(&m, &data, 0..6);
        let start = m.objective(l, n, 1e-4);
        for _ in 0..300 {
            let (g, _) = grad(&m, &data, 0..6);
            m.step(&g, n as f32, 0.5, 1e-4);
        }
        let (_, l) = grad(&m, &data, 0..6);
        let end = m.objective(l, n, 1e-4);
        assert!(end < start * 0.2, "objective {start} -> {end}");
        assert_eq!(m.correct(&data), 6);
        // Without the penalty the objective is the mean loss.
        assert_eq!(m.objective(l, n, 0.0), l / n);
    }

    #[test]
    fn init_is_seeded_and_scaled_per_layer() {
        let arch = Arch::Mlp { hidden: 1024 };
        assert_eq!(arch.param_count(64, 10), 1_126_410);
        let arch = Arch::Mlp { hidden: 32 };
        let a = Model::init(arch, 64, 10, 1);
        assert_eq!(a, Model::init(arch, 64, 10, 1));
        assert_ne!(a.fingerprint(), Model::init(arch, 64, 10, 2).fingerprint());
        let layers = a.layers();
        assert_eq!(layers.len(), 3);
        assert_eq!(layers[2].b + layers[2].outputs, a.params.len());
        assert_eq!(a.weight_count(), 64 * 32 + 32 * 32 + 32 * 10);
        for l in &layers {
            let bound = 1.0 / (l.inputs as f32).sqrt();
            let w = l.weights(&a.params);
            assert!(w.iter().all(|p| p.abs() <= bound), "{l:?}");
            // Spread over the range, not squeezed near zero.
            assert!(w.iter().any(|p| p.abs() > 0.9 * bound), "{l:?}");
            assert!(l.biases(&a.params).iter().all(|&p| p == 0.0), "{l:?}");
        }
    }

    #[test]
    fn logits_match_the_forward_pass_and_predict() {
        let (m, data) = tiny();
        for i in 0..data.len() {
            let z = logits(&m, data.row(i));
            assert_eq!(z.len(), 4);
            let best = (0..4).fold(0, |b, c| if z[c] > z[b] { c } else { b });
            assert_eq!(m.predict(data.row(i)), best);
        }
        // A blank sample's logits are the network's response to its biases.
        let mut zero = Model::new(Arch::Mlp { hidden: 2 }, 3, 4);
        let n = zero.params.len();
        zero.params[n - 4..].copy_from_slice(&[0.5, -1.0, 2.0, 0.0]);
        assert_eq!(logits(&zero, &[0.3, 0.2, 0.1]), vec![0.5, -1.0, 2.0, 0.0]);
        assert_eq!(zero.predict(&[0.3, 0.2, 0.1]), 2);
    }

    #[test]
    fn dot_and_axpy() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..19).map(|i| (i % 5) as f32 - 1.5).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
        // Small integers and halves: every partial sum is exact.
        assert_eq!(f64::from(dot(&a, &b)), want);
        assert_eq!(
            dot(&a[..3], &b[..3]),
            a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
        );
        assert_eq!(dot(&[], &[]), 0.0);
        let mut y = vec![1.0f32; 19];
        axpy(&mut y, 2.0, &a);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 1.0 + 2.0 * a[i]);
        }
    }
}
