//! The cluster file: a client's TOML config, which is also the shard map (see `map`).

use std::path::{Path, PathBuf};

use embank_core::{Error, ErrorKind, Result};
use serde::Deserialize;

/// A client's TOML file, for `embank.connect("cluster.toml")`: the shards, each a group
/// of replicas (its primary first), and the connection settings.
///
/// ```toml
/// token_file = "token"               # or token = "..."
/// tls_ca_file = "ca.pem"             # paths relative to this file
/// min_checkpoint = 5700              # read only replicas serving this checkpoint or later
/// timeout_seconds = 30.0
/// [[shards]]
/// replicas = ["10.0.0.1:7070", "10.0.0.2:7070"]
/// [[shards]]
/// replicas = ["10.0.0.3:7070", "10.0.0.4:7070"]
/// ```
///
/// It is also the **shard map** a running client reloads (see
/// [`crate::client::MapSource`]): `version = N` numbers it (a client switches only to a
/// higher version), `reload_seconds` says how often clients look for a new one, and a
/// shard may name a DNS name that resolves to its replicas (`service =
/// "embank-0.embank.ns.svc:7070"`, a headless Service) instead of listing them.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub shards: Vec<ShardEntry>,
    /// The shard map's version: clients switch to a map only of a higher version.
    #[serde(default)]
    pub version: Option<u64>,
    /// How often a client connected to this file looks for a new version (default 2 s).
    #[serde(default)]
    pub reload_seconds: Option<f64>,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    #[serde(default)]
    pub tls_server_name: Option<String>,
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    #[serde(default)]
    pub connect_timeout_seconds: Option<f64>,
    #[serde(default)]
    pub keys_per_request_max: Option<usize>,
    #[serde(default)]
    pub in_flight_per_shard: Option<usize>,
    #[serde(default)]
    pub min_checkpoint: Option<u64>,
    /// The shortest deadline of a read a sibling replica could take over (default 0.1 s).
    #[serde(default)]
    pub deadline_min_seconds: Option<f64>,
    /// The shortest deadline of a request no other replica can take (default 5 s).
    #[serde(default)]
    pub deadline_alone_min_seconds: Option<f64>,
    /// How long a read waits before a copy goes to a sibling (default: the group's recent
    /// p95; 0: never).
    #[serde(default)]
    pub hedge_delay_seconds: Option<f64>,
}

/// One shard of a [`ClientConfig`].
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Its replicas' addresses, the primary (which takes writes) first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Or a DNS name and port resolving to its replicas (every address a replica, in
    /// sorted order; resolved again at every reload and when every replica fails). For
    /// read-only replica groups: the first address takes writes, which of them that is
    /// may change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

impl ShardEntry {
    /// Its replicas' addresses: `replicas`, or what `service` resolves to now.
    pub fn resolve(&self) -> Result<Vec<String>> {
        let Some(service) = &self.service else { return Ok(self.replicas.clone()) };
        use std::net::ToSocketAddrs;
        let mut addrs: Vec<String> = service
            .to_socket_addrs()
            .map_err(|e| Error::new(ErrorKind::Unavailable, format!("service {service:?} does not resolve: {e}")))?
            .map(|a| a.to_string())
            .collect();
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty() {
            return Err(Error::new(ErrorKind::Unavailable, format!("service {service:?} resolves to no address")));
        }
        Ok(addrs)
    }
}

impl ClientConfig {
    /// Reads a client config; relative paths are made relative to the file, a
    /// `token_file` is read into `token`. Errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<ClientConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read client config {}", path.display()), e))?;
        Self::from_text(&text, &path.display().to_string(), path.parent().unwrap_or(Path::new(".")))
    }

    /// A client config from its text (`what` names it in errors; relative paths are
    /// made relative to `base`).
    pub fn from_text(text: &str, what: &str, base: &Path) -> Result<ClientConfig> {
        let mut c: ClientConfig =
            toml::from_str(text).map_err(|e| Error::config(format!("client config {what}: {e}")))?;
        let bad = |s: &ShardEntry| s.replicas.is_empty() == s.service.is_none();
        if c.shards.is_empty() || c.shards.iter().any(bad) {
            return Err(Error::config(format!(
                "client config {what}: give [[shards]], each with at least one address in `replicas` or a `service` (not both)"
            )));
        }
        if let Some(s) = c.reload_seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(Error::config(format!(
                    "client config {what}: reload_seconds must be a positive number, got {s}"
                )));
            }
        }
        for p in
            [&mut c.tls_ca_file, &mut c.tls_cert_file, &mut c.tls_key_file, &mut c.token_file].into_iter().flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(t) = c.token_file.take() {
            if c.token.is_some() {
                return Err(Error::config(format!("client config {what}: set `token` or `token_file`, not both")));
            }
            let token = std::fs::read_to_string(&t)
                .map_err(|e| Error::io(format!("cannot read token_file {}", t.display()), e))?;
            c.token = Some(token.lines().next().unwrap_or("").trim().to_string());
        }
        Ok(c)
    }
}
