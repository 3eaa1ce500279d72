//! A Redis Cluster as the shared tier of serving nodes (HugeCTR HPS's level 2): the
//! implementation of [`embank_core::SharedTier`] that `embank serve` installs
//! with a `[shared_tier]` section.
//!
//! Each record is one Redis string, `eb:<table>:<key>` holding the record encoded by
//! the table's layout (binary), with an optional TTL. A batch of misses is one
//! pipelined request per node (`GET`s routed by hash slot: redis-rs refuses
//! multi-key commands in cluster pipelines, and a batch's keys fall in hundreds of
//! slots, so a per-slot `MGET` would mostly carry one key); fills go through a
//! background thread, pipelined `SET`s. Invalidations are synchronous `DEL`s, made
//! before a local write returns, so no node reads a row older than its own last write.
//!
//! Never an error the caller sees: a request that fails (a node down, a timeout)
//! answers "absent" for its keys, which the store then reads from its medium, and the
//! tier is skipped for `backoff` before the next try (counted in `errors` and
//! `degraded_keys`). An invalidation that fails leaves copies that may be stale, so the
//! tier stops serving this store (`disabled`, logged) until it is set again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{SharedTier, SharedTierStats};
use parking_lot::Mutex;
use redis::cluster::{cluster_pipe, ClusterClient, ClusterClientBuilder, ClusterConnection};
use serde::Deserialize;

/// `[shared_tier]` of `embank serve`'s config.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTierConfig {
    /// Seed nodes of the cluster (`host:port`).
    pub redis_cluster: Vec<String>,
    /// Expire records this long after they were stored (default: never).
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// Connect and response timeout of a request, milliseconds.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// After a failed request the tier is skipped this long, milliseconds.
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
}

fn default_timeout_ms() -> u64 {
    250
}

fn default_backoff_ms() -> u64 {
    1000
}

enum Job {
    /// Records read from the medium while the invalidation epoch was `.2`.
    Put(String, Vec<(u64, Vec<u8>)>, u64),
    Stop,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    puts: AtomicU64,
    puts_dropped: AtomicU64,
    invalidations: AtomicU64,
    errors: AtomicU64,
    degraded_keys: AtomicU64,
}

struct Shared {
    client: ClusterClient,
    counters: Counters,
    ttl: Option<u64>,
    /// Bumped by every invalidation, under `order`'s write lock; a fill read before the
    /// last invalidation is dropped (it may hold a row written since), and a fill
    /// stores under the read lock, so it lands before an invalidation or not at all.
    epoch: AtomicU64,
    order: parking_lot::RwLock<()>,
}

pub struct RedisClusterTier {
    shared: Arc<Shared>,
    nodes: Vec<String>,
    /// The connection of reads and invalidations (the filler has its own).
    conn: Mutex<Option<ClusterConnection>>,
    down_until: Mutex<Option<Instant>>,
    backoff: Duration,
    disabled: AtomicBool,
    jobs: SyncSender<Job>,
    filler: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn redis_key(table: &str, key: u64) -> String {
    format!("eb:{table}:{key}")
}

impl RedisClusterTier {
    /// A tier over the cluster `config.redis_cluster` names. Connects lazily: a cluster
    /// that is not up yet only makes the first reads go to the medium.
    pub fn new(config: &RedisTierConfig) -> Result<RedisClusterTier, String> {
        if config.redis_cluster.is_empty() {
            return Err("[shared_tier] redis_cluster names no node".into());
        }
        let urls: Vec<String> = config
            .redis_cluster
            .iter()
            .map(|n| if n.starts_with("redis://") { n.clone() } else { format!("redis://{n}") })
            .collect();
        let timeout = Duration::from_millis(config.timeout_ms.max(1));
        let client = ClusterClientBuilder::new(urls)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1)
            .build()
            .map_err(|e| format!("[shared_tier] redis_cluster: {e}"))?;
        let shared = Arc::new(Shared {
            client,
            counters: Counters::default(),
            ttl: config.ttl_seconds,
            epoch: AtomicU64::new(0),
            order: parking_lot::RwLock::new(()),
        });
        let (tx, rx) = sync_channel(256);
        let s2 = Arc::clone(&shared);
        let filler = std::thread::Builder::new()
            .name("embank-redis-fill".into())
            .spawn(move || fill(s2, rx))
            .map_err(|e| format!("cannot start the shared tier's thread: {e}"))?;
        Ok(RedisClusterTier {
            shared,
            nodes: config.redis_cluster.clone(),
            conn: Mutex::new(None),
            down_until: Mutex::new(None),
            backoff: Duration::from_millis(config.backoff_ms),
            disabled: AtomicBool::new(false),
            jobs: tx,
            filler: Mutex::new(Some(filler)),
        })
    }

    /// Runs `f` on the read connection (made if needed); on an error the connection is
    /// dropped and the tier backs off.
    fn with_conn<T>(&self, f: impl FnOnce(&mut ClusterConnection) -> redis::RedisResult<T>) -> Option<T> {
        if let Some(until) = *self.down_until.lock() {
            if Instant::now() < until {
                return None;
            }
        }
        let mut guard = self.conn.lock();
        if guard.is_none() {
            match self.shared.client.get_connection() {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    self.failed(&e);
                    return None;
                }
            }
        }
        match f(guard.as_mut().expect("connected")) {
            Ok(v) => Some(v),
            Err(e) => {
                *guard = None;
                self.failed(&e);
                None
            }
        }
    }

    fn failed(&self, e: &redis::RedisError) {
        self.shared.counters.errors.fetch_add(1, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + self.backoff);
        tracing::warn!(error = %e, "shared tier (Redis Cluster) request failed; reading the medium");
    }
}

impl SharedTier for RedisClusterTier {
    fn get(&self, table: &str, keys: &[u64]) -> Vec<Option<Vec<u8>>> {
        let c = &self.shared.counters;
        if self.disabled.load(Ordering::Relaxed) {
            c.degraded_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
            return vec![None; keys.len()];
        }
        let mut pipe = cluster_pipe();
        for &k in keys {
            pipe.cmd("GET").arg(redis_key(table, k));
        }
        match self.with_conn(|conn| pipe.query::<Vec<Option<Vec<u8>>>>(conn)) {
            Some(got) if got.len() == keys.len() => {
                let hits = got.iter().filter(|g| g.is_some()).count() as u64;
                c.hits.fetch_add(hits, Ordering::Relaxed);
                c.misses.fetch_add(keys.len() as u64 - hits, Ordering::Relaxed);
                got
            }
            _ => {
                c.degraded_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
                vec![None; keys.len()]
            }
        }
    }

    fn put(&self, table: &str, items: Vec<(u64, Vec<u8>)>) {
        if self.disabled.load(Ordering::Relaxed) || items.is_empty() {
            return;
        }
        let n = items.len() as u64;
        let epoch = self.shared.epoch.load(Ordering::Acquire);
        match self.jobs.try_send(Job::Put(table.to_owned(), items, epoch)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.shared.counters.puts_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    fn invalidate(&self, table: &str, keys: &[u64]) {
        if self.disabled.load(Ordering::Relaxed) || keys.is_empty() {
            return;
        }
        let mut pipe = cluster_pipe();
        for &k in keys {
            pipe.cmd("DEL").arg(redis_key(table, k)).ignore();
        }
        // Not skipped in a back-off: a write must reach the tier or turn it off.
        *self.down_until.lock() = None;
        let _order = self.shared.order.write();
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
        match self.with_conn(|conn| pipe.query::<()>(conn)) {
            Some(()) => {
                self.shared.counters.invalidations.fetch_add(keys.len() as u64, Ordering::Relaxed);
            }
            None => {
                self.disabled.store(true, Ordering::Relaxed);
                tracing::error!(
                    table,
                    "shared tier: an invalidation failed, so its copies may be stale: this store stops \
                     reading it (restart the server to use it again)"
                );
            }
        }
    }

    fn stats(&self) -> SharedTierStats {
        let c = &self.shared.counters;
        SharedTierStats {
            kind: format!(
                "redis-cluster {}{}",
                self.nodes.join(","),
                if self.disabled.load(Ordering::Relaxed) { " (disabled: an invalidation failed)" } else { "" }
            ),
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            puts: c.puts.load(Ordering::Relaxed),
            invalidations: c.invalidations.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            degraded_keys: c.degraded_keys.load(Ordering::Relaxed),
            puts_dropped: c.puts_dropped.load(Ordering::Relaxed),
        }
    }
}

impl Drop for RedisClusterTier {
    fn drop(&mut self) {
        let _ = self.jobs.send(Job::Stop);
        if let Some(h) = self.filler.lock().take() {
            let _ = h.join();
        }
    }
}

/// The filler thread: stores what the medium gave, pipelined, best effort.
fn fill(shared: Arc<Shared>, rx: Receiver<Job>) {
    let mut conn: Option<ClusterConnection> = None;
    while let Ok(job) = rx.recv() {
        let (table, items, epoch) = match job {
            Job::Put(t, i, e) => (t, i, e),
            Job::Stop => return,
        };
        let _order = shared.order.read();
        if shared.epoch.load(Ordering::Acquire) != epoch {
            shared.counters.puts_dropped.fetch_add(items.len() as u64, Ordering::Relaxed);
            continue; // a write came in since these rows were read: they may be stale
        }
        if conn.is_none() {
            conn = shared.client.get_connection().ok();
        }
        let Some(c) = conn.as_mut() else {
            shared.counters.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let mut pipe = cluster_pipe();
        for (k, v) in &items {
            match shared.ttl {
                Some(ttl) => pipe.cmd("SET").arg(redis_key(&table, *k)).arg(v.as_slice()).arg("EX").arg(ttl).ignore(),
                None => pipe.cmd("SET").arg(redis_key(&table, *k)).arg(v.as_slice()).ignore(),
            };
        }
        match pipe.query::<()>(c) {
            Ok(()) => {
                shared.counters.puts.fetch_add(items.len() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                shared.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "shared tier: a fill failed");
                conn = None;
            }
        }
    }
}
