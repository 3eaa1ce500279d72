//! Room in the index: the load check every insert makes, the rebuild into an index
//! twice the size (rows never move), and the retry loop of writers that ran out of
//! room mid-batch. Also hot placement, which is the same rebuild at the same size
//! with the hot keys inserted first.

use std::time::Instant;

use super::options::load_target;
use super::{State, Table};
use crate::error::{Error, ErrorKind, Result};
use crate::index::{buckets_for, fits_in_memory, index_file_bytes, mem_available_bytes, Index};

impl Table {
    /// True when one more key fits under the table's load limit.
    #[inline]
    pub(super) fn has_room(&self, index: &Index) -> bool {
        (index.len() + 1) as f64 <= self.shared.config.load_factor_max * index.slot_count() as f64
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
                pass(&st, *progress)?
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
        let mut guard = self.shared.files.state.write();
        let st = guard
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.config.name)))?;
        let rows = st.index.len();
        if !self.shared.config.growth {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!(
                    "table {:?} is full: {rows} rows in {} slots (load factor max {}), and growth is off",
                    self.shared.config.name,
                    st.index.slot_count(),
                    self.shared.config.load_factor_max
                ),
            ));
        }
        let t0 = Instant::now();
        let old_buckets = st.index.bucket_count();
        let target = load_target(self.shared.config.load_factor_max);
        let buckets = buckets_for(rows.max(1) * 2, target).max(old_buckets * 2);
        let (index, buckets, generation) = self.build_index(st, buckets, &[])?;
        self.install_index(st, index, generation, true)?;
        tracing::info!(
            table = %self.shared.config.name,
            rows,
            buckets_from = old_buckets,
            buckets_to = buckets,
            seconds = t0.elapsed().as_secs_f64(),
            "table index grown"
        );
        Ok(())
    }

    /// Builds the next generation of the index from `old` with at least `buckets`
    /// buckets (doubled until every key fits): the keys of `first` that `old` holds are
    /// inserted first, so each lands in its home bucket unless that fills with other
    /// `first` keys; then every other key. Built in DRAM and written once when it fits
    /// ([`Table::new_index`]), so the file is written in order, once. Returns the index,
    /// durable, its bucket count and generation. The caller keeps writers out (the
    /// state's write lock, or the gate).
    fn build_index(&self, st: &State, mut buckets: u64, first: &[u64]) -> Result<(Index, u64, u64)> {
        let old = &st.index;
        let rows = old.len();
        let generation = st.generation + 1;
        let path = super::open::index_path(&self.shared.config.dir, generation);
        let placed: std::collections::HashSet<u64> = first.iter().copied().collect();
        let index = loop {
            let index = self.new_index(&path, buckets, old.seed(), old.units())?;
            // Every key inserted (`Ok(true)`), or one found no slot (`Ok(false)`: more
            // buckets), or the disk is full.
            let mut filled = Ok(true);
            for &key in first {
                if let Some(ptr) = old.get(key, old.hash(key)) {
                    if matches!(filled, Ok(true)) && index.get(key, index.hash(key)).is_none() {
                        filled = index.insert_new(key, index.hash(key), ptr);
                    }
                }
            }
            old.for_each(0, old.bucket_count(), |key, ptr| {
                if matches!(filled, Ok(true)) && !placed.contains(&key) {
                    filled = index.insert_new(key, index.hash(key), ptr);
                }
            });
            match filled {
                Ok(true) => break index,
                Ok(false) => buckets *= 2,
                Err(e) => {
                    drop(index);
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
            }
        };
        let built = index.len();
        if built != rows {
            drop(index);
            let _ = std::fs::remove_file(&path);
            return Err(Error::corrupt(format!(
                "rebuild of table {:?} saw {built} rows, expected {rows}",
                self.shared.config.name
            )));
        }
        Ok((index.persist()?, buckets, generation))
    }

    /// A new, empty index of the next generation at `path` (any left-over there removed):
    /// built in DRAM when it fits comfortably (`index::fits_in_memory`: half of the
    /// memory available), to be written once by [`Index::persist`]; else in the mapped
    /// file, as every index was before, and the log says so.
    pub(super) fn new_index(
        &self,
        path: &std::path::Path,
        buckets: u64,
        seed: u64,
        units: crate::format::RowUnits,
    ) -> Result<Index> {
        let _ = std::fs::remove_file(path);
        if fits_in_memory(buckets) {
            return Index::create_in_memory(path, buckets, seed, units);
        }
        tracing::info!(
            table = %self.shared.config.name,
            index_bytes = index_file_bytes(buckets),
            mem_available_bytes = mem_available_bytes().unwrap_or(0),
            "index rebuilt in its mapped file: built in DRAM it would take over half of the memory available"
        );
        Index::create(path, buckets, seed, units)
    }

    /// Makes a built index the table's: durable, named by the catalog (a crash from
    /// then on opens it; before, the open removes it as a left-over), swapped in. Needs
    /// the state's write lock.
    pub(super) fn install_index(&self, st: &mut State, index: Index, generation: u64, grown: bool) -> Result<()> {
        index.flush()?;
        crate::fsutil::sync_dir(&self.shared.config.dir)?;
        // The catalog names the new index first: a crash from here on opens it. (The state's
        // write lock is held, so nobody sees the new generation before the new index.)
        self.update_meta(|m| {
            m.index_generation = generation;
            if grown {
                m.grow_count += 1;
            }
        })?;
        let old_path = st.index.path().to_owned();
        index.advise(self.shared.runtime.mmap_advice);
        st.index = index;
        st.generation = generation;
        let _ = std::fs::remove_file(&old_path);
        Ok(())
    }

    /// Hot placement: moves `keys` (the hot set, hottest first) into their home index
    /// buckets, so each is found with one bucket read (PETHash's hotness-aware
    /// placement). The index is rebuilt at its size with these keys inserted first, as a
    /// growth rebuilds it, so a crash at any moment reopens the old index or the new one,
    /// whole. `lookup`s go on during the rebuild; writes and pulls of every table of the
    /// store wait for it (it holds the checkpoint gate, as a checkpoint does), about the
    /// time of one pass over the index (see `docs/BENCHMARKS.md`). Keys the table does
    /// not hold are ignored; at most 17 hot keys share a home bucket, the rest land next.
    pub fn place_hot(&self, keys: &[u64]) -> Result<PlaceReport> {
        self.wait_repaired();
        let t0 = Instant::now();
        let _gate = self.shared.runtime.gate.lock.write();
        let (index, generation, before) = {
            let st = self.state()?;
            let before = home_fraction(&st.index, keys);
            let (index, _, generation) = self.build_index(&st, st.index.bucket_count(), keys)?;
            (index, generation, before)
        };
        let after = home_fraction(&index, keys);
        {
            let mut guard = self.shared.files.state.write();
            let st = guard.as_mut().ok_or_else(|| {
                Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.config.name))
            })?;
            self.install_index(st, index, generation, false)?;
        }
        self.shared.counters.placements.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let report = PlaceReport {
            keys: keys.len() as u64,
            home_before: before.0,
            home_after: after.0,
            held: after.1,
            seconds: t0.elapsed().as_secs_f64(),
        };
        tracing::info!(table = %self.shared.config.name, ?report, "hot keys placed");
        Ok(report)
    }

    /// Of `keys` the table holds, the fraction found in their home index bucket (one
    /// bucket read), and how many it holds.
    pub fn home_fraction(&self, keys: &[u64]) -> Result<(f64, u64)> {
        let st = self.state()?;
        Ok(home_fraction(&st.index, keys))
    }
}

/// What a [`Table::place_hot`] did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlaceReport {
    /// Hot keys given.
    pub keys: u64,
    /// Of those the table holds: the fraction in their home bucket before and after.
    pub home_before: f64,
    pub home_after: f64,
    /// Hot keys the table holds.
    pub held: u64,
    pub seconds: f64,
}

fn home_fraction(index: &Index, keys: &[u64]) -> (f64, u64) {
    let (mut held, mut home) = (0u64, 0u64);
    for &k in keys {
        if let Some(f) = index.find(k, index.hash(k)) {
            held += 1;
            if f.bucket == index.home_of(index.hash(k)) {
                home += 1;
            }
        }
    }
    (if held == 0 { 1.0 } else { home as f64 / held as f64 }, held)
}
