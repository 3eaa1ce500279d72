//! What a replica serves: its last committed checkpoint, whole, while the next one is
//! applied.
//!
//! The applier writes a checkpoint's rows and deletes into the live tables as they
//! arrive. Before it changes a key for the first time in that checkpoint it keeps the
//! key's row as served (or its absence) in the *overlay*; a read through the view looks
//! its keys up in the live table, then replaces every key the overlay holds with its
//! kept row. At the commit marker the replica takes its checkpoint and empties the
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

use embank_core::{Result, Table};
use parking_lot::RwLock;

/// Bound of the rows a view keeps for one checkpoint in progress, by default.
pub const STAGED_BYTES_MAX_DEFAULT: u64 = 256 << 20;

/// One table's kept rows: key → what a lookup answered for it at the served checkpoint
/// (the row, the missing-row default when absent, and whether it was found).
type Kept = HashMap<u64, (Box<[f32]>, bool)>;

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
}

impl ServedView {
    pub fn new(bytes_max: u64) -> ServedView {
        ServedView {
            generation: AtomicU64::new(0),
            overlay: RwLock::new(HashMap::new()),
            bytes: AtomicU64::new(0),
            bytes_max,
            given_up: AtomicBool::new(false),
            given_up_total: AtomicU64::new(0),
        }
    }

    /// Looks `keys` of `table` up as the served checkpoint has them (a [`Table::lookup`]
    /// otherwise): never a mix of two checkpoints.
    pub fn lookup(&self, table: &Table, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let d = table.dim();
        loop {
            let before = self.generation.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::thread::yield_now();
                continue;
            }
            table.lookup(keys, out, found)?;
            {
                let overlay = self.overlay.read();
                if let Some(kept) = overlay.get(table.name()) {
                    for (i, k) in keys.iter().enumerate() {
                        if let Some((row, was_found)) = kept.get(k) {
                            out[i * d..(i + 1) * d].copy_from_slice(row);
                            found[i] = *was_found;
                        }
                    }
                }
            }
            if self.generation.load(Ordering::Acquire) == before {
                return Ok(());
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
        let mut overlay = self.overlay.write();
        let kept = overlay.entry(table.name().to_owned()).or_default();
        for (i, &k) in fresh.iter().enumerate() {
            kept.entry(k).or_insert_with(|| (rows[i * d..(i + 1) * d].into(), found[i]));
        }
        Ok(())
    }

    /// Called by the applier once the replica's checkpoint of a commit is taken: reads
    /// switch to it, every table at once.
    pub fn commit(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let kept = std::mem::take(&mut *self.overlay.write());
        self.bytes.store(0, Ordering::Relaxed);
        self.given_up.store(false, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::AcqRel);
        drop(kept); // freed after the switch: readers wait only for the swap
    }

    /// Bytes the overlay holds now.
    pub fn staged_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}
