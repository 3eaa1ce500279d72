//! What a replica serves: its last committed checkpoint, whole, while the next one is
//! applied.
//!
//! The applier writes a checkpoint's rows and deletes into the live tables as they
//! arrive. Before it changes a key for the first time in that checkpoint it keeps the
//! key's row as served (or its absence) in the *overlay*; a read through the view answers
//! the keys the overlay holds with their kept rows and looks only the others up in the
//! live table, holding the overlay's read lock throughout (so none of those can be
//! kept and changed meanwhile). At the commit marker the replica takes its checkpoint and empties the
//! overlay: every table switches to the new checkpoint at once. A read that overlaps that
//! switch (the view's generation moved while it ran) is done again, so an answer is the
//! old checkpoint or the new one, never a mix.
//!
//! The overlay costs a row (`dim` × 4 bytes, plus ~48 bytes of map entry) per key the
//! checkpoint in progress changes, and one lookup per applied batch. Past
//! `staged_bytes_max` it is given up for the rest of that checkpoint: reads then see the
//! live tables (a mix, as before the view) until the commit, and the status counts it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use embank_core::hash::IdMap;
use embank_core::{Error, ErrorKind, Result, Store, Table};

use super::replica::ReplicaMeta;
use parking_lot::RwLock;

/// Bound of the rows a view keeps for one checkpoint in progress, by default.
pub const STAGED_BYTES_MAX_DEFAULT: u64 = 256 << 20;

/// One table's kept rows: key → what a lookup answered for it at the served checkpoint
/// (the row, the missing-row default when absent, and whether it was found).
/// Hashed with the store's id hasher: a read probes it once per key while a checkpoint
/// is applied (SipHash made that probe cost as much as the lookup itself).
type Kept = IdMap<KeptRow>;

/// A kept row and whether the key was found.
type KeptRow = (Box<[f32]>, bool);

/// A replica's served view (see the module docs). Shared by the applier and the server.
pub struct ServedView {
    /// Even while no commit is switching; odd during a switch.
    generation: AtomicU64,
    /// By table name.
    overlay: RwLock<HashMap<String, Kept>>,
    bytes: AtomicU64,
    bytes_max: u64,
    /// Set when this checkpoint's overlay passed its bound (reads see the live tables).
    given_up: AtomicBool,
    /// Checkpoints whose overlay passed its bound.
    pub given_up_total: AtomicU64,
    /// The publisher's batch id of the served checkpoint; [`NONE`] before the first.
    served: AtomicU64,
    /// Set while a new replica copies a sibling's checkpoint: it takes no reads yet.
    bootstrapping: AtomicBool,
    /// Reads through the view so far: the applier paces itself while it moves.
    reads: AtomicU64,
}

/// [`ServedView::served`] before the first checkpoint.
const NONE: u64 = u64::MAX;

impl ServedView {
    pub fn new(bytes_max: u64) -> ServedView {
        ServedView {
            generation: AtomicU64::new(0),
            overlay: RwLock::new(HashMap::new()),
            bytes: AtomicU64::new(0),
            bytes_max,
            given_up: AtomicBool::new(false),
            given_up_total: AtomicU64::new(0),
            served: AtomicU64::new(NONE),
            bootstrapping: AtomicBool::new(false),
            reads: AtomicU64::new(0),
        }
    }

    /// Reads through the view so far (the applier yields to them, see
    /// `ReplicaOptions::ingest_share`).
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Whether the replica is still copying a sibling's checkpoint (reads are refused
    /// with `Unavailable`, so clients read its siblings).
    pub fn is_bootstrapping(&self) -> bool {
        self.bootstrapping.load(Ordering::Acquire)
    }

    pub(crate) fn set_bootstrapping(&self, on: bool) {
        self.bootstrapping.store(on, Ordering::Release);
    }

    /// The publisher's batch id of the checkpoint reads see, None before the first.
    pub fn served(&self) -> Option<u64> {
        Some(self.served.load(Ordering::Acquire)).filter(|&b| b != NONE)
    }

    /// Sets the served checkpoint without a switch (a replica starting at its last).
    pub fn set_served(&self, batch_id: u64) {
        self.served.store(batch_id, Ordering::Release);
    }

    /// Looks `keys` of `table` up as the served checkpoint has them (a [`Table::lookup`]
    /// otherwise): never a mix of two checkpoints.
    pub fn lookup(&self, table: &Table, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.lookup_served(table, None, keys, out, found).map(|_| ())
    }

    /// [`lookup`](Self::lookup) if the served checkpoint is the publisher's `batch_id`
    /// throughout the read (true), else nothing read (false): an exact read of the newest
    /// checkpoint, at the cost of a plain one.
    pub fn lookup_exact(
        &self,
        table: &Table,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<bool> {
        self.lookup_served(table, Some(batch_id), keys, out, found)
    }

    fn lookup_served(
        &self,
        table: &Table,
        want: Option<u64>,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<bool> {
        let d = table.dim();
        self.reads.fetch_add(1, Ordering::Relaxed);
        loop {
            let before = self.generation.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::thread::yield_now();
                continue;
            }
            if want.is_some_and(|b| self.served.load(Ordering::Acquire) != b || self.given_up.load(Ordering::Acquire)) {
                return Ok(false);
            }
            {
                // Kept keys are answered from the overlay and only the others are looked
                // up: a key the checkpoint in progress rewrote is not read twice (its new
                // record, then its kept row). The overlay's read lock is held through the
                // table's lookup: the applier keeps a key (under the write lock) before it
                // changes it, so a key not kept when the lock was taken is not changed
                // until the lookup is done.
                let overlay = self.overlay.read();
                match overlay.get(table.name()).filter(|k| !k.is_empty()) {
                    None => table.lookup(keys, out, found)?,
                    Some(kept) => {
                        let mut rest = Vec::new();
                        for (i, k) in keys.iter().enumerate() {
                            match kept.get(k) {
                                Some((row, was_found)) => {
                                    out[i * d..(i + 1) * d].copy_from_slice(row);
                                    found[i] = *was_found;
                                }
                                None => rest.push(i),
                            }
                        }
                        if rest.len() == keys.len() {
                            table.lookup(keys, out, found)?;
                        } else if !rest.is_empty() {
                            let rest_keys: Vec<u64> = rest.iter().map(|&i| keys[i]).collect();
                            let mut rows = vec![0f32; rest.len() * d];
                            let mut rest_found = vec![false; rest.len()];
                            table.lookup(&rest_keys, &mut rows, &mut rest_found)?;
                            for (j, &i) in rest.iter().enumerate() {
                                out[i * d..(i + 1) * d].copy_from_slice(&rows[j * d..(j + 1) * d]);
                                found[i] = rest_found[j];
                            }
                        }
                    }
                }
            }
            if self.generation.load(Ordering::Acquire) == before {
                return Ok(true);
            }
        }
    }

    /// Called by the applier before it writes or deletes `keys` of `table`: keeps the
    /// served row of each key not kept yet in this checkpoint.
    pub fn keep(&self, table: &Table, keys: &[u64]) -> Result<()> {
        if self.given_up.load(Ordering::Relaxed) {
            return Ok(());
        }
        let fresh: Vec<u64> = {
            let overlay = self.overlay.read();
            let kept = overlay.get(table.name());
            let mut fresh: Vec<u64> =
                keys.iter().copied().filter(|k| kept.is_none_or(|m| !m.contains_key(k))).collect();
            fresh.sort_unstable();
            fresh.dedup();
            fresh
        };
        if fresh.is_empty() {
            return Ok(());
        }
        let d = table.dim();
        let mut rows = vec![0f32; fresh.len() * d];
        let mut found = vec![false; fresh.len()];
        table.lookup(&fresh, &mut rows, &mut found)?;
        let added = fresh.len() as u64 * (d as u64 * 4 + 48);
        if self.bytes.fetch_add(added, Ordering::Relaxed) + added > self.bytes_max {
            tracing::warn!(
                table = table.name(),
                bytes_max = self.bytes_max,
                "the checkpoint in progress changes more rows than the served view keeps: reads see it \
                 partly applied until its commit"
            );
            self.given_up.store(true, Ordering::Relaxed);
            self.given_up_total.fetch_add(1, Ordering::Relaxed);
            self.overlay.write().clear();
            return Ok(());
        }
        // The kept rows are allocated before the write lock is taken: readers wait only
        // for the map's inserts.
        let entries: Vec<(u64, KeptRow)> =
            fresh.iter().enumerate().map(|(i, &k)| (k, (rows[i * d..(i + 1) * d].into(), found[i]))).collect();
        let mut overlay = self.overlay.write();
        let kept = overlay.entry(table.name().to_owned()).or_default();
        kept.reserve(entries.len());
        for (k, entry) in entries {
            kept.entry(k).or_insert(entry);
        }
        drop(overlay);
        Ok(())
    }

    /// Called by the applier once the replica's checkpoint of a commit is taken (the
    /// publisher's `batch_id`): reads switch to it, every table at once.
    pub fn commit(&self, batch_id: u64) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.served.store(batch_id, Ordering::Release);
        let kept = std::mem::take(&mut *self.overlay.write());
        self.bytes.store(0, Ordering::Relaxed);
        self.given_up.store(false, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::AcqRel);
        drop(kept); // freed after the switch: readers wait only for the swap
    }

    /// Looks `keys` of `table` up exactly as they were at the publisher's checkpoint
    /// `batch_id`, if this replica still holds it: the served one through the view (the
    /// cost of a plain read), an older one through the store's retained checkpoint taken
    /// at its commit (a pass over the keys changed since, per call: see
    /// [`Store::lookup_checkpoint`]). Fails with `Unavailable`, naming what is readable,
    /// for a checkpoint not held (dropped by `keep_checkpoints`, or not applied yet).
    pub fn lookup_at(
        &self,
        store: &Store,
        table: &Table,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        if self.lookup_exact(table, batch_id, keys, out, found)? {
            return Ok(());
        }
        let own = store
            .checkpoints()?
            .into_iter()
            .rev()
            .find(|c| ReplicaMeta::parse(&c.meta).is_some_and(|m| m.batch_id == batch_id));
        let dropped = |e: Error| match e.kind() {
            ErrorKind::NotFound => not_held(store, batch_id),
            _ => e,
        };
        match own {
            Some(c) => store.lookup_checkpoint(table.name(), c.batch_id, keys, out, found).map_err(dropped),
            None => Err(not_held(store, batch_id)),
        }
    }

    /// Bytes the overlay holds now.
    pub fn staged_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// The replica store's own checkpoint (its batch id) taken at the commit of the
/// publisher's checkpoint `batch_id`, with its metadata; `not_held` when it is not retained.
pub(crate) fn own_checkpoint(store: &Store, batch_id: u64) -> Result<(u64, ReplicaMeta)> {
    store
        .checkpoints()?
        .into_iter()
        .rev()
        .find_map(|c| ReplicaMeta::parse(&c.meta).filter(|m| m.batch_id == batch_id).map(|m| (c.batch_id, m)))
        .ok_or_else(|| not_held(store, batch_id))
}

/// The publisher's checkpoints a replica's store can be read at exactly (oldest first):
/// those of its retained checkpoints (`keep_checkpoints` of them).
pub fn readable(store: &Store) -> Vec<u64> {
    let mut v: Vec<u64> = store
        .checkpoints()
        .map(|list| list.iter().filter_map(|c| ReplicaMeta::parse(&c.meta)).map(|m| m.batch_id).collect())
        .unwrap_or_default();
    v.sort_unstable();
    v
}

pub(crate) fn not_held(store: &Store, batch_id: u64) -> Error {
    let held = readable(store);
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "checkpoint {batch_id} is not readable on this replica: it holds {} (store_options.keep_checkpoints \
             bounds how many)",
            if held.is_empty() {
                "none yet".to_string()
            } else {
                held.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
            }
        ),
    )
}
