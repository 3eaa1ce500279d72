//! Room in the index: the load check every insert makes, the rebuild into an index
//! twice the size (rows never move), and the retry loop of writers that ran out of
//! room mid-batch.

use std::time::Instant;

use super::options::LOAD_FACTOR_TARGET;
use super::{State, Table};
use crate::error::{Error, ErrorKind, Result};
use crate::index::{buckets_for, Index};

impl Table {
    /// True when one more key fits under the table's load limit.
    #[inline]
    pub(super) fn has_room(&self, index: &Index) -> bool {
        (index.len() + 1) as f64 <= self.shared.load_factor_max * index.slot_count() as f64
    }

    /// Runs a write pass over a batch until it is done, growing the index whenever the
    /// pass stops for room: `pass(state, from)` works on the batch from item `from` and
    /// returns `None` when done or `Some(n)` after `n` more items when it needs room.
    /// `progress` says how far the batch got (for a caller that must undo the rest).
    pub(super) fn with_room_from(
        &self,
        progress: &mut usize,
        mut pass: impl FnMut(&State, usize) -> Result<Option<usize>>,
    ) -> Result<()> {
        loop {
            let stopped = {
                let st = self.state()?;
                pass(st.as_ref().unwrap(), *progress)?
            };
            match stopped {
                None => return Ok(()),
                Some(done) => {
                    *progress += done;
                    self.make_room()?;
                }
            }
        }
    }

    /// [`with_room_from`](Self::with_room_from) from the start of the batch.
    pub(super) fn with_room(&self, pass: impl FnMut(&State, usize) -> Result<Option<usize>>) -> Result<()> {
        self.with_room_from(&mut 0, pass)
    }

    /// Grows the index, or says why it cannot.
    pub(super) fn make_room(&self) -> Result<()> {
        // The rebuild copies the index and checks the key count: both need the repair done.
        self.wait_repaired();
        let mut guard = self.shared.state.write();
        let st = guard
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.name)))?;
        let rows = st.index.len();
        if !self.shared.growth {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!(
                    "table {:?} is full: {rows} rows in {} slots (load factor max {}), and growth is off",
                    self.shared.name,
                    st.index.slot_count(),
                    self.shared.load_factor_max
                ),
            ));
        }
        let t0 = Instant::now();
        let old_buckets = st.index.bucket_count();
        let mut buckets = buckets_for(rows.max(1) * 2, LOAD_FACTOR_TARGET).max(old_buckets * 2);
        let generation = self.shared.meta.lock().index_generation + 1;
        let path = super::open::index_path(&self.shared.dir, generation);
        let index = loop {
            let _ = std::fs::remove_file(&path);
            let index = Index::create(&path, buckets, st.index.seed())?;
            let mut ok = true;
            st.index.for_each(0, st.index.bucket_count(), |key, ptr| {
                ok = ok && index.insert_new(key, index.hash(key), ptr);
            });
            if ok {
                break index;
            }
            buckets *= 2;
        };
        if index.len() != rows {
            return Err(Error::corrupt(format!(
                "rebuild of table {:?} saw {} rows, expected {rows}",
                self.shared.name,
                index.len()
            )));
        }
        index.flush()?;
        crate::fsutil::sync_dir(&self.shared.dir)?;
        // The catalog names the new index first: a crash from here on opens it. (The state's
        // write lock is held, so nobody sees the new generation before the new index.)
        self.update_meta(|m| {
            m.index_generation = generation;
            m.grow_count += 1;
        })?;
        let old_path = st.index.path().to_owned();
        if self.shared.runtime.mmap_random {
            index.advise_random();
        }
        st.index = index;
        let _ = std::fs::remove_file(&old_path);
        tracing::info!(
            table = %self.shared.name,
            rows,
            buckets_from = old_buckets,
            buckets_to = buckets,
            seconds = t0.elapsed().as_secs_f64(),
            "table index grown"
        );
        Ok(())
    }
}
