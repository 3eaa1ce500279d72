//! Initializers: the value of a row that was never written.
//!
//! Deterministic per `(seed, key, element)`, so two stores created alike
//! agree on every never-written row, whatever order rows are first touched in.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hash::splitmix64;

/// How rows that were never written are filled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Initializer {
    /// All zeros.
    Zeros,
    /// Uniform in `[low, high)`.
    Uniform { low: f32, high: f32 },
    /// Normal with `mean` and standard deviation `std`.
    Normal { mean: f32, std: f32 },
    /// Every element `value`.
    Constant { value: f32 },
}

impl Default for Initializer {
    /// The default is `Zeros`.
    fn default() -> Self {
        Initializer::Zeros
    }
}

/// The top 53 bits of a 64-bit draw as a float in [0, 1).
#[inline(always)]
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

impl Initializer {
    pub fn validate(&self) -> Result<()> {
        match *self {
            Initializer::Zeros => Ok(()),
            Initializer::Uniform { low, high } => {
                if !(low.is_finite() && high.is_finite() && low < high) {
                    return Err(Error::config(format!(
                        "uniform initializer needs finite low < high, got low={low} high={high}"
                    )));
                }
                Ok(())
            }
            Initializer::Normal { mean, std } => {
                if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
                    return Err(Error::config(format!(
                        "normal initializer needs finite mean and std >= 0, got mean={mean} std={std}"
                    )));
                }
                Ok(())
            }
            Initializer::Constant { value } => {
                if !value.is_finite() {
                    return Err(Error::config(format!("constant initializer must be finite, got {value}")));
                }
                Ok(())
            }
        }
    }

    /// Writes the initial row of `key` into `out` (one row of `out.len()` elements).
    pub fn fill(&self, seed: u64, key: u64, out: &mut [f32]) {
        let base = splitmix64(seed ^ splitmix64(key));
        match *self {
            Initializer::Zeros => out.fill(0.0),
            Initializer::Constant { value } => out.fill(value),
            Initializer::Uniform { low, high } => {
                let (low, span) = (low as f64, (high - low) as f64);
                for (j, x) in out.iter_mut().enumerate() {
                    let v = (low + span * unit(splitmix64(base.wrapping_add(j as u64)))) as f32;
                    // Rounding to f32 can land on `high`; keep the interval half-open.
                    *x = if v >= high_f32(low, span) { low as f32 } else { v };
                }
            }
            Initializer::Normal { mean, std } => {
                // Box-Muller, two normals per pair of uniforms.
                let mut j = 0;
                while j < out.len() {
                    let u1 = unit(splitmix64(base.wrapping_add(2 * j as u64))).max(f64::MIN_POSITIVE);
                    let u2 = unit(splitmix64(base.wrapping_add(2 * j as u64 + 1)));
                    let r = (-2.0 * u1.ln()).sqrt();
                    let theta = std::f64::consts::TAU * u2;
                    out[j] = (mean as f64 + std as f64 * r * theta.cos()) as f32;
                    if j + 1 < out.len() {
                        out[j + 1] = (mean as f64 + std as f64 * r * theta.sin()) as f32;
                    }
                    j += 2;
                }
            }
        }
    }
}

#[inline(always)]
fn high_f32(low: f64, span: f64) -> f32 {
    (low + span) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_key_dependent() {
        let init = Initializer::Normal { mean: 0.0, std: 1.0 };
        let mut a = vec![0.0; 33];
        let mut b = vec![0.0; 33];
        init.fill(5, 42, &mut a);
        init.fill(5, 42, &mut b);
        assert_eq!(a, b);
        init.fill(5, 43, &mut b);
        assert_ne!(a, b);
        init.fill(6, 42, &mut b);
        assert_ne!(a, b);
    }

    #[test]
    fn moments_are_plausible() {
        let init = Initializer::Normal { mean: 1.0, std: 2.0 };
        let mut row = vec![0.0; 64];
        let (mut sum, mut sum2, mut n) = (0.0f64, 0.0f64, 0.0f64);
        for key in 0..2000 {
            init.fill(9, key, &mut row);
            for &x in &row {
                sum += x as f64;
                sum2 += (x as f64) * (x as f64);
                n += 1.0;
            }
        }
        let mean = sum / n;
        let var = sum2 / n - mean * mean;
        assert!((mean - 1.0).abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());

        let init = Initializer::Uniform { low: -0.5, high: 0.25 };
        for key in 0..2000 {
            init.fill(9, key, &mut row);
            assert!(row.iter().all(|&x| (-0.5..0.25).contains(&x)), "{row:?}");
        }
    }

    #[test]
    fn validate_rejects_nonsense() {
        assert!(Initializer::Uniform { low: 1.0, high: 1.0 }.validate().is_err());
        assert!(Initializer::Normal { mean: 0.0, std: -1.0 }.validate().is_err());
        assert!(Initializer::Constant { value: f32::NAN }.validate().is_err());
        assert!(Initializer::Normal { mean: 0.0, std: 0.01 }.validate().is_ok());
    }
}
