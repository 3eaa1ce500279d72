//! The store's shared runtime: what its tables share (the DRAM row cache, the
//! I/O engine of block media, the checkpoint gate) and the maintenance thread
//! that writes dirty rows back, serves `lookahead` requests, sweeps expired rows
//! and does post-checkpoint file work off the caller's path.
//!
//! The thread works on tables through the [`Maintained`] trait, which the table
//! implements: this module does not import the table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::checkpoint::Gate;
use crate::error::{ErrorKind, Result};
use crate::io::IoEngine;
use crate::journal::Journal;
use crate::pooled::PooledCache;
use crate::tier::{Listener, StoreTiers, Tier};

/// Lookahead requests queued at most; more are dropped (and counted), never waited for.
const LOOKAHEAD_QUEUE: usize = 256;
/// How often the maintenance thread checks for dirty rows when idle.
const TICK: Duration = Duration::from_millis(20);
/// How often the maintenance thread evicts expired rows (tables with a TTL).
const TTL_SWEEP: Duration = Duration::from_secs(1);
/// Rows one write-back round takes per table.
const WRITE_BACK_BATCH: usize = 4096;

/// The background work of one table, as the maintenance thread sees it.
pub(crate) trait Maintained: Send + Sync {
    fn name(&self) -> String;
    /// Writes back up to `max` dirty cached rows; returns how many were taken.
    fn write_back(self: Arc<Self>, max: usize) -> Result<usize>;
    /// Whether rows expire (a TTL), so the sweep should visit the table.
    fn has_ttl(&self) -> bool;
    /// Evicts the rows past their TTL.
    fn evict_expired(self: Arc<Self>) -> Result<u64>;
    /// Automatic hot placement: places the sampled hot set if its interval has passed
    /// and too little of it is home; true if it placed.
    fn hot_round(self: Arc<Self>, opts: &crate::hot::HotOptions) -> Result<bool>;
    /// Loads rows into the row cache (the work behind `lookahead`).
    fn warm(self: Arc<Self>, keys: &[u64]) -> Result<()>;
    /// After a checkpoint: deletes the journals of dropped checkpoints, prepares a spare.
    fn housekeep(self: Arc<Self>, dropped: &[u64]);
}

type WeakTable = Weak<dyn Maintained>;

enum Job {
    Lookahead(WeakTable, Vec<u64>),
    /// After a checkpoint: prepare the table's next journal, delete dropped ones, unmap
    /// the replaced one — file work kept off the checkpointing thread.
    Housekeep(WeakTable, Vec<u64>, Option<Arc<Journal>>),
    Stop,
}

pub(crate) struct Runtime {
    /// The store's tiers (the DRAM row cache, a shared tier) and listeners of changes.
    pub tiers: Arc<StoreTiers>,
    /// The pooled-embedding cache of inference bags (absent when its budget is 0).
    pub pooled: Option<Arc<PooledCache>>,
    /// Automatic hot placement (absent: off).
    pub hot: Option<crate::hot::HotOptions>,
    pub io: Arc<dyn IoEngine>,
    /// How mapped files are paged.
    pub mmap_advice: crate::medium::MapAdvice,
    /// How mmap-medium records are written.
    pub row_writes: crate::medium::RowWrites,
    tables: Mutex<Vec<WeakTable>>,
    jobs: Mutex<Option<SyncSender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub lookahead_dropped: AtomicU64,
    pub lookahead_requests: AtomicU64,
    /// The store's checkpoint gate and current interval.
    pub gate: Gate,
}

impl Runtime {
    pub fn new(
        near: Vec<Arc<dyn Tier>>,
        pooled: Option<Arc<PooledCache>>,
        hot: Option<crate::hot::HotOptions>,
        io: Arc<dyn IoEngine>,
        mmap_advice: crate::medium::MapAdvice,
        row_writes: crate::medium::RowWrites,
    ) -> Arc<Runtime> {
        let (tx, rx) = sync_channel(LOOKAHEAD_QUEUE);
        // The pooled-bag cache drops the bags of changed rows.
        let listeners: Vec<Arc<dyn Listener>> = pooled.iter().map(|p| Arc::clone(p) as Arc<dyn Listener>).collect();
        let tier = Arc::new(Runtime {
            tiers: Arc::new(StoreTiers::new(near, listeners)),
            pooled,
            hot,
            io,
            mmap_advice,
            row_writes,
            tables: Mutex::new(Vec::new()),
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(None),
            lookahead_dropped: AtomicU64::new(0),
            lookahead_requests: AtomicU64::new(0),
            gate: Gate::default(),
        });
        let weak = Arc::downgrade(&tier);
        let handle = std::thread::Builder::new()
            .name("embank-maint".into())
            .spawn(move || maintenance(weak, rx))
            .expect("spawn maintenance thread");
        *tier.thread.lock() = Some(handle);
        tier
    }

    pub fn register(&self, table: WeakTable) {
        let mut tables = self.tables.lock();
        tables.retain(|t| t.upgrade().is_some());
        tables.push(table);
    }

    /// Hands post-checkpoint file work to the maintenance thread; does it here if the
    /// queue is full.
    pub fn housekeep(&self, table: Arc<dyn Maintained>, dropped: Vec<u64>, old: Option<Arc<Journal>>) {
        let job = Job::Housekeep(Arc::downgrade(&table), dropped, old);
        let left = match self.jobs.lock().as_ref() {
            Some(tx) => match tx.try_send(job) {
                Ok(()) => None,
                Err(TrySendError::Full(j)) | Err(TrySendError::Disconnected(j)) => Some(j),
            },
            None => Some(job),
        };
        if let Some(Job::Housekeep(_, dropped, old)) = left {
            drop(old);
            table.housekeep(&dropped);
        }
    }

    /// Queues a lookahead; returns false if the queue was full and the hint was dropped.
    pub fn lookahead(&self, table: WeakTable, keys: Vec<u64>) -> bool {
        self.lookahead_requests.fetch_add(1, Ordering::Relaxed);
        let jobs = self.jobs.lock();
        let Some(tx) = jobs.as_ref() else { return false };
        match tx.try_send(Job::Lookahead(table, keys)) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.lookahead_dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Stops the maintenance thread (the store is closing).
    pub fn stop(&self) {
        if let Some(tx) = self.jobs.lock().take() {
            let _ = tx.send(Job::Stop);
        }
        if let Some(handle) = self.thread.lock().take() {
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }

    /// Evicts expired rows of the tables with a TTL.
    fn ttl_round(&self) {
        let tables: Vec<Arc<dyn Maintained>> =
            self.tables.lock().iter().filter_map(|t| t.upgrade()).filter(|t| t.has_ttl()).collect();
        for table in tables {
            let name = table.name();
            if let Err(e) = table.evict_expired() {
                if e.kind() != ErrorKind::Closed {
                    tracing::warn!(table = name, error = %e, "evicting expired rows failed");
                }
            }
        }
    }

    /// Automatic hot placement, table by table.
    fn hot_round(&self) {
        let Some(opts) = &self.hot else { return };
        let tables: Vec<Arc<dyn Maintained>> = self.tables.lock().iter().filter_map(|t| t.upgrade()).collect();
        for table in tables {
            let name = table.name();
            match table.hot_round(opts) {
                Ok(true) => tracing::debug!(table = name, "hot keys placed automatically"),
                Ok(false) => {}
                Err(e) if e.kind() == ErrorKind::Closed => {}
                Err(e) => tracing::warn!(table = name, error = %e, "automatic hot placement failed"),
            }
        }
    }

    fn write_back_round(&self) {
        if !self.tiers.dirty_over_target() {
            return;
        }
        let tables: Vec<Arc<dyn Maintained>> = self.tables.lock().iter().filter_map(|t| t.upgrade()).collect();
        for table in tables {
            let name = table.name();
            if let Err(e) = table.write_back(WRITE_BACK_BATCH) {
                if e.kind() != ErrorKind::Closed {
                    tracing::warn!(table = name, error = %e, "background write-back failed; rows stay dirty");
                }
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}

fn maintenance(tier: Weak<Runtime>, rx: Receiver<Job>) {
    let mut last_sweep = std::time::Instant::now();
    loop {
        let mut next = Some(rx.recv_timeout(TICK));
        // The queued jobs before the next write-back round: a lookahead is a step's rows
        // wanted soon, and one that waits behind write-backs arrives after the step has
        // read them itself (writers write back past their own high-water mark meanwhile).
        // At most a queue's worth, so a steady stream of requests cannot starve the rounds.
        for _ in 0..LOOKAHEAD_QUEUE {
            let job = match next.take() {
                Some(first) => first,
                None => match rx.try_recv() {
                    Ok(job) => Ok(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                },
            };
            match job {
                Ok(Job::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(Job::Housekeep(table, dropped, old)) => {
                    drop(old);
                    if let Some(table) = table.upgrade() {
                        table.housekeep(&dropped);
                    }
                }
                Ok(Job::Lookahead(table, keys)) => {
                    if let Some(table) = table.upgrade() {
                        let name = table.name();
                        if let Err(e) = table.warm(&keys) {
                            tracing::debug!(table = name, error = %e, "lookahead failed");
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => break,
            }
        }
        let Some(tier) = tier.upgrade() else { return };
        tier.write_back_round();
        if last_sweep.elapsed() >= TTL_SWEEP {
            last_sweep = std::time::Instant::now();
            tier.ttl_round();
            tier.hot_round();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::RecordLayout;
    use crate::tier::RowCache;

    /// A table that records what the maintenance thread asks of it.
    struct Recorder {
        events: Mutex<Vec<&'static str>>,
        first_warm: std::sync::atomic::AtomicBool,
    }

    impl Maintained for Recorder {
        fn name(&self) -> String {
            "recorder".into()
        }
        fn write_back(self: Arc<Self>, _max: usize) -> Result<usize> {
            self.events.lock().push("write-back");
            Ok(0)
        }
        fn has_ttl(&self) -> bool {
            false
        }
        fn evict_expired(self: Arc<Self>) -> Result<u64> {
            Ok(0)
        }
        fn hot_round(self: Arc<Self>, _opts: &crate::hot::HotOptions) -> Result<bool> {
            Ok(false)
        }
        fn warm(self: Arc<Self>, _keys: &[u64]) -> Result<()> {
            // The first lookahead takes a while, so the next ones queue behind it.
            if self.first_warm.swap(false, Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
            }
            self.events.lock().push("lookahead");
            Ok(())
        }
        fn housekeep(self: Arc<Self>, _dropped: &[u64]) {}
    }

    #[test]
    fn queued_lookaheads_go_before_the_next_write_back_round() {
        // Dirty rows over the maintenance thread's target, so every round writes back.
        let layout = RecordLayout::new(16, 0, crate::format::DType::F32);
        let cache = Arc::new(RowCache::new(64 << 10));
        let row = vec![1.0f32; 16];
        for k in 0..200 {
            cache.lock(cache.hash(1, k)).insert(1, k, &layout, &row, true, false);
        }
        assert!(cache.dirty_bytes() > cache.dirty_target());
        let io = crate::io::engine(crate::io::IoChoice::Pread, 4).unwrap();
        let rt = Runtime::new(vec![cache], None, None, io, crate::medium::MapAdvice::Default, Default::default());
        let recorder =
            Arc::new(Recorder { events: Mutex::new(Vec::new()), first_warm: std::sync::atomic::AtomicBool::new(true) });
        let table: Arc<dyn Maintained> = recorder.clone();
        rt.register(Arc::downgrade(&table));
        for _ in 0..3 {
            assert!(rt.lookahead(Arc::downgrade(&table), vec![1, 2, 3]));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while recorder.events.lock().iter().filter(|e| **e == "lookahead").count() < 3 {
            assert!(std::time::Instant::now() < deadline, "lookaheads not served: {:?}", recorder.events.lock());
            std::thread::sleep(Duration::from_millis(5));
        }
        rt.stop();
        let seen = recorder.events.lock().clone();
        // (A write-back round of an idle tick may come before the first lookahead.)
        let from = seen.iter().position(|e| *e == "lookahead").unwrap();
        assert_eq!(
            seen[from..from + 3],
            ["lookahead"; 3],
            "the queued lookaheads one after the other, no write-back round between: {seen:?}"
        );
    }
}
