//! The serving side: applies one partition of the stream to a store.
//!
//! Rows and deletes are applied as they arrive (reads go on meanwhile). At a commit
//! marker the replica takes its own checkpoint whose metadata holds the stream position
//! just after the marker and the publisher's checkpoint id. After a crash the store
//! reopens at that checkpoint — whatever was applied after it is rolled back — and
//! reading resumes from that position: every checkpoint is applied exactly once in
//! effect. Messages of a checkpoint at or before the one applied (a publisher's retry)
//! are skipped. A broker that is down is retried with backoff while the store serves
//! what it has; a message that fails its checksum stops ingestion loudly (status and
//! `/readyz`), since skipping it would leave the replica wrong.
//!
//! A full snapshot (a table's reset marker, then all its rows) is applied beside what is
//! served, never by emptying the table first: its rows are upserts, and the keys the
//! table had when the reset arrived are remembered (sorted, with a bit each for "the
//! snapshot brought it"); at the commit of the snapshot's checkpoint the keys it did not
//! bring are deleted. So a key present before and after a resync is readable throughout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result, Store, TableOptions};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::message::{self, Kind};
use super::view::{ServedView, STAGED_BYTES_MAX_DEFAULT};
use super::{Source, Start, StreamConfig};

/// Where a replica reads.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaOptions {
    #[serde(flatten)]
    pub stream: StreamConfig,
    /// The partition this replica applies (its shard's index). Default 0.
    #[serde(default)]
    pub partition: u32,
    /// Where to begin when the store has no checkpoint of the stream: `earliest`
    /// (default) or `latest`.
    #[serde(default)]
    pub start: Start,
    /// The group's other replicas (`host:port` of their `embank serve`): a replica whose
    /// store holds no checkpoint of the stream first copies the checkpoint one of them
    /// serves, then follows the stream from its position (see `stream::bootstrap`), and
    /// takes no reads until then. Empty (default): it starts from `start`.
    #[serde(default)]
    pub bootstrap: Vec<String>,
    /// The token the siblings require (the server's own `token`; set by `embank serve`).
    #[serde(skip)]
    pub bootstrap_token: Option<String>,
    /// The most of one core the applier takes while reads keep a core busy, in (0, 1]
    /// (default 0.5): it applies a message's rows in chunks of [`INGEST_CHUNK_ROWS`], and
    /// after each rests in proportion to the chunk's time and to the share of a core the
    /// reads took meanwhile. Saturating reads then keep most of the machine while a
    /// backlog is applied; light reads slow it a little; with no reads it applies at full
    /// speed. 1.0: never rest. Reads first: 0.1 (docs/BENCHMARKS.md).
    #[serde(default = "default_ingest_share")]
    pub ingest_share: f64,
}

/// Rows of a message applied between two looks at the reads (see
/// [`ReplicaOptions::ingest_share`]); also the most a read waits behind in the overlay.
pub const INGEST_CHUNK_ROWS: usize = 1024;

fn default_ingest_share() -> f64 {
    0.5
}

impl ReplicaOptions {
    pub fn new(stream: StreamConfig) -> ReplicaOptions {
        ReplicaOptions {
            stream,
            partition: 0,
            start: Start::Earliest,
            bootstrap: Vec::new(),
            bootstrap_token: None,
            ingest_share: default_ingest_share(),
        }
    }
}

impl ReplicaOptions {
    /// The stream's settings and `ingest_share`.
    pub fn validate(&self) -> Result<()> {
        self.stream.validate()?;
        if !(self.ingest_share > 0.0 && self.ingest_share <= 1.0) {
            return Err(Error::config(format!(
                "updates.ingest_share must be in (0, 1] (the most of one core ingest takes while reads are \
                 served), not {}",
                self.ingest_share
            )));
        }
        Ok(())
    }
}

/// The applier's pace while reads arrive (see [`ReplicaOptions::ingest_share`]).
struct Pacer {
    share: f64,
    /// [`ServedView::read_nanos`] and the time at the last look.
    read_nanos_seen: u64,
    since: Instant,
}

impl Pacer {
    fn new(share: f64, view: &ServedView) -> Pacer {
        Pacer { share, read_nanos_seen: view.read_nanos(), since: Instant::now() }
    }

    /// After `work` spent applying: rests `work * (1 / share - 1) * load`, where `load` is
    /// the share of one core the view's reads took since the last look (1 when they kept
    /// a core or more busy), at most 100 ms at a time (so a stop is noticed). Saturating
    /// readers leave the applier `share` of a core; light reads slow it only a little.
    fn after(&mut self, view: &ServedView, work: Duration) {
        let read = view.read_nanos();
        let window = self.since.elapsed().as_nanos().max(1) as f64;
        let load = (read.saturating_sub(self.read_nanos_seen) as f64 / window).min(1.0);
        if load > 0.0 && self.share < 1.0 {
            let rest = work.mul_f64((1.0 / self.share - 1.0) * load).min(Duration::from_millis(100));
            std::thread::sleep(rest);
        }
        // The next look measures the reads from here: those during the rest are what it
        // gave way to, not a reason to rest again.
        self.read_nanos_seen = view.read_nanos();
        self.since = Instant::now();
    }
}

/// What a replica's checkpoint metadata holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ReplicaMeta {
    /// The stream position just after the applied commit marker.
    pub position: String,
    pub stream: String,
    pub partition: u32,
    /// The publisher's checkpoint.
    pub seq: u64,
    pub batch_id: u64,
    pub unix_micros: u64,
}

impl ReplicaMeta {
    pub fn parse(meta: &[u8]) -> Option<ReplicaMeta> {
        serde_json::from_slice::<serde_json::Value>(meta)
            .ok()?
            .get("replica")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }
}

/// What a replica reports (`/metrics`, `/readyz`, stats).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplicaStatus {
    pub stream: String,
    pub partition: u32,
    /// `ingesting`, `retrying` (the broker is unreachable) or `stopped` (a bad message).
    pub state: String,
    /// The publisher's checkpoint this replica serves (batch id, seq), None before the first.
    pub checkpoint_batch_id: Option<u64>,
    pub checkpoint_seq: Option<u64>,
    /// When the served checkpoint was taken on the trainer (Unix seconds).
    pub checkpoint_unix_seconds: Option<f64>,
    /// Seconds from the trainer's checkpoint to the replica serving it, for the last one.
    pub last_freshness_seconds: Option<f64>,
    /// Messages in the partition not yet read.
    pub lag_messages: Option<u64>,
    /// 0 when caught up; otherwise seconds since the served checkpoint was taken.
    pub lag_seconds: f64,
    /// Rows applied per second over the last few seconds.
    pub ingest_rows_per_second: f64,
    pub commits: u64,
    pub messages: u64,
    pub rows: u64,
    pub deletes: u64,
    /// Messages skipped as repeats of an applied checkpoint.
    pub repeats: u64,
    /// Checkpoints that changed more rows than the served view keeps: reads through
    /// [`Replica::view`] saw them partly applied before their commit.
    pub checkpoints_not_atomic: u64,
    pub last_error: Option<String>,
}

struct Shared {
    store: Arc<Store>,
    /// What reads see: the last committed checkpoint, whole.
    view: Arc<ServedView>,
    opts: ReplicaOptions,
    status: Mutex<ReplicaStatus>,
    stop: AtomicBool,
    /// Commits the applier may still take before it holds ([`NO_HOLD`]: no limit).
    commits_left: AtomicU64,
    /// Set while the applier holds: the stream's reader stops polling too.
    held: AtomicBool,
}

/// [`Shared::commits_left`] when the replica is not to hold.
const NO_HOLD: u64 = u64::MAX;

/// Gives a replica's status now.
pub type StatusFn = Arc<dyn Fn() -> ReplicaStatus + Send + Sync>;

/// The ingest thread of a replica. Dropping it stops the thread.
pub struct Replica {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

fn now_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Replica {
    /// Starts applying the stream to `store` from the position of its newest checkpoint
    /// of this stream (or `start`). Does not wait for the broker.
    pub fn start(store: Arc<Store>, opts: ReplicaOptions) -> Result<Replica> {
        opts.validate()?;
        let last = store.checkpoints()?.iter().rev().find_map(|c| ReplicaMeta::parse(&c.meta));
        let mut status = ReplicaStatus {
            stream: opts.stream.describe(),
            partition: opts.partition,
            state: "retrying".into(),
            ..Default::default()
        };
        if let Some(m) = &last {
            if m.partition != opts.partition {
                return Err(Error::config(format!(
                    "the store {} replicates partition {} of {}, the config says partition {}",
                    store.path().display(),
                    m.partition,
                    m.stream,
                    opts.partition
                )));
            }
            status.checkpoint_batch_id = Some(m.batch_id);
            status.checkpoint_seq = Some(m.seq);
            status.checkpoint_unix_seconds = Some(m.unix_micros as f64 * 1e-6);
        }
        let view = ServedView::new(STAGED_BYTES_MAX_DEFAULT);
        if let Some(m) = &last {
            view.set_served(m.batch_id);
        }
        let bootstrap = last.is_none() && !opts.bootstrap.is_empty();
        if bootstrap {
            view.set_bootstrapping(true);
            status.state = "bootstrapping".into();
        }
        let shared = Arc::new(Shared {
            store,
            view: Arc::new(view),
            opts,
            status: Mutex::new(status),
            stop: AtomicBool::new(false),
            commits_left: AtomicU64::new(NO_HOLD),
            held: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("embank-replica".into())
            .spawn(move || {
                let last = if bootstrap { bootstrap_then(&s) } else { last };
                if !s.stop.load(Ordering::Relaxed) {
                    run(&s, last)
                }
            })
            .map_err(|e| Error::io("cannot start the replica thread", e))?;
        Ok(Replica { shared, thread: Some(thread) })
    }

    pub fn status(&self) -> ReplicaStatus {
        self.shared.status.lock().clone()
    }

    /// The view reads should go through: the last committed checkpoint, whole, every
    /// table at once (see [`ServedView`]).
    pub fn view(&self) -> Arc<ServedView> {
        Arc::clone(&self.shared.view)
    }

    /// A closure giving the status, for the admin endpoint and the server.
    pub fn status_fn(&self) -> StatusFn {
        let s = Arc::clone(&self.shared);
        Arc::new(move || s.status.lock().clone())
    }

    /// Holds ingest at a checkpoint boundary once `commits` more checkpoints are applied
    /// (`Some(0)`: at the next boundary, which is now if no checkpoint is half applied),
    /// or lets it run on (`None`). A held replica serves its last commit with nothing
    /// kept in its view, so a read costs what it costs on an idle replica, and its state
    /// reads `held`; the stream waits in the broker. For an operator who freezes a replica
    /// without stopping it (a canary, an investigation), and for `embank bench-stream`,
    /// which alternates ingest and idle one checkpoint at a time.
    pub fn hold_after(&self, commits: Option<u64>) {
        self.shared.commits_left.store(commits.unwrap_or(NO_HOLD), Ordering::Release);
    }

    /// Stops the thread (a message being applied finishes first).
    pub fn close(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.close();
    }
}

/// The applied checkpoint: the last commit taken.
struct Applied {
    meta: Option<ReplicaMeta>,
    /// The replica's own checkpoint batch ids count up from its last.
    next_batch: u64,
}

/// Copies a sibling's served checkpoint (trying again with backoff until one gives it,
/// or the replica stops); the checkpoint it then serves.
fn bootstrap_then(s: &Shared) -> Option<ReplicaMeta> {
    let own_batch = s.store.checkpoints().ok().and_then(|c| c.last().map(|c| c.batch_id + 1)).unwrap_or(1);
    let mut backoff = Duration::from_millis(100);
    while !s.stop.load(Ordering::Relaxed) {
        let copied = super::bootstrap::copy_from_siblings(
            &s.store,
            &s.opts.bootstrap,
            s.opts.bootstrap_token.as_deref(),
            &s.opts.stream.describe(),
            s.opts.partition,
            own_batch,
        );
        match copied {
            Ok(c) => {
                tracing::info!(from = %c.from, batch_id = c.meta.batch_id, rows = c.rows, tables = c.tables, seconds = c.seconds, "copied a sibling's checkpoint; following the stream from its position");
                let mut st = s.status.lock();
                s.view.set_served(c.meta.batch_id);
                s.view.set_bootstrapping(false);
                st.state = "ingesting".into();
                st.last_error = None;
                st.checkpoint_batch_id = Some(c.meta.batch_id);
                st.checkpoint_seq = Some(c.meta.seq);
                st.checkpoint_unix_seconds = Some(c.meta.unix_micros as f64 * 1e-6);
                st.rows += c.rows;
                return Some(c.meta);
            }
            Err(e) => {
                let mut st = s.status.lock();
                if st.last_error.as_deref() != Some(&e.to_string()) {
                    tracing::warn!(error = %e, "cannot copy a sibling's checkpoint yet; trying again");
                }
                st.last_error = Some(e.to_string());
            }
        }
        let until = Instant::now() + backoff;
        while Instant::now() < until && !s.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    None
}

fn run(s: &Shared, last: Option<ReplicaMeta>) {
    let next_batch = s.store.checkpoints().ok().and_then(|c| c.last().map(|c| c.batch_id + 1)).unwrap_or(1);
    let mut applied = Applied { meta: last, next_batch };
    let mut backoff = Duration::from_millis(50);
    while !s.stop.load(Ordering::Relaxed) {
        match ingest(s, &mut applied) {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::Unavailable => {
                let mut st = s.status.lock();
                if st.state != "retrying" {
                    tracing::warn!(error = %e, "update stream unavailable; serving what is applied and retrying");
                }
                st.state = "retrying".into();
                st.last_error = Some(e.to_string());
            }
            Err(e) => {
                tracing::error!(error = %e, "replica ingestion stopped");
                let mut st = s.status.lock();
                st.state = "stopped".into();
                st.last_error = Some(e.to_string());
                return;
            }
        }
        let until = Instant::now() + backoff;
        while Instant::now() < until && !s.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Reads and applies until stopped (Ok) or an error; the caller retries from the last
/// commit's position.
fn ingest(s: &Shared, applied: &mut Applied) -> Result<()> {
    let mut source: Box<dyn Source> = s.opts.stream.source(s.opts.partition)?;
    // Rows applied after the last commit (before a broker error, or a clean shutdown) are
    // applied again from its position: applying a checkpoint's messages twice leaves the
    // same rows (a crash, instead, reopens the store at the commit's checkpoint).
    source.seek(applied.meta.as_ref().map(|m| m.position.as_str()), s.opts.start)?;
    {
        let mut st = s.status.lock();
        st.state = "ingesting".into();
        st.last_error = None;
    }
    // A reader thread polls and decodes while this one applies: the broker's reads and
    // the store's writes overlap. The channel bounds what is decoded ahead.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(String, message::Message)>>(64);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| read(s, source.as_mut(), &tx, &done));
        let r = apply_all(s, applied, &rx);
        done.store(true, Ordering::Relaxed);
        drop(rx);
        let _ = reader.join();
        r
    })
}

/// The reader: polls, decodes and sends until told to stop (or the applier is gone);
/// keeps the lag up to date.
fn read(
    s: &Shared,
    source: &mut dyn Source,
    tx: &std::sync::mpsc::SyncSender<Result<(String, message::Message)>>,
    done: &AtomicBool,
) {
    let mut lag_at = Instant::now() - Duration::from_secs(10);
    while !s.stop.load(Ordering::Relaxed) && !done.load(Ordering::Relaxed) {
        // A held replica reads nothing ahead either: the stream waits in the broker.
        if s.held.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let batch = match source.poll(256, Duration::from_millis(100)) {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        for p in batch {
            let m = message::decode(&p.payload)
                .map_err(|e| e.context(format!("at position {} of {}", p.position, s.opts.stream.describe())));
            let failed = m.is_err();
            if tx.send(m.map(|m| (p.position, m))).is_err() || failed {
                return;
            }
        }
        if lag_at.elapsed() >= Duration::from_millis(500) {
            lag_at = Instant::now();
            let lag = source.lag().ok().flatten();
            let mut st = s.status.lock();
            st.lag_messages = lag;
            st.lag_seconds = match (lag, st.checkpoint_unix_seconds) {
                (Some(0), _) => 0.0,
                (_, Some(t)) => (now_seconds() - t).max(0.0),
                _ => 0.0,
            };
        }
    }
}

/// A table being resynced from a full snapshot: the keys it held when the snapshot's
/// reset arrived (listed from the index, no row read), and which of them the snapshot has
/// brought. Costs 8 bytes and a bit per key the table held, for the length of the snapshot.
struct Resync {
    /// The snapshot's checkpoint: only its commit sweeps.
    seq: u64,
    /// Sorted.
    before: Vec<u64>,
    /// Bit i: `before[i]` came with the snapshot.
    brought: Vec<u64>,
}

impl Resync {
    fn start(table: &embank_core::Table, seq: u64) -> Result<Resync> {
        let started = Instant::now();
        let mut before = Vec::with_capacity(table.len()? as usize);
        // An index rebuilt between two pages (hot placement) ends an export: start over.
        let mut tries = 0;
        loop {
            before.clear();
            let r = table.export_keys(65536, |k| {
                before.extend_from_slice(k);
                Ok(())
            });
            tries += 1;
            match r {
                Err(e) if e.kind() == ErrorKind::Unsupported && tries < 3 => continue,
                r => r?,
            }
            break;
        }
        before.sort_unstable();
        let brought = vec![0u64; before.len().div_ceil(64)];
        tracing::info!(
            table = table.name(),
            rows = before.len(),
            seconds = started.elapsed().as_secs_f64(),
            "a full snapshot begins: applied beside the rows served, the rows it lacks deleted at its commit"
        );
        Ok(Resync { seq, before, brought })
    }

    fn mark(&mut self, keys: &[u64]) {
        for k in keys {
            if let Ok(i) = self.before.binary_search(k) {
                self.brought[i / 64] |= 1 << (i % 64);
            }
        }
    }

    /// The keys the table held before the snapshot and the snapshot did not bring.
    fn stale(&self) -> impl Iterator<Item = u64> + '_ {
        self.before.iter().enumerate().filter(|&(i, _)| self.brought[i / 64] & (1 << (i % 64)) == 0).map(|(_, &k)| k)
    }
}

/// Deletes the keys of each resynced table that the snapshot of checkpoint `seq` did
/// not bring; forgets resyncs of other checkpoints (an attempt the publisher abandoned:
/// its rows stay, as upserts, and what follows them carries every later change).
fn sweep(s: &Shared, resyncs: &mut HashMap<String, Resync>, seq: u64) -> Result<u64> {
    let mut swept = 0;
    for (name, r) in resyncs.drain() {
        if r.seq != seq {
            continue;
        }
        let Ok(t) = s.store.table(&name) else { continue };
        let stale: Vec<u64> = r.stale().collect();
        for chunk in stale.chunks(65536) {
            s.view.keep(&t, chunk)?;
            swept += t.delete(chunk)?;
        }
        tracing::info!(table = %name, deleted = stale.len(), "a full snapshot is complete");
    }
    Ok(swept)
}

/// The applier: applies what the reader sends, checkpointing at each commit marker.
fn apply_all(
    s: &Shared,
    applied: &mut Applied,
    rx: &std::sync::mpsc::Receiver<Result<(String, message::Message)>>,
) -> Result<()> {
    let mut window = (Instant::now(), 0u64);
    // Tables under a full snapshot, by name. Rebuilt from the reset after a retry: the
    // stream is read again from the last commit.
    let mut resyncs: HashMap<String, Resync> = HashMap::new();
    let mut pacer = Pacer::new(s.opts.ingest_share, &s.view);
    // Between two checkpoints (nothing of the next one applied yet): where a hold waits.
    let mut at_boundary = true;
    while !s.stop.load(Ordering::Relaxed) {
        if at_boundary && s.commits_left.load(Ordering::Acquire) == 0 {
            hold(s);
            continue;
        }
        let (position, m) = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => r?,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if window.0.elapsed() >= Duration::from_secs(1) {
                    s.status.lock().ingest_rows_per_second = 0.0;
                    window = (Instant::now(), 0);
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        };
        let served = applied.meta.as_ref().map_or(0, |m| m.seq);
        if m.checkpoint.seq <= served {
            s.status.lock().repeats += 1;
            continue;
        }
        apply(s, &m, &mut resyncs, &mut pacer)?;
        at_boundary = m.kind == Kind::Commit;
        let mut st = s.status.lock();
        st.messages += 1;
        match m.kind {
            Kind::Rows => {
                st.rows += m.keys.len() as u64;
                window.1 += m.keys.len() as u64;
                drop(st);
            }
            Kind::Deletes => {
                st.deletes += m.keys.len() as u64;
                drop(st);
            }
            Kind::Commit => {
                drop(st);
                let swept = sweep(s, &mut resyncs, m.checkpoint.seq)?;
                s.status.lock().deletes += swept;
                let meta = ReplicaMeta {
                    position,
                    stream: s.opts.stream.describe(),
                    partition: s.opts.partition,
                    seq: m.checkpoint.seq,
                    batch_id: m.checkpoint.batch_id,
                    unix_micros: m.checkpoint.unix_micros,
                };
                let blob = serde_json::to_vec(&serde_json::json!({ "replica": meta })).expect("serializes");
                s.store.checkpoint_with_meta(applied.next_batch, &blob)?;
                applied.next_batch += 1;
                // The status (what `SERVED` answers) changes with the view, under its lock:
                // a client that read rows of this checkpoint and then asks what the replica
                // serves is never told the one before.
                let mut st = s.status.lock();
                s.view.commit(meta.batch_id);
                st.checkpoints_not_atomic = s.view.given_up_total.load(Ordering::Relaxed);
                st.commits += 1;
                st.checkpoint_batch_id = Some(meta.batch_id);
                st.checkpoint_seq = Some(meta.seq);
                st.checkpoint_unix_seconds = Some(meta.unix_micros as f64 * 1e-6);
                st.last_freshness_seconds = Some((now_seconds() - meta.unix_micros as f64 * 1e-6).max(0.0));
                applied.meta = Some(meta);
                drop(st);
                let _ = s.commits_left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| match n {
                    NO_HOLD => None,
                    n => Some(n.saturating_sub(1)),
                });
            }
            Kind::Reset => drop(st),
        }
        let elapsed = window.0.elapsed();
        if elapsed >= Duration::from_secs(1) {
            s.status.lock().ingest_rows_per_second = window.1 as f64 / elapsed.as_secs_f64();
            window = (Instant::now(), 0);
        }
    }
    Ok(())
}

/// Waits while the replica is held (see [`Replica::hold_after`]) or until it stops.
fn hold(s: &Shared) {
    s.held.store(true, Ordering::Relaxed);
    s.status.lock().state = "held".into();
    while s.commits_left.load(Ordering::Acquire) == 0 && !s.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(1));
    }
    s.status.lock().state = "ingesting".into();
    s.held.store(false, Ordering::Relaxed);
}

fn apply(s: &Shared, m: &message::Message, resyncs: &mut HashMap<String, Resync>, pacer: &mut Pacer) -> Result<()> {
    let table = |create: bool| -> Result<Option<embank_core::Table>> {
        match s.store.table(&m.table) {
            Ok(t) => {
                if m.dim != 0 && t.dim() != m.dim as usize {
                    return Err(Error::config(format!(
                        "table {:?} has dim {} here but dim {} in the stream",
                        m.table,
                        t.dim(),
                        m.dim
                    )));
                }
                Ok(Some(t))
            }
            Err(e) if e.kind() == ErrorKind::NotFound && create => {
                tracing::info!(table = %m.table, dim = m.dim, "creating a table the stream brings");
                Ok(Some(s.store.create_table(&m.table, TableOptions::new(m.dim))?))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    match m.kind {
        Kind::Rows => {
            if let Some(r) = resyncs.get_mut(&m.table) {
                r.mark(&m.keys);
            }
            let t = table(true)?.expect("created");
            // In chunks: a read waits behind one chunk's overlay update at most, and the
            // pacer looks at the reads between chunks.
            let d = t.dim();
            if m.rows.len() != m.keys.len() * d {
                return Err(Error::corrupt(format!(
                    "a rows message of table {:?} holds {} floats for {} keys of dim {d}",
                    m.table,
                    m.rows.len(),
                    m.keys.len()
                )));
            }
            for (keys, rows) in m.keys.chunks(INGEST_CHUNK_ROWS).zip(m.rows.chunks(INGEST_CHUNK_ROWS * d)) {
                let started = Instant::now();
                s.view.keep(&t, keys)?;
                t.push(keys, rows)?;
                pacer.after(&s.view, started.elapsed());
            }
            Ok(())
        }
        Kind::Deletes => match table(false)? {
            Some(t) => {
                s.view.keep(&t, &m.keys)?;
                t.delete(&m.keys).map(|_| ())
            }
            None => Ok(()),
        },
        Kind::Reset => {
            // Remember what is served; the snapshot's rows replace it in place, and its
            // commit sweeps the rest. A second reset of the table (the publisher retried
            // the snapshot) starts over from what is there now.
            let Some(t) = table(true)? else { return Ok(()) };
            resyncs.insert(m.table.clone(), Resync::start(&t, m.checkpoint.seq)?);
            Ok(())
        }
        Kind::Commit => Ok(()),
    }
}

#[cfg(test)]
mod tests;
