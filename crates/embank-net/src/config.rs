//! The `embank serve` configuration file (TOML). See docs/serve.sample.toml.

use std::path::{Path, PathBuf};
use std::time::Duration;

use embank_core::{Error, IoChoice, Result, RowWrites, StoreOptions, TableOptions};
use serde::Deserialize;

use crate::server::ServerOptions;
use crate::tls::{ServerTls, ServerTlsFiles};

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Address of the protocol listener. Default `127.0.0.1:7070`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Address of `/metrics`, `/readyz` (also `/healthz`) and `/livez` (HTTP). None: not served.
    #[serde(default)]
    pub admin: Option<String>,
    /// Store directory (created if missing).
    pub store: PathBuf,
    /// Shared secret clients present; required to listen beyond loopback.
    #[serde(default)]
    pub token: Option<String>,
    /// File holding the token (first line), instead of `token`.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// TLS: the server's certificate and key, optionally a client CA (mutual TLS).
    /// Required to listen beyond loopback unless `insecure`.
    #[serde(default)]
    pub tls: Option<ServerTlsFiles>,
    /// Listen beyond loopback without TLS (clear text; logged loudly). Default false.
    #[serde(default)]
    pub insecure: bool,
    /// How long a shutdown waits for requests in flight. Default 30 s.
    #[serde(default = "default_drain")]
    pub drain_seconds: f64,
    /// The shard map clients reload (a cluster file; relative to this file): the server
    /// names its version in every hello, so a client still on an older one looks for the
    /// new one at once. None: not named.
    #[serde(default)]
    pub shard_map: Option<PathBuf>,
    #[serde(default)]
    pub store_options: StoreSection,
    #[serde(default)]
    pub limits: Limits,
    /// Tables created at start if missing (`name` plus any table option).
    #[serde(default)]
    pub tables: Vec<toml::Table>,
    /// Makes this server a replica: it applies one partition of an update stream
    /// (transport, brokers, topic, partition, start) and refuses writes from clients.
    #[serde(default)]
    pub updates: Option<crate::stream::ReplicaOptions>,
    /// A Redis Cluster shared by serving nodes as the tier between each store's row
    /// cache and its medium (`redis_cluster = ["host:port", ...]`, `ttl_seconds`,
    /// `timeout_ms`, `backoff_ms`).
    #[serde(default)]
    pub shared_tier: Option<crate::redis_tier::RedisTierConfig>,
    /// What the file spelt the old way (each also logged as a warning when parsed).
    #[serde(skip)]
    pub deprecated: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub cache_bytes: u64,
    pub io_engine: String,
    pub io_depth: u32,
    pub mmap_random_access: bool,
    /// Map the index and rows with transparent huge pages (read-mostly stores: replicas).
    pub huge_pages: bool,
    /// How rows are written to an mmap table's file: "mapped" (copied into the mapping,
    /// the default) or "file" (`pwrite`: the kernel's write-back then sends no TLB
    /// shootdowns to the cores that read; see `StoreOptions::row_writes`).
    pub row_writes: String,
    pub verify: bool,
    /// Checkpoints kept (at least 1). On a replica: how many of the publisher's
    /// checkpoints stay readable exactly (`lookup(checkpoint=N)`), each holding the rows
    /// changed since it from reuse.
    pub keep_checkpoints: usize,
    /// Automatic hot placement (`[store_options.hot_placement]`; absent: off).
    pub hot_placement: Option<embank_core::HotOptions>,
}

impl Default for StoreSection {
    fn default() -> Self {
        let d = StoreOptions::default();
        StoreSection {
            cache_bytes: d.cache_bytes,
            io_engine: "auto".into(),
            io_depth: d.io_depth,
            mmap_random_access: d.mmap_random_access,
            huge_pages: d.huge_pages,
            row_writes: d.row_writes.name().into(),
            verify: d.verify,
            keep_checkpoints: d.keep_checkpoints,
            hot_placement: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub frame_bytes_max: u32,
    pub keys_per_request_max: u32,
    pub connections_max: usize,
    pub auth_timeout_seconds: f64,
    pub pending_max: usize,
    pub pending_per_peer_max: usize,
    pub idle_timeout_seconds: f64,
    pub frame_timeout_seconds: f64,
    pub zero_copy: bool,
    pub zero_copy_row_bytes_min: usize,
    /// Old spellings, still read (a warning names the new one).
    #[serde(rename = "max_frame_bytes")]
    old_frame_bytes_max: Option<u32>,
    #[serde(rename = "max_connections")]
    old_connections_max: Option<usize>,
    #[serde(rename = "zero_copy_min_row_bytes")]
    old_zero_copy_row_bytes_min: Option<usize>,
}

impl Limits {
    /// Moves values given under old spellings to their fields; one message per spelling.
    fn take_old_spellings(&mut self) -> Vec<String> {
        let mut said = Vec::new();
        let mut note = |old: &str, new: &str| {
            said.push(format!("limits.{old} is deprecated: write limits.{new} (bounds are named with _max last)"))
        };
        if let Some(v) = self.old_frame_bytes_max.take() {
            self.frame_bytes_max = v;
            note("max_frame_bytes", "frame_bytes_max");
        }
        if let Some(v) = self.old_connections_max.take() {
            self.connections_max = v;
            note("max_connections", "connections_max");
        }
        if let Some(v) = self.old_zero_copy_row_bytes_min.take() {
            self.zero_copy_row_bytes_min = v;
            note("zero_copy_min_row_bytes", "zero_copy_row_bytes_min");
        }
        said
    }
}

impl Default for Limits {
    fn default() -> Self {
        let d = ServerOptions::default();
        Limits {
            frame_bytes_max: d.frame_bytes_max,
            keys_per_request_max: d.keys_per_request_max,
            connections_max: d.connections_max,
            auth_timeout_seconds: d.auth_timeout.as_secs_f64(),
            pending_max: d.pending_max,
            pending_per_peer_max: d.pending_per_peer_max,
            idle_timeout_seconds: d.idle_timeout.as_secs_f64(),
            frame_timeout_seconds: d.frame_timeout.as_secs_f64(),
            zero_copy: d.zero_copy,
            zero_copy_row_bytes_min: d.zero_copy_row_bytes_min,
            old_frame_bytes_max: None,
            old_connections_max: None,
            old_zero_copy_row_bytes_min: None,
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:7070".into()
}

fn default_drain() -> f64 {
    30.0
}

fn seconds(what: &str, s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        return Err(Error::config(format!("{what} must be a positive number of seconds, got {s}")));
    }
    Ok(Duration::from_secs_f64(s))
}

/// The store options a config may put at its top level by mistake: where they belong.
const STORE_KEYS: [&str; 9] = [
    "cache_bytes",
    "io_engine",
    "io_depth",
    "mmap_random_access",
    "huge_pages",
    "row_writes",
    "verify",
    "keep_checkpoints",
    "hot_placement",
];

/// A parse error naming an unknown top-level key that is a store option, with where it goes.
fn misplaced_hint(message: String) -> String {
    match STORE_KEYS.iter().find(|k| message.contains(&format!("unknown field `{k}`"))) {
        Some(k) => format!("{message}\n`{k}` is a store option: put it under [store_options]"),
        None => message,
    }
}

impl ServeConfig {
    /// Reads and checks a config file; errors name the file, the key and what was wrong.
    pub fn from_file(path: &Path) -> Result<ServeConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read config {}", path.display()), e))?;
        let mut c = Self::parse(&text).map_err(|e| e.context(format!("config {}", path.display())))?;
        // Relative paths in the file are relative to the file.
        let base = path.parent().unwrap_or(Path::new("."));
        if c.store.is_relative() {
            c.store = base.join(&c.store);
        }
        if let Some(m) = &mut c.shard_map {
            if m.is_relative() {
                *m = base.join(&*m);
            }
        }
        if let Some(tls) = &mut c.tls {
            for p in
                [Some(&mut tls.cert_file), Some(&mut tls.key_file), tls.client_ca_file.as_mut()].into_iter().flatten()
            {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        if let Some(t) = &c.token_file {
            let p = if t.is_relative() { base.join(t) } else { t.clone() };
            let token = std::fs::read_to_string(&p)
                .map_err(|e| Error::io(format!("cannot read token_file {}", p.display()), e))?;
            c.token = Some(token.lines().next().unwrap_or("").trim().to_string());
        }
        Ok(c)
    }

    /// Parses config text (relative paths stay relative).
    pub fn parse(text: &str) -> Result<ServeConfig> {
        let mut c: ServeConfig = toml::from_str(text).map_err(|e| Error::config(misplaced_hint(e.to_string())))?;
        c.deprecated = c.limits.take_old_spellings();
        for (i, t) in c.tables.iter().enumerate() {
            if t.get("lifecycle").and_then(|l| l.as_table()).is_some_and(|l| l.contains_key("max_rows")) {
                c.deprecated.push(format!(
                    "tables[{i}].lifecycle.max_rows is deprecated: write rows_max (bounds are named with _max last)"
                ));
            }
        }
        for d in &c.deprecated {
            tracing::warn!("{d}");
        }
        if c.token.is_some() && c.token_file.is_some() {
            return Err(Error::config("set `token` or `token_file`, not both"));
        }
        if c.token.as_deref() == Some("") {
            return Err(Error::config("`token` is empty"));
        }
        c.server_options()?;
        c.store_options()?;
        if let Some(u) = &c.updates {
            u.validate()?;
        }
        c.table_options()?;
        Ok(c)
    }

    pub fn server_options(&self) -> Result<ServerOptions> {
        let l = &self.limits;
        if l.keys_per_request_max == 0
            || l.connections_max == 0
            || l.pending_max == 0
            || l.pending_per_peer_max == 0
            || l.frame_bytes_max < 64
        {
            return Err(Error::config(
                "limits: keys_per_request_max, connections_max, pending_max and pending_per_peer_max must be at least 1, frame_bytes_max at least 64",
            ));
        }
        Ok(ServerOptions {
            token: self.token.clone(),
            tls: None,
            insecure: self.insecure,
            frame_bytes_max: l.frame_bytes_max,
            keys_per_request_max: l.keys_per_request_max,
            connections_max: l.connections_max,
            auth_timeout: seconds("limits.auth_timeout_seconds", l.auth_timeout_seconds)?,
            pending_max: l.pending_max,
            pending_per_peer_max: l.pending_per_peer_max,
            idle_timeout: seconds("limits.idle_timeout_seconds", l.idle_timeout_seconds)?,
            frame_timeout: seconds("limits.frame_timeout_seconds", l.frame_timeout_seconds)?,
            zero_copy: l.zero_copy,
            zero_copy_row_bytes_min: l.zero_copy_row_bytes_min,
            shard_map: self.shard_map.clone(),
            read_only: self.updates.as_ref().map(|u| {
                format!(
                    "this server is a replica of {} (partition {}): write to the training store",
                    u.stream.describe(),
                    u.partition
                )
            }),
        })
    }

    /// [`server_options`](Self::server_options) with the TLS files loaded.
    pub fn server_options_loaded(&self) -> Result<ServerOptions> {
        let mut o = self.server_options()?;
        o.tls = match &self.tls {
            Some(files) => Some(ServerTls::load(files)?),
            None => None,
        };
        Ok(o)
    }

    pub fn drain(&self) -> Result<Duration> {
        seconds("drain_seconds", self.drain_seconds)
    }

    pub fn store_options(&self) -> Result<StoreOptions> {
        let s = &self.store_options;
        if s.io_depth == 0 {
            return Err(Error::config("store_options.io_depth must be at least 1"));
        }
        if s.keep_checkpoints == 0 {
            return Err(Error::config("store_options.keep_checkpoints must be at least 1"));
        }
        Ok(StoreOptions {
            cache_bytes: s.cache_bytes,
            io_engine: IoChoice::parse(&s.io_engine).map_err(|e| e.context("store_options.io_engine"))?,
            io_depth: s.io_depth,
            mmap_random_access: s.mmap_random_access,
            huge_pages: s.huge_pages,
            row_writes: RowWrites::parse(&s.row_writes).map_err(|e| e.context("store_options.row_writes"))?,
            verify: s.verify,
            keep_checkpoints: s.keep_checkpoints,
            hot_placement: s.hot_placement.clone(),
            ..StoreOptions::default()
        })
    }

    /// `(name, options)` of each `[[tables]]` entry.
    pub fn table_options(&self) -> Result<Vec<(String, TableOptions)>> {
        let mut out: Vec<(String, TableOptions)> = Vec::new();
        for (i, t) in self.tables.iter().enumerate() {
            let mut t = t.clone();
            let name = match t.remove("name") {
                Some(toml::Value::String(s)) => s,
                Some(_) => return Err(Error::config(format!("tables[{i}].name must be a string"))),
                None => return Err(Error::config(format!("tables[{i}] has no `name`"))),
            };
            embank_core::validate_name(&name).map_err(|e| e.context(format!("tables[{i}]")))?;
            if !t.contains_key("dim") {
                return Err(Error::config(format!("tables[{i}] ({name:?}) has no `dim`")));
            }
            let o: TableOptions =
                toml::Value::Table(t).try_into().map_err(|e| Error::config(format!("tables[{i}] ({name:?}): {e}")))?;
            o.validate().map_err(|e| e.context(format!("tables[{i}] ({name:?})")))?;
            if out.iter().any(|(n, _)| *n == name) {
                return Err(Error::config(format!("tables[{i}]: table {name:?} is listed twice")));
            }
            out.push((name, o));
        }
        Ok(out)
    }
}

// The cluster file (a client's config, the shard map) lives with the client.
pub use crate::client::{ClientConfig, ShardEntry};

#[cfg(test)]
mod tests {
    #[test]
    fn a_store_option_at_the_top_level_is_pointed_to_its_section() {
        let e = super::ServeConfig::parse("store = \"/tmp/x\"\ncache_bytes = 1000\n").unwrap_err().to_string();
        assert!(e.contains("`cache_bytes` is a store option: put it under [store_options]"), "{e}");
        let e = super::ServeConfig::parse("store = \"/tmp/x\"\ncache_byts = 1000\n").unwrap_err().to_string();
        assert!(!e.contains("store option"), "{e}");
    }

    use super::*;

    const SAMPLE: &str = include_str!("../../../docs/serve.sample.toml");

    #[test]
    fn sample_config_parses() {
        let c = ServeConfig::parse(SAMPLE).unwrap();
        let tables = c.table_options().unwrap();
        assert_eq!(tables.len(), 3);
        assert_eq!(tables[0].0, "user");
        assert_eq!(tables[0].1.dim, 64);
        let life = &tables[2].1.lifecycle;
        assert_eq!((life.admit_after, life.rows_max), (3, Some(50_000_000)));
        assert_eq!(life.evict, embank_core::EvictPolicy::Lfu);
        assert_eq!(c.server_options().unwrap().keys_per_request_max, 65_536);
        assert_eq!(tables[1].1.dtype, embank_core::DType::Int8);
        assert!(c.store_options().unwrap().hot_placement.is_none());
        // The commented row-wise Adagrad line parses as the user table's optimizer.
        let line = SAMPLE.lines().find(|l| l.contains("kind = \"rowwise_adagrad\"")).unwrap();
        let uncommented = SAMPLE.replacen("optimizer = { kind = \"adagrad\"", "# was", 1).replacen(line, &line[2..], 1);
        let c = ServeConfig::parse(&uncommented).unwrap();
        let user = &c.table_options().unwrap()[0].1;
        assert_eq!(user.optimizer.name(), "rowwise_adagrad");
        assert_eq!(user.optimizer.state_len(64), 1);
    }

    #[test]
    fn old_spellings_of_bounds_are_read_and_named() {
        let text =
            "store = \"s\"\n[limits]\nmax_frame_bytes = 4096\nmax_connections = 7\nzero_copy_min_row_bytes = 9\n";
        let c = ServeConfig::parse(text).unwrap();
        let o = c.server_options().unwrap();
        assert_eq!((o.frame_bytes_max, o.connections_max, o.zero_copy_row_bytes_min), (4096, 7, 9));
        assert_eq!(c.deprecated.len(), 3, "{:?}", c.deprecated);
        assert!(c.deprecated[0].contains("limits.max_frame_bytes is deprecated: write limits.frame_bytes_max"));
        assert!(ServeConfig::parse(SAMPLE).unwrap().deprecated.is_empty());
        let old = "store = \"s\"\n[[tables]]\nname = \"t\"\ndim = 4\nlifecycle = { max_rows = 5 }\n";
        let c = ServeConfig::parse(old).unwrap();
        assert_eq!(c.table_options().unwrap()[0].1.lifecycle.rows_max, Some(5));
        assert!(c.deprecated[0].contains("tables[0].lifecycle.max_rows is deprecated"), "{:?}", c.deprecated);
    }

    #[test]
    fn the_sample_hot_placement_section_parses_uncommented() {
        let block: String = SAMPLE
            .lines()
            .skip_while(|l| !l.starts_with("# [store_options.hot_placement]"))
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches("# ").to_string() + "\n")
            .collect();
        let c = ServeConfig::parse(&format!("store = 'x'\n{block}")).unwrap();
        let h = c.store_options().unwrap().hot_placement.unwrap();
        assert_eq!((h.keys, h.every_seconds, h.sample_every), (10_000, 600.0, 16));
        assert!(err("store = 'x'\n[[tables]]\nname = 't'\ndim = 4\ndtype = 'bf16'").contains("bf16"));
    }

    #[test]
    fn row_writes_parse_and_reject_a_bad_value() {
        let plain = ServeConfig::parse("store = 'x'").unwrap();
        assert_eq!(plain.store_options().unwrap().row_writes, RowWrites::Mapped);
        let set = ServeConfig::parse("store = 'x'\n[store_options]\nrow_writes = 'file'").unwrap();
        assert_eq!(set.store_options().unwrap().row_writes, RowWrites::File);
        let e = err("store = 'x'\n[store_options]\nrow_writes = 'mmap'");
        assert!(e.contains("row_writes") && e.contains("mmap"), "{e}");
    }

    fn err(text: &str) -> String {
        ServeConfig::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn the_sample_updates_section_parses_uncommented() {
        let block: String = SAMPLE
            .lines()
            .skip_while(|l| !l.starts_with("# [updates]"))
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches("# ").split(" #").next().unwrap().to_string() + "\n")
            .collect();
        let c = ServeConfig::parse(&format!("store = 'x'\n{block}")).unwrap();
        let u = c.updates.as_ref().unwrap();
        assert_eq!((u.partition, u.stream.topic.as_str(), u.ingest_share), (0, "embank-updates", 0.5));
        for bad in ["0", "1.5"] {
            let e =
                err(&format!("store = 'x'\n[updates]\ntransport = 'kafka'\nbrokers = 'x:9092'\ningest_share = {bad}"));
            assert!(e.contains("ingest_share must be in (0, 1]"), "{e}");
        }
        let whole =
            ServeConfig::parse("store = 'x'\n[updates]\ntransport = 'kafka'\nbrokers = 'x:9092'\ningest_share = 1")
                .unwrap();
        assert_eq!(whole.updates.unwrap().ingest_share, 1.0);
        assert!(c.server_options().unwrap().read_only.unwrap().contains("replica of kafka://10.0.0.5:9092"));
        assert!(err("store = 'x'\n[updates]\ntransport = 'carrier-pigeon'\nbrokers = 'x'").contains("carrier-pigeon"));
        assert!(err("store = 'x'\n[updates]\ntransport = 'redis'\nbrokers = ''").contains("brokers"));
    }

    #[test]
    fn client_configs_read_with_paths_relative_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "s3cret\n").unwrap();
        let p = dir.path().join("cluster.toml");
        std::fs::write(
            &p,
            "token_file = 'token'\ntls_ca_file = 'ca.pem'\nmin_checkpoint = 7\n\
             [[shards]]\nreplicas = ['a:1', 'b:1']\n[[shards]]\nreplicas = ['c:1']\n",
        )
        .unwrap();
        let c = ClientConfig::from_file(&p).unwrap();
        assert_eq!(c.token.as_deref(), Some("s3cret"));
        assert_eq!(c.tls_ca_file.unwrap(), dir.path().join("ca.pem"));
        assert_eq!((c.shards[0].replicas.len(), c.min_checkpoint), (2, Some(7)));
        std::fs::write(&p, "[[shards]]\nreplicas = []\n").unwrap();
        assert!(ClientConfig::from_file(&p).unwrap_err().to_string().contains("at least one address"));
        std::fs::write(&p, "[[shards]]\nreplica = ['a:1']\n").unwrap();
        assert!(ClientConfig::from_file(&p).unwrap_err().to_string().contains("replica"));
    }

    #[test]
    fn bad_configs_name_the_key() {
        assert!(err("store = 'x'\nlisen = 'a'").contains("lisen"), "{}", err("store = 'x'\nlisen = 'a'"));
        assert!(err("listen = 'a'").contains("store"));
        assert!(err("store = 'x'\n[limits]\nkeys_per_request_max = 'many'").contains("keys_per_request_max"));
        assert!(err("store = 'x'\n[[tables]]\nname = 'u'\ndim = 8\ndimm = 3").contains("dimm"));
        assert!(err("store = 'x'\n[[tables]]\nname = 'u'").contains("no `dim`"));
        assert!(err("store = 'x'\n[[tables]]\nname = 'u'\ndim = 0").contains("dim must be"));
        assert!(err("store = 'x'\n[[tables]]\nname = 'u'\ndim = 8\nmedium = 'tape'").contains("tape"));
        assert!(err("store = 'x'\n[store_options]\nio_engine = 'x'").contains("io_engine"));
        assert!(err("store = 'x'\ntoken = ''").contains("empty"));
        assert!(err("store = 'x'\n[limits]\nidle_timeout_seconds = -1").contains("idle_timeout"));
        assert!(err("store = 'x'\n[[tables]]\nname = 'u'\ndim = 8\n[[tables]]\nname = 'u'\ndim = 8").contains("twice"));
    }
}
