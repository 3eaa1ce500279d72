//! Admission and eviction around the batch calls of a table with a lifecycle
//! (`lifecycle.rs` keeps the books; this file decides per batch): pulls admit
//! keys seen often enough and answer the others with the initializer's row,
//! writes make room under `rows_max` first, `push_grad` drops the gradients of
//! rows not admitted. Evictions are ordinary deletes, so they go through the
//! write protocol (journaled, tiers updated) like any other.

use std::collections::HashSet;

use super::Table;
use crate::error::{Error, Result};
use crate::lifecycle::Lifecycle;

/// A full table (`rows_max`) evicts `rows_max / EVICT_SLACK_DIVISOR` rows more than it must.
const EVICT_SLACK_DIVISOR: u64 = 32;

impl Table {
    /// [`pull`](Self::pull) of a table with admission or eviction: existing rows are read,
    /// missing ones admitted (or answered with the initializer's row, unstored), room made
    /// for the admitted ones, then they are created.
    pub(super) fn pull_lifecycle(&self, life: &Lifecycle, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let _gate = self.shared.runtime.gate.batch();
        let w = self.shared.config.layout.elems();
        let mut records = vec![0f32; keys.len() * w];
        let mut found = vec![false; keys.len()];
        let missing = self.lookup_records(keys, &mut records, &mut found)?;
        if !missing.is_empty() {
            let missing_keys: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            let admit = if life.opts.admits() { life.admit(&missing_keys) } else { vec![true; missing.len()] };
            let (mut new_pos, mut new_keys) = (Vec::new(), Vec::new());
            for (j, &i) in missing.iter().enumerate() {
                if admit[j] {
                    new_pos.push(i);
                    new_keys.push(keys[i]);
                } else {
                    self.init_record(keys[i], &mut records[i * w..(i + 1) * w]);
                }
            }
            if !new_keys.is_empty() {
                self.make_room_for(life, &new_keys, keys)?;
                let mut created = vec![0f32; new_keys.len() * w];
                self.pull_records(&new_keys, &mut created)?;
                for (j, &i) in new_pos.iter().enumerate() {
                    records[i * w..(i + 1) * w].copy_from_slice(&created[j * w..(j + 1) * w]);
                    found[i] = true;
                }
            }
        }
        life.touch((0..keys.len()).filter(|&i| found[i]).map(|i| keys[i]));
        self.copy_rows(&records, out);
        Ok(())
    }

    /// [`push`](Self::push) (and [`push_with_state`](Self::push_with_state)) of a table with
    /// admission or eviction: always creates rows, making room for the new ones first, then
    /// `write`s them.
    pub(super) fn push_lifecycle(
        &self,
        life: &Lifecycle,
        keys: &[u64],
        write: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let _gate = self.shared.runtime.gate.batch();
        life.written(keys);
        if life.opts.rows_max.is_some() {
            let mut records = vec![0f32; keys.len() * self.shared.config.layout.elems()];
            let mut found = vec![false; keys.len()];
            let missing = self.lookup_records(keys, &mut records, &mut found)?;
            let new: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            if !new.is_empty() {
                self.make_room_for(life, &new, keys)?;
            }
        }
        write()?;
        life.touch(keys.iter().copied());
        Ok(())
    }

    /// The gradients of a `push_grad` that a table with admission or eviction applies:
    /// rows not admitted (or evicted since their pull) take no update; with `rows_max`,
    /// room is made for the rows the update creates.
    pub(super) fn grads_lifecycle(
        &self,
        life: &Lifecycle,
        uniq: Vec<u64>,
        sums: Vec<f32>,
    ) -> Result<(Vec<u64>, Vec<f32>)> {
        if !(life.opts.admits() || life.opts.rows_max.is_some()) {
            return Ok((uniq, sums));
        }
        let d = self.dim();
        let mut records = vec![0f32; uniq.len() * self.shared.config.layout.elems()];
        let mut found = vec![false; uniq.len()];
        let missing = self.lookup_records(&uniq, &mut records, &mut found)?;
        if missing.is_empty() {
            return Ok((uniq, sums));
        }
        if !life.opts.admits() {
            let new: Vec<u64> = missing.iter().map(|&i| uniq[i]).collect();
            self.make_room_for(life, &new, &uniq)?;
            return Ok((uniq, sums));
        }
        life.dropped_grads(missing.len() as u64);
        let (mut k2, mut g2) = (Vec::with_capacity(uniq.len()), Vec::with_capacity(sums.len()));
        for (i, &k) in uniq.iter().enumerate() {
            if found[i] {
                k2.push(k);
                g2.extend_from_slice(&sums[i * d..(i + 1) * d]);
            }
        }
        Ok((k2, g2))
    }

    /// Evicts rows until `new` keys (distinct or not, some possibly present by now) fit
    /// under `rows_max`; never evicts a key of `batch`.
    fn make_room_for(&self, life: &Lifecycle, new: &[u64], batch: &[u64]) -> Result<()> {
        let Some(max) = life.opts.rows_max else { return Ok(()) };
        let distinct: HashSet<u64> = new.iter().copied().collect();
        if distinct.len() as u64 > max {
            return Err(Error::invalid(format!(
                "table {:?}: a batch creates {} rows, more than rows_max ({max}); nothing was created",
                self.shared.config.name,
                distinct.len()
            )));
        }
        let _one = life.evicting.lock();
        let len = self.len()?;
        if len + distinct.len() as u64 <= max {
            return Ok(());
        }
        // Evict a little more than needed, so a full table does not evict on every batch.
        let n = (len + distinct.len() as u64 - max + max / EVICT_SLACK_DIVISOR) as usize;
        let spare: HashSet<u64> = batch.iter().copied().collect();
        let victims = life.victims(n, &spare);
        let gone = self.delete(&victims)?;
        life.count_evicted(false, gone);
        Ok(())
    }

    /// Evicts every row of a table with a TTL that was not touched within it; returns how
    /// many. The store's maintenance thread calls it about once a second; call it to
    /// evict at a point of your choosing (after a batch, say).
    pub fn evict_expired(&self) -> Result<u64> {
        let Some(life) = &self.shared.lifecycle else { return Ok(0) };
        let _gate = self.shared.runtime.gate.batch();
        let _one = life.evicting.lock();
        let victims = life.expired();
        if victims.is_empty() {
            return Ok(0);
        }
        let gone = self.delete(&victims)?;
        life.count_evicted(true, gone);
        Ok(gone)
    }
}
