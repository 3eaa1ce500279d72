//! Rows with their optimizer state: what moves a trained table, accumulators and all,
//! between embank and another trainer (TorchRec's fused optimizer state, say). Records
//! here are decoded: the row's `dim` elements, then the optimizer's `state_len`.

use super::Table;
use crate::catalog::MissingDefault;
use crate::error::{Error, Result};
use crate::optim::Optimizer;

impl Table {
    /// `f32`s of optimizer state stored after each row (0 without an optimizer).
    pub fn state_len(&self) -> usize {
        self.shared.config.layout.state_len
    }

    /// Like [`lookup`](Self::lookup), with each row's optimizer state after it: `out`
    /// holds `keys.len() * (dim + state_len)` elements. A missing key gets the table's
    /// missing-row default and the optimizer's initial state, and `found[i] = false`;
    /// nothing is created.
    pub fn lookup_with_state(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let layout = self.shared.config.layout;
        let (w, d) = (layout.elems(), layout.dim);
        if out.len() != keys.len() * w || found.len() != keys.len() {
            return Err(Error::invalid(format!(
                "lookup_with_state: table {:?} has records of {w} elements (dim {d}, state {}), so {} keys \
                 need {} elements and {} found flags, got {} and {}",
                self.shared.config.name,
                layout.state_len,
                keys.len(),
                keys.len() * w,
                keys.len(),
                out.len(),
                found.len()
            )));
        }
        let missing = self.lookup_records(keys, out, found)?;
        let opt = self.optimizer();
        for i in missing {
            let (row, state) = out[i * w..(i + 1) * w].split_at_mut(d);
            match self.shared.config.missing {
                MissingDefault::Zeros => row.fill(0.0),
                MissingDefault::Value { value } => row.fill(value),
                MissingDefault::Init => self.shared.config.init.fill(self.shared.config.seed, keys[i], row),
            }
            opt.init_state(state);
        }
        Ok(())
    }

    /// Writes rows with their optimizer state (insert or replace; with duplicate keys
    /// the last wins): `records` holds `keys.len() * (dim + state_len)` elements. On a
    /// table with a lifecycle, as [`push`](Self::push): rows are admitted at once and room
    /// is made under `rows_max` (evicting victims) first. Refused
    /// with nothing written when a value is not finite or a state is one the optimizer
    /// cannot reach (a negative accumulator, a fractional Adam step count).
    pub fn push_with_state(&self, keys: &[u64], records: &[f32]) -> Result<()> {
        self.check_records("push_with_state", keys, records)?;
        match &self.shared.lifecycle {
            // As a push: admitted at once, room made under `rows_max`, touched.
            Some(life) => self.push_lifecycle(life, keys, || self.push_records(keys, records)),
            None => self.push_records(keys, records),
        }
    }
}

impl Table {
    /// Refuses (an `Invalid` error saying why, as `what`) records that
    /// [`push_with_state`](Self::push_with_state) would refuse: of the wrong length,
    /// holding a non-finite value, or a state the optimizer cannot reach.
    pub(super) fn check_records(&self, what: &str, keys: &[u64], records: &[f32]) -> Result<()> {
        let layout = self.shared.config.layout;
        let (w, d) = (layout.elems(), layout.dim);
        if records.len() != keys.len() * w {
            return Err(Error::invalid(format!(
                "{what}: table {:?} has records of {w} elements (dim {d}, state {}), so {} keys need {} \
                 elements, got {}",
                self.shared.config.name,
                layout.state_len,
                keys.len(),
                keys.len() * w,
                records.len()
            )));
        }
        if let Some(i) = crate::optim::first_non_finite(records) {
            return Err(Error::invalid(format!(
                "{what}: record of key {} holds a non-finite value ({}); nothing was written",
                keys[i / w],
                records[i]
            )));
        }
        let opt = self.optimizer();
        for (key, record) in keys.iter().zip(records.chunks_exact(w)) {
            if let Some(refused) = state_refused(&opt, d, &record[d..]) {
                return Err(Error::invalid(format!(
                    "{what}: the {} state of key {key} is refused: {refused}; nothing was written",
                    opt.name()
                )));
            }
        }
        Ok(())
    }
}

/// Why `state` (of a row of `dim` elements) is not one `opt` can reach, if it is not.
fn state_refused(opt: &Optimizer, dim: usize, state: &[f32]) -> Option<String> {
    let negative = |xs: &[f32], what: &str| xs.iter().find(|&&x| x < 0.0).map(|x| format!("{what} {x} < 0"));
    match opt {
        Optimizer::None | Optimizer::Sgd { .. } => None,
        Optimizer::Adagrad { .. } | Optimizer::RowWiseAdagrad { .. } => negative(state, "accumulator"),
        Optimizer::Ftrl { .. } => negative(&state[dim..], "n"),
        Optimizer::FbgemmAdam { .. }
        | Optimizer::Lamb { .. }
        | Optimizer::PartialRowWiseAdam { .. }
        | Optimizer::PartialRowWiseLamb { .. } => negative(&state[dim..], "second moment"),
        Optimizer::Adam { .. } | Optimizer::AdamW { .. } => {
            let step = state[2 * dim];
            negative(&state[dim..2 * dim], "second moment").or_else(|| {
                (step < 0.0 || step.fract() != 0.0).then(|| format!("step count {step} is not a whole number >= 0"))
            })
        }
    }
}
