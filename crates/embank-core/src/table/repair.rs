//! The background repair after a killed process.
//!
//! A table a killed process left behind (same boot, so every write it made is in
//! the page cache) serves as soon as it is opened: the index repairs each bucket
//! the first time anyone touches it (`Index::begin_lazy_repair`), writers take
//! fresh records while the free list is unknown, and this thread walks the index
//! in chunks behind them:
//!
//! 1. each chunk under the table's state lock (shared): buckets repaired, keys
//!    counted, every record the index names marked live;
//! 2. at the end, with every writer stripe held (no write in flight): the exact
//!    key count is set and the free list installed — every record handed out
//!    before the crash that is neither live, held by a checkpoint, nor unlinked
//!    by a writer since (`RecordAlloc::note_unlinked`).
//!
//! Growing the index and closing the table wait for the repair to finish;
//! dropping the table stops it (the next open repairs again).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::options::RecoverStats;
use super::{Shared, Table};
use crate::error::Result;
use crate::medium::Medium;

/// Buckets per step of the background pass (the state lock is released in between).
const CHUNK_BUCKETS: u64 = 1 << 14;

/// A running (or finished) background repair.
pub(super) struct Repair {
    started: Instant,
    /// The stats of the open; completed when the repair is done.
    stats: Mutex<RecoverStats>,
    /// True once the thread has stopped (done or abandoned).
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl Repair {
    pub fn new(open: RecoverStats) -> Arc<Repair> {
        Arc::new(Repair {
            started: Instant::now(),
            stats: Mutex::new(RecoverStats { background: true, pending: true, ..open }),
            stopped: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    pub fn stats(&self) -> RecoverStats {
        self.stats.lock().clone()
    }

    /// Waits until the background thread has stopped.
    pub fn wait(&self) {
        let mut stopped = self.stopped.lock();
        while !*stopped {
            self.cv.wait(&mut stopped);
        }
    }

    fn stop(&self) {
        *self.stopped.lock() = true;
        self.cv.notify_all();
    }
}

/// Starts the background thread. `live` has a bit for every record below `limit`
/// that a checkpoint holds; the pass adds those the index names.
pub(super) fn spawn(table: &Table, repair: Arc<Repair>, live: Vec<u64>, limit: u64, throttle: Option<(u64, Duration)>) {
    let weak = Arc::downgrade(&table.shared);
    let job = Arc::new(Mutex::new(Some(live)));
    let (r, j, w) = (Arc::clone(&repair), Arc::clone(&job), weak.clone());
    let spawned =
        std::thread::Builder::new().name(format!("embank-repair-{}", table.shared.config.id)).spawn(move || {
            if let Some(live) = j.lock().take() {
                run(w, &r, live, limit, throttle);
            }
            r.stop();
        });
    if let Err(e) = spawned {
        // Without a thread the repair runs here (the open then takes as long as a full pass).
        tracing::warn!(error = %e, "cannot start the background repair thread; repairing in the open");
        if let Some(live) = job.lock().take() {
            run(weak, &repair, live, limit, None);
        }
        repair.stop();
    }
}

fn run(weak: Weak<Shared>, repair: &Repair, mut live: Vec<u64>, limit: u64, throttle: Option<(u64, Duration)>) {
    let (chunk, pause) = throttle.unwrap_or((CHUNK_BUCKETS, Duration::ZERO));
    // A rollback on first touch ends first: the pass marks the records the index names,
    // which must be the checkpoint's. In chunks, as the pass.
    let mut undone = 0usize;
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let table = Table { shared };
        let Ok(guard) = table.state() else { return };
        if guard.index.undo_pending() {
            undone = guard.index.undo_some(undone, chunk.max(1));
            drop(guard);
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
            continue;
        }
        drop(guard);
        if let Err(e) = table.finish_rollback() {
            // The table then does not close cleanly: the next open rolls back again.
            tracing::error!(table = %table.shared.config.name, error = %e, "rollback failed");
        }
        break;
    }
    let mut next = 0u64;
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let table = Table { shared };
        let Ok(guard) = table.state() else { return };
        let st = &*guard;
        let buckets = st.index.bucket_count();
        if next < buckets {
            let end = (next + chunk.max(1)).min(buckets);
            // Read ahead: this chunk (the first time) and the next, in large requests.
            if next == 0 {
                st.index.will_need(0, end);
            }
            st.index.will_need(end, end + chunk.max(1));
            let alloc = st.medium.alloc();
            st.index.repair_scan(next, end, |_, ptr| alloc.mark_below(&mut live, limit, ptr));
            next = end;
            drop(guard);
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
            continue;
        }
        // Every bucket passed: with no writer in flight, set the count, install the free list.
        let stripes: Vec<_> = table.shared.files.stripes.iter().map(|s| s.lock()).collect();
        let report = st.index.finish_lazy_repair();
        let freed = st.medium.alloc().finish_rebuild(&live);
        drop(stripes);
        let mut stats = repair.stats.lock();
        stats.buckets_interrupted = report.buckets_interrupted;
        stats.slots_dropped = report.slots_dropped;
        stats.records_freed = freed;
        stats.pending = false;
        stats.background_seconds = Some(repair.started.elapsed().as_secs_f64());
        tracing::info!(table = %table.shared.config.name, stats = ?*stats, keys = report.keys, "background repair done");
        return;
    }
}

impl Table {
    /// Finishes a rollback on first touch (if one runs): every key the journal names
    /// returned to the checkpoint, then the journal marked. Before a checkpoint (whose
    /// retention may drop the journal) and a clean close; the background repair calls it
    /// first. An error (a key with no slot to return to) stays: every later call fails.
    pub(crate) fn finish_rollback(&self) -> Result<()> {
        let mut pending = self.shared.repairs.rollback.lock();
        let Some(p) = *pending else { return Ok(()) };
        let st = self.state()?;
        st.index.undo_all().map_err(|e| e.context(format!("rolling back table {:?}", self.shared.config.name)))?;
        self.shared.checkpoints.finish_rollback(p)?;
        *pending = None;
        if let Some(r) = &self.shared.repairs.background {
            r.stats.lock().rollback_seconds = Some(r.started.elapsed().as_secs_f64());
        }
        tracing::info!(table = %self.shared.config.name, seq = p.seq, "rollback on first touch done");
        Ok(())
    }

    /// What recovery repaired when the table was opened after a crash (`None` after a
    /// clean close): the same as `stats().recovered`, without the rest of the stats
    /// (which walk the whole index).
    pub fn recover_stats(&self) -> Option<RecoverStats> {
        self.shared.repairs.background.as_ref().map(|r| r.stats()).or_else(|| self.shared.repairs.recovered.clone())
    }

    /// Waits until the background repair after a crash (if any) is done: the row count
    /// is then exact and the free list complete.
    pub fn wait_repaired(&self) {
        if let Some(r) = &self.shared.repairs.background {
            r.wait();
        }
    }
}
