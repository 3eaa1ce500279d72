//! The training side: publishes each checkpoint's changes to the stream.
//!
//! [`Publisher::notify`] is called after `checkpoint()`; a background thread sends the
//! changes between the last checkpoint it published and the newest one (several
//! checkpoints taken while it was busy are sent as one), as they were at the newest,
//! then a commit marker in every partition, then waits for the broker's
//! acknowledgement. Only then does that checkpoint count as published: its seq is
//! written to `PUBLISHED-<topic>.json` in the store directory and pinned against
//! retention, since the next publish starts from it.
//!
//! The first publish, and any publish after the publisher lost its place (the
//! checkpoint it published was restored away, or it gave up after `checkpoints_pending_max`
//! failures), sends every table whole after a reset marker.
//!
//! Retention: the stream keeps what a replica may still need and no more. A replica up to
//! `keep_checkpoints` checkpoints behind goes on from its position; one further behind, or
//! a new one, reads the full snapshot the stream begins with. So the stream always begins
//! at a full snapshot's first message: the publisher trims (Redis `XTRIM MINID`, Kafka
//! `DeleteRecords`) only there, at the newest snapshot with `keep_checkpoints` checkpoints
//! published after it. New snapshots come after a checkpoint's changes (with the same
//! seq: a replica that applied the changes skips them as repeats) once the stream holds
//! `keep_checkpoints` checkpoints since the newest one and their changes weigh as much as
//! it, so the stream holds about two snapshots and what changed since the older one.
//! Where the snapshots begin is kept in `PUBLISHED-<topic>.json` with the place.
//!
//! While the broker is down, checkpoints queue up (retained by the pin, retried with
//! backoff). When more than `checkpoints_pending_max` are waiting, `notify` fails loudly — the
//! caller's `checkpoint()` raises — and the publisher drops its pin so retention goes on:
//! once the broker is back it sends a full snapshot. It never reports a checkpoint as
//! published that the broker did not acknowledge.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use embank_core::{CheckpointInfo, CheckpointPin, Error, ErrorKind, Result, Store};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::message::{self, CheckpointId, MESSAGE_BYTES_MIN};
use super::{Sink, StreamConfig};
use crate::proto::shard_of;

/// What a publisher sends where.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishOptions {
    #[serde(flatten)]
    pub stream: StreamConfig,
    /// Partitions of the stream: one per serving shard (keys are routed by the shard hash).
    #[serde(default = "one")]
    pub partitions: u32,
    /// Bound of one message in bytes (Kafka's default limit is 1 MiB).
    #[serde(default = "default_message_bytes")]
    pub message_bytes: usize,
    /// Checkpoints that may wait for the broker before `checkpoint()` fails.
    #[serde(default = "default_checkpoints_pending_max", alias = "max_pending")]
    pub checkpoints_pending_max: usize,
    /// Tables to publish (default: all).
    #[serde(default)]
    pub tables: Option<Vec<String>>,
    /// Checkpoints the stream keeps (default 8): a replica at most this many checkpoints
    /// behind goes on from its position, one further behind (or a new one) reads the full
    /// snapshot the stream begins with (see the module's doc). 0: never trim, and publish
    /// a full snapshot only when the publisher lost its place (the stream grows forever).
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
}

fn one() -> u32 {
    1
}
fn default_message_bytes() -> usize {
    1 << 20
}
fn default_checkpoints_pending_max() -> usize {
    4
}
fn default_keep_checkpoints() -> usize {
    8
}

impl PublishOptions {
    pub fn new(stream: StreamConfig) -> PublishOptions {
        PublishOptions {
            stream,
            partitions: 1,
            message_bytes: default_message_bytes(),
            checkpoints_pending_max: default_checkpoints_pending_max(),
            tables: None,
            keep_checkpoints: default_keep_checkpoints(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.stream.validate()?;
        if self.partitions == 0 || self.partitions > 4096 {
            return Err(Error::config(format!("publish: partitions must be 1..=4096, got {}", self.partitions)));
        }
        if self.message_bytes < MESSAGE_BYTES_MIN || self.message_bytes > 64 << 20 {
            return Err(Error::config(format!(
                "publish: message_bytes must be {MESSAGE_BYTES_MIN}..={}, got {}",
                64 << 20,
                self.message_bytes
            )));
        }
        if self.checkpoints_pending_max == 0 {
            return Err(Error::config("publish: checkpoints_pending_max must be at least 1"));
        }
        Ok(())
    }
}

/// The last checkpoint the stream has, as `PUBLISHED-<topic>.json` keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Published {
    seq: u64,
    batch_id: u64,
    tables: Vec<String>,
    partitions: u32,
    /// Where the stream's full snapshots begin (absent in files of older publishers).
    #[serde(default)]
    retention: Retention,
}

/// What trimming the stream needs to know.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct Retention {
    /// Checkpoints published to the stream so far.
    published: u64,
    /// The full snapshots the stream holds, oldest first.
    snapshots: Vec<SnapshotPlace>,
    /// Bytes of rows and deletes published since the newest snapshot.
    bytes_since_snapshot: u64,
    /// Seq of the snapshot the stream was last trimmed to (it begins there).
    trimmed_to: Option<u64>,
}

/// A full snapshot in the stream.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct SnapshotPlace {
    /// The checkpoint it holds.
    seq: u64,
    /// [`Retention::published`] once it was published.
    number: u64,
    /// Bytes of its rows.
    bytes: u64,
    /// Where it begins in each partition ([`Sink::marked`]).
    places: Vec<Option<String>>,
}

/// What a publisher has done, for stats and tests.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PublisherStatus {
    pub stream: String,
    /// Batch id and seq of the newest checkpoint the broker acknowledged (None: none yet).
    pub published_batch_id: Option<u64>,
    pub published_seq: Option<u64>,
    /// Checkpoints taken and not yet published.
    pub pending: usize,
    pub checkpoints_published: u64,
    /// Full snapshots sent because the publisher had no place (the first publish, and
    /// after it lost its place).
    pub full_snapshots: u64,
    /// Full snapshots sent after a checkpoint's changes, for the stream to be trimmed to.
    pub retention_snapshots: u64,
    /// Trims of the stream, and the messages they dropped (Redis says how many; Kafka not).
    pub trims: u64,
    pub messages_trimmed: u64,
    /// Seq of the full snapshot the stream was last trimmed to (None: never trimmed).
    pub trimmed_to_seq: Option<u64>,
    pub messages: u64,
    pub rows: u64,
    pub deletes: u64,
    pub bytes: u64,
    /// Seconds the last publish took (export, send, acknowledgement).
    pub last_publish_seconds: f64,
    /// Why the last attempt failed, while it is not yet retried successfully.
    pub last_error: Option<String>,
    /// Failed attempts so far.
    pub failures: u64,
}

struct State {
    /// The newest checkpoint the broker has, and the pin that keeps it retained.
    published: Option<(Published, Option<CheckpointPin>)>,
    /// Seq of the newest checkpoint notified.
    wanted: u64,
    /// Checkpoints notified and not yet published (by seq).
    waiting: BTreeSet<u64>,
    /// Set when the publisher lost its place: the next publish is a full snapshot.
    resync: bool,
    status: PublisherStatus,
    /// First failure of the current run of failures.
    failing_since: Option<Instant>,
}

struct Shared {
    store: Arc<Store>,
    opts: PublishOptions,
    state: Mutex<State>,
    wake: Condvar,
    /// Signalled after every attempt.
    done: Condvar,
    stop: AtomicBool,
    path: PathBuf,
}

/// A publisher over an embedded store. Dropping it stops the thread (what is not yet
/// published stays pending for the next publisher: its place is on disk). Every method
/// takes `&self`: one thread may `close` it while another waits in `flush`.
pub struct Publisher {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Publisher {
    /// Connects to the broker (failing at once if it cannot) and starts the thread.
    pub fn start(store: Arc<Store>, opts: PublishOptions) -> Result<Publisher> {
        opts.validate()?;
        let sink = opts.stream.sink(opts.partitions)?;
        let path = store.path().join(format!("PUBLISHED-{}.json", sanitize(&opts.stream.topic)));
        let mut resync = true;
        let published = match std::fs::read(&path) {
            Ok(bytes) => {
                let p: Published =
                    serde_json::from_slice(&bytes).map_err(|e| Error::corrupt(format!("{}: {e}", path.display())))?;
                match store.pin_checkpoint(p.seq) {
                    Ok(pin) if p.partitions == opts.partitions => {
                        resync = false;
                        Some((p, Some(pin)))
                    }
                    Ok(_) => {
                        tracing::warn!(
                            was = p.partitions,
                            now = opts.partitions,
                            "partition count changed: publishing a full snapshot"
                        );
                        Some((p, None))
                    }
                    Err(_) => {
                        tracing::warn!(
                            seq = p.seq,
                            "the last published checkpoint is no longer retained: publishing a full snapshot"
                        );
                        Some((p, None))
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(format!("cannot read {}", path.display()), e)),
        };
        let mut status = PublisherStatus { stream: opts.stream.describe(), ..Default::default() };
        if let Some((p, _)) = &published {
            status.published_batch_id = Some(p.batch_id);
            status.published_seq = Some(p.seq);
            status.trimmed_to_seq = p.retention.trimmed_to;
        }
        let shared = Arc::new(Shared {
            store,
            opts,
            state: Mutex::new(State {
                published,
                wanted: 0,
                waiting: BTreeSet::new(),
                resync,
                status,
                failing_since: None,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            stop: AtomicBool::new(false),
            path,
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("embank-publish".into())
            .spawn(move || run(&s, sink))
            .map_err(|e| Error::io("cannot start the publisher thread", e))?;
        Ok(Publisher { shared, thread: Mutex::new(Some(thread)) })
    }

    /// A checkpoint was taken: publish up to the newest one. Fails (the checkpoint
    /// itself stands) when more than `checkpoints_pending_max` checkpoints wait for the broker.
    pub fn notify(&self) -> Result<()> {
        let latest = self.shared.store.checkpoints()?.last().map(|c| c.seq).unwrap_or(0);
        let mut st = self.shared.state.lock();
        st.wanted = st.wanted.max(latest);
        if latest > st.published.as_ref().map_or(0, |(p, _)| p.seq) {
            st.waiting.insert(latest);
        }
        let pending = st.waiting.len();
        st.status.pending = pending;
        self.shared.wake.notify_all();
        // Checkpoints taken while a publish is under way are sent together by the next
        // one: only a broker that fails makes them a problem.
        if pending > self.shared.opts.checkpoints_pending_max && st.status.last_error.is_some() {
            // Give up the place: retention goes on, and the next publish is a full snapshot.
            if let Some((_, pin)) = st.published.as_mut() {
                *pin = None;
            }
            st.resync = true;
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "{pending} checkpoints wait to be published to {} (checkpoints_pending_max {}); the last attempt failed: {}. \
                     The checkpoint was taken; the stream gets a full snapshot once the broker is back",
                    self.shared.opts.stream.describe(),
                    self.shared.opts.checkpoints_pending_max,
                    st.status.last_error.as_deref().unwrap_or("")
                ),
            ));
        }
        Ok(())
    }

    /// Publishes up to the newest checkpoint and waits until the broker has it; fails
    /// with the last error if that takes longer than `timeout`, and at once (`Closed`)
    /// when the publisher is closed meanwhile.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        let Some(latest) = self.shared.store.checkpoints()?.last().map(|c| c.seq) else {
            // No checkpoint yet: nothing to publish (a new publisher's pending snapshot
            // waits for the first one).
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock();
        st.wanted = st.wanted.max(latest);
        self.shared.wake.notify_all();
        loop {
            let published = st.published.as_ref().map_or(0, |(p, _)| p.seq);
            if published >= latest && !st.resync {
                return Ok(());
            }
            if self.shared.stop.load(Ordering::Relaxed) {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!(
                        "the publisher to {} was closed before checkpoint seq {latest} was published",
                        self.shared.opts.stream.describe()
                    ),
                ));
            }
            if self.shared.done.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "checkpoint seq {latest} not published to {} within {timeout:?}: {}",
                        self.shared.opts.stream.describe(),
                        st.status.last_error.as_deref().unwrap_or("still sending")
                    ),
                ));
            }
        }
    }

    pub fn status(&self) -> PublisherStatus {
        let st = self.shared.state.lock();
        let mut s = st.status.clone();
        s.pending = st.waiting.len();
        s
    }

    /// Stops the thread (an attempt in flight finishes first) and wakes a `flush` in
    /// flight, which fails. Idempotent.
    pub fn close(&self) {
        {
            // Under the state lock, so a flush between its check of `stop` and its wait
            // cannot miss the wake-up.
            let _st = self.shared.state.lock();
            self.shared.stop.store(true, Ordering::Relaxed);
            self.shared.wake.notify_all();
            self.shared.done.notify_all();
        }
        let thread = self.thread.lock().take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.close();
    }
}

fn sanitize(topic: &str) -> String {
    topic.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect()
}

fn run(s: &Shared, mut sink: Box<dyn Sink>) {
    // Training comes first: the publisher thread runs at a lower priority (nice 10), so
    // on a busy machine it takes the cores the training threads leave.
    // SAFETY: setpriority on this thread's own id.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
    let mut backoff = Duration::from_millis(50);
    loop {
        {
            let mut st = s.state.lock();
            loop {
                if s.stop.load(Ordering::Relaxed) {
                    return;
                }
                let published = st.published.as_ref().map_or(0, |(p, _)| p.seq);
                if st.wanted > published || (st.resync && st.wanted > 0) {
                    break;
                }
                s.wake.wait_for(&mut st, Duration::from_millis(200));
            }
        }
        let started = Instant::now();
        let result = publish_newest(s, sink.as_mut());
        let mut st = s.state.lock();
        match result {
            Ok(()) => {
                st.status.last_publish_seconds = started.elapsed().as_secs_f64();
                st.status.last_error = None;
                st.failing_since = None;
                backoff = Duration::from_millis(50);
            }
            Err(e) => {
                tracing::warn!(error = %e, stream = %s.opts.stream.describe(), "publishing failed; retrying");
                st.status.last_error = Some(e.to_string());
                st.status.failures += 1;
                st.failing_since.get_or_insert_with(Instant::now);
                drop(st);
                s.done.notify_all();
                // Back off, but wake for stop.
                let until = Instant::now() + backoff;
                while Instant::now() < until && !s.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        }
        drop(st);
        s.done.notify_all();
    }
}

/// Per-partition buffers of rows or deletes, sent when a message's worth is there.
struct Batcher<'a> {
    sink: &'a mut dyn Sink,
    ck: CheckpointId,
    table: &'a str,
    dim: usize,
    per_rows: usize,
    per_deletes: usize,
    keys: Vec<Vec<u64>>,
    rows: Vec<Vec<f32>>,
    deleted: Vec<Vec<u64>>,
    sent: &'a mut [u32],
    status: &'a mut PublisherStatus,
}

impl Batcher<'_> {
    fn send(&mut self, p: usize, m: Vec<u8>) -> Result<()> {
        self.status.messages += 1;
        self.status.bytes += m.len() as u64;
        self.sent[p] += 1;
        self.sink.send(p as u32, vec![m])
    }

    fn add(&mut self, keys: &[u64], rows: &[f32], deleted: &[u64]) -> Result<()> {
        let parts = self.keys.len() as u32;
        let d = self.dim;
        for (i, &k) in keys.iter().enumerate() {
            let p = if parts == 1 { 0 } else { shard_of(k, parts) as usize };
            self.keys[p].push(k);
            self.rows[p].extend_from_slice(&rows[i * d..(i + 1) * d]);
            if self.keys[p].len() >= self.per_rows {
                self.flush_rows(p)?;
            }
        }
        for &k in deleted {
            let p = if parts == 1 { 0 } else { shard_of(k, parts) as usize };
            self.deleted[p].push(k);
            if self.deleted[p].len() >= self.per_deletes {
                self.flush_deletes(p)?;
            }
        }
        self.status.rows += keys.len() as u64;
        self.status.deletes += deleted.len() as u64;
        Ok(())
    }

    fn flush_rows(&mut self, p: usize) -> Result<()> {
        if self.keys[p].is_empty() {
            return Ok(());
        }
        let m = message::encode_rows(self.ck, self.table, self.dim, &self.keys[p], &self.rows[p]);
        self.keys[p].clear();
        self.rows[p].clear();
        self.send(p, m)
    }

    fn flush_deletes(&mut self, p: usize) -> Result<()> {
        if self.deleted[p].is_empty() {
            return Ok(());
        }
        let m = message::encode_deletes(self.ck, self.table, &self.deleted[p]);
        self.deleted[p].clear();
        self.send(p, m)
    }

    fn finish(mut self) -> Result<()> {
        for p in 0..self.keys.len() {
            self.flush_rows(p)?;
            self.flush_deletes(p)?;
        }
        Ok(())
    }
}

fn publish_newest(s: &Shared, sink: &mut dyn Sink) -> Result<()> {
    let store = &s.store;
    let Some(target) = store.checkpoints()?.last().cloned() else { return Ok(()) };
    // Keep the target retained while it is read (the place we publish from keeps it too).
    let target_pin = store.pin_checkpoint(target.seq)?;
    let (from, resync, published_tables, mut retention) = {
        let st = s.state.lock();
        let retention = st.published.as_ref().map(|(p, _)| p.retention.clone()).unwrap_or_default();
        match &st.published {
            Some((p, Some(_))) if !st.resync => {
                (Some(p.seq), false, p.tables.iter().cloned().collect::<BTreeSet<_>>(), retention)
            }
            _ => (None, true, BTreeSet::new(), retention),
        }
    };
    if from == Some(target.seq) {
        return Ok(());
    }
    let mut tables = store.tables()?;
    if let Some(only) = &s.opts.tables {
        for t in only {
            if !tables.contains(t) {
                return Err(Error::new(ErrorKind::NotFound, format!("publish: no table {t:?} in the store")));
            }
        }
        tables.retain(|t| only.contains(t));
    }
    let mut status = PublisherStatus::default();
    if resync {
        sink.mark()?;
    }
    send_checkpoint(s, sink, &target, &tables, from, &published_tables, &mut status)?;
    let changes_bytes = status.bytes;
    // A full snapshot after the changes, for the stream to be trimmed to later.
    let keep = s.opts.keep_checkpoints as u64;
    let snapshot_due = !resync
        && keep > 0
        && retention.snapshots.last().is_none_or(|n| {
            retention.published + 1 - n.number >= keep && retention.bytes_since_snapshot + changes_bytes >= n.bytes
        });
    if snapshot_due {
        sink.mark()?;
        send_checkpoint(s, sink, &target, &tables, None, &BTreeSet::new(), &mut status)?;
    }
    sink.flush()?;
    retention.published += 1;
    if resync || snapshot_due {
        let bytes = if resync { changes_bytes } else { status.bytes - changes_bytes };
        let places = sink.marked();
        retention.snapshots.push(SnapshotPlace { seq: target.seq, number: retention.published, bytes, places });
        retention.bytes_since_snapshot = 0;
    } else {
        retention.bytes_since_snapshot += changes_bytes;
    }
    // The broker has it: record the place, then move the pin.
    let mut published = Published {
        seq: target.seq,
        batch_id: target.batch_id,
        tables: tables.clone(),
        partitions: sink.partitions(),
        retention,
    };
    write_published(&s.path, &published)?;
    // Then drop what no replica needs any more (on failure, after the next publish).
    let trimmed = trim_to_snapshot(s, sink, &mut published.retention);
    if let Some((_, true)) = trimmed {
        if let Err(e) = write_published(&s.path, &published) {
            tracing::warn!(error = %e, "the stream was trimmed; recording it failed (it is done again next time)");
        }
    }
    let trimmed_to = published.retention.trimmed_to;
    let mut st = s.state.lock();
    st.published = Some((published, Some(target_pin)));
    st.resync = false;
    st.waiting.retain(|&q| q > target.seq);
    let t = &mut st.status;
    t.published_batch_id = Some(target.batch_id);
    t.published_seq = Some(target.seq);
    t.checkpoints_published += 1;
    t.full_snapshots += resync as u64;
    t.retention_snapshots += snapshot_due as u64;
    t.messages += status.messages;
    t.rows += status.rows;
    t.deletes += status.deletes;
    t.bytes += status.bytes;
    if let Some((dropped, true)) = trimmed {
        t.trims += 1;
        t.messages_trimmed += dropped;
        t.trimmed_to_seq = trimmed_to;
    }
    tracing::debug!(
        seq = target.seq,
        batch = target.batch_id,
        rows = status.rows,
        snapshot_due,
        "checkpoint published"
    );
    Ok(())
}

/// Sends checkpoint `target`'s tables to every partition: after a reset, every table whole
/// when `from` is None, and tables not in `seen`; the others' changes since `from`. Then a
/// commit marker in every partition. Counts into `status`.
fn send_checkpoint(
    s: &Shared,
    sink: &mut dyn Sink,
    target: &CheckpointInfo,
    tables: &[String],
    from: Option<u64>,
    seen: &BTreeSet<String>,
    status: &mut PublisherStatus,
) -> Result<()> {
    let store = &s.store;
    let ck = checkpoint_id(target);
    let parts = sink.partitions() as usize;
    let mut sent = vec![0u32; parts];
    for name in tables {
        let dim = store.table(name)?.dim();
        // A table the stream has not seen whole yet goes whole, after a reset.
        let whole = from.is_none() || !seen.contains(name);
        if whole {
            for (p, n) in sent.iter_mut().enumerate() {
                *n += 1;
                status.messages += 1;
                sink.send(p as u32, vec![message::encode_reset(ck, name, dim)])?;
            }
        }
        let mut b = Batcher {
            sink: &mut *sink,
            ck,
            table: name,
            dim,
            per_rows: message::rows_per_message(s.opts.message_bytes, name, dim),
            per_deletes: message::deletes_per_message(s.opts.message_bytes, name),
            keys: vec![Vec::new(); parts],
            rows: vec![Vec::new(); parts],
            deleted: vec![Vec::new(); parts],
            sent: &mut sent,
            status: &mut *status,
        };
        let chunk = 8192;
        store.export_changes_between(name, if whole { None } else { from }, target.seq, chunk, |k, r, d| {
            b.add(k, r, d)
        })?;
        b.finish()?;
    }
    for (p, &before) in sent.iter().enumerate() {
        status.messages += 1;
        sink.send(p as u32, vec![message::encode_commit(ck, before)])?;
    }
    Ok(())
}

/// Trims the stream to the newest full snapshot with `keep_checkpoints` checkpoints
/// published after it, unless it begins there already, and forgets the snapshots before
/// it. Some((messages dropped, whether it trimmed)), None when a trim failed (logged).
fn trim_to_snapshot(s: &Shared, sink: &mut dyn Sink, r: &mut Retention) -> Option<(u64, bool)> {
    let keep = s.opts.keep_checkpoints as u64;
    if keep == 0 {
        return Some((0, false));
    }
    let Some(i) = r.snapshots.iter().rposition(|p| p.number + keep <= r.published) else { return Some((0, false)) };
    let to = &r.snapshots[i];
    if r.trimmed_to == Some(to.seq) {
        return Some((0, false));
    }
    let mut dropped = 0;
    for (p, place) in to.places.iter().enumerate().take(sink.partitions() as usize) {
        // A partition whose place is unknown keeps everything.
        let Some(place) = place else { continue };
        match sink.trim(p as u32, place) {
            Ok(n) => dropped += n.unwrap_or(0),
            Err(e) => {
                tracing::warn!(error = %e, partition = p, "cannot trim the stream; trying again after the next publish");
                return None;
            }
        }
    }
    tracing::info!(
        stream = %s.opts.stream.describe(),
        snapshot_seq = to.seq,
        dropped,
        "trimmed the stream to a full snapshot"
    );
    r.trimmed_to = Some(to.seq);
    r.snapshots.drain(..i);
    Some((dropped, true))
}

fn write_published(path: &std::path::Path, published: &Published) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(published).expect("serializes"))
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| Error::io(format!("cannot record the published checkpoint in {}", path.display()), e))
}

fn checkpoint_id(c: &CheckpointInfo) -> CheckpointId {
    CheckpointId { seq: c.seq, batch_id: c.batch_id, unix_micros: (c.unix_seconds * 1e6) as u64 }
}
