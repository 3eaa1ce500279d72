//! A replica's health as the client sees it: its recent latencies (which set its
//! requests' deadlines and its group's hedging delay), its counters, and the prober that
//! readmits an ejected replica.
//!
//! A replica that misses a deadline or fails a request is **ejected**: reads go to its
//! siblings (it is tried last, only when none answers). The prober, a thread per client
//! with replica groups, asks every ejected replica which checkpoint it serves every
//! `probe_every` (a fresh connection, the hello and `SERVED`, each within the probe's
//! deadline) and readmits it when it answers in time and serves a checkpoint at least as
//! new as its group's. It also asks the admitted read-only replicas once a second: one
//! that does not answer in time is ejected, and so is one still below the checkpoint its
//! group served a round before (a replica cut off from its update stream). Reads with
//! `min_checkpoint` that find a replica's last-heard checkpoint too old while a sibling's
//! is new enough read the sibling and ask the prober to refresh the others (at most every
//! 20 ms), so no read waits on a replica's `SERVED`. Between rounds the thread holds the
//! client only weakly: a dropped client ends it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::background::Background;
use super::pool::Shard;
use super::transport::{Transport, Wire};
use super::Client;

/// Latency samples kept per replica and per group.
const SAMPLES: usize = 256;
/// Samples before the percentiles are used (until then the floors and defaults hold).
pub(super) const SAMPLES_MIN: u32 = 16;
/// The percentiles are recomputed after this many new samples.
const RECOMPUTE_EVERY: u32 = 16;

/// Recent request latencies (microseconds): a ring of the last [`SAMPLES`], with the
/// 95th and 99th percentiles recomputed every [`RECOMPUTE_EVERY`] samples.
pub(super) struct Latencies {
    ring: Vec<u32>,
    next: usize,
    count: u32,
    fresh: u32,
    p95: u32,
    p99: u32,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies { ring: Vec::with_capacity(SAMPLES), next: 0, count: 0, fresh: 0, p95: 0, p99: 0 }
    }
}

impl Latencies {
    pub(super) fn record(&mut self, took: Duration) {
        let us = took.as_micros().min(u32::MAX as u128) as u32;
        if self.ring.len() < SAMPLES {
            self.ring.push(us);
        } else {
            self.ring[self.next] = us;
        }
        self.next = (self.next + 1) % SAMPLES;
        self.count = self.count.saturating_add(1);
        self.fresh += 1;
        if self.fresh >= RECOMPUTE_EVERY || self.count == SAMPLES_MIN {
            self.fresh = 0;
            let mut sorted = self.ring.clone();
            sorted.sort_unstable();
            let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
            self.p95 = at(0.95);
            self.p99 = at(0.99);
        }
    }

    /// The 95th percentile, once [`SAMPLES_MIN`] samples were taken.
    pub(super) fn p95(&self) -> Option<Duration> {
        (self.count >= SAMPLES_MIN).then(|| Duration::from_micros(self.p95.into()))
    }

    /// The 99th percentile, once [`SAMPLES_MIN`] samples were taken.
    pub(super) fn p99(&self) -> Option<Duration> {
        (self.count >= SAMPLES_MIN).then(|| Duration::from_micros(self.p99.into()))
    }
}

/// A replica's counters (`Client::replica_counts`).
#[derive(Default)]
pub(super) struct Counters {
    /// Requests it answered (reads and writes).
    pub(super) answered: AtomicU64,
    /// Copies of slow requests sent to it (hedges).
    pub(super) hedges_sent: AtomicU64,
    /// Hedges it answered first.
    pub(super) hedges_won: AtomicU64,
    /// Requests it did not answer within their deadline.
    pub(super) deadlines_missed: AtomicU64,
    /// Times it was taken out of the rotation.
    pub(super) ejections: AtomicU64,
    /// Times the prober put it back.
    pub(super) readmissions: AtomicU64,
}

impl Counters {
    pub(super) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A replica's place in the rotation.
#[derive(Default)]
pub(super) struct Rotation {
    /// Out of the rotation (reads try it last) until the prober readmits it.
    pub(super) ejected: AtomicBool,
    /// Why, for the logs and `replica_counts`.
    pub(super) why: Mutex<String>,
}

/// How often the admitted read-only replicas are asked what they serve.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Signals to the prober's thread: probe the ejected replicas now (one was just ejected).
const HINT: u32 = 1;
/// Signals to the prober's thread: ask the replicas in rotation what they serve (see
/// [`Client::refresh_served`]).
const REFRESH: u32 = 2;

/// The prober's thread: started once for a client with a group of two or more replicas.
pub(super) struct Prober {
    thread: Background,
}

impl Prober {
    pub(super) fn start(client: &Client) -> Prober {
        let every = client.inner.opts.probe_every;
        let thread = Background::spawn(
            "embank-probe",
            client,
            "cannot start the replica prober: ejected replicas come back only when every other fails",
            move |sleeper| {
                let mut rounds = ProbeRounds::new(Instant::now());
                let mut refreshed = Instant::now();
                loop {
                    let Some(raised) = sleeper.sleep_until(Instant::now() + every) else { return };
                    let refresh = raised & REFRESH != 0;
                    if refresh {
                        // At most one refresh round per REFRESH_GAP_MIN.
                        let since = refreshed.elapsed();
                        if since < REFRESH_GAP_MIN {
                            std::thread::sleep(REFRESH_GAP_MIN - since);
                        }
                        refreshed = Instant::now();
                    }
                    let Some(client) = sleeper.client() else { return };
                    rounds.run(&client, &Wire::default(), refresh);
                }
            },
        );
        Prober { thread }
    }

    /// Probes at once (a replica was just ejected).
    pub(super) fn hint(&self) {
        self.thread.raise(HINT);
    }

    /// Asks the replicas in rotation what they serve, soon.
    fn refresh(&self) {
        self.thread.raise(REFRESH);
    }

    pub(super) fn stop(&self) {
        self.thread.stop();
    }
}

/// What the prober keeps from round to round.
pub(super) struct ProbeRounds {
    /// The group's newest served checkpoint at the last check, per shard index.
    newest_before: Vec<Option<u64>>,
    /// When the admitted read-only replicas were last asked.
    checked: Instant,
}

impl ProbeRounds {
    pub(super) fn new(now: Instant) -> ProbeRounds {
        ProbeRounds { newest_before: Vec::new(), checked: now }
    }

    /// One round over every group of the client's map (see [`Client::probe_group`]): a
    /// check of the admitted replicas when [`CHECK_EVERY`] has passed since the last.
    pub(super) fn run<T: Transport>(&mut self, client: &Client, t: &T, refresh: bool) {
        let check = t.now().saturating_duration_since(self.checked) >= CHECK_EVERY;
        if check {
            self.checked = t.now();
        }
        let topo = client.topology();
        self.newest_before.resize(topo.shards.len(), None);
        for shard in topo.shards.iter().filter(|s| s.replicas.len() > 1) {
            let newest = client.probe_group(t, shard, check, refresh, self.newest_before[shard.index]);
            if check {
                self.newest_before[shard.index] = newest;
            }
        }
    }
}

impl Client {
    /// Reads with `min_checkpoint` found replicas whose served checkpoint, as last
    /// heard, is older than asked: the prober asks them again in the background.
    pub(super) fn refresh_served(&self) {
        if let Some(p) = self.inner.prober.lock().as_ref() {
            p.refresh();
        }
    }

    /// One prober round over a group: probes its ejected replicas (readmitting those
    /// that answer in time and are current) and, with `check` or `refresh`, asks its
    /// admitted replicas what they serve (ejecting one that does not answer in time and,
    /// with `check`, a read-only one still below `newest_before`, the group's newest a
    /// check before). Returns the newest checkpoint an admitted read-only replica serves.
    pub(super) fn probe_group<T: Transport>(
        &self,
        t: &T,
        shard: &Shard,
        check: bool,
        refresh: bool,
        newest_before: Option<u64>,
    ) -> Option<u64> {
        let budget = (self.inner.opts.deadline_min * 5).max(PROBE_BUDGET_MIN).min(self.inner.opts.timeout);
        let n = shard.replicas.len();
        if check || refresh {
            for r in 0..n {
                let ep = &shard.replicas[r];
                if ep.rotation.ejected.load(Ordering::Relaxed)
                    || (check && !refresh && !ep.read_only.load(Ordering::Relaxed))
                {
                    continue;
                }
                match self.served_within(t, shard, r, budget) {
                    Ok(Some(b))
                        if check
                            && ep.read_only.load(Ordering::Relaxed)
                            && newest_before.is_some_and(|want| b < want) =>
                    {
                        self.eject(
                            t,
                            shard,
                            r,
                            &format!("serves checkpoint {b}, behind its group's {}", newest_before.unwrap()),
                        );
                    }
                    Ok(_) => {}
                    Err(e) => self.eject(t, shard, r, &format!("did not answer the prober: {e}")),
                }
            }
        }
        let newest = (0..n)
            .filter(|&r| {
                let ep = &shard.replicas[r];
                !ep.rotation.ejected.load(Ordering::Relaxed) && ep.read_only.load(Ordering::Relaxed)
            })
            .filter_map(|r| *shard.replicas[r].served.lock())
            .max();
        for r in 0..n {
            let ep = &shard.replicas[r];
            if !ep.rotation.ejected.load(Ordering::Relaxed) {
                continue;
            }
            let probe = t.open(self, shard, r, budget).and_then(|conn| {
                t.keep(shard, r, conn);
                self.served_within(t, shard, r, budget)
            });
            match probe {
                Ok(served) => {
                    let current = !ep.read_only.load(Ordering::Relaxed)
                        || newest.is_none()
                        || served.is_some_and(|b| Some(b) >= newest);
                    if current {
                        ep.rotation.ejected.store(false, Ordering::Relaxed);
                        ep.rotation.why.lock().clear();
                        Counters::bump(&ep.counters.readmissions);
                        tracing::info!(replica = %shard.replica_name(r), "replica readmitted: it answers in time and is current");
                    } else {
                        tracing::debug!(replica = %shard.replica_name(r), ?served, ?newest, "ejected replica answers but is behind its group");
                    }
                }
                Err(e) => {
                    t.clear_pool(shard, r);
                    tracing::debug!(replica = %shard.replica_name(r), error = %e, "ejected replica still does not answer");
                }
            }
        }
        newest
    }

    /// Takes replica `r` out of the rotation (and drops its connections): reads go to its
    /// siblings until the prober readmits it.
    pub(super) fn eject<T: Transport>(&self, t: &T, shard: &Shard, r: usize, why: &str) {
        let ep = &shard.replicas[r];
        t.clear_pool(shard, r);
        ep.tables.lock().clear();
        t.draining(shard, r).clear();
        if !ep.rotation.ejected.swap(true, Ordering::Relaxed) {
            Counters::bump(&ep.counters.ejections);
            *ep.rotation.why.lock() = why.to_string();
            if shard.replicas.len() > 1 {
                tracing::warn!(replica = %shard.replica_name(r), why, "replica ejected: reads go to its siblings until it answers again");
            }
        }
        if let Some(p) = self.inner.prober.lock().as_ref() {
            p.hint();
        }
        // A replica that fails may have been retired: look for a new shard map.
        self.hint_map();
    }

    /// Starts the prober if some group has two replicas or more (once).
    pub(super) fn ensure_prober(&self) {
        if self.topology().shards.iter().all(|s| s.replicas.len() < 2) {
            return;
        }
        let mut p = self.inner.prober.lock();
        if p.is_none() {
            *p = Some(Prober::start(self));
        }
    }
}

/// The shortest deadline of a probe (connecting, the hello, `SERVED`): 5x `deadline_min`,
/// at least this.
const PROBE_BUDGET_MIN: Duration = Duration::from_millis(500);
/// Refresh rounds (reads asking for fresher served checkpoints) are at least this apart.
const REFRESH_GAP_MIN: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_after_enough_samples_and_follow_the_recent_ones() {
        let mut l = Latencies::default();
        for _ in 0..SAMPLES_MIN - 1 {
            l.record(Duration::from_micros(100));
        }
        assert_eq!(l.p95(), None);
        l.record(Duration::from_micros(100));
        assert_eq!(l.p95(), Some(Duration::from_micros(100)));
        // 5 % slow: p99 is slow, p95 not yet; then all slow.
        for i in 0..SAMPLES as u64 {
            l.record(Duration::from_micros(if i % 20 == 0 { 10_000 } else { 100 }));
        }
        assert_eq!(l.p99(), Some(Duration::from_micros(10_000)));
        assert_eq!(l.p95(), Some(Duration::from_micros(100)));
        for _ in 0..SAMPLES {
            l.record(Duration::from_millis(3));
        }
        assert_eq!(l.p95(), Some(Duration::from_millis(3)));
    }
}
