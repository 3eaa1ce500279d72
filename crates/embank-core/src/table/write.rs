//! The write protocol: the one place where a key's index slot changes.
//!
//! Every writer — create (fast and tiered paths), push, write-through,
//! write-back, delete, eviction — hands its keys to a [`RecordWriter`], one key at a
//! time, under the store's checkpoint gate (taken by the caller, once per
//! batch). For each key, [`RecordWriter::publish`] runs the sequence:
//!
//! 1. take the key's stripe lock, then its lock in every tier (that order, always);
//! 2. let the writer veto under those locks (a write-back whose row was pushed
//!    again, a create whose row a tier already has);
//! 3. a create of a key that exists answers `Present`; a new key when the index
//!    is at its load limit answers `NoRoom` (the caller grows the index and
//!    retries from that key: [`Table::with_room`]);
//! 4. journal the key's record at the latest checkpoint if this is its first
//!    change since (`checkpoint.rs`);
//! 5. swap the slot (insert, replace or remove);
//! 6. let the writer update the tiers under the same locks;
//!
//! and [`RecordWriter::finish`] settles the batch: replaced records a retained
//! checkpoint needs are held, the others retired to the epoch collector, records
//! allocated but not published go back to the allocator. The keys published go
//! into the batch's [`Notice`], which tells them to the tier stack once, when the
//! batch's locks are released ([`TierStack::changed`]): the tiers, the pooled-bag
//! cache and the store's listeners hear of them. (A push that stays in a tier,
//! dirty, adds its keys to the same notice; a write-back changes nothing readers
//! see and has none.)
//!
//! Invariants asserted here (`strict_assert!`, on in tests and debug builds): a
//! record published on a mapped medium holds its key; the record the journal
//! step recorded is the one the swap replaced.

use std::cell::RefCell;

use crossbeam_epoch::Guard;

use super::{State, Table};
use crate::error::Result;
use crate::journal;
use crate::medium::Medium;
use crate::tier::{KeyLocks, TierStack};

/// What a writer asks of a key's slot.
#[derive(Clone, Copy, Debug)]
pub(super) enum Change {
    /// Point a key the index does not have at a new record (`Present` if it has it).
    Create(u64),
    /// Point the key at a new record, whether or not the index has it.
    Upsert(u64),
    /// Take the key out of the index.
    Remove,
}

/// What became of one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Published,
    /// A `Create` found the key in the index: its record.
    Present(u64),
    /// The index is at its load limit: grow it and retry from this key.
    NoRoom,
    /// The writer vetoed the change under the key's locks.
    Skipped,
    /// A `Remove` of a key the index does not have.
    Absent,
}

impl Table {
    /// Takes keys out of the index (and the tiers); returns how many were present.
    pub(super) fn remove(&self, keys: &[u64]) -> Result<u64> {
        let notice = Notice::new(self.tiers());
        let _gate = self.shared.runtime.gate.batch();
        let st = self.state()?;
        let mut p = RecordWriter::new(self, &st, Some(&notice));
        for &key in keys {
            p.publish(key, Change::Remove, |_| false, |_| {})?;
        }
        Ok(p.finish())
    }
}

/// The keys one batch changed, told to the tier stack ([`TierStack::changed`]) once,
/// when the notice is dropped: the writer makes it before it takes the batch's locks,
/// so it goes out after they are released, also when the batch failed part way (the
/// keys published before the failure changed).
pub(super) struct Notice<'a> {
    tiers: &'a TierStack,
    keys: RefCell<Vec<u64>>,
}

impl<'a> Notice<'a> {
    pub fn new(tiers: &'a TierStack) -> Notice<'a> {
        Notice { tiers, keys: RefCell::new(Vec::new()) }
    }

    /// Keys changed without a publish (a push that stays in a tier, dirty).
    pub fn add(&self, keys: &[u64]) {
        self.keys.borrow_mut().extend_from_slice(keys);
    }
}

impl Drop for Notice<'_> {
    fn drop(&mut self) {
        self.tiers.changed(self.keys.get_mut());
    }
}

/// Publishes the keys of one pass of one batch (see the module docs).
pub(super) struct RecordWriter<'a> {
    table: &'a Table,
    st: &'a State,
    tiers: &'a TierStack,
    /// The batch's notice, which hears of every key published (`None`: a pass that
    /// changes no row as readers see it, a write-back).
    notice: Option<&'a Notice<'a>>,
    interval: u64,
    jw: Option<journal::Writer>,
    guard: Guard,
    retired: Vec<u64>,
    held: Vec<u64>,
    unused: Vec<u64>,
}

impl<'a> RecordWriter<'a> {
    /// The caller holds the store's checkpoint gate (shared) for the whole batch.
    pub fn new(table: &'a Table, st: &'a State, notice: Option<&'a Notice<'a>>) -> RecordWriter<'a> {
        RecordWriter {
            table,
            st,
            tiers: table.tiers(),
            notice,
            interval: table.shared.runtime.gate.interval(),
            jw: None,
            guard: crossbeam_epoch::pin(),
            retired: Vec::new(),
            held: Vec::new(),
            unused: Vec::new(),
        }
    }

    /// Hints the CPU to load what publishing `key` will read: its home bucket, the
    /// checkpoint marks line included. Called a few keys ahead, so a batch's index misses
    /// overlap instead of stalling one after the other.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        let index = &self.st.index;
        index.prefetch(index.hash(key));
    }

    /// Records allocated for this pass that will not be published (returned in `finish`).
    pub fn unused(&mut self, ptrs: &[u64]) {
        self.unused.extend_from_slice(ptrs);
    }

    /// Runs the publish sequence for `key`. `veto` sees the tiers' state under the key's
    /// locks and may skip the change; `after` updates the tiers once the slot changed.
    /// A record of `change` that is not published (skipped, present, no room) is
    /// returned to the allocator by [`finish`](Self::finish).
    #[inline]
    pub fn publish(
        &mut self,
        key: u64,
        change: Change,
        mut veto: impl FnMut(&KeyLocks) -> bool,
        mut after: impl FnMut(&mut KeyLocks),
    ) -> Result<Outcome> {
        let h = self.st.index.hash(key);
        let _stripe = self.table.stripe(h).lock();
        let tiers = self.tiers;
        tiers.locked(key, |locks| self.publish_locked(key, h, change, locks, &mut veto, &mut after))
    }

    /// [`publish`](Self::publish) under the key's stripe lock and tier locks.
    #[inline(always)]
    fn publish_locked(
        &mut self,
        key: u64,
        h: u64,
        change: Change,
        locks: &mut KeyLocks,
        veto: &mut impl FnMut(&KeyLocks) -> bool,
        after: &mut impl FnMut(&mut KeyLocks),
    ) -> Result<Outcome> {
        let index = &self.st.index;
        let new = match change {
            Change::Create(p) | Change::Upsert(p) => Some(p),
            Change::Remove => None,
        };
        if veto(locks) {
            self.unused.extend(new);
            return Ok(Outcome::Skipped);
        }
        if let Change::Create(ptr) = change {
            if let Some(current) = index.get(key, h) {
                self.unused.push(ptr);
                return Ok(Outcome::Present(current));
            }
            if !self.table.has_room(index) {
                self.unused.push(ptr);
                return Ok(Outcome::NoRoom);
            }
        }
        if let (Some(ptr), Some(m)) = (new, self.st.medium.as_mapped()) {
            strict_assert_eq!(m.key_at(ptr), key, "a record is published under its own key");
        }
        let checkpoints = &self.table.shared.checkpoints;
        let keep = checkpoints
            .journal_first_change(self.interval, &mut self.jw, index, key, h)
            .map_err(|e| e.context(format!("table {:?}", self.table.shared.config.name)))?;
        let old = match change {
            Change::Create(ptr) => {
                if !index.insert_new(key, h, ptr)? {
                    self.unused.push(ptr);
                    return Ok(Outcome::NoRoom);
                }
                None
            }
            Change::Upsert(ptr) => match index.replace(key, h, ptr) {
                Some(old) => Some(old),
                None if self.table.has_room(index) && index.insert_new(key, h, ptr)? => None,
                None => {
                    self.unused.push(ptr);
                    return Ok(Outcome::NoRoom);
                }
            },
            Change::Remove => {
                locks.remove();
                match index.remove(key, h) {
                    Some(old) => Some(old),
                    None => return Ok(Outcome::Absent),
                }
            }
        };
        // Paired with the journal step: what it recorded is exactly what the swap replaced
        // (the stripe lock kept the slot still in between).
        strict_assert!(keep.is_none() || keep == old, "journaled record {keep:?} but replaced {old:?} of key {key}");
        if let Some(old) = old {
            self.st.medium.alloc().note_unlinked(old);
            if keep == Some(old) {
                self.held.push(old);
            } else {
                self.retired.push(old);
            }
        }
        after(locks);
        if let Some(notice) = self.notice {
            notice.keys.borrow_mut().push(key);
        }
        Ok(Outcome::Published)
    }

    /// Ends the pass: holds what the latest checkpoint needs, retires the other replaced
    /// records, returns unpublished ones to the allocator. Returns the records replaced
    /// or removed.
    pub fn finish(self) -> u64 {
        let alloc = self.st.medium.alloc();
        let replaced = (self.retired.len() + self.held.len()) as u64;
        alloc.release(self.unused);
        alloc.retire(&self.guard, self.retired);
        self.table.shared.checkpoints.hold(self.interval, self.held);
        replaced
    }
}
