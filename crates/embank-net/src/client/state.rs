//! A remote table's rows with their optimizer state (`LOOKUP_WITH_STATE`,
//! `PUSH_WITH_STATE`): state dicts of served tables.

use std::collections::HashSet;

use embank_core::{Error, Result};

use super::table::RemoteTable;
use crate::proto::{self, mask_bytes, Op};

impl RemoteTable {
    /// Elements of a record with its optimizer state: `dim + state_len`.
    fn record_width(&self) -> usize {
        self.dim + self.meta.optimizer.state_len(self.dim)
    }

    /// Rows with their optimizer state (`dim + state_len` f32 each, see
    /// `embank_core::Table::lookup_with_state`) and a found mask; never creates rows. Read
    /// from each shard's primary (a replica keeps no state where reads see it).
    pub fn lookup_with_state(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let w = self.record_width();
        if out.len() != keys.len() * w || found.len() != keys.len() {
            return Err(Error::invalid(format!(
                "lookup_with_state: table {:?} has records of {w} elements (dim {}), so {} keys need {} elements \
                 and {} found flags, got {} and {}",
                self.name,
                self.dim,
                keys.len(),
                keys.len() * w,
                keys.len(),
                out.len(),
                found.len()
            )));
        }
        let plan = self.plan(Op::LookupWithState, keys, None);
        self.client.run(&plan.reqs, |i, _, _, body| {
            let positions = &plan.positions[i];
            let (m, rb) = (mask_bytes(positions.len()), proto::row_bytes(w));
            if body.len() != m + positions.len() * rb {
                return Err(Error::corrupt(format!(
                    "lookup_with_state reply of {} bytes for {} records of {w} elements",
                    body.len(),
                    positions.len()
                )));
            }
            for (j, &p) in positions.iter().enumerate() {
                found[p] = body[j / 8] & (1 << (j % 8)) != 0;
                let src = &body[m + j * rb..m + (j + 1) * rb];
                for (x, b) in out[p * w..(p + 1) * w].iter_mut().zip(src.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Ok(())
        })
    }

    /// Writes rows with their optimizer state (`embank_core::Table::push_with_state`); with
    /// duplicate keys the last record wins. Each shard checks the states as embedded.
    pub fn push_with_state(&self, keys: &[u64], records: &[f32]) -> Result<()> {
        let w = self.record_width();
        if records.len() != keys.len() * w {
            return Err(Error::invalid(format!(
                "push_with_state: table {:?} has records of {w} elements (dim {}), so {} keys need {} elements, got {}",
                self.name,
                self.dim,
                keys.len(),
                keys.len() * w,
                records.len()
            )));
        }
        if let Some(i) = records.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "push_with_state: record of key {} holds a non-finite value ({}); nothing was written",
                keys[i / w],
                records[i]
            )));
        }
        let mut seen = HashSet::with_capacity(keys.len());
        let mut last: Vec<usize> = (0..keys.len()).rev().filter(|&i| seen.insert(keys[i])).collect();
        last.reverse();
        let ukeys: Vec<u64> = last.iter().map(|&i| keys[i]).collect();
        let urecs: Vec<f32> = last.iter().flat_map(|&i| records[i * w..(i + 1) * w].iter().copied()).collect();
        let plan = self.plan_wide(Op::PushWithState, &[], &ukeys, Some(&urecs), w);
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }
}
