//! The client: a remote store of N shards with the same operations as an embedded one.
//!
//! Keys are routed by [`proto::shard_of`] (a consistent hash, identical in every
//! client). A batch is split by shard, then into requests of at most
//! `keys_per_request_max` keys; the requests go out at once, each on its own pooled
//! connection (up to `in_flight_per_shard` per shard), and the replies are put back
//! in the caller's order. One request per connection at a time: a server thread
//! never blocks writing a reply that nobody reads, so big batches cannot deadlock.
//!
//! Connections are opened on demand and kept; a pooled connection whose server went
//! away (restart, crash) is noticed before use and replaced, so a restarted shard is
//! picked up by the next call. A shard that cannot be reached fails the call with
//! `Unavailable`, naming the shard.
//!
//! A silent replica (a partition, a stopped process, a stuck disk) costs a read
//! milliseconds: every request has a deadline from the latencies the client observes, a
//! read not answered within its group's recent p95 is sent to a sibling too (the first
//! answer wins), and a replica that misses a deadline is ejected from the rotation until
//! a background probe finds it answering and current (see `route` and `health`).
//!
//! The parts: `pool` (the shards' replicas, their connections), `health` (latencies,
//! counters, ejection and the prober), `route` (which replica takes a request, sending,
//! waiting, hedging, failing over), `table` (the remote table), `map` (the shard map).

mod background;
mod cluster;
mod health;
mod map;
mod pool;
mod route;
mod served;
#[cfg(test)]
mod sim;
mod state;
mod table;
#[cfg(test)]
mod tests;
mod transport;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use embank_core::TableMeta;
use embank_core::{Error, ErrorKind, Result, TableOptions};
use parking_lot::{Mutex, RwLock};

use crate::proto::Op;
use crate::tls::ClientTls;

pub use cluster::{ClientConfig, ShardEntry};
pub use map::{served_range, switch_when_serving, MapSource, ShardMap};
use pool::{Endpoint, Shard};
use route::join_errors;
pub use table::{merge_stats, RemoteTable};
use transport::{Transport, Wire};

/// How a client talks to its shards.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Token the servers require (sent in HELLO on every new connection).
    pub token: Option<String>,
    /// Most keys per request; a larger batch is split. Default 500.
    pub keys_per_request_max: usize,
    /// Longest wait for a reply (or for a request to be taken): the ceiling of every
    /// deadline, and the deadline of store-wide operations (checkpoint, flush, restore,
    /// export pages; for a shard of n replicas a read's attempt gets `timeout / n`).
    /// Default 30 s.
    pub timeout: Duration,
    /// Longest wait to connect. Default 5 s.
    pub connect_timeout: Duration,
    /// Most requests of one call in flight to one shard. Default 8.
    pub in_flight_per_shard: usize,
    /// TLS to the shards (the CA to verify them, optionally a client certificate).
    /// Default none: plain TCP.
    pub tls: Option<ClientTls>,
    /// Reads go only to replicas serving at least this checkpoint (the publisher's batch
    /// id, see [`Client::served`]); a shard with none fails the call, naming what each
    /// replica serves. Default none.
    pub min_checkpoint: Option<u64>,
    /// The shortest deadline of a keyed request a sibling replica could take over (a
    /// read of a group): it may take 10x its replica's recent p99, at least this. A
    /// replica that misses it is ejected and the read goes to a sibling. Default 100 ms.
    pub deadline_min: Duration,
    /// The shortest deadline of a keyed request no other replica can take (a write, a
    /// read of a single server): missing it fails the call, naming the shard and the
    /// wait. Default 5 s.
    pub deadline_alone_min: Duration,
    /// How long a read waits before a copy goes to a sibling replica serving a checkpoint
    /// at least as new (the first answer is taken): `None` the group's recent p95 (at
    /// least 1 ms), zero never. Default `None`.
    pub hedge_delay: Option<Duration>,
    /// How often an ejected replica is probed (connect, hello, `SERVED`) to be readmitted.
    /// Default 250 ms.
    pub probe_every: Duration,
}

/// A client's options as settings give them (a cluster file's keys, [`ClientConfig`], or
/// `embank.connect`'s keyword arguments): every field optional, the rest defaulted.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientSettings {
    pub token: Option<String>,
    pub timeout_seconds: Option<f64>,
    pub connect_timeout_seconds: Option<f64>,
    pub keys_per_request_max: Option<usize>,
    pub in_flight_per_shard: Option<usize>,
    pub tls_ca_file: Option<std::path::PathBuf>,
    pub tls_cert_file: Option<std::path::PathBuf>,
    pub tls_key_file: Option<std::path::PathBuf>,
    pub tls_server_name: Option<String>,
    pub min_checkpoint: Option<u64>,
    pub deadline_min_seconds: Option<f64>,
    pub deadline_alone_min_seconds: Option<f64>,
    /// 0: no hedged reads.
    pub hedge_delay_seconds: Option<f64>,
    /// The shard map's version these shards are (a cluster file's `version`).
    pub version: Option<u64>,
    /// How often to look for a new shard map (with `map`). Default 2 s.
    pub reload_seconds: Option<f64>,
    /// Where the shard map is reloaded from (a cluster file's path or an `http://` URL);
    /// none: the shards stay as given.
    pub map: Option<String>,
}

impl ClientSettings {
    /// Connects to `groups` with these options; with `map`, keeps reloading it.
    pub fn connect(&self, groups: &[Vec<String>]) -> Result<Client> {
        let client = Client::connect_groups(groups, self.options()?)?;
        client.set_version(self.version.unwrap_or(0));
        if let Some(m) = &self.map {
            client.watch_map(MapSource::parse(m), self.reload_seconds);
        }
        Ok(client)
    }

    /// The options, checked (TLS files loaded): errors name the key.
    pub fn options(&self) -> Result<ClientOptions> {
        let d = ClientOptions::default();
        let secs = |what: &str, s: Option<f64>, default: Duration| match s {
            None => Ok(default),
            Some(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            Some(s) => Err(Error::config(format!("{what} must be a positive number of seconds, got {s}"))),
        };
        let at_least_one = |what: &str, n: Option<usize>, default: usize| match n {
            Some(0) => Err(Error::config(format!("{what} must be at least 1"))),
            n => Ok(n.unwrap_or(default)),
        };
        let tls = match &self.tls_ca_file {
            Some(ca_file) => Some(crate::tls::ClientTls::load(&crate::tls::ClientTlsFiles {
                ca_file: ca_file.clone(),
                cert_file: self.tls_cert_file.clone(),
                key_file: self.tls_key_file.clone(),
                server_name: self.tls_server_name.clone(),
            })?),
            None if self.tls_cert_file.is_some() || self.tls_key_file.is_some() || self.tls_server_name.is_some() => {
                return Err(Error::config("tls_cert_file, tls_key_file and tls_server_name need tls_ca_file"));
            }
            None => None,
        };
        Ok(ClientOptions {
            token: self.token.clone(),
            keys_per_request_max: at_least_one(
                "keys_per_request_max",
                self.keys_per_request_max,
                d.keys_per_request_max,
            )?,
            timeout: secs("timeout_seconds", self.timeout_seconds, d.timeout)?,
            connect_timeout: secs("connect_timeout_seconds", self.connect_timeout_seconds, d.connect_timeout)?,
            in_flight_per_shard: at_least_one("in_flight_per_shard", self.in_flight_per_shard, d.in_flight_per_shard)?,
            tls,
            min_checkpoint: self.min_checkpoint,
            deadline_min: secs("deadline_min_seconds", self.deadline_min_seconds, d.deadline_min)?,
            deadline_alone_min: secs(
                "deadline_alone_min_seconds",
                self.deadline_alone_min_seconds,
                d.deadline_alone_min,
            )?,
            hedge_delay: match self.hedge_delay_seconds {
                None => None,
                Some(0.0) => Some(Duration::ZERO),
                s => Some(secs("hedge_delay_seconds", s, Duration::ZERO)?),
            },
            ..d
        })
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            token: None,
            keys_per_request_max: 500,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            in_flight_per_shard: 8,
            tls: None,
            min_checkpoint: None,
            deadline_min: Duration::from_millis(100),
            deadline_alone_min: Duration::from_secs(5),
            hedge_delay: None,
            probe_every: Duration::from_millis(250),
        }
    }
}

/// The shards a call routes by: one version of the shard map. A call takes the current
/// one when it begins and sends every request by it; a new version replaces it whole.
struct Topology {
    version: u64,
    shards: Vec<Arc<Shard>>,
}

struct Inner {
    topo: RwLock<Arc<Topology>>,
    opts: ClientOptions,
    next_id: AtomicU64,
    closed: AtomicBool,
    /// Where the shard map is reloaded from (a client connected to a map), and the
    /// thread that watches it.
    map: Mutex<Option<map::Watch>>,
    /// The thread that readmits ejected replicas (clients with replica groups).
    prober: Mutex<Option<health::Prober>>,
}

/// A connection to a set of shards; cheap to clone, usable from many threads.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Connects to every shard (checking the token), so a wrong address fails here. An
    /// address `a:7070|b:7070` is a shard of two replicas (see [`connect_groups`](Self::connect_groups)).
    pub fn connect<S: AsRef<str>>(addrs: &[S], opts: ClientOptions) -> Result<Client> {
        let groups: Vec<Vec<String>> = addrs
            .iter()
            .map(|a| a.as_ref().split('|').filter(|s| !s.trim().is_empty()).map(str::to_string).collect())
            .collect();
        Self::connect_groups(&groups, opts)
    }

    /// Connects to shards of several replicas each (`groups[i]`: shard i's replicas, the
    /// first its primary). Reads (lookup, len, stats, and pull on read-only replicas) are
    /// spread over a shard's healthy replicas and fail over to another on an error or a
    /// timeout; writes go to the primary alone. At least one replica of every shard must
    /// answer now; one that does not is skipped until it does.
    pub fn connect_groups<S: AsRef<str>>(groups: &[Vec<S>], opts: ClientOptions) -> Result<Client> {
        let client = Self::connect_over(&Wire::default(), groups, opts)?;
        client.ensure_prober();
        Ok(client)
    }

    /// [`connect_groups`](Self::connect_groups) over the transport `t`, without the prober.
    fn connect_over<T: Transport, S: AsRef<str>>(t: &T, groups: &[Vec<S>], opts: ClientOptions) -> Result<Client> {
        if groups.is_empty() || groups.iter().any(|g| g.is_empty()) {
            return Err(Error::config("connect: give at least one shard, each with at least one address"));
        }
        if opts.keys_per_request_max == 0 || opts.in_flight_per_shard == 0 {
            return Err(Error::config("keys_per_request_max and in_flight_per_shard must be at least 1"));
        }
        let client = Client {
            inner: Arc::new(Inner {
                topo: RwLock::new(Arc::new(Topology { version: 0, shards: Vec::new() })),
                opts,
                next_id: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                map: Mutex::new(None),
                prober: Mutex::new(None),
            }),
        };
        let topo = client.topology_of(0, groups);
        client.check_reachable(t, &topo)?;
        *client.inner.topo.write() = Arc::new(topo);
        Ok(client)
    }

    /// Shards of `groups`, keeping the current map's endpoint of every address that stays
    /// (its pooled connections, health and table ids).
    fn topology_of<S: AsRef<str>>(&self, version: u64, groups: &[Vec<S>]) -> Topology {
        let current = self.topology();
        let known: std::collections::HashMap<&str, &Arc<Endpoint>> =
            current.shards.iter().flat_map(|s| s.replicas.iter().map(|e| (e.addr.as_str(), e))).collect();
        let shards = groups
            .iter()
            .enumerate()
            .map(|(index, g)| {
                Arc::new(Shard {
                    index,
                    replicas: g
                        .iter()
                        .map(|a| {
                            let fresh = Endpoint::new(a.as_ref());
                            match known.get(fresh.addr.as_str()) {
                                Some(e) => Arc::clone(e),
                                None => Arc::new(fresh),
                            }
                        })
                        .collect(),
                    next: AtomicUsize::new(index),
                    latency: Default::default(),
                })
            })
            .collect();
        Topology { version, shards }
    }

    /// Connects to every replica of `topo` not yet connected: at least one of each shard
    /// must answer (one that does not is marked down and skipped until it does).
    fn check_reachable<T: Transport>(&self, t: &T, topo: &Topology) -> Result<()> {
        for shard in &topo.shards {
            let mut errors = Vec::new();
            for r in 0..shard.replicas.len() {
                if t.has_pooled(shard, r) {
                    continue;
                }
                let budget = self.inner.opts.timeout / shard.replicas.len() as u32;
                match t.open(self, shard, r, budget) {
                    Ok(conn) => t.keep(shard, r, conn),
                    Err(e) if shard.replicas.len() > 1 && route::retryable(&e) => {
                        self.eject(t, shard, r, &e.to_string());
                        errors.push(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            if errors.len() == shard.replicas.len() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("no replica of {} answers: {}", shard.name(), join_errors(&errors)),
                ));
            }
        }
        Ok(())
    }

    /// The shard map calls route by now.
    fn topology(&self) -> Arc<Topology> {
        Arc::clone(&self.inner.topo.read())
    }

    pub fn shard_count(&self) -> usize {
        self.topology().shards.len()
    }

    /// The version of the shard map in use (0: addresses given directly).
    pub fn map_version(&self) -> u64 {
        self.topology().version
    }

    /// The shards' primary addresses, in routing order.
    pub fn addrs(&self) -> Vec<String> {
        self.topology().shards.iter().map(|s| s.replicas[0].addr.clone()).collect()
    }

    /// Every shard's replica addresses, in routing order.
    pub fn groups(&self) -> Vec<Vec<String>> {
        self.topology().shards.iter().map(|s| s.replicas.iter().map(|r| r.addr.clone()).collect()).collect()
    }

    /// What each replica of the current map did since this client connected
    /// (`[shard][replica]`): `{"address", "answered", "hedges_sent", "hedges_won",
    /// "deadlines_missed", "ejections", "readmissions", "ejected", "why", "p99_ms"}` —
    /// requests answered (the share of reads it takes), copies of slow reads sent to it
    /// and those it answered first, requests it let pass their deadline, times it left
    /// and rejoined the rotation, whether it is out now (and why), its recent p99.
    pub fn replica_counts(&self) -> Vec<Vec<serde_json::Value>> {
        let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        self.topology()
            .shards
            .iter()
            .map(|s| {
                s.replicas
                    .iter()
                    .map(|e| {
                        let c = &e.counters;
                        serde_json::json!({
                            "address": e.addr,
                            "answered": n(&c.answered),
                            "hedges_sent": n(&c.hedges_sent),
                            "hedges_won": n(&c.hedges_won),
                            "deadlines_missed": n(&c.deadlines_missed),
                            "ejections": n(&c.ejections),
                            "readmissions": n(&c.readmissions),
                            "ejected": e.rotation.ejected.load(Ordering::Relaxed),
                            "why": e.rotation.why.lock().clone(),
                            "p99_ms": e.latency.lock().p99().map(|p| p.as_secs_f64() * 1e3),
                        })
                    })
                    .collect()
            })
            .collect()
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }
}

impl Client {
    /// Creates a table on every shard.
    pub fn create_table(&self, name: &str, options: TableOptions) -> Result<RemoteTable> {
        embank_core::validate_name(name)?;
        options.validate()?;
        let body = serde_json::json!({ "name": name, "options": options }).to_string();
        let replies = self.broadcast_from(Op::CreateTable, body.as_bytes(), None)?;
        self.table_from(name, replies)
    }

    /// Opens a table that exists on every shard.
    pub fn table(&self, name: &str) -> Result<RemoteTable> {
        let replies = self.broadcast_from(Op::OpenTable, name.as_bytes(), None)?;
        self.table_from(name, replies)
    }

    fn table_from(&self, name: &str, replies: Vec<route::Answer>) -> Result<RemoteTable> {
        let mut meta: Option<TableMeta> = None;
        for (shard, r, h, body) in replies {
            let m: TableMeta = serde_json::from_slice(&body)
                .map_err(|e| Error::corrupt(format!("{}: bad table description: {e}", shard.replica_name(r))))?;
            if let Some(first) = &meta {
                if first.dim != m.dim {
                    return Err(Error::config(format!(
                        "table {name:?} has dim {} on shard 0 but {} on {}",
                        first.dim,
                        m.dim,
                        shard.replica_name(r)
                    )));
                }
            }
            shard.replicas[r].tables.lock().insert(name.to_string(), h.table_id);
            meta.get_or_insert(m);
        }
        let meta = meta.expect("at least one shard");
        Ok(RemoteTable { client: self.clone(), name: name.to_string(), dim: meta.dim as usize, id: name.into(), meta })
    }

    /// Names of the tables on the servers (their union), sorted.
    pub fn tables(&self) -> Result<Vec<String>> {
        let mut names = std::collections::BTreeSet::new();
        for (_, body) in self.broadcast(Op::ListTables, &[], None)? {
            let list: Vec<String> =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad table list: {e}")))?;
            names.extend(list);
        }
        Ok(names.into_iter().collect())
    }

    pub fn drop_table(&self, name: &str) -> Result<()> {
        self.broadcast(Op::DropTable, name.as_bytes(), None).map(|_| ())
    }

    /// Makes every write acknowledged before this call durable on every shard.
    pub fn flush(&self) -> Result<()> {
        self.broadcast(Op::Flush, &[], None).map(|_| ())
    }

    /// Store statistics with the embedded store's fields, summed over the shards
    /// (tables matched by name), and each shard's own under `"shards"`.
    pub fn stats(&self) -> Result<serde_json::Value> {
        let mut shards = Vec::new();
        for (s, r, _, body) in self.broadcast_from(Op::StoreStats, &[], None)? {
            let mut v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad stats: {e}")))?;
            v["shard"] = serde_json::json!(s.replicas[r].addr);
            shards.push(v);
        }
        let mut total = merge_stats(&shards);
        total["path"] = serde_json::json!(self.url());
        total["shards"] = serde_json::Value::Array(shards);
        Ok(total)
    }

    /// A checkpoint of every shard at this batch boundary (call it between batches).
    pub fn checkpoint(&self, batch_id: u64) -> Result<()> {
        self.checkpoint_with_meta(batch_id, &[])
    }

    /// A checkpoint of every shard at `batch_id` that keeps `meta` (at most 64 KiB) with it.
    pub fn checkpoint_with_meta(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        let mut body = batch_id.to_le_bytes().to_vec();
        body.extend_from_slice(meta);
        self.broadcast(Op::Checkpoint, &body, None).map(|_| ())
    }

    /// The checkpoints every shard retains, oldest first.
    /// Which checkpoint each shard serves (`{"batch_id", "seq", "replica", "state"}`, in
    /// shard order): a replica's the publisher's checkpoint it applied last, a primary's
    /// its newest retained checkpoint.
    pub fn served(&self) -> Result<Vec<serde_json::Value>> {
        self.broadcast_from(Op::Served, &[], None)?
            .into_iter()
            .map(|(s, r, _, body)| {
                let mut v: serde_json::Value =
                    serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad served reply: {e}")))?;
                *s.replicas[r].served.lock() = v["batch_id"].as_u64();
                v["address"] = serde_json::json!(s.replicas[r].addr);
                Ok(v)
            })
            .collect()
    }

    /// Which checkpoint every replica serves: `[shard][replica]`, each `{"batch_id", "seq",
    /// "replica", "state", "readable", "address"}` or `{"error": ...}` for one that does
    /// not answer.
    pub fn served_all(&self) -> Vec<Vec<serde_json::Value>> {
        self.topology()
            .shards
            .iter()
            .map(|shard| {
                (0..shard.replicas.len())
                    .map(|r| match self.served_reply(shard, r) {
                        Ok(mut v) => {
                            v["address"] = serde_json::json!(shard.replicas[r].addr);
                            v
                        }
                        Err(e) => serde_json::json!({"error": e.to_string(), "address": shard.replicas[r].addr}),
                    })
                    .collect()
            })
            .collect()
    }

    pub fn checkpoints(&self) -> Result<Vec<embank_core::CheckpointInfo>> {
        let mut common: Option<Vec<embank_core::CheckpointInfo>> = None;
        for (_, body) in self.broadcast(Op::Checkpoints, &[], None)? {
            let list: Vec<embank_core::CheckpointInfo> =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad checkpoint list: {e}")))?;
            common = Some(match common {
                None => list,
                Some(c) => c.into_iter().filter(|x| list.iter().any(|y| y.batch_id == x.batch_id)).collect(),
            });
        }
        Ok(common.unwrap_or_default())
    }

    /// Returns every shard to checkpoint `batch_id`.
    pub fn restore(&self, batch_id: u64) -> Result<()> {
        self.broadcast(Op::Restore, &batch_id.to_le_bytes(), None).map(|_| ())
    }

    /// `tcp://host:port,host:port` (a shard's replicas joined by `|`).
    pub fn url(&self) -> String {
        format!("tcp://{}", self.groups().iter().map(|g| g.join("|")).collect::<Vec<_>>().join(","))
    }

    /// Closes every pooled connection; later calls fail with `Closed`. The servers keep running.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Relaxed);
        if let Some(w) = self.inner.map.lock().take() {
            w.stop();
        }
        if let Some(p) = self.inner.prober.lock().take() {
            p.stop();
        }
        for s in &self.topology().shards {
            for r in &s.replicas {
                r.pool.lock().clear();
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Relaxed)
    }
}

impl embank_core::StoreApi for Client {
    fn location(&self) -> String {
        self.url()
    }
    fn served(&self) -> Result<serde_json::Value> {
        Ok(serde_json::Value::Array(Client::served(self)?))
    }
    fn lookup_checkpoint(
        &self,
        name: &str,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        Client::table(self, name)?.lookup_at(batch_id, keys, out, found)
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn is_closed(&self) -> bool {
        Client::is_closed(self)
    }
    fn create_table(&self, name: &str, options: TableOptions) -> Result<std::sync::Arc<dyn embank_core::TableApi>> {
        Ok(std::sync::Arc::new(Client::create_table(self, name, options)?))
    }
    fn table(&self, name: &str) -> Result<std::sync::Arc<dyn embank_core::TableApi>> {
        Ok(std::sync::Arc::new(Client::table(self, name)?))
    }
    fn tables(&self) -> Result<Vec<String>> {
        Client::tables(self)
    }
    fn drop_table(&self, name: &str) -> Result<()> {
        Client::drop_table(self, name)
    }
    fn flush(&self) -> Result<()> {
        Client::flush(self)
    }
    fn close(&self) -> Result<()> {
        if Client::is_closed(self) {
            return Ok(());
        }
        // Read-only replica groups (fed by an update stream) take no writes to flush.
        let read_only = self.topology().shards.iter().all(|s| s.replicas[0].read_only.load(Ordering::Relaxed));
        let flushed = if read_only { Ok(()) } else { Client::flush(self) };
        Client::close(self);
        flushed
    }
    fn checkpoint(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        self.checkpoint_with_meta(batch_id, meta)
    }
    fn checkpoints(&self) -> Result<Vec<embank_core::CheckpointInfo>> {
        Client::checkpoints(self)
    }
    fn restore(&self, batch_id: u64) -> Result<()> {
        Client::restore(self, batch_id)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        Client::stats(self)
    }
}
