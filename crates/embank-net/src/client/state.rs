//! A remote table's rows with their optimizer state (`LOOKUP_WITH_STATE`,
//! `PUSH_WITH_STATE`): state dicts of served tables.

use embank_core::{Error, Result};

use super::table::{last_of_each, scatter_wide, RemoteTable};
use crate::proto::{mask_bytes, Op};

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
            let m = mask_bytes(positions.len());
            if body.len() < m {
                return Err(Error::corrupt("lookup_with_state reply shorter than its mask"));
            }
            for (j, &p) in positions.iter().enumerate() {
                found[p] = body[j / 8] & (1 << (j % 8)) != 0;
            }
            scatter_wide(&body, m, positions, out, w)?;
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
        let (ukeys, urecs) = last_of_each(keys, records, w);
        let plan = self.plan_wide(Op::PushWithState, &[], &ukeys, Some(&urecs), w);
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }
}
