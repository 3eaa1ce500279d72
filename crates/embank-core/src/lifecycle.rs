//! Row lifecycle of one table: admission by access count and eviction by TTL and
//! by capacity (LRU or LFU victims).
//!
//! Everything here lives in DRAM beside the table and is rebuilt at open:
//! - admission candidates: `key -> sightings` of keys not yet admitted. A pull
//!   counts one sighting per distinct key of the batch; the sighting that reaches
//!   `admit_after` creates the row. Bounded: a stripe over its share halves its
//!   counts and forgets the zeros (old, rare ids fade out).
//! - activity (only with an eviction policy): `key -> (tick, step, time, count)`
//!   of the last touch of every row. `tick` is a per-table clock advanced by every
//!   batch (recency for LRU, ties broken by key), `step` counts `push_grad` calls
//!   (TTL in steps), `time` is milliseconds since the table was opened (TTL in
//!   seconds), `count` the touches (LFU). About 48 bytes per row.
//!
//! A reopen (or a restore) seeds every row as touched once at step 0, time 0:
//! each row's TTL starts over from the reopen, and candidate counts start over.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const STRIPES: usize = 64;
/// Admission candidates kept per table at most (summed over stripes).
pub const CANDIDATES_MAX: usize = 1 << 24;

/// Which rows a full table evicts first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EvictPolicy {
    /// Least recently touched (by batch; ties: smaller key first).
    #[default]
    Lru,
    /// Fewest touches (ties: least recent, then smaller key).
    Lfu,
}

impl EvictPolicy {
    pub fn parse(s: &str) -> Result<EvictPolicy> {
        match s {
            "lru" => Ok(EvictPolicy::Lru),
            "lfu" => Ok(EvictPolicy::Lfu),
            other => Err(Error::config(format!("unknown eviction policy {other:?}: use lru or lfu"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EvictPolicy::Lru => "lru",
            EvictPolicy::Lfu => "lfu",
        }
    }
}

/// The lifecycle options of a table (part of its options and of the catalog).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct LifecycleOptions {
    /// A row is created at the pull that sees its key for the `admit_after`-th time
    /// (0 or 1: at once). Before, pulls return the initializer's row without storing
    /// it and gradients pushed for it are dropped.
    pub admit_after: u32,
    /// Evict rows not touched during this many `push_grad` calls of the table.
    pub ttl_steps: Option<u64>,
    /// Evict rows not touched for this many seconds.
    pub ttl_seconds: Option<f64>,
    /// Most rows the table keeps: creating more evicts victims first.
    #[serde(alias = "max_rows")]
    pub rows_max: Option<u64>,
    /// Victims of `rows_max`.
    pub evict: EvictPolicy,
}

impl LifecycleOptions {
    pub fn validate(&self) -> Result<()> {
        if self.admit_after > 1_000_000 {
            return Err(Error::config(format!("admit_after must be at most 1000000, got {}", self.admit_after)));
        }
        if self.ttl_steps == Some(0) {
            return Err(Error::config("ttl_steps must be at least 1"));
        }
        if let Some(s) = self.ttl_seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(Error::config(format!("ttl_seconds must be positive, got {s}")));
            }
        }
        if self.rows_max == Some(0) {
            return Err(Error::config("rows_max must be at least 1"));
        }
        Ok(())
    }

    /// Whether rows' touches must be tracked.
    pub fn evicts(&self) -> bool {
        self.ttl_steps.is_some() || self.ttl_seconds.is_some() || self.rows_max.is_some()
    }

    pub fn admits(&self) -> bool {
        self.admit_after > 1
    }

    pub fn any(&self) -> bool {
        self.evicts() || self.admits()
    }
}

#[derive(Clone, Copy, Debug)]
struct Touch {
    tick: u64,
    step: u64,
    millis: u64,
    count: u64,
}

/// Counters of a table's lifecycle (in its stats).
#[derive(Clone, Debug, Default, Serialize)]
pub struct LifecycleStats {
    pub admit_after: u32,
    /// Keys seen but not yet admitted.
    pub admission_pending: u64,
    /// Rows created by admission.
    pub admitted: u64,
    /// Pulled rows answered with the initializer's row, not stored (not yet admitted).
    pub not_admitted_pulls: u64,
    /// Gradients dropped because their key has no row (not admitted, or evicted).
    pub grads_dropped: u64,
    pub evicted_ttl: u64,
    pub evicted_capacity: u64,
    /// `push_grad` calls so far (the clock of `ttl_steps`).
    pub step: u64,
}

pub(crate) struct Lifecycle {
    pub opts: LifecycleOptions,
    candidates: Box<[Mutex<HashMap<u64, u32>>]>,
    activity: Box<[Mutex<HashMap<u64, Touch>>]>,
    tick: AtomicU64,
    step: AtomicU64,
    born: Instant,
    /// One eviction round at a time.
    pub evicting: Mutex<()>,
    admitted: AtomicU64,
    not_admitted: AtomicU64,
    grads_dropped: AtomicU64,
    evicted_ttl: AtomicU64,
    evicted_capacity: AtomicU64,
}

#[inline]
fn stripe_of(key: u64) -> usize {
    (crate::hash::key_hash(key, 0x6c69_6665) as usize) & (STRIPES - 1)
}

impl Lifecycle {
    /// `keys`: the rows the table holds now (seeded as touched once).
    pub fn new(opts: LifecycleOptions, keys: impl IntoIterator<Item = u64>) -> Lifecycle {
        let l = Lifecycle {
            opts,
            candidates: (0..STRIPES).map(|_| Mutex::new(HashMap::new())).collect(),
            activity: (0..STRIPES).map(|_| Mutex::new(HashMap::new())).collect(),
            tick: AtomicU64::new(1),
            step: AtomicU64::new(0),
            born: Instant::now(),
            evicting: Mutex::new(()),
            admitted: AtomicU64::new(0),
            not_admitted: AtomicU64::new(0),
            grads_dropped: AtomicU64::new(0),
            evicted_ttl: AtomicU64::new(0),
            evicted_capacity: AtomicU64::new(0),
        };
        if l.opts.evicts() {
            let t = Touch { tick: 0, step: 0, millis: 0, count: 1 };
            for k in keys {
                l.activity[stripe_of(k)].lock().insert(k, t);
            }
        }
        l
    }

    /// One sighting of each distinct key of `keys` (keys without a row); returns, per
    /// key, whether it is admitted now (its candidate count is then forgotten).
    pub fn admit(&self, keys: &[u64]) -> Vec<bool> {
        let n = self.opts.admit_after;
        let mut seen: HashMap<u64, bool> = HashMap::with_capacity(keys.len());
        let share = CANDIDATES_MAX / STRIPES;
        let mut out = Vec::with_capacity(keys.len());
        for &k in keys {
            let ok = *seen.entry(k).or_insert_with(|| {
                let mut m = self.candidates[stripe_of(k)].lock();
                let c = m.entry(k).or_insert(0);
                *c += 1;
                if *c >= n {
                    m.remove(&k);
                    return true;
                }
                if m.len() > share {
                    m.retain(|_, c| {
                        *c /= 2;
                        *c > 0
                    });
                }
                false
            });
            out.push(ok);
        }
        let admitted = seen.values().filter(|&&a| a).count() as u64;
        self.admitted.fetch_add(admitted, Ordering::Relaxed);
        self.not_admitted.fetch_add(out.iter().filter(|&&a| !a).count() as u64, Ordering::Relaxed);
        out
    }

    /// A push wrote these keys: they are rows now, not candidates.
    pub fn written(&self, keys: &[u64]) {
        if self.opts.admits() {
            for &k in keys {
                self.candidates[stripe_of(k)].lock().remove(&k);
            }
        }
    }

    pub fn dropped_grads(&self, n: u64) {
        self.grads_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// Records a touch of each key (one batch: one tick).
    pub fn touch(&self, keys: impl IntoIterator<Item = u64>) {
        if !self.opts.evicts() {
            return;
        }
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let step = self.step.load(Ordering::Relaxed);
        let millis = self.born.elapsed().as_millis() as u64;
        for k in keys {
            let mut m = self.activity[stripe_of(k)].lock();
            let t = m.entry(k).or_insert(Touch { tick, step, millis, count: 0 });
            t.tick = tick;
            t.step = step;
            t.millis = millis;
            t.count += 1;
        }
    }

    /// The keys are gone (deleted or evicted).
    pub fn forget(&self, keys: &[u64]) {
        if self.opts.evicts() {
            for &k in keys {
                self.activity[stripe_of(k)].lock().remove(&k);
            }
        }
    }

    /// Ends a `push_grad` call: the step clock advances.
    pub fn step(&self) {
        self.step.fetch_add(1, Ordering::Relaxed);
    }

    /// Rows untouched for `ttl_steps` steps or `ttl_seconds`, smallest key first.
    pub fn expired(&self) -> Vec<u64> {
        let step = self.step.load(Ordering::Relaxed);
        let millis = self.born.elapsed().as_millis() as u64;
        let ttl_ms = self.opts.ttl_seconds.map(|s| (s * 1000.0).ceil() as u64);
        let mut out = Vec::new();
        if self.opts.ttl_steps.is_none() && ttl_ms.is_none() {
            return out;
        }
        for s in self.activity.iter() {
            for (&k, t) in s.lock().iter() {
                let by_steps = self.opts.ttl_steps.is_some_and(|n| step.saturating_sub(t.step) >= n);
                let by_time = ttl_ms.is_some_and(|ms| millis.saturating_sub(t.millis) >= ms);
                if by_steps || by_time {
                    out.push(k);
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Up to `n` victims by the policy, none of `spare`.
    pub fn victims(&self, n: usize, spare: &HashSet<u64>) -> Vec<u64> {
        let mut all: Vec<(u64, u64, u64)> = Vec::new();
        for s in self.activity.iter() {
            for (&k, t) in s.lock().iter() {
                if !spare.contains(&k) {
                    let rank = match self.opts.evict {
                        EvictPolicy::Lru => (t.tick, 0, k),
                        EvictPolicy::Lfu => (t.count, t.tick, k),
                    };
                    all.push(rank);
                }
            }
        }
        if all.len() > n {
            all.select_nth_unstable(n);
            all.truncate(n);
        }
        all.sort_unstable();
        all.into_iter().map(|(_, _, k)| k).collect()
    }

    pub fn count_evicted(&self, ttl: bool, n: u64) {
        let c = if ttl { &self.evicted_ttl } else { &self.evicted_capacity };
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn stats(&self) -> LifecycleStats {
        LifecycleStats {
            admit_after: self.opts.admit_after,
            admission_pending: self.candidates.iter().map(|m| m.lock().len() as u64).sum(),
            admitted: self.admitted.load(Ordering::Relaxed),
            not_admitted_pulls: self.not_admitted.load(Ordering::Relaxed),
            grads_dropped: self.grads_dropped.load(Ordering::Relaxed),
            evicted_ttl: self.evicted_ttl.load(Ordering::Relaxed),
            evicted_capacity: self.evicted_capacity.load(Ordering::Relaxed),
            step: self.step.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_counts_distinct_keys_per_call() {
        let l = Lifecycle::new(LifecycleOptions { admit_after: 3, ..Default::default() }, []);
        assert_eq!(l.admit(&[1, 1, 2]), [false, false, false]);
        assert_eq!(l.admit(&[1]), [false]);
        assert_eq!(l.admit(&[1, 2, 1]), [true, false, true]);
        // Admitted keys start over if seen again (their row was evicted, say).
        assert_eq!(l.admit(&[1, 2]), [false, true]);
        assert_eq!(l.stats().admission_pending, 1);
    }

    #[test]
    fn victims_follow_the_policy() {
        let lru = Lifecycle::new(LifecycleOptions { rows_max: Some(10), ..Default::default() }, []);
        lru.touch([5, 6]);
        lru.touch([7]);
        lru.touch([5]);
        assert_eq!(lru.victims(2, &HashSet::new()), [6, 7]);
        assert_eq!(lru.victims(5, &HashSet::from([6])), [7, 5]);
        let lfu =
            Lifecycle::new(LifecycleOptions { rows_max: Some(10), evict: EvictPolicy::Lfu, ..Default::default() }, []);
        lfu.touch([5, 6, 7]);
        lfu.touch([5, 7]);
        lfu.touch([7]);
        assert_eq!(lfu.victims(2, &HashSet::new()), [6, 5]);
    }

    #[test]
    fn ttl_in_steps() {
        let l = Lifecycle::new(LifecycleOptions { ttl_steps: Some(2), ..Default::default() }, [9]);
        l.touch([1]);
        l.step();
        l.touch([2]);
        assert!(l.expired().is_empty());
        l.step();
        assert_eq!(l.expired(), [1, 9]);
        l.forget(&[1, 9]);
        l.step();
        assert_eq!(l.expired(), [2]);
    }

    #[test]
    fn bad_options_are_refused() {
        for o in [
            LifecycleOptions { ttl_steps: Some(0), ..Default::default() },
            LifecycleOptions { ttl_seconds: Some(-1.0), ..Default::default() },
            LifecycleOptions { ttl_seconds: Some(f64::NAN), ..Default::default() },
            LifecycleOptions { rows_max: Some(0), ..Default::default() },
            LifecycleOptions { admit_after: 2_000_000, ..Default::default() },
        ] {
            assert!(o.validate().is_err(), "{o:?}");
        }
    }
}
