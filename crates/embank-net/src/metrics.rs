//! Server counters and their Prometheus text rendering, plus the admin HTTP endpoint:
//! `GET /metrics`; `GET /readyz` (readiness; `/healthz` is the same answer, its name
//! before `/readyz`); `GET /livez` (liveness).
//!
//! Ready means "answers reads with data": a primary at once, a replica once it serves a
//! checkpoint (one applied from the stream, one copied from a sibling, or its own from
//! an earlier run), never while its store is closed (draining). Live means the process
//! answers at all: a replica waiting for its first checkpoint, copying a sibling's or
//! stopped at a bad message is live (restarting it would not help), only not ready.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use embank_core::Store;

use crate::proto::{self, Op};

/// Upper bounds of the latency histogram's buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 12] =
    [25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0];

#[derive(Default)]
struct OpCounters {
    requests: AtomicU64,
    keys: AtomicU64,
    errors: AtomicU64,
    /// Cumulative-free counts per bucket, the last one for +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    micros: AtomicU64,
}

/// Everything `/metrics` reports about the server itself (the store adds its own).
pub struct Metrics {
    ops: [OpCounters; Op::ALL.len()],
    /// Replies with a non-zero status, by status code.
    errors: [AtomicU64; 72],
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub connections_refused: AtomicU64,
    /// Connections closed before they authenticated to make room (pending bounds).
    pub connections_evicted: AtomicU64,
    /// Pull/lookup replies sent straight from the mapped file, and those copied first.
    pub replies_zero_copy: AtomicU64,
    pub replies_copied: AtomicU64,
    /// The replica's status, when this server applies an update stream.
    pub replica: std::sync::OnceLock<crate::stream::replica::StatusFn>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ops: Default::default(),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            connections_total: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            connections_evicted: AtomicU64::new(0),
            replies_zero_copy: AtomicU64::new(0),
            replies_copied: AtomicU64::new(0),
            replica: std::sync::OnceLock::new(),
        }
    }
}

fn op_index(op: Op) -> usize {
    Op::ALL.iter().position(|&o| o == op).expect("every op is in ALL")
}

/// Label of a reply status in `embank_request_errors_total{kind=...}`.
fn status_label(status: u16) -> String {
    match status {
        proto::status::BAD_FRAME => "bad_frame".into(),
        proto::status::UNAUTHORIZED => "unauthorized".into(),
        proto::status::TOO_LARGE => "too_large".into(),
        proto::status::UNKNOWN_OPCODE => "unknown_opcode".into(),
        proto::status::BUSY => "busy".into(),
        s => proto::error_of(s, String::new()).kind().as_str().replace(' ', "_"),
    }
}

impl Metrics {
    /// Records one request of `op` over `keys` keys that took `micros` and ended with `status`.
    pub fn record(&self, op: Option<Op>, keys: u64, micros: u64, status: u16) {
        if let Some(op) = op {
            let c = &self.ops[op_index(op)];
            c.requests.fetch_add(1, Ordering::Relaxed);
            c.keys.fetch_add(keys, Ordering::Relaxed);
            c.micros.fetch_add(micros, Ordering::Relaxed);
            let secs = micros as f64 * 1e-6;
            let b = LATENCY_BUCKETS.iter().position(|&le| secs <= le).unwrap_or(LATENCY_BUCKETS.len());
            c.buckets[b].fetch_add(1, Ordering::Relaxed);
            if status != 0 {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if status != 0 {
            self.errors[(status as usize).min(self.errors.len() - 1)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Requests of `op` recorded so far.
    pub fn requests(&self, op: Op) -> u64 {
        self.ops[op_index(op)].requests.load(Ordering::Relaxed)
    }

    /// Errors of a kind recorded so far.
    pub fn errors_of(&self, status: u16) -> u64 {
        self.errors[status as usize].load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition of these counters and of `store`'s statistics.
    pub fn render(&self, store: Option<&Store>) -> String {
        let mut o = String::with_capacity(16 << 10);
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        head(&mut o, "embank_requests_total", "counter", "Requests served, by opcode.");
        for op in Op::ALL {
            let _ = writeln!(o, "embank_requests_total{{op=\"{}\"}} {}", op.name(), self.requests(op));
        }
        head(&mut o, "embank_keys_total", "counter", "Keys carried by requests, by opcode.");
        for op in Op::ALL.iter().filter(|o| o.has_keys()) {
            let _ = writeln!(o, "embank_keys_total{{op=\"{}\"}} {}", op.name(), ld(&self.ops[op_index(*op)].keys));
        }
        head(&mut o, "embank_request_errors_total", "counter", "Error replies, by kind.");
        for (status, n) in self.errors.iter().enumerate() {
            let n = ld(n);
            if n > 0 {
                let _ = writeln!(o, "embank_request_errors_total{{kind=\"{}\"}} {n}", status_label(status as u16));
            }
        }
        head(
            &mut o,
            "embank_request_duration_seconds",
            "histogram",
            "Time from a request's last byte to its reply, by opcode.",
        );
        for op in Op::ALL {
            let c = &self.ops[op_index(op)];
            if ld(&c.requests) == 0 {
                continue;
            }
            let mut cum = 0;
            for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
                cum += ld(&c.buckets[i]);
                let _ = writeln!(o, "embank_request_duration_seconds_bucket{{op=\"{}\",le=\"{le}\"}} {cum}", op.name());
            }
            cum += ld(&c.buckets[LATENCY_BUCKETS.len()]);
            let _ = writeln!(o, "embank_request_duration_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {cum}", op.name());
            let _ = writeln!(
                o,
                "embank_request_duration_seconds_sum{{op=\"{}\"}} {}",
                op.name(),
                ld(&c.micros) as f64 * 1e-6
            );
            let _ = writeln!(o, "embank_request_duration_seconds_count{{op=\"{}\"}} {cum}", op.name());
        }
        for (name, help, v, kind) in [
            ("embank_received_bytes_total", "Bytes of request frames received.", ld(&self.bytes_in), "counter"),
            ("embank_sent_bytes_total", "Bytes of reply frames sent.", ld(&self.bytes_out), "counter"),
            ("embank_connections_open", "Client connections open now.", ld(&self.connections_open), "gauge"),
            ("embank_connections_total", "Client connections accepted.", ld(&self.connections_total), "counter"),
            (
                "embank_connections_refused_total",
                "Connections refused at the connection limit.",
                ld(&self.connections_refused),
                "counter",
            ),
            (
                "embank_connections_evicted_total",
                "Connections closed before authenticating, to make room for new ones.",
                ld(&self.connections_evicted),
                "counter",
            ),
            (
                "embank_replies_zero_copy_total",
                "Pull/lookup replies written straight from the mapped rows file.",
                ld(&self.replies_zero_copy),
                "counter",
            ),
            (
                "embank_replies_copied_total",
                "Pull/lookup replies copied into a buffer first (cached or block tables).",
                ld(&self.replies_copied),
                "counter",
            ),
        ] {
            head(&mut o, name, kind, help);
            let _ = writeln!(o, "{name} {v}");
        }
        if let Some(f) = self.replica.get() {
            render_replica(&mut o, &f());
        }
        if let Some(store) = store {
            match store.stats() {
                Ok(s) => render_store(&mut o, &s),
                Err(e) => {
                    let _ = writeln!(o, "# store statistics unavailable: {e}");
                }
            }
        }
        o
    }
}

fn render_replica(o: &mut String, r: &crate::stream::ReplicaStatus) {
    let label = format!("partition=\"{}\"", r.partition);
    let gauges: [(&str, &str, &str, f64); 10] = [
        (
            "embank_replica_checkpoint_batch_id",
            "gauge",
            "Batch id of the publisher's checkpoint this replica serves (-1: none).",
            r.checkpoint_batch_id.map_or(-1.0, |b| b as f64),
        ),
        (
            "embank_replica_checkpoint_seq",
            "gauge",
            "Seq of the publisher's checkpoint this replica serves (-1: none).",
            r.checkpoint_seq.map_or(-1.0, |b| b as f64),
        ),
        (
            "embank_replica_lag_messages",
            "gauge",
            "Messages of the partition not yet read (-1: unknown).",
            r.lag_messages.map_or(-1.0, |l| l as f64),
        ),
        (
            "embank_replica_lag_seconds",
            "gauge",
            "0 when caught up, else seconds since the served checkpoint was taken.",
            r.lag_seconds,
        ),
        (
            "embank_replica_freshness_seconds",
            "gauge",
            "From the trainer's checkpoint to this replica serving it, for the last one.",
            r.last_freshness_seconds.unwrap_or(0.0),
        ),
        (
            "embank_replica_ingest_rows_per_second",
            "gauge",
            "Rows applied per second, recently.",
            r.ingest_rows_per_second,
        ),
        ("embank_replica_commits_total", "counter", "Checkpoints applied.", r.commits as f64),
        ("embank_replica_rows_total", "counter", "Rows applied.", r.rows as f64),
        ("embank_replica_deletes_total", "counter", "Deletes applied.", r.deletes as f64),
        (
            "embank_replica_up",
            "gauge",
            "1 while ingesting, 0 while retrying or stopped.",
            (r.state == "ingesting") as u8 as f64,
        ),
    ];
    for (name, kind, help, v) in gauges {
        head(o, name, kind, help);
        let _ = writeln!(o, "{name}{{{label}}} {v}");
    }
}

fn head(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn render_store(o: &mut String, s: &embank_core::StoreStats) {
    let tables = &s.tables;
    type Gauge = fn(&embank_core::TableStats) -> f64;
    let per_table: [(&str, &str, &str, Gauge); 6] = [
        ("embank_table_rows", "gauge", "Live rows of a table.", |t| t.rows as f64),
        ("embank_table_cache_hits_total", "counter", "Row-cache hits of a table's reads.", |t| t.cache_hits as f64),
        ("embank_table_cache_misses_total", "counter", "Row-cache misses of a table's reads.", |t| {
            t.cache_misses as f64
        }),
        (
            "embank_table_cache_hit_ratio",
            "gauge",
            "Row-cache hit rate of a table (1 for tables read straight from their mapping).",
            |t| t.cache_hit_rate.unwrap_or(1.0),
        ),
        (
            "embank_table_medium_rows_read_total",
            "counter",
            "Rows a table read from its medium (misses and lookaheads).",
            |t| t.medium_rows_read as f64,
        ),
        ("embank_table_load_factor", "gauge", "Fill of a table's index.", |t| t.load_factor),
    ];
    for (name, kind, help, f) in per_table {
        head(o, name, kind, help);
        for t in tables {
            let _ = writeln!(o, "{name}{{table=\"{}\"}} {}", t.name, f(t));
        }
    }
    if let Some(c) = &s.cache {
        for (name, help, v) in [
            ("embank_cache_budget_bytes", "Budget of the DRAM row cache.", c.budget_bytes),
            ("embank_cache_bytes", "Bytes of rows in the DRAM row cache.", c.bytes_cached),
            ("embank_cache_dirty_bytes", "Bytes of cached rows not yet written back.", c.dirty_bytes),
        ] {
            head(o, name, "gauge", help);
            let _ = writeln!(o, "{name} {v}");
        }
        head(o, "embank_cache_evictions_total", "counter", "Rows evicted from the DRAM row cache.");
        let _ = writeln!(o, "embank_cache_evictions_total {}", c.evictions);
    }
    head(o, "embank_io_reads_total", "counter", "Reads the block-medium I/O engine issued.");
    let _ = writeln!(o, "embank_io_reads_total {}", s.io.reads);
    head(o, "embank_io_read_bytes_total", "counter", "Bytes the block-medium I/O engine read.");
    let _ = writeln!(o, "embank_io_read_bytes_total {}", s.io.bytes_read);
}

/// Serves `GET /metrics`, `/readyz` (also `/healthz`) and `/livez` on `listener` until
/// `shutdown` is set.
/// One request per connection, answered in the accepting thread (scrapes are rare).
pub fn serve_admin(listener: TcpListener, store: Arc<Store>, metrics: Arc<Metrics>, shutdown: Arc<AtomicBool>) {
    let _ = listener.set_nonblocking(true);
    while !shutdown.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = answer(stream, &store, &metrics) {
                    tracing::debug!(error = %e, "admin request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// `/readyz`: 200 when the server answers reads with data, 503 (saying why) before.
fn readiness(store: &Store, metrics: &Metrics) -> (&'static str, &'static str, String) {
    const NOT_READY: &str = "503 Service Unavailable";
    if store.is_closed() {
        return (NOT_READY, "text/plain", "store closed\n".to_string());
    }
    let Some(f) = metrics.replica.get() else { return ("200 OK", "text/plain", "ok\n".to_string()) };
    let r = f();
    let json = serde_json::to_string(&r).expect("status serializes");
    if r.state == "bootstrapping" {
        // It refuses reads until it holds a sibling's checkpoint.
        (NOT_READY, "text/plain", format!("replica bootstrapping: {json}\n"))
    } else if r.checkpoint_seq.is_none() {
        // It would answer every read with "not found": a DNS-named group must not take it
        // as a replica yet.
        (NOT_READY, "text/plain", format!("replica {} and serving no checkpoint yet: {json}\n", r.state))
    } else {
        // A replica serves what it has whatever the stream does (retrying, stopped):
        // ready, with the ingest state for whoever looks.
        ("200 OK", "text/plain", format!("replica {}: {json}\nok\n", r.state))
    }
}

fn answer(mut stream: TcpStream, store: &Store, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = [0u8; 4096];
    let mut n = 0;
    while n < buf.len() {
        let r = stream.read(&mut buf[n..])?;
        if r == 0 {
            break;
        }
        n += r;
        // Not HTTP (an embank client's hello sent to this port, say): answer at once
        // instead of waiting out the read timeout, so the client can say what happened.
        if !buf[..n].iter().take(8).all(|b| b.is_ascii_alphabetic() || *b == b' ' || *b == b'/') {
            break;
        }
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") || buf[..n].windows(2).any(|w| w == b"\n\n") {
            break;
        }
    }
    let request = String::from_utf8_lossy(&buf[..n]);
    let mut words = request.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics.render(Some(store))),
        ("GET", "/readyz" | "/healthz") => readiness(store, metrics),
        ("GET", "/livez") => ("200 OK", "text/plain", "alive\n".to_string()),
        ("GET", _) => ("404 Not Found", "text/plain", "not found: try /metrics, /readyz or /livez\n".to_string()),
        (m, _) if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) => (
            "400 Bad Request",
            "text/plain",
            "this is embank's admin HTTP port (/metrics, /readyz, /livez); tables are served on the `listen` port\n"
                .to_string(),
        ),
        _ => ("405 Method Not Allowed", "text/plain", "only GET\n".to_string()),
    };
    // One write: `write!` on the socket would send each piece of the format apart.
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes())?;
    stream.flush()
}
