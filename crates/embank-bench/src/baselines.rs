//! Baseline engines (cargo feature `baselines`), each tuned as its own users tune it.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::engines::Engine;

fn rows_from_bytes(bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    if bytes.len() != std::mem::size_of_val(out) {
        return Err(format!("stored row has {} bytes, expected {}", bytes.len(), std::mem::size_of_val(out)));
    }
    for (x, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes(c.try_into().unwrap());
    }
    Ok(())
}

fn row_bytes(row: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; this target is little-endian.
    const _: () = assert!(cfg!(target_endian = "little"));
    unsafe { std::slice::from_raw_parts(row.as_ptr() as *const u8, std::mem::size_of_val(row)) }
}

/// LMDB through heed: big-endian u64 keys, rows as values, one read transaction per batch.
pub struct Lmdb {
    env: heed::Env,
    db: heed::Database<heed::types::U64<heed::byteorder::BigEndian>, heed::types::Bytes>,
    dim: usize,
}

impl Lmdb {
    pub fn open(dir: &Path, keys: u64, dim: usize) -> Result<Self, String> {
        let path = dir.join("lmdb");
        std::fs::create_dir_all(&path).map_err(|e| e.to_string())?;
        let map_size = ((keys as usize * (dim * 4 + 64)) * 2).max(64 << 20);
        // SAFETY: the directory is ours and opened once.
        let env = unsafe { heed::EnvOpenOptions::new().map_size(map_size).max_dbs(1).open(&path) }
            .map_err(|e| e.to_string())?;
        // Durability of a bulk-loaded benchmark table is not measured: no fsync per commit.
        unsafe { env.set_flags(heed::EnvFlags::NO_SYNC, heed::FlagSetMode::Enable) }.map_err(|e| e.to_string())?;
        let mut wtxn = env.write_txn().map_err(|e| e.to_string())?;
        let db = env.create_database(&mut wtxn, None).map_err(|e| e.to_string())?;
        wtxn.commit().map_err(|e| e.to_string())?;
        Ok(Lmdb { env, db, dim })
    }
}

impl Engine for Lmdb {
    fn name(&self) -> &'static str {
        "lmdb"
    }
    fn push(&self, _: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        let mut wtxn = self.env.write_txn().map_err(|e| e.to_string())?;
        for (i, &k) in keys.iter().enumerate() {
            self.db
                .put(&mut wtxn, &k, row_bytes(&rows[i * self.dim..(i + 1) * self.dim]))
                .map_err(|e| e.to_string())?;
        }
        wtxn.commit().map_err(|e| e.to_string())
    }
    /// Written pages reach the file before the measured phase (as with every engine).
    fn finish_load(&self) -> Result<(), String> {
        self.env.force_sync().map_err(|e| e.to_string())
    }
    fn pull(&self, _: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        let rtxn = self.env.read_txn().map_err(|e| e.to_string())?;
        for (i, &k) in keys.iter().enumerate() {
            let v =
                self.db.get(&rtxn, &k).map_err(|e| e.to_string())?.ok_or_else(|| format!("lmdb: key {k} missing"))?;
            rows_from_bytes(v, &mut out[i * self.dim..(i + 1) * self.dim])?;
        }
        Ok(())
    }
}

/// RocksDB linked from the system library: block cache of the DRAM budget, bloom
/// filters, `multi_get` per batch, writes in a batch without the WAL.
pub struct Rocks {
    db: rocksdb::DB,
    dim: usize,
}

impl Rocks {
    /// `direct`: read and compact with O_DIRECT, so the OS page cache does not add
    /// memory beyond the block cache (used when a DRAM budget is set).
    pub fn open(dir: &Path, dram_bytes: u64, dim: usize, direct: bool) -> Result<Self, String> {
        let mut table = rocksdb::BlockBasedOptions::default();
        let cache = rocksdb::Cache::new_lru_cache(dram_bytes as usize);
        table.set_block_cache(&cache);
        table.set_bloom_filter(10.0, false);
        table.set_cache_index_and_filter_blocks(true);
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.set_block_based_table_factory(&table);
        opts.increase_parallelism(std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(2));
        if direct {
            opts.set_use_direct_reads(true);
            opts.set_use_direct_io_for_flush_and_compaction(true);
        }
        let db = rocksdb::DB::open(&opts, dir.join("rocksdb")).map_err(|e| e.to_string())?;
        Ok(Rocks { db, dim })
    }
}

impl Engine for Rocks {
    fn name(&self) -> &'static str {
        "rocksdb"
    }
    /// After a bulk load its users compact, so reads see one sorted level.
    fn finish_load(&self) -> Result<(), String> {
        self.db.flush().map_err(|e| e.to_string())?;
        self.db.compact_range::<&[u8], &[u8]>(None, None);
        Ok(())
    }
    fn push(&self, _: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        let mut batch = rocksdb::WriteBatch::default();
        for (i, &k) in keys.iter().enumerate() {
            batch.put(k.to_be_bytes(), row_bytes(&rows[i * self.dim..(i + 1) * self.dim]));
        }
        let mut wo = rocksdb::WriteOptions::default();
        wo.disable_wal(true);
        self.db.write_opt(batch, &wo).map_err(|e| e.to_string())
    }
    fn pull(&self, _: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        let values = self.db.multi_get(keys.iter().map(|k| k.to_be_bytes()));
        for (i, v) in values.into_iter().enumerate() {
            let v = v.map_err(|e| e.to_string())?.ok_or_else(|| format!("rocksdb: key {} missing", keys[i]))?;
            rows_from_bytes(&v, &mut out[i * self.dim..(i + 1) * self.dim])?;
        }
        Ok(())
    }
}

/// Redis: a `redis-server` started on a free loopback port, rows as binary strings,
/// one `MGET` per batch, one connection per client thread.
pub struct Redis {
    server: Child,
    conns: Vec<Mutex<redis::Connection>>,
    dim: usize,
}

impl Redis {
    pub fn start(dir: &Path, threads: usize, dim: usize) -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let server = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server ({e}); install it (apt-get install redis-server)"))?;
        let mut engine = Redis { server, conns: Vec::new(), dim };
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let first = loop {
            match client.get_connection() {
                Ok(c) => break c,
                Err(e) if t0.elapsed() > Duration::from_secs(10) => {
                    return Err(format!("redis-server did not answer: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        engine.conns.push(Mutex::new(first));
        for _ in 1..threads.max(1) {
            engine.conns.push(Mutex::new(client.get_connection().map_err(|e| e.to_string())?));
        }
        Ok(engine)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

impl Engine for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }
    fn push(&self, thread: usize, keys: &[u64], rows: &[f32]) -> Result<(), String> {
        let mut cmd = redis::cmd("MSET");
        for (i, &k) in keys.iter().enumerate() {
            cmd.arg(&k.to_le_bytes()[..]).arg(row_bytes(&rows[i * self.dim..(i + 1) * self.dim]));
        }
        let mut con = self.conns[thread % self.conns.len()].lock();
        cmd.query::<()>(&mut *con).map_err(|e| e.to_string())
    }
    fn pull(&self, thread: usize, keys: &[u64], out: &mut [f32]) -> Result<(), String> {
        let mut cmd = redis::cmd("MGET");
        for &k in keys {
            cmd.arg(&k.to_le_bytes()[..]);
        }
        let mut con = self.conns[thread % self.conns.len()].lock();
        let values: Vec<Option<Vec<u8>>> = cmd.query(&mut *con).map_err(|e| e.to_string())?;
        drop(con);
        for (i, v) in values.into_iter().enumerate() {
            let v = v.ok_or_else(|| format!("redis: key {} missing", keys[i]))?;
            rows_from_bytes(&v, &mut out[i * self.dim..(i + 1) * self.dim])?;
        }
        Ok(())
    }
    fn external_resident_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.server.id())).ok()?;
        let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
}
