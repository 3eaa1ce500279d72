//! Engines the bench drives: embank and the baselines a user would otherwise pick.
//!
//! Every engine gets the same keys and rows, loads them in a separately timed
//! phase, and then serves batches of `pull` and `push` from several threads.

use std::collections::HashMap;
use std::path::Path;

use embank_core::{IoChoice, Loader, MediumKind, Store, StoreOptions, Table, TableOptions};
use parking_lot::RwLock;

/// A key-value engine holding rows of `dim` f32 per u64 key.
pub trait Engine: Sync {
    fn name(&self) -> &'static str;
    /// Writes rows; used for the load phase and for pushes in the measured phase.
    fn push(&self, thread: usize, keys: &[u64], rows: &[f32]) -> Result<(), String>;
    /// Reads rows of keys that exist into `out` (`keys.len() * dim`).
    fn pull(&self, thread: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String>;
    /// Called once before the load phase's first `load`, with the keys it will load.
    fn begin_load(&self, _keys: u64) -> Result<(), String> {
        Ok(())
    }
    /// Writes rows of the load phase (a bulk load where the engine has one).
    fn load(&self, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        self.push(0, keys, rows)
    }
    /// Called once after the bulk load, inside the timed load phase (e.g. a compaction).
    fn finish_load(&self) -> Result<(), String> {
        Ok(())
    }
    /// Bytes of DRAM the engine holds outside this process (a server's), if any.
    fn external_resident_bytes(&self) -> Option<u64> {
        None
    }
    /// Hit rate of the engine's DRAM tier during the measured phase, where it has one.
    fn hit_rate(&self) -> Option<f64> {
        None
    }
    /// Device reads and writes (I/O requests) since the measured phase started, where
    /// the engine reads its medium through embank's I/O engine.
    fn io_ops(&self) -> Option<(u64, u64)> {
        None
    }
    /// Called between the load and the measured phase (resets counters).
    fn start_measure(&self) {}
    /// Of `keys` (lookups of the stream), the fraction found in their home index bucket.
    fn home_fraction(&self, _keys: &[u64]) -> Option<f64> {
        None
    }
    /// Seconds a hot placement after the load took, where the engine did one.
    fn placement_seconds(&self) -> Option<f64> {
        None
    }
    /// A batch-aware checkpoint (`--checkpoint-every`), where the engine has them.
    fn checkpoint(&self) -> Result<(), String> {
        Err(format!("{} has no checkpoints (--checkpoint-every is an embank feature)", self.name()))
    }
}

/// The embedded embank store: `embank-mmap` (the mmap medium, no row cache),
/// `embank-mmap-hot` (the same with the workload's hottest keys placed in their home
/// index buckets after the load),
/// `embank-block` (block medium through io_uring under the row cache) and
/// `embank-block-pread` (the same through the pread pool).
pub struct Embank {
    name: &'static str,
    _store: Store,
    table: Table,
    /// Cache hits and misses when the measured phase started.
    base: parking_lot::Mutex<(u64, u64)>,
    /// Device reads and writes when the measured phase started.
    io_base: parking_lot::Mutex<(u64, u64)>,
    /// Batch id of the next checkpoint.
    checkpoints: std::sync::atomic::AtomicU64,
    /// Keys to place in their home buckets after the load (`embank-mmap-hot`).
    hot: Vec<u64>,
    placement_seconds: parking_lot::Mutex<Option<f64>>,
    /// Reads take rows as stored (`Table::lookup_stored`), into a buffer of the thread's.
    stored_rows: bool,
    /// The load phase's bulk load (`Table::loader`), between `begin_load` and `finish_load`.
    loader: parking_lot::Mutex<Option<Loader>>,
}

thread_local! {
    /// `--stored-rows`: a reader thread's stored rows and found-mask, reused across batches.
    static STORED: std::cell::RefCell<(Vec<u8>, Vec<bool>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `--stored-rows`: `read` (a `lookup_stored`) of `keys`' rows, `row_bytes` each, into
/// the thread's buffers.
fn read_stored(
    keys: &[u64],
    row_bytes: usize,
    read: impl FnOnce(&[u64], &mut [u8], &mut [bool]) -> embank_core::Result<()>,
) -> Result<(), String> {
    STORED.with_borrow_mut(|(bytes, found)| {
        bytes.resize(keys.len() * row_bytes, 0);
        found.resize(keys.len(), false);
        read(keys, bytes, found).map_err(|e| e.to_string())
    })
}

impl Embank {
    pub fn open(
        name: &'static str,
        dir: &Path,
        keys: u64,
        dim: u32,
        dtype: embank_core::DType,
        cache_bytes: u64,
        (mmap_random_access, huge_pages): (bool, bool),
    ) -> Result<Self, String> {
        let (medium, io) = match name {
            "embank-mmap" | "embank-mmap-hot" => (MediumKind::Mmap, IoChoice::Auto),
            "embank-block" => (MediumKind::Block, IoChoice::Uring),
            "embank-block-pread" => (MediumKind::Block, IoChoice::Pread),
            other => return Err(format!("not an embank engine: {other}")),
        };
        let options =
            StoreOptions { cache_bytes, io_engine: io, mmap_random_access, huge_pages, ..StoreOptions::default() };
        let store = Store::open(dir.join(name), options).map_err(|e| e.to_string())?;
        let mut o = TableOptions::new(dim);
        o.capacity = keys;
        o.medium = medium;
        o.dtype = dtype;
        let table = store.create_table("bench", o).map_err(|e| e.to_string())?;
        Ok(Embank {
            name,
            _store: store,
            table,
            base: parking_lot::Mutex::new((0, 0)),
            io_base: parking_lot::Mutex::new((0, 0)),
            checkpoints: std::sync::atomic::AtomicU64::new(1),
            hot: Vec::new(),
            placement_seconds: parking_lot::Mutex::new(None),
            stored_rows: false,
            loader: parking_lot::Mutex::new(None),
        })
    }

    /// Reads take rows as stored (`Table::lookup_stored`), not decoded (`--stored-rows`).
    pub fn set_stored_rows(&mut self, stored_rows: bool) {
        self.stored_rows = stored_rows;
    }

    /// Keys to place in their home index buckets once loaded.
    pub fn set_hot(&mut self, hot: Vec<u64>) {
        self.hot = hot;
    }

    fn hits_misses(&self) -> (u64, u64) {
        self.table.stats().map(|s| (s.cache_hits, s.cache_misses)).unwrap_or((0, 0))
    }

    fn reads_writes(&self) -> (u64, u64) {
        self._store.stats().map(|s| (s.io.reads, s.io.writes)).unwrap_or((0, 0))
    }
}

impl Engine for Embank {
    fn name(&self) -> &'static str {
        self.name
    }
    fn begin_load(&self, keys: u64) -> Result<(), String> {
        *self.loader.lock() = Some(self.table.loader(keys).map_err(|e| e.to_string())?);
        Ok(())
    }
    fn load(&self, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        match self.loader.lock().as_mut() {
            Some(loader) => loader.push(keys, rows).map_err(|e| e.to_string()),
            None => self.push(0, keys, rows),
        }
    }
    /// Rows reach the medium before the measured phase (the page cache holds no
    /// dirty pages of the load; the row cache no dirty rows).
    fn finish_load(&self) -> Result<(), String> {
        if let Some(loader) = self.loader.lock().take() {
            loader.finish().map_err(|e| e.to_string())?;
        }
        self.table.flush().map_err(|e| e.to_string())?;
        if !self.hot.is_empty() {
            let r = self.table.place_hot(&self.hot).map_err(|e| e.to_string())?;
            println!(
                "{:<18} placed {} hot keys in {:.2}s: {:.1} % of them in their home bucket before, {:.1} % after",
                self.name,
                r.held,
                r.seconds,
                r.home_before * 100.0,
                r.home_after * 100.0
            );
            *self.placement_seconds.lock() = Some(r.seconds);
        }
        Ok(())
    }
    fn home_fraction(&self, keys: &[u64]) -> Option<f64> {
        self.table.home_fraction(keys).ok().map(|(f, _)| f)
    }
    fn placement_seconds(&self) -> Option<f64> {
        *self.placement_seconds.lock()
    }
    fn start_measure(&self) {
        *self.base.lock() = self.hits_misses();
        *self.io_base.lock() = self.reads_writes();
    }
    fn io_ops(&self) -> Option<(u64, u64)> {
        let (r0, w0) = *self.io_base.lock();
        let (r, w) = self.reads_writes();
        (!self.name.starts_with("embank-mmap")).then_some((r - r0, w - w0))
    }
    fn hit_rate(&self) -> Option<f64> {
        let (h0, m0) = *self.base.lock();
        let (h, m) = self.hits_misses();
        let (h, m) = (h - h0, m - m0);
        (!self.name.starts_with("embank-mmap") && h + m > 0).then(|| h as f64 / (h + m) as f64)
    }
    fn push(&self, _: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        self.table.push(keys, rows).map_err(|e| e.to_string())
    }
    fn pull(&self, _: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        if !self.stored_rows {
            return self.table.pull(keys, out).map_err(|e| e.to_string());
        }
        read_stored(keys, self.table.row_bytes(), |k, b, f| self.table.lookup_stored(k, b, f))
    }
    fn checkpoint(&self) -> Result<(), String> {
        let b = self.checkpoints.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self._store.checkpoint(b).map_err(|e| e.to_string())
    }
}

/// `embank-tcp`: running `embank serve` shards through the client (the same keys
/// routed and split as `embank.connect` does).
pub struct Remote {
    client: embank_net::Client,
    table: embank_net::RemoteTable,
    /// Reads take rows as stored (`RemoteTable::lookup_stored`).
    stored_rows: bool,
    /// Bytes of a stored row of the table.
    row_bytes: usize,
}

impl Remote {
    pub fn open(
        target: &str,
        token: Option<String>,
        keys: u64,
        dim: u32,
        dtype: embank_core::DType,
    ) -> Result<Remote, String> {
        let addrs: Vec<&str> = target.trim_start_matches("tcp://").split(',').filter(|a| !a.is_empty()).collect();
        let client = embank_net::Client::connect(&addrs, embank_net::ClientOptions { token, ..Default::default() })
            .map_err(|e| e.to_string())?;
        let name = format!("bench-{}", std::process::id());
        let _ = client.drop_table(&name);
        let mut o = TableOptions::new(dim);
        o.capacity = keys / client.shard_count() as u64 + 1;
        o.dtype = dtype;
        let table = client.create_table(&name, o).map_err(|e| e.to_string())?;
        let row_bytes = dtype.row_bytes(dim as usize);
        Ok(Remote { client, table, stored_rows: false, row_bytes })
    }

    /// Reads take rows as stored over the wire (`LOOKUP_STORED`), not decoded (`--stored-rows`).
    pub fn set_stored_rows(&mut self, stored_rows: bool) {
        self.stored_rows = stored_rows;
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = self.client.drop_table(self.table.name());
    }
}

impl Engine for Remote {
    fn name(&self) -> &'static str {
        "embank-tcp"
    }
    fn finish_load(&self) -> Result<(), String> {
        self.client.flush().map_err(|e| e.to_string())
    }
    fn push(&self, _: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        self.table.push(keys, rows).map_err(|e| e.to_string())
    }
    fn pull(&self, _: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        if !self.stored_rows {
            return self.table.pull(keys, out).map_err(|e| e.to_string());
        }
        read_stored(keys, self.row_bytes, |k, b, f| self.table.lookup_stored(k, b, f))
    }
}

/// Shards of the classic in-DRAM parameter server.
pub const HASHMAP_SHARDS: usize = 32;

/// The classic in-DRAM parameter server: `HashMap<u64, Box<[f32]>>` in 32 shards
/// behind read-write locks; a batch takes each shard's lock once per key.
pub struct ShardedHashMap {
    shards: Vec<RwLock<HashMap<u64, Box<[f32]>>>>,
    dim: usize,
}

impl ShardedHashMap {
    pub fn new(keys: u64, dim: usize) -> Self {
        let per = (keys as usize / HASHMAP_SHARDS) + 1;
        ShardedHashMap { shards: (0..HASHMAP_SHARDS).map(|_| RwLock::new(HashMap::with_capacity(per))).collect(), dim }
    }

    #[inline]
    fn shard(&self, key: u64) -> &RwLock<HashMap<u64, Box<[f32]>>> {
        // The std hasher hashes again inside the shard; pick the shard by a cheap mix.
        &self.shards[(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) as usize % HASHMAP_SHARDS]
    }
}

impl Engine for ShardedHashMap {
    fn name(&self) -> &'static str {
        "hashmap"
    }
    fn push(&self, _: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        for (i, &k) in keys.iter().enumerate() {
            let row: Box<[f32]> = rows[i * self.dim..(i + 1) * self.dim].into();
            self.shard(k).write().insert(k, row);
        }
        Ok(())
    }
    fn pull(&self, _: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        for (i, &k) in keys.iter().enumerate() {
            let shard = self.shard(k).read();
            let row = shard.get(&k).ok_or_else(|| format!("hashmap: key {k} missing"))?;
            out[i * self.dim..(i + 1) * self.dim].copy_from_slice(row);
        }
        Ok(())
    }
}
