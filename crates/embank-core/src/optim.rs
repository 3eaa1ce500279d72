//! Server-side optimizers: `push_grad` updates rows where they live.
//!
//! A table with an optimizer stores its optimizer state in the same record as
//! the row, after the row's elements, so state never travels and is persisted,
//! cached and recovered with the row:
//!
//! ```text
//! SGD              row[dim]                          (no state)
//! Adagrad          row[dim] | sum of squared grads[dim]
//! row-wise Adagrad row[dim] | sum of mean squared grads (1 element)
//! Adam, AdamW      row[dim] | first moment[dim] | second moment[dim] | step (1 element)
//! FTRL             row[dim] | z[dim] | n[dim]
//! FBGEMM Adam,     row[dim] | first moment[dim] | second moment[dim]
//!   LAMB
//! partial row-wise row[dim] | first moment[dim] | second moment (1 element)
//!   Adam and LAMB
//! ```
//!
//! Updates are per row and lazy (rows not in a `push_grad` are untouched), the
//! semantics of sparse optimizers: Adagrad is exactly PyTorch's `Adagrad` on
//! sparse gradients (`lr_decay = 0`, no weight decay); row-wise Adagrad is FBGEMM's
//! `EXACT_ROWWISE_ADAGRAD` (TorchRec's default: one f32 of state per row instead of
//! `dim`); Adam keeps its step count per row (each row's bias correction uses the
//! number of updates that row received), like TensorFlow's lazy Adam with a per-row
//! step, and AdamW is that Adam with PyTorch's decoupled weight decay; FTRL is
//! FTRL-Proximal (McMahan et al., 2013) per coordinate, with L1 and L2.
//!
//! Two Adams, side by side. embank's `Adam`/`AdamW` count the bias-correction step per
//! row (a step element in each record: a row updated for the 3rd time uses t = 3). FBGEMM's
//! (`EmbOptimType.ADAM`, `PARTIAL_ROWWISE_ADAM`, `LAMB`, `PARTIAL_ROWWISE_LAMB`: the kinds
//! `fbgemm_adam`, `partial_rowwise_adam`, `lamb`, `partial_rowwise_lamb`) use the *table's*
//! step: the training iteration, the same t for every row updated in it, advancing every
//! step whether a row is in it or not. Their records hold no step; the table keeps it
//! ([`Optimizer::uses_table_step`]): `push_grad` of training step t passes it (or, without
//! one, the call is a step of its own, the table's last step + 1), and checkpoints record
//! it. Their update rules are FBGEMM's GPU kernels' (`fbgemm_gpu/codegen/genscript/
//! optimizers.py`; FBGEMM has no CPU kernel of them), weight decay included: decoupled,
//! `lr * weight_decay * w` taken from the row with the step, whatever `weight_decay_mode`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A table's optimizer and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Optimizer {
    /// No optimizer: `push_grad` is refused.
    #[default]
    None,
    /// `w -= lr * g`.
    Sgd { lr: f32 },
    /// `s += g^2; w -= lr * g / (sqrt(s) + eps)`; `s` starts at `initial_accumulator_value`.
    Adagrad { lr: f32, eps: f32, initial_accumulator_value: f32 },
    /// `t += 1; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    /// w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32 },
    /// FBGEMM's exact row-wise Adagrad: `s += mean(g^2); w -= lr * g / (sqrt(s) + eps)`,
    /// one accumulator `s` per row, starting at `initial_accumulator_value`.
    #[serde(rename = "rowwise_adagrad")]
    RowWiseAdagrad { lr: f32, eps: f32, initial_accumulator_value: f32 },
    /// Adam with decoupled weight decay (PyTorch's `AdamW`): `w *= 1 - lr * weight_decay`,
    /// then the Adam step above.
    #[serde(rename = "adamw")]
    AdamW { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// FTRL-Proximal per coordinate: `sigma = (sqrt(n + g^2) - sqrt(n)) / lr;
    /// z += g - sigma w; n += g^2; w = 0 if |z| <= l1 else
    /// -(z - sign(z) l1) / ((beta + sqrt(n)) / lr + l2)`; `n` starts at
    /// `initial_accumulator_value`, `z` at 0.
    Ftrl { lr: f32, beta: f32, l1: f32, l2: f32, initial_accumulator_value: f32 },
    /// FBGEMM's Adam (`EmbOptimType.ADAM`), bias-corrected with the table's step t:
    /// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    /// w -= lr * ((m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * w)`.
    #[serde(rename = "fbgemm_adam")]
    FbgemmAdam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        #[serde(default)]
        weight_decay: f32,
    },
    /// FBGEMM's `PARTIAL_ROWWISE_ADAM`: FBGEMM's Adam with one second moment per row,
    /// `v = b2 v + (1-b2) mean(g^2)`.
    #[serde(rename = "partial_rowwise_adam")]
    PartialRowWiseAdam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        #[serde(default)]
        weight_decay: f32,
    },
    /// FBGEMM's `LAMB`: Adam's moments, bias-corrected with the table's step t, then
    /// `r = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * w;
    /// w -= lr * (||w|| / ||r||) * r` (one trust ratio per row).
    Lamb {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        #[serde(default)]
        weight_decay: f32,
    },
    /// FBGEMM's `PARTIAL_ROWWISE_LAMB`: LAMB with one second moment per row,
    /// `v = b2 v + (1-b2) mean(g^2)`.
    #[serde(rename = "partial_rowwise_lamb")]
    PartialRowWiseLamb {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        #[serde(default)]
        weight_decay: f32,
    },
}

/// The four FBGEMM kinds' rule, shared: whether the second moment is one per row, and
/// whether the step is LAMB's (a per-row trust ratio).
#[derive(Clone, Copy)]
struct TableStepRule {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    rowwise: bool,
    lamb: bool,
}

impl Optimizer {
    /// Elements of state stored after a row of `dim` elements.
    pub fn state_len(&self, dim: usize) -> usize {
        match self {
            Optimizer::None | Optimizer::Sgd { .. } => 0,
            Optimizer::Adagrad { .. } => dim,
            Optimizer::RowWiseAdagrad { .. } => 1,
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => 2 * dim + 1,
            Optimizer::Ftrl { .. } => 2 * dim,
            Optimizer::FbgemmAdam { .. } | Optimizer::Lamb { .. } => 2 * dim,
            Optimizer::PartialRowWiseAdam { .. } | Optimizer::PartialRowWiseLamb { .. } => dim + 1,
        }
    }

    /// True for the kinds whose bias correction uses the table's step (FBGEMM's Adam,
    /// LAMB and their partial row-wise forms), not a step count per row.
    pub fn uses_table_step(&self) -> bool {
        self.table_step_rule().is_some()
    }

    fn table_step_rule(&self) -> Option<TableStepRule> {
        let (lr, beta1, beta2, eps, weight_decay, rowwise, lamb) = match *self {
            Optimizer::FbgemmAdam { lr, beta1, beta2, eps, weight_decay } => {
                (lr, beta1, beta2, eps, weight_decay, false, false)
            }
            Optimizer::PartialRowWiseAdam { lr, beta1, beta2, eps, weight_decay } => {
                (lr, beta1, beta2, eps, weight_decay, true, false)
            }
            Optimizer::Lamb { lr, beta1, beta2, eps, weight_decay } => {
                (lr, beta1, beta2, eps, weight_decay, false, true)
            }
            Optimizer::PartialRowWiseLamb { lr, beta1, beta2, eps, weight_decay } => {
                (lr, beta1, beta2, eps, weight_decay, true, true)
            }
            _ => return None,
        };
        Some(TableStepRule { lr, beta1, beta2, eps, weight_decay, rowwise, lamb })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::None => "none",
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Adagrad { .. } => "adagrad",
            Optimizer::Adam { .. } => "adam",
            Optimizer::RowWiseAdagrad { .. } => "rowwise_adagrad",
            Optimizer::AdamW { .. } => "adamw",
            Optimizer::Ftrl { .. } => "ftrl",
            Optimizer::FbgemmAdam { .. } => "fbgemm_adam",
            Optimizer::PartialRowWiseAdam { .. } => "partial_rowwise_adam",
            Optimizer::Lamb { .. } => "lamb",
            Optimizer::PartialRowWiseLamb { .. } => "partial_rowwise_lamb",
        }
    }

    pub fn lr(&self) -> Option<f32> {
        match *self {
            Optimizer::None => None,
            Optimizer::Sgd { lr }
            | Optimizer::Adagrad { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::RowWiseAdagrad { lr, .. }
            | Optimizer::AdamW { lr, .. }
            | Optimizer::Ftrl { lr, .. }
            | Optimizer::FbgemmAdam { lr, .. }
            | Optimizer::PartialRowWiseAdam { lr, .. }
            | Optimizer::Lamb { lr, .. }
            | Optimizer::PartialRowWiseLamb { lr, .. } => Some(lr),
        }
    }

    /// The same optimizer with another learning rate.
    pub fn with_lr(&self, new: f32) -> Result<Optimizer> {
        let mut o = *self;
        match &mut o {
            Optimizer::None => return Err(Error::config("the table has no optimizer, so no learning rate")),
            Optimizer::Sgd { lr }
            | Optimizer::Adagrad { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::RowWiseAdagrad { lr, .. }
            | Optimizer::AdamW { lr, .. }
            | Optimizer::Ftrl { lr, .. }
            | Optimizer::FbgemmAdam { lr, .. }
            | Optimizer::PartialRowWiseAdam { lr, .. }
            | Optimizer::Lamb { lr, .. }
            | Optimizer::PartialRowWiseLamb { lr, .. } => *lr = new,
        }
        o.validate()?;
        Ok(o)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::config(format!("{} optimizer: {what}", self.name())));
        match *self {
            Optimizer::None => Ok(()),
            Optimizer::Sgd { lr } if !(lr.is_finite() && lr > 0.0) => bad(&format!("lr must be > 0, got {lr}")),
            Optimizer::Sgd { .. } => Ok(()),
            Optimizer::Adagrad { lr, eps, initial_accumulator_value }
            | Optimizer::RowWiseAdagrad { lr, eps, initial_accumulator_value } => {
                if !(lr.is_finite() && lr > 0.0) {
                    return bad(&format!("lr must be > 0, got {lr}"));
                }
                if !(eps.is_finite() && eps >= 0.0) {
                    return bad(&format!("eps must be >= 0, got {eps}"));
                }
                if !(initial_accumulator_value.is_finite() && initial_accumulator_value >= 0.0) {
                    return bad(&format!("initial_accumulator_value must be >= 0, got {initial_accumulator_value}"));
                }
                Ok(())
            }
            Optimizer::Adam { lr, beta1, beta2, eps } | Optimizer::AdamW { lr, beta1, beta2, eps, .. } => {
                if !(lr.is_finite() && lr > 0.0) {
                    return bad(&format!("lr must be > 0, got {lr}"));
                }
                if !((0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2)) {
                    return bad(&format!("betas must be in [0, 1), got ({beta1}, {beta2})"));
                }
                if !(eps.is_finite() && eps >= 0.0) {
                    return bad(&format!("eps must be >= 0, got {eps}"));
                }
                if let Optimizer::AdamW { weight_decay, .. } = *self {
                    if !(weight_decay.is_finite() && weight_decay >= 0.0 && lr * weight_decay < 1.0) {
                        return bad(&format!(
                            "weight_decay must be >= 0 with lr * weight_decay < 1, got {weight_decay}"
                        ));
                    }
                }
                Ok(())
            }
            Optimizer::FbgemmAdam { .. }
            | Optimizer::PartialRowWiseAdam { .. }
            | Optimizer::Lamb { .. }
            | Optimizer::PartialRowWiseLamb { .. } => {
                let r = self.table_step_rule().expect("a table-step kind");
                if !(r.lr.is_finite() && r.lr > 0.0) {
                    return bad(&format!("lr must be > 0, got {}", r.lr));
                }
                if !((0.0..1.0).contains(&r.beta1) && (0.0..1.0).contains(&r.beta2)) {
                    return bad(&format!("betas must be in [0, 1), got ({}, {})", r.beta1, r.beta2));
                }
                if !(r.eps.is_finite() && r.eps >= 0.0) {
                    return bad(&format!("eps must be >= 0, got {}", r.eps));
                }
                if !(r.weight_decay.is_finite() && r.weight_decay >= 0.0) {
                    return bad(&format!("weight_decay must be >= 0, got {}", r.weight_decay));
                }
                Ok(())
            }
            Optimizer::Ftrl { lr, beta, l1, l2, initial_accumulator_value } => {
                if !(lr.is_finite() && lr > 0.0) {
                    return bad(&format!("lr must be > 0, got {lr}"));
                }
                for (name, v) in [("beta", beta), ("l1", l1), ("l2", l2)] {
                    if !(v.is_finite() && v >= 0.0) {
                        return bad(&format!("{name} must be >= 0, got {v}"));
                    }
                }
                if !(initial_accumulator_value.is_finite() && initial_accumulator_value >= 0.0) {
                    return bad(&format!("initial_accumulator_value must be >= 0, got {initial_accumulator_value}"));
                }
                if beta == 0.0 && l2 == 0.0 && initial_accumulator_value == 0.0 {
                    return bad("beta, l2 and initial_accumulator_value are all 0: the first update divides by 0");
                }
                Ok(())
            }
        }
    }

    /// Fills the state of a new row.
    pub fn init_state(&self, state: &mut [f32]) {
        match *self {
            Optimizer::Adagrad { initial_accumulator_value, .. }
            | Optimizer::RowWiseAdagrad { initial_accumulator_value, .. } => state.fill(initial_accumulator_value),
            Optimizer::Ftrl { initial_accumulator_value, .. } => {
                let (z, n) = state.split_at_mut(state.len() / 2);
                z.fill(0.0);
                n.fill(initial_accumulator_value);
            }
            _ => state.fill(0.0),
        }
    }

    /// Applies one update to `record` (`dim` row elements, then the state) with gradient
    /// `g`, as part of the table's training step `step` (counted from 1; only the kinds
    /// that [use the table's step](Self::uses_table_step) read it).
    pub fn apply(&self, record: &mut [f32], g: &[f32], step: u64) {
        let dim = g.len();
        debug_assert_eq!(record.len(), dim + self.state_len(dim));
        if let Some(rule) = self.table_step_rule() {
            debug_assert!(step >= 1, "{}: training steps count from 1", self.name());
            return rule.apply(record, g, step);
        }
        match *self {
            Optimizer::None => {}
            Optimizer::Sgd { lr } => {
                for (w, g) in record.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Optimizer::Adagrad { lr, eps, .. } => {
                // Zipped (no index bounds checks), so the loop vectorizes; the same
                // operations in the same order as the scalar form, so the same bits.
                let (w, s) = record.split_at_mut(dim);
                for ((w, s), &g) in w.iter_mut().zip(&mut s[..dim]).zip(g) {
                    *s += g * g;
                    *w -= lr * g / (s.sqrt() + eps);
                }
            }
            Optimizer::RowWiseAdagrad { lr, eps, .. } => {
                // FBGEMM's CPU kernel: the mean of the squared gradient (summed in f32,
                // in order), one accumulator, one multiplier for the row.
                let (w, s) = record.split_at_mut(dim);
                let mut sum = 0.0f32;
                for &g in g {
                    sum += g * g;
                }
                s[0] += sum / dim as f32;
                let multiplier = lr / (s[0].sqrt() + eps);
                for (w, &g) in w.iter_mut().zip(g) {
                    *w -= multiplier * g;
                }
            }
            Optimizer::Ftrl { lr, beta, l1, l2, .. } => {
                let (w, rest) = record.split_at_mut(dim);
                let (z, n) = rest.split_at_mut(dim);
                for (((w, z), n), &g) in w.iter_mut().zip(&mut z[..dim]).zip(&mut n[..dim]).zip(g) {
                    let n_new = *n + g * g;
                    let sigma = (n_new.sqrt() - n.sqrt()) / lr;
                    *z += g - sigma * *w;
                    *n = n_new;
                    *w = if z.abs() <= l1 { 0.0 } else { -(*z - z.signum() * l1) / ((beta + n.sqrt()) / lr + l2) };
                }
            }
            Optimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                let decay = 1.0 - lr * weight_decay;
                for w in &mut record[..dim] {
                    *w *= decay;
                }
                Optimizer::Adam { lr, beta1, beta2, eps }.apply_adam(record, g);
            }
            Optimizer::Adam { .. } => self.apply_adam(record, g),
            Optimizer::FbgemmAdam { .. }
            | Optimizer::PartialRowWiseAdam { .. }
            | Optimizer::Lamb { .. }
            | Optimizer::PartialRowWiseLamb { .. } => unreachable!("a table-step kind is applied above"),
        }
    }

    /// The Adam step on `record` (row, first moment, second moment, step).
    fn apply_adam(&self, record: &mut [f32], g: &[f32]) {
        let dim = g.len();
        match *self {
            Optimizer::Adam { lr, beta1, beta2, eps } => {
                let (w, rest) = record.split_at_mut(dim);
                let (m, rest) = rest.split_at_mut(dim);
                let (v, t) = rest.split_at_mut(dim);
                t[0] += 1.0;
                let step = t[0];
                // beta^t in f64, rounded once: what the GPU cache's kernels compute (a
                // libm `powf` is not correctly rounded and varies by libm: 0.999f32^2958
                // was an ulp off, and a hot row trained on the device drifted from it).
                let bc1 = 1.0 - pow_rounded(beta1, step);
                let bc2 = 1.0 - pow_rounded(beta2, step);
                for (((w, m), v), &g) in w.iter_mut().zip(&mut m[..dim]).zip(&mut v[..dim]).zip(g) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let mhat = *m / bc1;
                    let vhat = *v / bc2;
                    *w -= lr * mhat / (vhat.sqrt() + eps);
                }
            }
            _ => unreachable!("apply_adam on {}", self.name()),
        }
    }
}

/// `base^t` computed in f64 and rounded to f32 once (see Adam's bias correction).
fn pow_rounded(base: f32, t: f32) -> f32 {
    (base as f64).powf(t as f64) as f32
}

impl TableStepRule {
    /// FBGEMM's kernel for one row (`optimizers.py`: `adam`, `partial_rowwise_adam`,
    /// `lamb`, `partial_rowwise_lamb`), in f32 as there; `t` is FBGEMM's `iter`.
    fn apply(&self, record: &mut [f32], g: &[f32], t: u64) {
        let TableStepRule { lr, beta1, beta2, eps, weight_decay, rowwise, lamb } = *self;
        let dim = g.len();
        let t = t as f32;
        let bc1 = 1.0 - beta1.powf(t);
        let bc2 = 1.0 - beta2.powf(t);
        let (w, rest) = record.split_at_mut(dim);
        let (m, v) = rest.split_at_mut(dim);
        // The row's one second moment and its `sqrt(v_hat) + eps`, for the partial
        // row-wise kinds: the mean of g^2 (summed in f32, in order).
        let row_denominator = if rowwise {
            let mut sum = 0.0f32;
            for &g in g {
                sum += g * g;
            }
            v[0] = beta2 * v[0] + (1.0 - beta2) * (sum / dim as f32);
            (v[0] / bc2).sqrt() + eps
        } else {
            0.0
        };
        // The moments, then r = the step before the learning rate (and LAMB's trust ratio).
        for (m, &g) in m.iter_mut().zip(g) {
            *m = beta1 * *m + (1.0 - beta1) * g;
        }
        if !rowwise {
            for (v, &g) in v.iter_mut().zip(g) {
                *v = beta2 * *v + (1.0 - beta2) * g * g;
            }
        }
        let r = |i: usize, w: f32| {
            let denominator = if rowwise { row_denominator } else { (v[i] / bc2).sqrt() + eps };
            (m[i] / bc1) / denominator + weight_decay * w
        };
        if !lamb {
            for (i, w) in w.iter_mut().enumerate() {
                *w -= lr * r(i, *w);
            }
            return;
        }
        // LAMB: a first pass for the norms of w and r, a second (r computed again, so
        // nothing is allocated per row) for the step.
        let (mut w_sq, mut r_sq) = (0.0f32, 0.0f32);
        for (i, &w) in w.iter().enumerate() {
            let r = r(i, w);
            w_sq += w * w;
            r_sq += r * r;
        }
        // FBGEMM divides without a guard: a zero r (no gradient, no momentum, no decay)
        // gives 0/0 there; here the row stays as it is.
        let trust = if r_sq > 0.0 { w_sq.sqrt() / r_sq.sqrt() } else { 0.0 };
        for (i, w) in w.iter_mut().enumerate() {
            *w -= lr * trust * r(i, *w);
        }
    }
}

/// The position of the first value of `xs` that is not finite (NaN or ±inf).
///
/// The common answer is None over a large batch (every gradient and updated record of
/// a push is checked), so the scan tests blocks with a branch-free fold that the
/// compiler vectorizes and looks inside a block only when it holds one.
pub fn first_non_finite(xs: &[f32]) -> Option<usize> {
    const BLOCK: usize = 256;
    // Not finite: every exponent bit set.
    let bad = |x: &f32| (x.to_bits() & 0x7f80_0000 == 0x7f80_0000) as u32;
    xs.chunks(BLOCK)
        .position(|c| c.iter().fold(0u32, |acc, x| acc | bad(x)) != 0)
        .map(|b| b * BLOCK + xs[b * BLOCK..].iter().position(|x| bad(x) != 0).expect("the block holds one"))
}

/// Sums the gradients of duplicate keys: returns the unique keys (first-seen order)
/// and one summed gradient row per unique key.
pub fn sum_duplicates(keys: &[u64], grads: &[f32], dim: usize) -> (Vec<u64>, Vec<f32>) {
    let mut at = crate::hash::IdMap::<usize>::with_capacity_and_hasher(keys.len(), Default::default());
    let mut uniq = Vec::with_capacity(keys.len());
    let mut sums: Vec<f32> = Vec::with_capacity(grads.len());
    for (i, &k) in keys.iter().enumerate() {
        let g = &grads[i * dim..(i + 1) * dim];
        match at.get(&k) {
            Some(&j) => {
                for (s, x) in sums[j * dim..(j + 1) * dim].iter_mut().zip(g) {
                    *s += x;
                }
            }
            None => {
                at.insert(k, uniq.len());
                uniq.push(k);
                sums.extend_from_slice(g);
            }
        }
    }
    (uniq, sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_finite_finds_the_first() {
        assert_eq!(first_non_finite(&[]), None);
        assert_eq!(first_non_finite(&vec![1.5f32; 1000]), None);
        for (at, bad) in [(0, f32::NAN), (255, f32::INFINITY), (256, f32::NEG_INFINITY), (999, f32::NAN)] {
            let mut xs = vec![-2.0f32; 1000];
            xs[at] = bad;
            // Later ones are not the answer.
            xs.iter_mut().skip(at + 300).for_each(|x| *x = f32::NAN);
            assert_eq!(first_non_finite(&xs), Some(at), "{bad} at {at}");
        }
        // Large finite values, subnormals and negative zero are finite.
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE / 2.0, -0.0]), None);
    }

    #[test]
    fn adagrad_by_hand() {
        let o = Optimizer::Adagrad { lr: 0.5, eps: 0.0, initial_accumulator_value: 0.0 };
        let mut r = [1.0, 2.0, 0.0, 0.0];
        o.apply(&mut r, &[2.0, -1.0], 1);
        // s = [4, 1]; w -= 0.5 * g / sqrt(s) = 0.5 * [1, -1]
        assert_eq!(r, [0.5, 2.5, 4.0, 1.0]);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let o = Optimizer::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0 };
        let mut r = vec![0.0; 2 + 2 * 2 + 1];
        o.apply(&mut r, &[3.0, -0.5], 1);
        // After one step mhat = g and vhat = g^2, so each weight moves by lr * sign(g).
        assert!((r[0] + 0.1).abs() < 1e-6 && (r[1] - 0.1).abs() < 1e-6, "{r:?}");
        assert_eq!(r[6], 1.0, "step count");
    }

    #[test]
    fn rowwise_adagrad_by_hand() {
        let o = Optimizer::RowWiseAdagrad { lr: 0.5, eps: 0.0, initial_accumulator_value: 0.0 };
        let mut r = [1.0, 2.0, 0.0];
        o.apply(&mut r, &[2.0, -2.0], 1);
        // s = mean([4, 4]) = 4; one multiplier 0.5 / 2 for the row.
        assert_eq!(r, [0.5, 2.5, 4.0]);
        o.apply(&mut r, &[0.0, 0.0], 1);
        assert_eq!(r, [0.5, 2.5, 4.0], "a zero gradient changes nothing");
    }

    #[test]
    fn ftrl_against_the_paper_in_f64() {
        let (lr, beta, l1, l2, n0) = (0.1f32, 1.0f32, 0.05f32, 0.01f32, 0.1f32);
        let o = Optimizer::Ftrl { lr, beta, l1, l2, initial_accumulator_value: n0 };
        let dim = 3;
        let mut r = vec![0.2f32, -0.1, 0.0];
        let mut state = vec![0.0f32; 2 * dim];
        o.init_state(&mut state);
        r.extend_from_slice(&state);
        let (mut w, mut z, mut n) = (vec![0.2f64, -0.1, 0.0], vec![0.0f64; dim], vec![f64::from(n0); dim]);
        let (lr, beta, l1, l2) = (f64::from(lr), f64::from(beta), f64::from(l1), f64::from(l2));
        for step in 0..50 {
            let g: Vec<f32> = (0..dim).map(|i| ((step * 7 + i * 3) % 11) as f32 / 10.0 - 0.5).collect();
            o.apply(&mut r, &g, 1);
            for i in 0..dim {
                let g = f64::from(g[i]);
                let sigma = ((n[i] + g * g).sqrt() - n[i].sqrt()) / lr;
                z[i] += g - sigma * w[i];
                n[i] += g * g;
                w[i] = if z[i].abs() <= l1 {
                    0.0
                } else {
                    -(z[i] - z[i].signum() * l1) / ((beta + n[i].sqrt()) / lr + l2)
                };
            }
            for i in 0..dim {
                assert!(
                    (f64::from(r[i]) - w[i]).abs() <= 1e-5 * (1.0 + w[i].abs()),
                    "step {step} w[{i}]: {} vs {}",
                    r[i],
                    w[i]
                );
            }
        }
    }

    #[test]
    fn ftrl_l1_zeroes_small_weights() {
        let o = Optimizer::Ftrl { lr: 0.1, beta: 1.0, l1: 10.0, l2: 0.0, initial_accumulator_value: 0.0 };
        let mut r = vec![0.3, -0.7, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[0.01, -0.02], 1);
        assert_eq!(&r[..2], &[0.0, 0.0], "|z| <= l1 gives an exact zero");
    }

    #[test]
    fn adamw_decays_then_steps_like_adam() {
        let (lr, wd) = (0.1f32, 0.5f32);
        let adamw = Optimizer::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd };
        let adam = Optimizer::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let mut a = vec![1.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let mut b = a.clone();
        adamw.apply(&mut a, &[0.3, 0.4], 1);
        b[0] *= 1.0 - lr * wd;
        b[1] *= 1.0 - lr * wd;
        adam.apply(&mut b, &[0.3, 0.4], 1);
        assert_eq!(a, b);
    }

    #[test]
    fn new_optimizers_by_their_names_in_json() {
        for (json, name, state) in [
            (r#"{"kind":"rowwise_adagrad","lr":0.1,"eps":1e-8,"initial_accumulator_value":0.0}"#, "rowwise_adagrad", 1),
            (r#"{"kind":"adamw","lr":0.1,"beta1":0.9,"beta2":0.999,"eps":1e-8,"weight_decay":0.01}"#, "adamw", 17),
            (r#"{"kind":"ftrl","lr":0.1,"beta":1.0,"l1":0.0,"l2":0.0,"initial_accumulator_value":0.1}"#, "ftrl", 16),
        ] {
            let o: Optimizer = serde_json::from_str(json).unwrap();
            assert_eq!(o.name(), name);
            assert_eq!(o.state_len(8), state);
            o.validate().unwrap();
            assert_eq!(serde_json::from_str::<Optimizer>(&serde_json::to_string(&o).unwrap()).unwrap(), o);
        }
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((f64::from(g) - w).abs() < 1e-6, "{what}: element {i} is {g}, expected {w} (all: {got:?})");
        }
    }

    #[test]
    fn fbgemm_adam_uses_the_tables_step_by_hand() {
        let o = Optimizer::FbgemmAdam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.0 };
        assert!(o.uses_table_step() && o.state_len(2) == 4);
        // Step 1 of a fresh row: m_hat = g, v_hat = g^2, so each weight moves by lr * sign(g).
        let mut r = [1.0, 2.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[3.0, -0.5], 1);
        close(&r, &[0.9, 2.1, 0.3, -0.05, 0.009, 0.00025], "step 1");
        // A fresh row first updated at the table's step 3 (its first update: per-row Adam
        // would move it by lr again): m = 0.1 g, v = 0.001 g^2, m_hat = 0.1 g / (1 - 0.9^3),
        // v_hat = 0.001 g^2 / (1 - 0.999^3): a step of lr * 0.369004 / 0.577639 = lr * 0.638814.
        let mut r = [1.0, 2.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[3.0, -0.5], 3);
        let k = (0.1 / (1.0 - 0.9f64.powi(3))) / (0.001 / (1.0 - 0.999f64.powi(3))).sqrt();
        assert!((k - 0.638_814).abs() < 1e-5, "{k}");
        close(&r[..2], &[1.0 - 0.1 * k, 2.0 + 0.1 * k], "first update at step 3");
        // Weight decay as FBGEMM's kernel: lr * weight_decay * w with the step (decoupled).
        let o = Optimizer::FbgemmAdam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.01 };
        let mut r = [1.0, -2.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[0.5, 0.25], 1);
        close(&r[..2], &[1.0 - 0.1 * (1.0 + 0.01), -2.0 - 0.1 * (1.0 - 0.02)], "weight decay");
    }

    #[test]
    fn partial_rowwise_adam_by_hand() {
        let o = Optimizer::PartialRowWiseAdam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.0 };
        assert!(o.uses_table_step() && o.state_len(2) == 3);
        let mut r = [0.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[3.0, -1.0], 1);
        // v = 0.001 * mean([9, 1]) = 0.005, v_hat = 5: w -= 0.1 * g / sqrt(5).
        let s5 = 5f64.sqrt();
        close(&r, &[-0.3 / s5, 0.1 / s5, 0.3, -0.1, 0.005], "step 1");
        // Step 2 of the table with a zero gradient: the momentum still moves the row.
        o.apply(&mut r, &[0.0, 0.0], 2);
        let (m, v) = ([0.27, -0.09], 0.999 * 0.005);
        let (bc1, bc2) = (1.0 - 0.81, 1.0 - 0.999f64 * 0.999);
        let d = (v / bc2).sqrt();
        close(
            &r,
            &[-0.3 / s5 - 0.1 * m[0] / bc1 / d, 0.1 / s5 - 0.1 * m[1] / bc1 / d, m[0], m[1], v],
            "step 2, no gradient",
        );
    }

    #[test]
    fn lamb_trust_ratio_by_hand() {
        let o = Optimizer::Lamb { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.0 };
        assert!(o.uses_table_step() && o.state_len(2) == 4);
        // ||w|| = 5; step 1: r = sign(g) = [1, -1], ||r|| = sqrt(2); trust = 5 / sqrt(2).
        let mut r = [3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[1.0, -1.0], 1);
        let step = 0.1 * 5.0 / 2f64.sqrt();
        close(&r[..2], &[3.0 - step, 4.0 + step], "step 1");
        // With weight decay: r = sign(g) + wd * w.
        let o = Optimizer::Lamb { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.5 };
        let mut r = [3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[1.0, -1.0], 1);
        let rr: [f64; 2] = [1.0 + 1.5, -1.0 + 2.0];
        let trust = 5.0 / (rr[0] * rr[0] + rr[1] * rr[1]).sqrt();
        close(&r[..2], &[3.0 - 0.1 * trust * rr[0], 4.0 - 0.1 * trust * rr[1]], "weight decay");
        // A zero r (fresh row, zero gradient, no decay) leaves the row as it is (FBGEMM: 0/0).
        let o = Optimizer::Lamb { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut r = [3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[0.0, 0.0], 1);
        assert_eq!(r, [3.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn partial_rowwise_lamb_by_hand() {
        let o = Optimizer::PartialRowWiseLamb { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.0 };
        assert!(o.uses_table_step() && o.state_len(2) == 3);
        // mean(g^2) = 2, v_hat = 2; m_hat = g = [2, 0]; r = [sqrt(2), 0]; trust = 5 / sqrt(2):
        // w -= 0.1 * 5 / sqrt(2) * [sqrt(2), 0] = [0.5, 0].
        let mut r = [3.0, 4.0, 0.0, 0.0, 0.0];
        o.apply(&mut r, &[2.0, 0.0], 1);
        close(&r, &[2.5, 4.0, 0.2, 0.0, 0.002], "step 1");
    }

    #[test]
    fn table_step_kinds_by_their_names_in_json() {
        for name in ["fbgemm_adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"] {
            let json = format!(r#"{{"kind":"{name}","lr":0.1,"beta1":0.9,"beta2":0.999,"eps":1e-8}}"#);
            let o: Optimizer = serde_json::from_str(&json).unwrap();
            assert_eq!(o.name(), name);
            assert!(o.uses_table_step());
            o.validate().unwrap();
            assert_eq!(serde_json::from_str::<Optimizer>(&serde_json::to_string(&o).unwrap()).unwrap(), o);
            let bad = format!(r#"{{"kind":"{name}","lr":0.1,"beta1":0.9,"beta2":0.999,"eps":1e-8,"weight_decay":-1}}"#);
            assert!(serde_json::from_str::<Optimizer>(&bad).unwrap().validate().is_err(), "{name}");
        }
        assert!(!Optimizer::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8 }.uses_table_step());
    }

    #[test]
    fn duplicates_are_summed_in_first_seen_order() {
        let (k, g) = sum_duplicates(&[5, 3, 5, 5], &[1.0, 10.0, 2.0, 4.0], 1);
        assert_eq!(k, vec![5, 3]);
        assert_eq!(g, vec![7.0, 10.0]);
    }

    #[test]
    fn bad_hyper_parameters_are_config_errors() {
        assert!(Optimizer::Sgd { lr: 0.0 }.validate().is_err());
        assert!(Optimizer::Adam { lr: 0.1, beta1: 1.0, beta2: 0.9, eps: 1e-8 }.validate().is_err());
        assert!(Optimizer::None.with_lr(0.1).is_err());
        assert!(Optimizer::RowWiseAdagrad { lr: 0.1, eps: -1.0, initial_accumulator_value: 0.0 }.validate().is_err());
        assert!(Optimizer::Ftrl { lr: 0.1, beta: 0.0, l1: 0.0, l2: 0.0, initial_accumulator_value: 0.0 }
            .validate()
            .is_err());
        let adamw = Optimizer::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 20.0 };
        assert!(adamw.validate().is_err(), "lr * weight_decay >= 1 would flip the sign of every row");
        assert_eq!(Optimizer::Sgd { lr: 0.1 }.with_lr(0.2).unwrap().lr(), Some(0.2));
    }
}
