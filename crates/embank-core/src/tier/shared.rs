//! A tier shared by several stores: the DRAM of a cluster that serving nodes read
//! through (HugeCTR HPS's level 2), between a store's row cache and its medium.
//!
//! The core knows only this trait; an implementation over the network (a Redis
//! Cluster: `embank-net`) is handed to [`Store::set_shared_tier`](crate::Store::set_shared_tier)
//! by whoever opens the store. Records travel encoded by the table's layout, addressed
//! by table *name* (ids differ between stores) and key. A shared tier is a cache of
//! what the stores' media hold: a table reads it only for keys its own index holds
//! (a key deleted here is never revived from there), fills it with what it reads from
//! its medium, and drops from it every key it writes, so it never serves a row older
//! than the last local write of this store. It must never fail a read: an unreachable
//! tier answers "absent" (and counts it), and the read goes on to the medium.

use serde::Serialize;

/// Counters of a shared tier.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SharedTierStats {
    /// What it is (e.g. `redis-cluster`) and where.
    pub kind: String,
    pub hits: u64,
    pub misses: u64,
    /// Records stored in it.
    pub puts: u64,
    /// Records not stored: the fill queue was full, or a local write came in after
    /// they were read (they might be older than it).
    pub puts_dropped: u64,
    /// Keys dropped from it by local writes.
    pub invalidations: u64,
    /// Requests that failed (a node down, a timeout): their keys were read from the
    /// medium instead, and puts were dropped.
    pub errors: u64,
    /// Keys read from the medium because the tier was unavailable.
    pub degraded_keys: u64,
}

pub trait SharedTier: Send + Sync {
    /// Encoded records of `keys` of `table`, `None` where the tier has none (or is
    /// unavailable). Blocks for one round trip at most.
    fn get(&self, table: &str, keys: &[u64]) -> Vec<Option<Vec<u8>>>;
    /// Stores encoded records; may return before they are stored.
    fn put(&self, table: &str, items: Vec<(u64, Vec<u8>)>);
    /// Drops `keys` of `table`: written locally, the tier's copies are stale.
    fn invalidate(&self, table: &str, keys: &[u64]);
    fn stats(&self) -> SharedTierStats;
}
