//! Zero-copy reads for a server: rows handed out as slices of the mapped rows file,
//! sent with vectored writes while the table's read lock and an epoch guard keep them.

use super::read::resolve;
use super::Table;
use crate::error::{Error, Result};
use crate::layout::f32_bytes;

impl Table {
    /// Calls `f` with the rows of `keys` borrowed from the mapped file, without copying
    /// them (for a server that sends rows straight from the medium with vectored writes).
    /// Each item of `f`'s slice is one row's `dim * 4` bytes, little-endian `f32`, in key
    /// order; rows the table does not hold point into a scratch buffer (with `create`,
    /// rows made by the initializer and stored, as [`pull`](Self::pull) does; without,
    /// the missing-row default, as [`lookup`](Self::lookup) does) and `found` says which.
    ///
    /// The table's read lock and an epoch guard are held while `f` runs: a row overwritten
    /// meanwhile keeps its old bytes (copy-on-write) until `f` returns, so `f` should not
    /// block for long. Returns `Ok(None)` without calling `f` when the table's rows are not
    /// directly addressable (block medium, rows behind a tier, or stored in another type
    /// than `f32`); use [`pull`](Self::pull)/[`lookup`](Self::lookup) then (also the
    /// answer, rarely, when a key is deleted while its missing neighbours are being created).
    pub fn with_rows<R>(
        &self,
        keys: &[u64],
        create: bool,
        f: impl FnOnce(&[&[u8]], &[bool]) -> R,
    ) -> Result<Option<R>> {
        if !self.shared.config.layout.rows_are_f32() {
            return Ok(None);
        }
        self.borrow_rows(keys, create, f)
    }

    /// [`with_rows`](Self::with_rows) for rows as stored, of any element type: each item
    /// of `f`'s slice is one row's `row_bytes()` bytes as
    /// [`lookup_stored`](Self::lookup_stored) returns them (a missing key's: the
    /// missing-row default, encoded). Never creates rows. `Ok(None)` without calling `f`
    /// when the rows are not directly addressable (block medium, rows behind a tier).
    pub fn with_stored_rows<R>(&self, keys: &[u64], f: impl FnOnce(&[&[u8]], &[bool]) -> R) -> Result<Option<R>> {
        self.borrow_rows(keys, false, f)
    }

    /// The body of [`with_rows`](Self::with_rows) and
    /// [`with_stored_rows`](Self::with_stored_rows): the mapped rows' stored bytes.
    fn borrow_rows<R>(&self, keys: &[u64], create: bool, f: impl FnOnce(&[&[u8]], &[bool]) -> R) -> Result<Option<R>> {
        // Tables with admission or eviction keep books of every access: the copying path.
        if self.tiered() || self.shared.lifecycle.is_some() {
            return Ok(None);
        }
        let d = self.dim();
        let layout = self.shared.config.layout;
        let n = keys.len();
        let st = self.state()?;
        let index = &st.index;
        let medium = self.mapped(&st);
        let _pin = crossbeam_epoch::pin();
        let mut ptrs = vec![0u64; n];
        let mut missing = Vec::new();
        // Found rows are prefetched: the kernel copies them out later, have them in cache.
        resolve(index, &medium, keys, &mut ptrs, &mut missing, |_, _| {});
        // The records' keys are checked once every record has been asked for: checking
        // each as it is found would wait for its line before the next key's probe.
        if let Some(i) = (0..n).find(|&i| ptrs[i] != 0 && medium.key_at(ptrs[i]) != keys[i]) {
            return Err(Error::corrupt(format!(
                "table {:?}: the index points key {} at a record of another key",
                self.shared.config.name, keys[i]
            )));
        }
        let mut scratch = vec![0f32; missing.len() * d];
        if !missing.is_empty() {
            let missing_keys: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            if create {
                // Creating rows takes writer locks and may grow the index: not under our read lock.
                drop(st);
                Table::pull(self, &missing_keys, &mut scratch)?;
                return self.with_rows_created(keys, &missing, &scratch, f);
            }
            let positions: Vec<usize> = (0..missing.len()).collect();
            self.fill_missing(&missing_keys, &positions, &mut scratch);
        }
        // The missing rows as stored (f32: the scratch rows' bytes as they are).
        let rb = layout.row_bytes();
        let mut encoded = Vec::new();
        if !layout.rows_are_f32() {
            encoded = vec![0u8; missing.len() * rb];
            crate::layout::encode_rows(layout.dtype, d, &scratch, &mut encoded);
        }
        let missing_rows: &[u8] = if layout.rows_are_f32() { f32_bytes(&scratch) } else { &encoded };
        let mut found = vec![true; n];
        let mut slices: Vec<&[u8]> = Vec::with_capacity(n);
        let mut next_missing = missing.iter().peekable();
        let mut m = 0;
        for (i, &ptr) in ptrs.iter().enumerate() {
            if next_missing.peek() == Some(&&i) {
                next_missing.next();
                found[i] = false;
                slices.push(&missing_rows[m * rb..(m + 1) * rb]);
                m += 1;
            } else {
                slices.push(medium.row_bytes(ptr));
            }
        }
        Ok(Some(f(&slices, &found)))
    }

    /// Second half of [`with_rows`](Self::with_rows) with `create`, once the missing rows
    /// exist: resolves every key again; a key deleted in between is sent as created.
    fn with_rows_created<R>(
        &self,
        keys: &[u64],
        missing: &[usize],
        created: &[f32],
        f: impl FnOnce(&[&[u8]], &[bool]) -> R,
    ) -> Result<Option<R>> {
        let d = self.dim();
        let st = self.state()?;
        let index = &st.index;
        let medium = self.mapped(&st);
        let _pin = crossbeam_epoch::pin();
        let mut found = vec![true; keys.len()];
        for &i in missing {
            found[i] = false;
        }
        let mut slices: Vec<&[u8]> = Vec::with_capacity(keys.len());
        let mut m = 0;
        for (i, &key) in keys.iter().enumerate() {
            let fallback = !found[i];
            if fallback {
                m += 1;
            }
            match index.get(key, index.hash(key)) {
                Some(ptr) if medium.key_at(ptr) == key => slices.push(medium.row_bytes(ptr)),
                _ if fallback => slices.push(f32_bytes(&created[(m - 1) * d..m * d])),
                // Deleted between the two passes: let the caller take the copying path.
                _ => return Ok(None),
            }
        }
        Ok(Some(f(&slices, &found)))
    }
}
