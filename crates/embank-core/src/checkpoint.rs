//! Batch-aware checkpoints, in one place: the store's gate and interval, the
//! checkpoint list (`CHECKPOINTS.0`/`.1`, with each checkpoint's metadata blob), and per table the
//! undo journal of the current interval, the spare for the next, the records
//! held for retained checkpoints, the interval marks, and the rollback that
//! returns a table to a checkpoint after a crash or on `restore`.
//!
//! A checkpoint copies nothing. Batches that change rows hold the gate shared;
//! `checkpoint(batch)` holds it exclusively for a moment, so it falls between
//! batches, and starts a new interval: from then on the *first* change of each
//! key appends `(key, record at the checkpoint)` to the table's undo journal
//! before the key's index slot changes (see `table/write.rs`), and that record
//! is held from reuse while a checkpoint that can reach it is retained.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::index::Index;
use crate::journal::{self, Journal};

/// Largest metadata blob a checkpoint keeps (stream offsets, a trainer's position).
pub const CHECKPOINT_META_BYTES_MAX: usize = 64 << 10;
/// The checkpoint list of stores written before the two slots (see [`CheckpointFile`]).
const CHECKPOINTS_FILE: &str = "CHECKPOINTS";

/// The store's checkpoint gate and the seq of the current interval.
#[derive(Default)]
pub(crate) struct Gate {
    /// Batches that change rows hold this shared; a checkpoint holds it exclusively, so
    /// it falls between batches. Taken before any table lock (`read_recursive`: batches nest).
    pub lock: RwLock<()>,
    /// Seq of the latest checkpoint (0: none yet, nothing is journaled).
    pub interval: AtomicU64,
}

impl Gate {
    /// Held by every batch that may change rows.
    #[inline]
    pub fn batch(&self) -> parking_lot::RwLockReadGuard<'_, ()> {
        self.lock.read_recursive()
    }

    #[inline]
    pub fn interval(&self) -> u64 {
        self.interval.load(Ordering::Acquire)
    }
}

/// One retained checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// The caller's batch id.
    pub batch_id: u64,
    /// The store's sequence number of the checkpoint (names its undo journals).
    pub seq: u64,
    pub unix_seconds: f64,
    /// The caller's metadata blob (empty if none), e.g. the stream offsets it covers.
    #[serde(default, with = "hex_bytes", skip_serializing_if = "Vec::is_empty")]
    pub meta: Vec<u8>,
    /// The training step of each table (by id) whose optimizer [uses the table's
    /// step](crate::optim::Optimizer::uses_table_step) and had one: a rollback to this
    /// checkpoint returns the table to it (absent: 0).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub steps: BTreeMap<u32, u64>,
}

/// Metadata blobs are kept as hex strings in the JSON of `CHECKPOINTS`.
mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        // Bytes, not `&s[i..i + 2]`: a non-ASCII character would split (found by fuzzing).
        let b = s.as_bytes();
        if !b.len().is_multiple_of(2) {
            return Err(serde::de::Error::custom("odd length of a hex blob"));
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        b.chunks(2)
            .map(|p| match (digit(p[0]), digit(p[1])) {
                (Some(h), Some(l)) => Ok(h << 4 | l),
                _ => Err(serde::de::Error::custom("a metadata blob is not hex")),
            })
            .collect()
    }
}

/// The retained checkpoints a store directory's checkpoint list holds, oldest first
/// (the fuzz target of the list's parser).
#[cfg(feature = "fuzzing")]
pub fn load_checkpoints(dir: &Path) -> Result<Vec<CheckpointInfo>> {
    Ok(CheckpointFile::load(dir)?.checkpoints)
}

/// What a table needs to know about the store's checkpoints when it opens.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CheckpointState {
    /// Seq of the latest checkpoint (0: none).
    pub latest: u64,
    /// Seq of the oldest retained checkpoint.
    pub oldest: u64,
    /// Roll back to this checkpoint whatever state the table was left in (a restore).
    pub restore_to: Option<u64>,
    /// A rollback on first touch is under way (set by the table's open): its journal's
    /// entries before `upto` count as undone.
    pub undoing: Option<PendingRollback>,
}

/// A rollback on first touch (`index/undo.rs`) not yet finished: the entries of journal
/// `seq` before `upto` are being undone; once they all are, the journal is marked so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PendingRollback {
    pub seq: u64,
    pub upto: u64,
}

impl CheckpointState {
    /// The entries of `j` that no rollback undid or is undoing.
    fn live_entries(&self, j: &Journal) -> Vec<journal::Entry> {
        match self.undoing {
            Some(p) if p.seq == j.seq() => j.entries_since(p.upto),
            _ => j.entries_since_rollback(),
        }
    }
}

/// The checkpoint list of a store: `CHECKPOINTS.0` and `CHECKPOINTS.1`, written in turn.
///
/// Each save writes the whole list, behind a header with a generation number, its length
/// and a CRC-32C, over the slot the previous save did not use — one `pwrite` into the
/// page cache, no file created or renamed. A write + rename cost 0.2-0.5 ms on ext4 (it
/// replaces a file, which also starts its write-back), and a checkpoint makes it with
/// every batch waiting at the gate. A save cut short leaves a slot whose CRC fails;
/// the other slot, the previous generation, is then read: the list before the cut
/// save, which had not returned. Stores written before the slots have one `CHECKPOINTS`
/// (JSON, replaced by write + rename): it is read if no slot is, and deleted by the
/// first save.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct CheckpointFile {
    pub next_seq: u64,
    pub checkpoints: Vec<CheckpointInfo>,
    /// Set while a restore to this seq has not finished: the next open completes it.
    #[serde(default)]
    pub restore_to: Option<u64>,
    /// Generation of the slot this was read from (0: none, or the file before slots).
    #[serde(skip)]
    generation: u64,
    /// Read from a `CHECKPOINTS` of before the slots: deleted once a slot is written.
    #[serde(skip)]
    legacy: bool,
}

const SLOT_FILES: [&str; 2] = ["CHECKPOINTS.0", "CHECKPOINTS.1"];
const SLOT_MAGIC: &str = "embank-checkpoints";
const SLOT_VERSION: u32 = 2;

/// A slot's generation and list, or why it is not one.
fn parse_slot(bytes: &[u8]) -> std::result::Result<(u64, CheckpointFile), String> {
    let nl = bytes.iter().take(128).position(|&b| b == b'\n').ok_or("no header line")?;
    let header = std::str::from_utf8(&bytes[..nl]).map_err(|_| "header is not text")?;
    let f: Vec<&str> = header.split(' ').collect();
    if f.len() != 5 || f[0] != SLOT_MAGIC {
        return Err(format!("not a checkpoint list header: {header:?}"));
    }
    let num = |s: &str| s.parse::<u64>().map_err(|_| format!("bad number {s:?} in the header"));
    if num(f[1])? != SLOT_VERSION as u64 {
        return Err(format!("format version {} (this build reads {SLOT_VERSION})", f[1]));
    }
    let (generation, len) = (num(f[2])?, num(f[3])?);
    let crc = u32::from_str_radix(f[4], 16).map_err(|_| format!("bad checksum {:?} in the header", f[4]))?;
    let body = bytes
        .get(nl + 1..)
        .and_then(|b| b.get(..usize::try_from(len).ok()?))
        .ok_or_else(|| format!("{len} bytes of list announced, fewer present (a save cut short)"))?;
    if crc32c::crc32c(body) != crc {
        return Err("checksum mismatch (a save cut short)".into());
    }
    let file: CheckpointFile = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    Ok((generation, file))
}

impl CheckpointFile {
    pub fn load(dir: &Path) -> Result<CheckpointFile> {
        let mut best: Option<(u64, CheckpointFile)> = None;
        let mut damaged = Vec::new();
        for name in SLOT_FILES {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => match parse_slot(&bytes) {
                    Ok((g, f)) if best.as_ref().is_none_or(|(b, _)| g > *b) => best = Some((g, f)),
                    Ok(_) => {}
                    Err(e) => damaged.push(format!("{}: {e}", path.display())),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_at("cannot read", &path, e)),
            }
        }
        if let Some((generation, file)) = best {
            for d in &damaged {
                tracing::info!(slot = %d, "ignoring a checkpoint list slot; the other one is newer and whole");
            }
            return Ok(CheckpointFile { generation, ..file });
        }
        // Both slots exist only after two saves: both damaged is not a cut-short save.
        if damaged.len() == SLOT_FILES.len() {
            return Err(Error::new(ErrorKind::Recover, damaged.join("; ")));
        }
        let path = dir.join(CHECKPOINTS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(|f: CheckpointFile| CheckpointFile { legacy: true, ..f })
                .map_err(|e| Error::new(ErrorKind::Recover, format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // No list, or only the first save's slot, cut short: no checkpoint yet.
                for d in &damaged {
                    tracing::warn!(slot = %d, "ignoring the first checkpoint list, cut short");
                }
                Ok(CheckpointFile { next_seq: 1, ..Default::default() })
            }
            Err(e) => Err(io_at("cannot read", &path, e)),
        }
    }

    /// Writes the list over the older slot (no fsync: a SIGKILL keeps it, `sync` syncs).
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let generation = self.generation + 1;
        let body = serde_json::to_vec(&*self).expect("checkpoints serialize");
        let mut bytes =
            format!("{SLOT_MAGIC} {SLOT_VERSION} {generation} {} {:08x}\n", body.len(), crc32c::crc32c(&body))
                .into_bytes();
        bytes.extend_from_slice(&body);
        let path = dir.join(SLOT_FILES[(generation % 2) as usize]);
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .and_then(|f| f.write_all_at(&bytes, 0))
            .map_err(|e| io_at("cannot write", &path, e))?;
        self.generation = generation;
        if self.legacy {
            let _ = std::fs::remove_file(dir.join(CHECKPOINTS_FILE));
            self.legacy = false;
        }
        Ok(())
    }

    /// Makes the slots durable (`Store::flush`).
    pub fn sync(dir: &Path) -> Result<()> {
        for name in SLOT_FILES {
            let path = dir.join(name);
            match std::fs::File::open(&path) {
                Ok(f) => f.sync_data().map_err(|e| io_at("cannot sync", &path, e))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_at("cannot open", &path, e)),
            }
        }
        Ok(())
    }

    pub fn state(&self, restore_to: Option<u64>) -> CheckpointState {
        CheckpointState {
            latest: self.checkpoints.last().map_or(0, |c| c.seq),
            oldest: self.checkpoints.first().map_or(0, |c| c.seq),
            restore_to,
            undoing: None,
        }
    }

    /// The seq of the retained checkpoint of `batch_id`.
    /// Table `id`'s training step at each retained checkpoint, by seq (see
    /// [`CheckpointInfo::steps`]).
    pub fn steps_of(&self, id: u32) -> BTreeMap<u64, u64> {
        self.checkpoints.iter().filter_map(|c| Some((c.seq, *c.steps.get(&id)?))).collect()
    }

    pub fn seq_of(&self, batch_id: u64) -> Result<u64> {
        self.checkpoints.iter().find(|c| c.batch_id == batch_id).map(|c| c.seq).ok_or_else(|| {
            let kept: Vec<u64> = self.checkpoints.iter().map(|c| c.batch_id).collect();
            Error::new(ErrorKind::NotFound, format!("no retained checkpoint of batch {batch_id} (retained: {kept:?})"))
        })
    }
}

/// Distinguishes the tables opened by one process (see [`TableCheckpoints::mark_nonce`]).
static MARK_NONCE: AtomicU64 = AtomicU64::new(0);

/// A table's share of the checkpoints.
pub(crate) struct TableCheckpoints {
    dir: PathBuf,
    /// Mixed into the index's checkpoint-mark tags: marks left by an earlier open never match.
    mark_nonce: u64,
    /// Undo journal of the latest checkpoint's interval (`None` before any checkpoint).
    journal: RwLock<Option<Arc<Journal>>>,
    /// An empty journal ready to become the next checkpoint's.
    spare: Mutex<Option<Journal>>,
    /// Records live at a retained checkpoint and since replaced, by the checkpoint's seq:
    /// kept from reuse until that checkpoint is dropped.
    held: Mutex<BTreeMap<u64, Vec<u64>>>,
}

impl TableCheckpoints {
    /// A new table's: journals from the current interval on.
    pub fn create(dir: &Path, interval: u64) -> Result<TableCheckpoints> {
        let journal = if interval > 0 { Some(Arc::new(Journal::create(dir, interval)?)) } else { None };
        Ok(Self::new(dir, journal, BTreeMap::new()))
    }

    /// An opened table's (after any rollback): left-over journals removed, the current
    /// one opened, held records listed, and its keys marked in `index` so they are not
    /// journaled again this interval.
    pub fn open(dir: &Path, ckpt: CheckpointState, index: &Index) -> Result<TableCheckpoints> {
        // Journals of dropped checkpoints, or of one whose creation was cut short, are left-overs.
        for seq in journal::list(dir) {
            if seq < ckpt.oldest || seq > ckpt.latest {
                let _ = std::fs::remove_file(journal::path_of(dir, seq));
            }
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".ebj.tmp") || name == "undo.spare.ebj" {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let held = held_records(dir, ckpt)?;
        let journal = match ckpt.latest {
            0 => None,
            seq if journal::path_of(dir, seq).exists() => Some(Arc::new(Journal::open(dir, seq)?)),
            seq => Some(Arc::new(Journal::create(dir, seq)?)),
        };
        let c = Self::new(dir, None, BTreeMap::new());
        // Keys changed since the checkpoint (and since the last rollback to it) are marked
        // journaled; entries a rollback undid name keys back at their checkpoint record,
        // whose next change is journaled again.
        if let Some(j) = journal.as_ref() {
            let tag = c.tag(j.seq());
            for e in ckpt.live_entries(j) {
                if let Some(f) = index.find(e.key, index.hash(e.key)) {
                    if f.ptr != e.old {
                        index.mark_journaled(f.bucket, f.slot, tag);
                    }
                }
            }
        }
        let mut held = held;
        // A key journaled again after a rollback names the same record twice.
        for v in held.values_mut() {
            v.sort_unstable();
            v.dedup();
        }
        *c.journal.write() = journal;
        *c.held.lock() = held;
        Ok(c)
    }

    fn new(dir: &Path, journal: Option<Arc<Journal>>, held: BTreeMap<u64, Vec<u64>>) -> TableCheckpoints {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        TableCheckpoints {
            dir: dir.to_owned(),
            mark_nonce: crate::hash::splitmix64(
                now ^ (std::process::id() as u64) << 32 ^ MARK_NONCE.fetch_add(1, Ordering::Relaxed),
            ),
            journal: RwLock::new(journal),
            spare: Mutex::new(None),
            held: Mutex::new(held),
        }
    }

    /// The mark tag of interval `seq` in this open of the table.
    #[inline]
    fn tag(&self, seq: u64) -> u64 {
        crate::hash::splitmix64(self.mark_nonce ^ seq)
    }

    /// Under the key's stripe lock, before its index slot changes (with the store's gate
    /// held): journals the key's current record if this is its first change since the
    /// latest checkpoint, and returns that record, which the caller must hold (not
    /// retire) since the checkpoint still needs it.
    pub fn journal_first_change(
        &self,
        interval: u64,
        jw: &mut Option<journal::Writer>,
        index: &Index,
        key: u64,
        h: u64,
    ) -> Result<Option<u64>> {
        if interval == 0 {
            return Ok(None);
        }
        // A key present in the index is journaled once per interval: a mark in its bucket
        // (a line the lookup just read) says so. An absent key is always journaled (as
        // absent); it can only enter a slot that way, so a marked slot's key was journaled.
        // Duplicate entries (a key deleted and created again) are harmless: every reader
        // of a journal takes a key's first entry.
        let found = index.find(key, h);
        let tag = self.tag(interval);
        if let Some(f) = found {
            if index.journaled(f.bucket, f.slot, tag) {
                return Ok(None);
            }
        }
        if jw.as_ref().is_none_or(|j| j.seq() != interval) {
            match self.journal.read().as_ref() {
                Some(j) if j.seq() == interval => *jw = Some(journal::Writer::new(Arc::clone(j))),
                _ => return Err(Error::corrupt(format!("no undo journal for checkpoint {interval}"))),
            }
        }
        jw.as_mut().expect("set above").append(key, found.map_or(0, |f| f.ptr))?;
        if let Some(f) = found {
            index.mark_journaled(f.bucket, f.slot, tag);
        }
        Ok(found.map(|f| f.ptr))
    }

    /// Ends a rollback on first touch whose every entry the index has applied.
    pub fn finish_rollback(&self, p: PendingRollback) -> Result<()> {
        let j = self.journal.read();
        finish_lazy_rollback(&self.dir, j.as_deref(), p)
    }

    /// Keeps replaced records that checkpoint `interval` still needs.
    pub fn hold(&self, interval: u64, records: Vec<u64>) {
        if !records.is_empty() {
            self.held.lock().entry(interval).or_default().extend(records);
        }
    }

    /// Starts the interval of checkpoint `seq` (the gate is held exclusively): a new,
    /// empty undo journal — the spare prepared after the last checkpoint, renamed — and
    /// returns the one it replaces.
    ///
    /// The spare's lock is held until it is renamed: the housekeeping job, which may run
    /// meanwhile, renames a dropped journal onto the spare's name only while it finds no
    /// spare, and must not do so between the take and the rename (it would replace the
    /// file being adopted, and the adopted journal would write to an unlinked file).
    pub fn start_interval(&self, seq: u64) -> Result<Option<Arc<Journal>>> {
        let mut spare = self.spare.lock();
        let j = match spare.take() {
            Some(sp) => sp.adopt(&self.dir, seq)?,
            None => Journal::create(&self.dir, seq)?,
        };
        drop(spare);
        Ok(self.journal.write().replace(Arc::new(j)))
    }

    /// After a checkpoint, off the caller's thread: while the table is open, prepares the
    /// next spare journal — the journal of a dropped checkpoint, recycled, or a new one —
    /// and deletes the other dropped journals.
    pub fn housekeep(&self, dropped: &[u64], open: bool, table: &str) {
        let mut spare = self.spare.lock();
        for &seq in dropped {
            if spare.is_none() && open {
                if let Some(j) = Journal::recycle(&self.dir, seq) {
                    *spare = Some(j);
                    continue;
                }
            }
            let _ = std::fs::remove_file(journal::path_of(&self.dir, seq));
        }
        if spare.is_none() && open {
            match Journal::create_spare(&self.dir) {
                Ok(j) => *spare = Some(j),
                Err(e) => tracing::warn!(table, error = %e, "cannot prepare a spare undo journal"),
            }
        }
    }

    /// Checkpoint `seq` is no longer retained: the records held for it, to be freed.
    pub fn drop_interval(&self, seq: u64) -> Vec<u64> {
        self.held.lock().remove(&seq).unwrap_or_default()
    }

    /// Records held for retained checkpoints.
    pub fn held_count(&self) -> u64 {
        self.held.lock().values().map(|v| v.len() as u64).sum()
    }

    pub fn flush(&self) -> Result<()> {
        match self.journal.read().as_ref() {
            Some(j) => j.flush(),
            None => Ok(()),
        }
    }

    /// The first undo entry of each key in the journals of checkpoints `seq` and later:
    /// each key's record at checkpoint `seq` (0: absent), for keys changed since.
    /// `open` keeps the journals mapped between calls: only journals of checkpoints taken
    /// since the last call are opened; the entries of every one are read again (the
    /// current one grows).
    pub fn changed_since(&self, seq: u64, open: &mut BTreeMap<u64, Journal>, first: &mut HashMap<u64, u64>) {
        for j in journal::list(&self.dir).into_iter().filter(|&s| s >= seq) {
            if let std::collections::btree_map::Entry::Vacant(v) = open.entry(j) {
                // A journal deleted meanwhile belongs to a dropped checkpoint: the caller checks.
                if let Ok(journal) = Journal::open(&self.dir, j) {
                    v.insert(journal);
                }
            }
        }
        for journal in open.values() {
            for e in journal.entries() {
                first.entry(e.key).or_insert(e.old);
            }
        }
    }
}

impl TableCheckpoints {
    /// Every key changed between checkpoints `from` and `to` (`from < to`): the keys of the
    /// journals of the intervals `from..to`, sorted. A superset where a rollback undid
    /// changes (harmless: their rows are sent as they are at `to`).
    pub fn keys_changed_between(&self, from: u64, to: u64) -> Result<Vec<u64>> {
        let mut keys = Vec::new();
        for seq in journal::list(&self.dir).into_iter().filter(|&s| s >= from && s < to) {
            keys.extend(Journal::open(&self.dir, seq)?.entries().iter().map(|e| e.key));
        }
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }
}

/// Applies the undo journals of checkpoints `to` and later, newest first and each in
/// reverse (so every key's earliest entry wins): the index then maps every key to its
/// record at checkpoint `to`. Journal `to` is emptied (new changes start from there), the
/// later ones deleted. Each journal is deleted only once applied, so a crash in between
/// applies it again (applying is idempotent).
pub(crate) fn rollback(dir: &Path, index: &Index, to: u64) -> Result<()> {
    let seqs: Vec<u64> = journal::list(dir).into_iter().filter(|&s| s >= to).collect();
    for &seq in seqs.iter().rev() {
        let j = Journal::open(dir, seq)?;
        let entries = j.entries();
        for e in entries.iter().rev() {
            let h = index.hash(e.key);
            if e.old == 0 {
                index.remove(e.key, h);
            } else if index.replace(e.key, h, e.old).is_none() && !index.insert_new(e.key, h, e.old)? {
                return Err(Error::new(
                    ErrorKind::Recover,
                    format!("no index slot to return key {} to checkpoint {to}", e.key),
                ));
            }
        }
        tracing::info!(seq, entries = entries.len(), to, "undo journal applied");
        // The journal of `to` stays: it still says what every key it names held at
        // checkpoint `to` (applying it again after another crash is harmless), so the
        // index need not reach the disk before the table serves. Journals of later
        // checkpoints go, once the index no longer needs them.
        if seq != to {
            index.flush()?;
            j.remove();
        } else {
            j.mark_rolled_back();
        }
    }
    Ok(())
}

/// Journals of more entries are rolled back before the table serves: a rollback on
/// first touch keeps its entries in DRAM (24 bytes each).
const LAZY_ROLLBACK_ENTRIES_MAX: u64 = 16 << 20;
/// The most of the index's slots a rollback on first touch may fill (see
/// `begin_lazy_rollback`): the load at which a table grows its index.
const LAZY_ROLLBACK_LOAD_MAX: f64 = 0.9;

/// Starts a rollback to checkpoint `to` on first touch (`index/undo.rs`): the journal is
/// read, and each key is returned to its record at the checkpoint before anyone reads or
/// writes it. Only when the journal of `to` is the only one to apply (a crash: no later
/// checkpoint exists) and small enough; `None` otherwise (the caller rolls back now).
/// Nothing on disk changes until [`finish_lazy_rollback`] (a crash meanwhile rolls back
/// again from the same journal: applying it is idempotent, and entries appended since
/// name the same checkpoint records).
pub(crate) fn begin_lazy_rollback(dir: &Path, index: &mut Index, to: u64) -> Result<Option<PendingRollback>> {
    if journal::list(dir).into_iter().filter(|&s| s >= to).ne([to]) {
        return Ok(None);
    }
    let j = Journal::open(dir, to)?;
    let upto = j.appended();
    if upto.saturating_sub(j.rolled_back()) > LAZY_ROLLBACK_ENTRIES_MAX {
        return Ok(None);
    }
    let entries = j.entries_since_rollback();
    // Undos run by bucket, not newest first: a key may come back before another leaves
    // the slot it needs. Only with room for every key the journal may bring back (at
    // the load at which the index grows) is that never short of a slot.
    let returns = entries.iter().filter(|e| e.old != 0).count() as u64;
    if (index.len() + returns) as f64 > LAZY_ROLLBACK_LOAD_MAX * index.slot_count() as f64 {
        return Ok(None);
    }
    let keys = index.begin_lazy_undo(to, entries.iter().map(|e| (e.key, e.old)));
    tracing::info!(seq = to, entries = entries.len(), keys, "undo journal applied on first touch");
    Ok(Some(PendingRollback { seq: to, upto }))
}

/// Ends a rollback on first touch once the index has applied every entry: the journal
/// says its entries before `upto` are undone (those after are the new interval's).
fn finish_lazy_rollback(dir: &Path, current: Option<&Journal>, p: PendingRollback) -> Result<()> {
    match current {
        Some(j) if j.seq() == p.seq => j.mark_rolled_back_to(p.upto),
        _ => Journal::open(dir, p.seq)?.mark_rolled_back_to(p.upto),
    }
    Ok(())
}

/// Records kept for the retained checkpoints: those the journals name.
pub(crate) fn held_records(dir: &Path, ckpt: CheckpointState) -> Result<BTreeMap<u64, Vec<u64>>> {
    let mut held = BTreeMap::new();
    for seq in journal::list(dir) {
        if seq < ckpt.oldest || seq > ckpt.latest {
            continue;
        }
        // Entries a rollback undid name records that are live again: not held.
        let v: Vec<u64> =
            ckpt.live_entries(&Journal::open(dir, seq)?).iter().filter(|e| e.old != 0).map(|e| e.old).collect();
        if !v.is_empty() {
            held.insert(seq, v);
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(batch_id: u64, meta: Vec<u8>) -> CheckpointInfo {
        CheckpointInfo { batch_id, seq: batch_id, unix_seconds: batch_id as f64, meta, steps: BTreeMap::new() }
    }

    fn batches(dir: &Path) -> Vec<u64> {
        CheckpointFile::load(dir).unwrap().checkpoints.iter().map(|c| c.batch_id).collect()
    }

    #[test]
    fn metadata_blobs_roundtrip_through_the_slots_and_old_files_read() {
        let dir = tempfile::tempdir().unwrap();
        // A store of before the slots: its one JSON file is read...
        std::fs::write(
            dir.path().join(CHECKPOINTS_FILE),
            r#"{"next_seq":2,"checkpoints":[{"batch_id":5,"seq":1,"unix_seconds":1.0}]}"#,
        )
        .unwrap();
        let mut f = CheckpointFile::load(dir.path()).unwrap();
        assert!(f.checkpoints[0].meta.is_empty(), "written before checkpoints had metadata");
        // ... and replaced by the slots at the first save.
        f.checkpoints.push(CheckpointInfo {
            batch_id: 6,
            seq: 2,
            unix_seconds: 2.5,
            meta: vec![0, 0xff, 7],
            steps: BTreeMap::from([(3, 41)]),
        });
        f.next_seq = 3;
        f.save(dir.path()).unwrap();
        assert!(!dir.path().join(CHECKPOINTS_FILE).exists());
        let text = std::fs::read_to_string(dir.path().join(SLOT_FILES[1])).unwrap();
        assert!(text.starts_with("embank-checkpoints 2 1 "), "{text}");
        assert!(text.contains("\"meta\":\"00ff07\""), "{text}");
        let back = CheckpointFile::load(dir.path()).unwrap();
        assert_eq!(back.checkpoints, f.checkpoints);
        assert_eq!(back.seq_of(6).unwrap(), 2);
        assert_eq!(back.seq_of(9).unwrap_err().kind(), ErrorKind::NotFound);
        // A blob with a non-ASCII character is refused, not a panic (a fuzz finding).
        let other = tempfile::tempdir().unwrap();
        std::fs::write(
            other.path().join(CHECKPOINTS_FILE),
            "{\"next_seq\":2,\"checkpoints\":[{\"batch_id\":5,\"seq\":1,\"unix_seconds\":1.0,\"meta\":\"6\u{1fc}f\"}]}",
        )
        .unwrap();
        assert!(CheckpointFile::load(other.path()).is_err());
    }

    #[test]
    fn saves_alternate_slots_and_a_save_cut_short_reads_as_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut f = CheckpointFile::load(d).unwrap();
        // The first save cut short (a header and part of the list): no checkpoint yet.
        f.checkpoints.push(info(1, vec![]));
        f.save(d).unwrap();
        let first = std::fs::read(d.join(SLOT_FILES[1])).unwrap();
        std::fs::write(d.join(SLOT_FILES[1]), &first[..first.len() - 3]).unwrap();
        assert!(batches(d).is_empty());
        std::fs::write(d.join(SLOT_FILES[1]), &first).unwrap();
        let mut f = CheckpointFile::load(d).unwrap();
        // A long list (a metadata blob), then a short one over the other slot, then a
        // third save over the first slot, which keeps the long list's tail after its own.
        f.checkpoints.push(info(2, vec![9; 3000]));
        f.save(d).unwrap();
        assert_eq!(batches(d), vec![1, 2]);
        f.checkpoints.remove(1);
        f.checkpoints.push(info(3, vec![]));
        f.save(d).unwrap();
        f.checkpoints.push(info(4, vec![]));
        f.save(d).unwrap();
        assert_eq!(batches(d), vec![1, 3, 4]);
        // The last save cut short: the list of the save before it.
        let slot = d.join(SLOT_FILES[0]);
        let whole = std::fs::read(&slot).unwrap();
        let mut torn = whole.clone();
        // The list's own last bytes (the file goes on with the long list's tail).
        let nl = whole.iter().position(|&b| b == b'\n').unwrap();
        let len: usize = std::str::from_utf8(&whole[..nl]).unwrap().split(' ').nth(3).unwrap().parse().unwrap();
        assert!(whole.len() > nl + 1 + len, "the stale tail is there");
        // One digit: still a valid list, so only the checksum tells.
        let at = whole[..nl + 1 + len].windows(12).rposition(|w| w == b"\"batch_id\":4").unwrap();
        torn[at + 11] = b'5';
        std::fs::write(&slot, &torn).unwrap();
        assert_eq!(batches(d), vec![1, 3]);
        // Both slots damaged is no cut-short save: refused, naming both.
        let other = d.join(SLOT_FILES[1]);
        std::fs::write(&other, b"embank-checkpoints 2 9 5 00000000\nxxxxx").unwrap();
        let e = CheckpointFile::load(d).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Recover);
        assert!(e.to_string().contains("CHECKPOINTS.0") && e.to_string().contains("CHECKPOINTS.1"), "{e}");
        std::fs::write(&slot, &whole).unwrap();
        assert_eq!(batches(d), vec![1, 3, 4]);
    }
}
