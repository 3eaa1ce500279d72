//! embank's GPU cache, driven from Rust: a lookup is one native call (ids in, rows out,
//! on the caller's stream), no Python between kernels and no interpreter lock held
//! while misses are fetched from the table.
//!
//! [`GpuTable`] keeps the hot rows of one [`TableApi`] table in device memory in the
//! layout of `kernels/cache.cu` (buckets of up to 128 slots: keys, digests, scores,
//! rows; a version a bucket). A lookup:
//!
//! 1. under the cache's launch lock, orders itself after the cache's previous launch
//!    (one event), applies the invalidations that change notices queued
//!    ([`GpuTable::listener`]), launches **find** (find + touch + gather + the misses
//!    compacted, one launch) and copies the miss count and the misses to pinned memory;
//! 2. *sync*: waits for that copy (the one host sync); with misses, reads their rows from
//!    the table straight into pinned memory (as stored: f16/int8 rows are decoded on the
//!    device), copies them up in one copy and launches **fill** (answers the misses and
//!    inserts the new keys, one warp a bucket, one launch);
//!    *async*: returns at once (misses answered with the default row); the background
//!    inserter waits for the copy, fetches and inserts on its own stream.
//!
//! Every buffer is allocated once and grown on demand (a pool of per-call scratch);
//! nothing is allocated per call in the steady state.
//!
//! The kernels run on CUDA through [`device::Cuda`] (libcuda loaded at run time, the PTX
//! compiled by the driver), or on the CPU through the emulator (feature `emulator`).

mod args;
pub mod device;
mod insert;
mod lookup;
mod mem;
mod refresh;
pub mod train;

use std::collections::{HashMap, VecDeque};

use args::{bytes_of, CacheDesc, CountArgs, FillArgs, FindArgs, InvalidateArgs, PoolArgs, Report};
use mem::{Buffer, FillLayout, FindLayout, Host, Scratch};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use embank_core::{Changed, Listener};
use embank_core::{DType, Error, ErrorKind, Result, TableApi};
use parking_lot::{Condvar, Mutex};

pub use device::{Device, Event, Kernel, Stream};
pub use train::{Missed, Placed, Rule, RuleKind, TrainKernels, TrainLayout};

const LOCKED_KEY: u64 = u64::MAX - 1;
/// Miss ids a lookup copies to the host with the count, at least.
const MISS_HINT_MIN: usize = 1024;
/// Lookups whose misses may wait for the background inserter at once; more are dropped.
const ASYNC_JOBS_MAX: usize = 16;
/// Misses an async lookup records for the background insert, at most (the rest are
/// answered with the default row all the same, and counted as dropped): its scratch
/// stays small however large the batch, and several are in flight.
pub const ASYNC_MISS_CAP: usize = 1 << 16;
/// Lookups of at most this many warps (ids, or bags) have their last warp write the miss
/// count and misses into mapped pinned memory (no copy launched); larger ones copy them
/// (a fence and an atomic a warp would cost them more: 3.0 against 0.76 G keys/s at 1 M
/// ids on an H200).
pub const REPORT_WARPS_MAX: usize = 4096;
/// Async lookups left unread before a lookup polls them (an event query each).
const POLL_AT: usize = 2;
/// Rows a refresh reads from the table a chunk, by default (two chunk buffers of pinned
/// memory: 2 x 35 MB at dim 128).
pub const REFRESH_CHUNK: usize = 1 << 16;
// Device counters (cache.cu's C_*).
const C_INVALIDATED: usize = 0;
const C_SYNC_INSERTS: u32 = 1;
const C_ASYNC_INSERTS: u32 = 2;
const C_REFUSED: usize = 3;
const C_EVICTIONS: usize = 4;
const C_REFRESH_CHANGED: usize = 5;
const C_ROWS: usize = 6;
const COUNTERS: usize = 8;
/// Words before a find's misses in its payload: the two miss counts, the warps done
/// (cache.cu's `Report::done`), a pad.
pub(crate) const PAYLOAD_HEAD: usize = 4;
/// Where a background fill starts in a scratch: past the miss counts it must keep.
const FILL_BASE: usize = 256;

/// The bucket of a key's hash among `n_buckets`: cache.cu's `bucket_of`.
pub fn bucket_of(h: u64, n_buckets: u64) -> u64 {
    ((h & 0xffff_ffff) * n_buckets) >> 32
}

/// splitmix64's finalizer: cache.cu's `mix`, `embank.gpu.key_hash`.
pub fn mix(k: u64) -> u64 {
    let mut h = k ^ (k >> 30);
    h = h.wrapping_mul(0xbf58476d1ce4e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d049bb133111eb);
    h ^ (h >> 31)
}

/// Element type of the cached rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowType {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

impl RowType {
    fn bytes(self) -> usize {
        if self == RowType::F32 {
            4
        } else {
            2
        }
    }
}

/// Which slot a new key takes, and what a hit does to its score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Score: the clock of the last use.
    Lru = 0,
    /// Score: uses; a new key starts at 1.
    Lfu = 1,
    /// Score: the caller's (a hit keeps the larger).
    Custom = 2,
}

/// When a lookup's misses are inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// Before the lookup returns (one host sync).
    Sync,
    /// In the background; misses are answered with the default row (no host sync).
    Async,
    /// Async once the window's hit rate reaches the threshold.
    Auto,
}

/// How a cache is made.
#[derive(Clone, Debug)]
pub struct Options {
    pub n_buckets: usize,
    /// Slots a bucket: a power of two up to 128.
    pub slots: usize,
    pub row_type: RowType,
    pub policy: Policy,
    pub insert: Insert,
    pub hit_rate_threshold: f64,
    pub window: usize,
    /// The row of an async miss (`dim` values).
    pub default_row: Vec<f32>,
    /// Fetch f16/int8 rows as stored and decode them on the device.
    pub stored_rows: bool,
    /// Misses an async lookup records for the background insert, at most
    /// ([`ASYNC_MISS_CAP`] by default); the rest are answered and counted as dropped.
    pub async_miss_cap: usize,
    /// Lookups of at most this many warps report their misses from the kernel
    /// ([`REPORT_WARPS_MAX`] by default); larger ones copy them.
    pub report_warps_max: usize,
    /// Rows a refresh reads from the table a chunk ([`REFRESH_CHUNK`] by default); a
    /// reader takes at least a 64th of a chunk.
    pub refresh_chunk: usize,
}

/// Counts kept on the host.
#[derive(Clone, Debug, Default)]
pub struct HostStats {
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub default_answers: u64,
    pub async_dropped: u64,
    pub async_errors: u64,
    pub refreshes: u64,
    pub refresh_rows: u64,
    pub refresh_changed: u64,
    pub refresh_bytes: u64,
    pub refresh_seconds: f64,
    pub notices: u64,
    /// Per-call scratch buffers (device and pinned) allocated: a pool's growth; steady
    /// once as many are held as calls are in flight.
    pub scratch_allocations: u64,
    pub host_syncs: u64,
}

/// Everything [`GpuTable::stats`] reports.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub host: HostStats,
    pub window_hit_rate: Option<f64>,
    pub invalidated: u64,
    pub sync_inserts: u64,
    pub async_inserts: u64,
    pub insert_refused: u64,
    pub evictions: u64,
    pub rows_cached: u64,
    pub rows_max: u64,
    pub bytes: u64,
}

/// What [`GpuTable::refresh`] did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Refreshed {
    pub rows: u64,
    pub changed: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// Of `seconds`: the buffers (allocated by the first refresh, then kept) and the
    /// snapshot of the cache's keys (copied down, the live slots listed).
    pub setup_seconds: f64,
    /// Of `seconds`: the host waiting for its readers of the table (the chunks' rows, keys
    /// and slots written into pinned memory).
    pub read_seconds: f64,
    /// Of `seconds`: the host waiting for the device (a buffer's copy and launch before
    /// it is refilled, and the last ones).
    pub wait_seconds: f64,
    /// Reader threads.
    pub threads: u64,
}

/// What a pooled lookup adds to a plain one: the bags (device addresses).
#[derive(Clone, Copy, Debug)]
pub struct Bags {
    /// i64 offsets: where each bag starts (the last ends at the ids' end).
    pub offsets: u64,
    pub bags: usize,
    /// f32 per-sample weights (sum), or 0.
    pub weights: u64,
    /// Mean instead of sum.
    pub mean: bool,
}

// ---- the cache ----

struct State {
    /// The event after the cache's last launch, and its stream: the next launch waits
    /// for it (on the device), unless it goes to the same stream.
    last: Event,
    last_stream: Option<Stream>,
    clock: u64,
    miss_hint: usize,
    window: VecDeque<(u64, u64)>,
    inval: Option<Scratch>,
    /// Where the device's counters are copied down (kept: pinned memory is slow to
    /// allocate and its free may wait for the device; stats are read often).
    counters_host: Option<Host>,
}

struct Job {
    scratch: Scratch,
    n: usize,
    count_hint: usize,
    parity: usize,
    /// Misses recorded at most: more were answered with the default and not inserted.
    cap: usize,
}

struct Queue {
    jobs: VecDeque<Job>,
    busy: bool,
    closed: bool,
    error: Option<String>,
}

struct Inner {
    dev: Arc<dyn Device>,
    table: Arc<dyn TableApi>,
    desc: CacheDesc,
    dim: usize,
    stored: u32,
    row_bytes: usize,
    opts: Options,
    _arrays: Vec<Buffer>,
    dflt: Buffer,
    /// The event after the cache's last launch: the next waits for it (the launch lock).
    order: Event,
    side: Stream,
    state: Mutex<State>,
    pool: Mutex<Vec<Scratch>>,
    /// The refresh's buffers, kept between refreshes.
    refreshing: Mutex<Option<refresh::Kept>>,
    pending: Mutex<Vec<u64>>,
    /// Async lookups whose miss counts were not read yet, oldest first.
    unread: Mutex<VecDeque<Job>>,
    stats: Mutex<HostStats>,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    closed: AtomicBool,
    /// The insert mode now ([`Insert`] as u8): [`GpuTable::set_insert`] changes it.
    insert: AtomicU8,
}

/// A GPU cache of one table (see the crate's text).
pub struct GpuTable {
    inner: Arc<Inner>,
    inserter: Mutex<Option<JoinHandle<()>>>,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidInput, msg)
}

impl GpuTable {
    /// A cache of `table` on `dev`, empty.
    pub fn new(dev: Arc<dyn Device>, table: Arc<dyn TableApi>, opts: Options) -> Result<GpuTable> {
        let dim = table.dim();
        let s = opts.slots;
        if s == 0 || s > 128 || !s.is_power_of_two() {
            return Err(invalid(format!("slots must be a power of two up to 128, got {s}")));
        }
        if opts.n_buckets == 0 || opts.n_buckets > u32::MAX as usize {
            return Err(invalid(format!("buckets must be in 1..2^32, got {}", opts.n_buckets)));
        }
        if opts.default_row.len() != dim {
            return Err(invalid(format!("the default row has {} values for dim {dim}", opts.default_row.len())));
        }
        let meta = table.meta();
        let (stored, row_bytes) = match (opts.stored_rows, meta.dtype) {
            (true, DType::F16) => (1, meta.dtype.row_bytes(dim)),
            (true, DType::Int8) => (2, meta.dtype.row_bytes(dim)),
            _ => (0, 4 * dim),
        };
        let _cx = dev.enter()?;
        let slots_total = opts.n_buckets * s;
        let keys = Buffer::new(&dev, slots_total * 8)?;
        let digests = Buffer::new(&dev, slots_total)?;
        let scores = Buffer::new(&dev, slots_total * 8)?;
        let rows = Buffer::new(&dev, slots_total * dim * opts.row_type.bytes())?;
        let versions = Buffer::new(&dev, opts.n_buckets * 4)?;
        let counters = Buffer::new(&dev, COUNTERS * 8)?;
        let side = dev.stream()?;
        dev.memset(keys.ptr, 0xff, keys.bytes, side)?;
        dev.memset(digests.ptr, 0, digests.bytes, side)?;
        dev.memset(scores.ptr, 0, scores.bytes, side)?;
        dev.memset(rows.ptr, 0, rows.bytes, side)?;
        dev.memset(versions.ptr, 0, versions.bytes, side)?;
        dev.memset(counters.ptr, 0, counters.bytes, side)?;
        let dflt = Buffer::new(&dev, dim * 4)?;
        let mut staging = Host::new(&dev, dim * 4)?;
        for (i, v) in opts.default_row.iter().enumerate() {
            staging.slice_mut(4 * i, 4).copy_from_slice(&v.to_le_bytes());
        }
        // SAFETY: staging lives until the wait below.
        unsafe { dev.htod(dflt.ptr, staging.ptr, dim * 4, side)? };
        let order = dev.event()?;
        dev.record(order, side)?;
        dev.wait(order)?;
        drop(staging);
        let desc = CacheDesc {
            keys: keys.ptr,
            digests: digests.ptr,
            scores: scores.ptr,
            rows: rows.ptr,
            versions: versions.ptr,
            counters: counters.ptr,
            clock: 0,
            n_buckets: opts.n_buckets as u32,
            slots: s as u32,
            dim: dim as u32,
            dtype: opts.row_type as u32,
            policy: opts.policy as u32,
            pad: 0,
        };
        let insert = AtomicU8::new(opts.insert as u8);
        let inner = Arc::new(Inner {
            dev,
            table,
            desc,
            dim,
            stored,
            row_bytes,
            opts,
            _arrays: vec![keys, digests, scores, rows, versions, counters],
            dflt,
            order,
            side,
            state: Mutex::new(State {
                last: order,
                last_stream: None,
                clock: 0,
                miss_hint: MISS_HINT_MIN,
                window: VecDeque::new(),
                inval: None,
                counters_host: None,
            }),
            pool: Mutex::new(Vec::new()),
            refreshing: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            unread: Mutex::new(VecDeque::new()),
            stats: Mutex::new(HostStats::default()),
            queue: Mutex::new(Queue { jobs: VecDeque::new(), busy: false, closed: false, error: None }),
            queue_cv: Condvar::new(),
            closed: AtomicBool::new(false),
            insert,
        });
        let weak = Arc::downgrade(&inner);
        let inserter = std::thread::Builder::new()
            .name("embank-gpu-insert".into())
            .spawn(move || insert::insert_loop(weak))
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start the GPU cache's inserter: {e}")))?;
        Ok(GpuTable { inner, inserter: Mutex::new(Some(inserter)) })
    }

    pub fn dim(&self) -> usize {
        self.inner.dim
    }

    /// Changes when misses are inserted, from the next lookup on.
    pub fn set_insert(&self, insert: Insert) {
        self.inner.insert.store(insert as u8, Ordering::Relaxed);
    }

    /// Bytes of the cache's structure on the device.
    pub fn bytes(&self) -> u64 {
        self.inner._arrays.iter().map(|b| b.bytes as u64).sum()
    }

    /// Rows of the `n` keys at device address `ids` (u64) into `out` (`n * dim` f32), on
    /// `stream`; `given` (u64 scores) for [`Policy::Custom`], else 0. Returns the hits
    /// when the lookup waited for its miss count (sync), None when it did not (async).
    pub fn lookup(&self, ids: u64, n: usize, out: u64, stream: Stream, given: u64) -> Result<Option<usize>> {
        self.inner.lookup(ids, n, out, stream, given, None)
    }

    /// Bags of the `n` keys at `ids` pooled into `out` (`bags * dim` f32), in one launch
    /// (plus the misses' fill when sync): what an `EmbeddingBag` over the cache needs.
    /// Otherwise as [`GpuTable::lookup`] (a miss of an async lookup pools the default row).
    #[allow(clippy::too_many_arguments)]
    pub fn lookup_pooled(
        &self,
        ids: u64,
        n: usize,
        bags: Bags,
        out: u64,
        stream: Stream,
        given: u64,
    ) -> Result<Option<usize>> {
        self.inner.lookup(ids, n, out, stream, given, Some(bags))
    }

    /// Drops `keys` from the cache now (and bumps their buckets' versions, so no insert
    /// of a row read before this lands); returns the rows dropped. Waits for the device.
    pub fn invalidate(&self, keys: &[u64]) -> Result<u64> {
        self.inner.check_open()?;
        let _cx = self.inner.dev.enter()?;
        self.inner.pending.lock().extend_from_slice(keys);
        let before = self.inner.counters()?[C_INVALIDATED];
        {
            let mut st = self.inner.state.lock();
            self.inner.enter_ordered(&mut st, self.inner.side)?;
            self.inner.apply_pending(&mut st, self.inner.side)?;
            self.inner.mark(&mut st, self.inner.order, self.inner.side)?;
        }
        Ok(self.inner.counters()?[C_INVALIDATED] - before)
    }

    /// Keys that changed in the table, to drop at the next launch (a change notice).
    pub fn notice(&self, keys: &[u64]) {
        self.inner.notice(keys)
    }

    /// A listener for `Store::add_change_listener`: the changes of the table named
    /// `name` reach the cache before its next lookup. Holds the cache weakly.
    pub fn listener(&self, name: &str) -> Arc<dyn Listener> {
        Arc::new(Notices { inner: Arc::downgrade(&self.inner), name: name.to_owned() })
    }

    /// Re-reads every cached key from the table and rewrites the rows that changed
    /// (drops the keys the table no longer holds); a row whose bucket moved since its
    /// key was read (a write meanwhile) is left alone. Waits for the device.
    pub fn refresh(&self) -> Result<Refreshed> {
        self.inner.refresh()
    }

    /// Waits until the background inserter has inserted everything queued.
    pub fn wait(&self) -> Result<()> {
        let _cx = self.inner.dev.enter()?;
        self.inner.poll_unread(true)?;
        let mut q = self.inner.queue.lock();
        while !q.jobs.is_empty() || q.busy {
            self.inner.queue_cv.wait(&mut q);
        }
        match q.error.take() {
            Some(e) => Err(Error::new(ErrorKind::Io, format!("a background insert of the GPU cache failed: {e}"))),
            None => Ok(()),
        }
    }

    pub fn stats(&self) -> Result<Stats> {
        self.inner.stats()
    }

    /// Finishes the queued inserts and stops the inserter.
    pub fn close(&self) -> Result<()> {
        let result = self.wait();
        self.inner.closed.store(true, Ordering::SeqCst);
        {
            let mut q = self.inner.queue.lock();
            q.closed = true;
            self.inner.queue_cv.notify_all();
        }
        if let Some(h) = self.inserter.lock().take() {
            let _ = h.join();
        }
        // A refresh running now puts its buffers back after this: the drop frees them.
        let kept = self.inner.refreshing.lock().take();
        if let Some(k) = kept {
            let _cx = self.inner.dev.enter();
            k.free(&self.inner.dev);
        }
        result
    }
}

impl Drop for GpuTable {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _cx = self.dev.enter();
        let last = self.state.get_mut().last;
        let _ = self.dev.wait(last);
        if let Some(k) = self.refreshing.get_mut().take() {
            k.free(&self.dev);
        }
        let mut pool = std::mem::take(&mut *self.pool.lock());
        pool.extend(self.unread.get_mut().drain(..).map(|j| j.scratch));
        pool.extend(self.queue.get_mut().jobs.drain(..).map(|j| j.scratch));
        for s in &pool {
            let _ = self.dev.wait(s.last);
        }
        // SAFETY: everything launched is done (waited above).
        unsafe {
            for s in &pool {
                self.dev.drop_event(s.done);
                self.dev.drop_event(s.copied);
            }
            if let Some(s) = self.state.get_mut().inval.take() {
                self.dev.drop_event(s.done);
                self.dev.drop_event(s.copied);
            }
            self.dev.drop_event(self.order);
            self.dev.drop_stream(self.side);
        }
    }
}

struct Notices {
    inner: Weak<Inner>,
    name: String,
}

impl Listener for Notices {
    fn rows_changed(&self, changed: &Changed<'_>) {
        if changed.name != self.name {
            return;
        }
        if let Some(inner) = self.inner.upgrade() {
            inner.notice(changed.keys);
        }
    }
}

impl Inner {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Closed, "the GPU cache is closed"));
        }
        Ok(())
    }

    fn notice(&self, keys: &[u64]) {
        let mut p = self.pending.lock();
        p.extend_from_slice(keys);
        drop(p);
        self.stats.lock().notices += keys.len() as u64;
    }

    /// Under the launch lock: `stream` waits for the cache's previous launch.
    fn enter_ordered(&self, st: &mut State, stream: Stream) -> Result<()> {
        if st.last_stream == Some(stream) {
            return Ok(()); // in order already
        }
        self.dev.stream_wait(stream, st.last)
    }

    /// Under the launch lock: records `event` on `stream` as the cache's last launch.
    fn mark(&self, st: &mut State, event: Event, stream: Stream) -> Result<()> {
        self.dev.record(event, stream)?;
        st.last = event;
        st.last_stream = Some(stream);
        Ok(())
    }

    /// Under the launch lock: the queued invalidations, one launch.
    fn apply_pending(&self, st: &mut State, stream: Stream) -> Result<()> {
        let mut keys = std::mem::take(&mut *self.pending.lock());
        if keys.is_empty() {
            return Ok(());
        }
        keys.sort_unstable();
        keys.dedup();
        let bytes = keys.len() * 8;
        let c = self.desc_now(st);
        if st.inval.is_none() {
            st.inval = Some(Scratch::new(&self.dev, bytes.max(4096), stream)?);
        }
        let s = st.inval.as_mut().expect("made above");
        s.reserve(&self.dev, bytes, stream)?;
        self.dev.wait(s.done)?;
        s.host.u64s(0, keys.len()).copy_from_slice(&keys);
        // SAFETY: the pinned buffer is not written again before `done` (waited above).
        unsafe { self.dev.htod(s.dev_buf.ptr, s.host.ptr, bytes, stream)? };
        let args = InvalidateArgs { c, keys: s.dev_buf.ptr, n: keys.len() as u64 };
        self.dev.launch(Kernel::Invalidate, keys.len() as u64 * 32, bytes_of(&args), stream)?;
        self.dev.record(s.done, stream)
    }

    fn desc_now(&self, st: &State) -> CacheDesc {
        CacheDesc { clock: st.clock, ..self.desc }
    }

    /// The async lookups whose copies are done (all of them with `block`): an all-hit
    /// one's scratch goes back to the pool here, one with misses to the inserter.
    fn poll_unread(&self, block: bool) -> Result<()> {
        loop {
            let job = {
                let mut unread = self.unread.lock();
                let Some(front) = unread.front() else { return Ok(()) };
                if !block && !self.dev.done(front.scratch.copied)? {
                    return Ok(());
                }
                unread.pop_front().expect("a front")
            };
            self.dev.wait(job.scratch.copied)?;
            let mut job = job;
            let m = job.scratch.host.u64s(0, PAYLOAD_HEAD)[job.parity] as usize;
            if m == 0 {
                self.record_window(job.n as u64, job.n as u64);
                self.stats.lock().hits += job.n as u64;
                self.give_scratch(job.scratch);
                continue;
            }
            let mut q = self.queue.lock();
            if q.jobs.len() >= ASYNC_JOBS_MAX || q.closed {
                drop(q);
                let mut stats = self.stats.lock();
                stats.async_dropped += m as u64;
                stats.hits += (job.n - m) as u64;
                stats.misses += m as u64;
                stats.default_answers += m as u64;
                drop(stats);
                self.give_scratch(job.scratch);
            } else {
                q.jobs.push_back(job);
                self.queue_cv.notify_all();
            }
        }
    }

    fn take_scratch(&self, bytes: usize) -> Result<Scratch> {
        let popped = self.pool.lock().pop();
        let mut s = match popped {
            Some(s) => s,
            None => {
                self.stats.lock().scratch_allocations += 1;
                Scratch::new(&self.dev, bytes.max(1 << 16), self.side)?
            }
        };
        s.reserve(&self.dev, bytes, self.side)?;
        Ok(s)
    }

    fn give_scratch(&self, s: Scratch) {
        self.pool.lock().push(s);
    }

    fn asynchronous(&self, st: &State) -> bool {
        match self.insert.load(Ordering::Relaxed) {
            x if x == Insert::Sync as u8 => false,
            x if x == Insert::Async as u8 => true,
            _ => {
                let (h, n) = st.window.iter().fold((0, 0), |(h, n), (a, b)| (h + a, n + b));
                n > 0 && h as f64 >= self.opts.hit_rate_threshold * n as f64
            }
        }
    }

    fn record_window(&self, hits: u64, n: u64) {
        let mut st = self.state.lock();
        st.window.push_back((hits, n));
        while st.window.len() > self.opts.window.max(1) {
            st.window.pop_front();
        }
    }

    /// Reads the device counters (waits for the device).
    fn counters(&self) -> Result<[u64; COUNTERS]> {
        let mut st = self.state.lock();
        self.counters_locked(&mut st, false)
    }

    fn counters_locked(&self, st: &mut State, count_rows: bool) -> Result<[u64; COUNTERS]> {
        let _cx = self.dev.enter()?;
        let mut h = match st.counters_host.take() {
            Some(h) => h,
            None => Host::new(&self.dev, COUNTERS * 8)?,
        };
        let r = self.read_counters(st, &mut h, count_rows);
        st.counters_host = Some(h); // kept even after an error: a copy may still use it
        r
    }

    fn read_counters(&self, st: &mut State, h: &mut Host, count_rows: bool) -> Result<[u64; COUNTERS]> {
        self.enter_ordered(st, self.side)?;
        if count_rows {
            let c = self.desc_now(st);
            self.dev.memset(c.counters + 8 * C_ROWS as u64, 0, 8, self.side)?;
            let n = self.desc.n_buckets as u64 * self.desc.slots as u64;
            let args = CountArgs { c, n };
            self.dev.launch(Kernel::Count, n.div_ceil(32) * 32, bytes_of(&args), self.side)?;
        }
        // SAFETY: `h` is kept by the cache until a later call, after the wait below.
        unsafe { self.dev.dtoh(h.ptr, self.desc.counters, COUNTERS * 8, self.side)? };
        self.mark(st, self.order, self.side)?;
        self.dev.wait(self.order)?;
        let mut out = [0u64; COUNTERS];
        out.copy_from_slice(h.u64s(0, COUNTERS));
        Ok(out)
    }

    fn stats(&self) -> Result<Stats> {
        let _cx = self.dev.enter()?;
        self.poll_unread(true)?;
        let c = {
            let mut st = self.state.lock();
            self.enter_ordered(&mut st, self.side)?;
            self.apply_pending(&mut st, self.side)?;
            self.counters_locked(&mut st, true)?
        };
        let st = self.state.lock();
        let (h, n) = st.window.iter().fold((0, 0), |(h, n), (a, b)| (h + a, n + b));
        Ok(Stats {
            host: self.stats.lock().clone(),
            window_hit_rate: (n > 0).then(|| h as f64 / n as f64),
            invalidated: c[C_INVALIDATED],
            sync_inserts: c[C_SYNC_INSERTS as usize],
            async_inserts: c[C_ASYNC_INSERTS as usize],
            insert_refused: c[C_REFUSED],
            evictions: c[C_EVICTIONS],
            rows_cached: c[C_ROWS],
            rows_max: self.desc.n_buckets as u64 * self.desc.slots as u64,
            bytes: self._arrays.iter().map(|b| b.bytes as u64).sum(),
        })
    }
}
