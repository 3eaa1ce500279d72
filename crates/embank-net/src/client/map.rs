//! The shard map: the shards, their replicas and the map's version, as a cluster file
//! gives them, loaded from a file or an `http://` URL and reloaded while the client runs.
//!
//! A client connected to a map ([`Client::connect_map`], or `embank.connect("cluster.toml")`)
//! looks for a new version every `reload_seconds` (default 2 s), at once when a replica
//! stops answering, and when a server's hello names a newer map version than its own. A
//! new version is switched to whole, between calls: a call takes the map in use when it
//! begins and sends every request by it, so no call mixes two partitionings. A map whose
//! shards do not all answer is not switched to (the old one stays; the error is logged),
//! and a lower version is ignored. Addresses that stay keep their connections.
//!
//! A shard given as a `service` (a DNS name that resolves to its replicas, as a headless
//! Service in Kubernetes does) is resolved again at every reload: replicas that come and
//! go are picked up even while the version stays.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};

use super::background::Background;
use super::cluster::ClientConfig;
use super::transport::{Transport, Wire};
use super::{Client, ClientSettings};

/// Where a shard map is read from.
#[derive(Clone, Debug, PartialEq)]
pub enum MapSource {
    File(PathBuf),
    /// `http://host[:port]/path` (plain HTTP GET; put TLS in front with a sidecar).
    Url(String),
}

impl MapSource {
    /// `http://...` is a URL, anything else a file path.
    pub fn parse(s: &str) -> MapSource {
        if s.starts_with("http://") || s.starts_with("https://") {
            MapSource::Url(s.to_string())
        } else {
            MapSource::File(PathBuf::from(s))
        }
    }

    pub fn describe(&self) -> String {
        match self {
            MapSource::File(p) => p.display().to_string(),
            MapSource::Url(u) => u.clone(),
        }
    }

    /// Reads and parses the map, resolving `service` shards.
    pub fn load(&self) -> Result<ShardMap> {
        let config = match self {
            MapSource::File(p) => ClientConfig::from_file(p)?,
            MapSource::Url(u) => {
                let text = http_get(u, Duration::from_secs(5))?;
                ClientConfig::from_text(&text, u, &std::env::current_dir().unwrap_or_default())?
            }
        };
        ShardMap::from_config(config)
    }
}

/// One version of the shard map.
#[derive(Clone, Debug)]
pub struct ShardMap {
    pub version: u64,
    /// Shard i's replicas (services resolved), the primary first.
    pub groups: Vec<Vec<String>>,
    /// Whether a shard is given by a DNS name (resolved again at every reload).
    pub resolved: bool,
    /// The file's client settings (token, TLS, timeouts).
    pub config: ClientConfig,
}

impl ShardMap {
    pub fn from_config(config: ClientConfig) -> Result<ShardMap> {
        let groups = config.shards.iter().map(|s| s.resolve()).collect::<Result<Vec<_>>>()?;
        Ok(ShardMap {
            version: config.version.unwrap_or(0),
            groups,
            resolved: config.shards.iter().any(|s| s.service.is_some()),
            config,
        })
    }

    /// The client settings of the file (every option but the shards).
    pub fn settings(&self) -> ClientSettings {
        let c = &self.config;
        ClientSettings {
            token: c.token.clone(),
            timeout_seconds: c.timeout_seconds,
            connect_timeout_seconds: c.connect_timeout_seconds,
            keys_per_request_max: c.keys_per_request_max,
            in_flight_per_shard: c.in_flight_per_shard,
            tls_ca_file: c.tls_ca_file.clone(),
            tls_cert_file: c.tls_cert_file.clone(),
            tls_key_file: c.tls_key_file.clone(),
            tls_server_name: c.tls_server_name.clone(),
            min_checkpoint: c.min_checkpoint,
            deadline_min_seconds: c.deadline_min_seconds,
            deadline_alone_min_seconds: c.deadline_alone_min_seconds,
            hedge_delay_seconds: c.hedge_delay_seconds,
            version: c.version,
            reload_seconds: c.reload_seconds,
            map: None,
        }
    }
}

/// Reloads closer together than this are put off (a replica that stays down would
/// otherwise ask for one after every failed call).
const RELOAD_GAP_MIN: Duration = Duration::from_millis(200);

/// Signals to the watcher's thread: look for a new version now.
const HINT: u32 = 1;

/// The thread that watches a client's map source.
pub(super) struct Watch {
    pub(super) source: MapSource,
    thread: Background,
}

impl Watch {
    /// Starts watching `source` for `client` every `every`.
    pub(super) fn start(client: &Client, source: MapSource, every: Duration) -> Watch {
        let src = source.clone();
        let thread = Background::spawn(
            "embank-map",
            client,
            "cannot start the shard map's watcher: the map is not reloaded",
            move |sleeper| {
                let mut last_error = String::new();
                let mut last = Instant::now();
                loop {
                    if sleeper.sleep_until(last + every).is_none() {
                        return;
                    }
                    let since = last.elapsed();
                    if since < RELOAD_GAP_MIN {
                        std::thread::sleep(RELOAD_GAP_MIN - since);
                    }
                    last = Instant::now();
                    let Some(client) = sleeper.client() else { return };
                    match client.reload_from(&src) {
                        Ok(_) => last_error.clear(),
                        Err(e) => {
                            let e = e.to_string();
                            if e != last_error {
                                tracing::warn!(map = %src.describe(), error = %e, "cannot load the shard map; keeping the one in use");
                                last_error = e;
                            }
                        }
                    }
                }
            },
        );
        Watch { source, thread }
    }

    /// Asks for a reload now.
    pub(super) fn hint(&self) {
        self.thread.raise(HINT);
    }

    /// Stops the thread (it ends at its next wake-up; nothing waits for it).
    pub(super) fn stop(&self) {
        self.thread.stop();
    }
}

impl Client {
    /// Connects to the shards of the map at `source` (a cluster file or an `http://` URL),
    /// with the options the map gives, and keeps reloading it (see the module's doc).
    pub fn connect_map(source: &MapSource) -> Result<Client> {
        let map = source.load()?;
        let opts = map.settings().options()?;
        let client = Client::connect_groups(&map.groups, opts)?;
        client.set_version(map.version);
        client.watch_map(source.clone(), map.config.reload_seconds);
        Ok(client)
    }

    /// Keeps reloading the map at `source` every `reload_seconds` (default 2 s) for a
    /// client connected to its shards (what `embank.connect` does with a cluster file).
    pub fn watch_map(&self, source: MapSource, reload_seconds: Option<f64>) {
        let every = Duration::from_secs_f64(reload_seconds.filter(|s| s.is_finite() && *s > 0.0).unwrap_or(2.0));
        let old = self.inner.map.lock().replace(Watch::start(self, source, every));
        if let Some(w) = old {
            w.stop();
        }
    }

    /// Numbers the map in use (a client connected to addresses has version 0).
    pub fn set_version(&self, version: u64) {
        let topo = self.topology();
        let shards = topo.shards.clone();
        *self.inner.topo.write() = Arc::new(super::Topology { version, shards });
    }

    /// Loads the map again now; `Ok(true)` if it switched to a new one.
    pub fn reload_map(&self) -> Result<bool> {
        let source = self.inner.map.lock().as_ref().map(|w| w.source.clone());
        let source =
            source.ok_or_else(|| Error::invalid("reload_map: this client was not connected to a shard map"))?;
        self.reload_from(&source)
    }

    /// Asks the map's watcher to look for a new version now (no-op without a map).
    pub(super) fn hint_map(&self) {
        if let Some(w) = self.inner.map.lock().as_ref() {
            w.hint();
        }
    }

    fn reload_from(&self, source: &MapSource) -> Result<bool> {
        let map = source.load()?;
        let switched = self.switch_map(&Wire::default(), &map, &source.describe())?;
        if switched {
            self.ensure_prober();
        }
        Ok(switched)
    }

    /// Switches to `map` (loaded from `from`) if it is a new version whose shards answer
    /// (see the module's doc); `Ok(true)` if it did.
    pub(super) fn switch_map<T: Transport>(&self, t: &T, map: &ShardMap, from: &str) -> Result<bool> {
        let current = self.topology();
        if map.version < current.version {
            return Err(Error::config(format!(
                "the map at {} has version {}, older than the version in use ({}): ignored",
                from, map.version, current.version
            )));
        }
        let same = current.shards.len() == map.groups.len()
            && current.shards.iter().zip(&map.groups).all(|(s, g)| {
                s.replicas.len() == g.len()
                    && s.replicas.iter().zip(g).all(|(e, a)| e.addr == a.trim().trim_start_matches("tcp://"))
            });
        if same {
            return Ok(false);
        }
        if map.version == current.version && !map.resolved {
            return Err(Error::config(format!(
                "the map at {} changed but kept version {}: give it a higher version to switch to it",
                from, map.version
            )));
        }
        let topo = self.topology_of(map.version, &map.groups);
        self.check_reachable(t, &topo)?;
        if current.shards.len() != topo.shards.len() {
            tracing::info!(
                from = current.shards.len(),
                to = topo.shards.len(),
                version = map.version,
                "shard map: the shard count changes"
            );
        }
        tracing::info!(version = map.version, groups = ?map.groups, "shard map switched");
        *self.inner.topo.write() = Arc::new(topo);
        Ok(true)
    }
}

/// The body of `url` (HTTP/1.0 GET, status 200 only).
fn http_get(url: &str, timeout: Duration) -> Result<String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        Error::config(format!("{url}: only http:// shard map URLs are read (serve HTTPS through a local proxy)"))
    })?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let hostport = if host.contains(':') { host.to_string() } else { format!("{host}:80") };
    use std::net::ToSocketAddrs;
    let unreachable = |e: std::io::Error| Error::new(ErrorKind::Unavailable, format!("{url}: {e}"));
    let addr = hostport
        .to_socket_addrs()
        .map_err(unreachable)?
        .next()
        .ok_or_else(|| Error::new(ErrorKind::Unavailable, format!("{url}: no address")))?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).map_err(unreachable)?;
    s.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    s.set_write_timeout(Some(timeout)).map_err(unreachable)?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: embank\r\nConnection: close\r\n\r\n")
        .map_err(unreachable)?;
    let mut bytes = Vec::new();
    s.take(16 << 20).read_to_end(&mut bytes).map_err(unreachable)?;
    let text = String::from_utf8_lossy(&bytes);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| Error::new(ErrorKind::Unavailable, format!("{url}: not an HTTP reply")))?;
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(Error::new(ErrorKind::Unavailable, format!("{url}: {status}")));
    }
    Ok(body.to_string())
}

/// Which checkpoints the replicas of `groups` serve: the newest any serves and the
/// oldest the slowest serves (`None` while a replica serves none or a shard has no
/// replica answering).
pub fn served_range(client: &Client) -> (Option<u64>, Option<u64>) {
    let all = client.served_all();
    let mut newest: Option<u64> = None;
    let mut oldest: Option<u64> = Some(u64::MAX);
    for shard in &all {
        let answering: Vec<Option<u64>> =
            shard.iter().filter(|v| v.get("error").is_none()).map(|v| v["batch_id"].as_u64()).collect();
        if answering.is_empty() {
            oldest = None;
        }
        for b in answering {
            newest = newest.max(b);
            oldest = match (oldest, b) {
                (Some(o), Some(b)) => Some(o.min(b)),
                _ => None,
            };
        }
    }
    (newest, oldest)
}

/// Switches the shard map in the file `map` to the one in the file `next` (new replicas, or
/// a new shard count fed by a second partitioning of the stream), once every replica of
/// `next` serves a checkpoint at least as new as the newest any replica of the current map
/// serves: a client that switches between two calls never reads an older checkpoint than
/// before. Writes `next`'s text, with `version` one above the current, over `map`
/// atomically (a temporary file renamed). `progress` hears what it waits for. Returns the
/// new version.
pub fn switch_when_serving(
    map: &std::path::Path,
    next: &std::path::Path,
    timeout: Duration,
    mut progress: impl FnMut(&str),
) -> Result<u64> {
    let current = MapSource::File(map.to_path_buf()).load()?;
    let wanted = MapSource::File(next.to_path_buf()).load()?;
    let old = Client::connect_groups(&current.groups, current.settings().options()?)?;
    let new = Client::connect_groups(&wanted.groups, wanted.settings().options()?)?;
    let deadline = Instant::now() + timeout;
    let mut said = String::new();
    loop {
        let (old_newest, _) = served_range(&old);
        let (_, new_oldest) = served_range(&new);
        let ready = match (old_newest, new_oldest) {
            (None, Some(_)) => true,
            (Some(o), Some(n)) => n >= o,
            _ => false,
        };
        if ready {
            break;
        }
        let line = format!(
            "waiting: the current map's replicas serve up to checkpoint {}, the new map's slowest {}",
            old_newest.map_or("none".into(), |b| b.to_string()),
            new_oldest.map_or("none".into(), |b| b.to_string())
        );
        if line != said {
            progress(&line);
            said = line;
        }
        if Instant::now() > deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{} did not catch up within {:.0} s ({said})", next.display(), timeout.as_secs_f64()),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let version = current.version + 1;
    let text = std::fs::read_to_string(next).map_err(|e| Error::io(format!("cannot read {}", next.display()), e))?;
    let body: String = text
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .filter(|l| !l.trim_start().starts_with("version"))
        .map(|l| format!("{l}\n"))
        .collect();
    let tmp = map.with_extension("toml.tmp");
    std::fs::write(&tmp, format!("version = {version}\n{body}"))
        .map_err(|e| Error::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, map).map_err(|e| Error::io(format!("cannot replace {}", map.display()), e))?;
    progress(&format!("{} is version {version}: {:?}", map.display(), wanted.groups));
    old.close();
    new.close();
    Ok(version)
}
