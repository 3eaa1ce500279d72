//! Bounded staleness: per-key holds of training workers (BSP, SSP, ASP).
//!
//! A worker's pull of a key takes a *hold* on it (pulled, gradient not yet pushed);
//! its `push_grad` of that key gives one back. With a staleness bound `k`, a pull of a
//! key that already has `k + 1` holds waits until one is given back — so no pull
//! returns a row more than `k` updates behind the updates already owed to it. `k = 0`
//! is BSP (per key strictly pull, push, pull, push), no bound is ASP (nothing waits,
//! nothing is tracked).
//!
//! A worker that dies would hold its keys forever: holds end with `release(worker)`,
//! or when the worker has not been heard from for its lease. Keys of one call are
//! taken in sorted order, so two workers pulling overlapping batches cannot deadlock
//! each other; a worker that pulls a key again before pushing it waits on itself (as
//! BSP demands) until the wait times out with an error naming the key.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};

const SHARDS: usize = 64;

#[derive(Default)]
struct Shard {
    /// Outstanding holds per key (absent = 0).
    holds: Mutex<HashMap<u64, u32>>,
    changed: Condvar,
}

struct Worker {
    last_seen: Instant,
    /// Holds of this worker per key.
    keys: HashMap<u64, u32>,
}

/// The holds of one table.
pub struct Holds {
    bound: u32,
    lease: Duration,
    shards: Box<[Shard]>,
    workers: Mutex<HashMap<u64, Worker>>,
}

#[inline]
fn shard_of(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
}

impl Holds {
    /// Holds for a bound of `bound` updates; a worker silent for `lease` loses its holds.
    pub fn new(bound: u32, lease: Duration) -> Holds {
        Holds {
            bound,
            lease,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            workers: Mutex::new(HashMap::new()),
        }
    }

    pub fn bound(&self) -> u32 {
        self.bound
    }

    /// How long a hold lasts without its push.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Takes one hold of each distinct key for `worker`, waiting (at most `timeout` in
    /// all) while a key has more than `bound` holds. On a timeout the holds this call
    /// took are given back and the error names the key.
    pub fn acquire(&self, worker: u64, keys: &[u64], timeout: Duration, table: &str) -> Result<()> {
        let mut uniq: Vec<u64> = keys.to_vec();
        uniq.sort_unstable();
        uniq.dedup();
        let deadline = Instant::now() + timeout;
        self.touch(worker);
        for (done, &key) in uniq.iter().enumerate() {
            let shard = &self.shards[shard_of(key)];
            let mut holds = shard.holds.lock();
            loop {
                let n = holds.get(&key).copied().unwrap_or(0);
                if n <= self.bound {
                    *holds.entry(key).or_insert(0) += 1;
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    drop(holds);
                    self.give_back(worker, &uniq[..done]);
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "table {table:?}: pull of key {key} waited {:.1} s: {n} pulls of it await their push_grad \
                             (staleness bound {}); a worker that stopped without release() holds it until its lease \
                             of {:.0} s ends",
                            timeout.as_secs_f64(),
                            self.bound,
                            self.lease.as_secs_f64()
                        ),
                    ));
                }
                // Wake at least every 100 ms to end the leases of silent workers.
                let wait = (deadline - now).min(Duration::from_millis(100));
                if shard.changed.wait_for(&mut holds, wait).timed_out() {
                    drop(holds);
                    self.touch(worker); // waiting is not silence
                    self.expire();
                    holds = shard.holds.lock();
                }
            }
            drop(holds);
            *self.workers.lock().entry(worker).or_insert_with(Self::fresh).keys.entry(key).or_insert(0) += 1;
        }
        Ok(())
    }

    fn fresh() -> Worker {
        Worker { last_seen: Instant::now(), keys: HashMap::new() }
    }

    fn touch(&self, worker: u64) {
        self.workers.lock().entry(worker).or_insert_with(Self::fresh).last_seen = Instant::now();
    }

    /// Gives back one hold of each distinct key that `worker` holds (after its push_grad).
    pub fn give_back(&self, worker: u64, keys: &[u64]) {
        let mut freed = Vec::with_capacity(keys.len());
        {
            let mut workers = self.workers.lock();
            let Some(w) = workers.get_mut(&worker) else { return };
            w.last_seen = Instant::now();
            for &key in keys {
                if let Some(n) = w.keys.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        w.keys.remove(&key);
                    }
                    freed.push(key);
                }
            }
        }
        self.free(&freed);
    }

    fn free(&self, keys: &[u64]) {
        for &key in keys {
            let shard = &self.shards[shard_of(key)];
            let mut holds = shard.holds.lock();
            if let Some(n) = holds.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    holds.remove(&key);
                }
            }
            drop(holds);
            shard.changed.notify_all();
        }
    }

    /// Gives back every hold of `worker`; returns how many.
    pub fn release(&self, worker: u64) -> u64 {
        let Some(w) = self.workers.lock().remove(&worker) else { return 0 };
        let mut keys = Vec::new();
        for (k, n) in w.keys {
            keys.extend(std::iter::repeat_n(k, n as usize));
        }
        self.free(&keys);
        keys.len() as u64
    }

    /// Ends the holds of workers silent for longer than the lease.
    pub fn expire(&self) -> u64 {
        let expired: Vec<u64> = {
            let workers = self.workers.lock();
            workers.iter().filter(|(_, w)| w.last_seen.elapsed() > self.lease).map(|(&id, _)| id).collect()
        };
        let mut n = 0;
        for id in expired {
            tracing::warn!(worker = id, "staleness lease expired; releasing the worker's holds");
            n += self.release(id);
        }
        n
    }

    /// Holds outstanding now (all keys) and workers holding any.
    pub fn outstanding(&self) -> (u64, u64) {
        let workers = self.workers.lock();
        let holds = workers.values().map(|w| w.keys.values().map(|&n| n as u64).sum::<u64>()).sum();
        (holds, workers.values().filter(|w| !w.keys.is_empty()).count() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bsp_blocks_a_second_pull_until_the_push() {
        let h = Arc::new(Holds::new(0, Duration::from_secs(60)));
        h.acquire(1, &[5, 6], Duration::from_secs(1), "t").unwrap();
        let e = h.acquire(2, &[6], Duration::from_millis(50), "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.to_string().contains("key 6"), "{e}");
        let h2 = Arc::clone(&h);
        let waiter = std::thread::spawn(move || h2.acquire(2, &[6, 7], Duration::from_secs(5), "t"));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished());
        h.give_back(1, &[5, 6]);
        waiter.join().unwrap().unwrap();
        assert_eq!(h.outstanding(), (2, 1));
    }

    #[test]
    fn ssp_allows_bound_plus_one_and_release_frees() {
        let h = Holds::new(2, Duration::from_secs(60));
        for w in 0..3 {
            h.acquire(w, &[9], Duration::from_millis(10), "t").unwrap();
        }
        assert!(h.acquire(3, &[9], Duration::from_millis(10), "t").is_err());
        // The timed-out call gave back what it took: key 1 came before 9 in sorted order.
        assert!(h.acquire(4, &[1, 9], Duration::from_millis(10), "t").is_err());
        assert_eq!(h.outstanding(), (3, 3));
        assert_eq!(h.release(0), 1);
        h.acquire(3, &[9], Duration::from_millis(10), "t").unwrap();
        // Giving back a key one does not hold changes nothing.
        h.give_back(7, &[9]);
        assert_eq!(h.outstanding().0, 3);
    }

    #[test]
    fn a_silent_worker_loses_its_holds_after_the_lease() {
        let h = Holds::new(0, Duration::from_millis(100));
        h.acquire(1, &[3], Duration::from_secs(1), "t").unwrap();
        let t0 = Instant::now();
        h.acquire(2, &[3], Duration::from_secs(5), "t").unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(100));
        assert_eq!(h.outstanding(), (1, 1));
    }
}
