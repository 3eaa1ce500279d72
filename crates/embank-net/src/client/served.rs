//! Which checkpoint replicas serve: asking one (`SERVED`, within a deadline), or several
//! at once until one serves the checkpoint a read asks for.

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};

use super::health::Counters;
use super::pool::{check_reply, Draining, Frame, Shard, DRAINING_MAX};
use super::route::retryable;
use super::transport::{Transport, Wire};
use super::Client;
use crate::proto::{Header, Op};

impl Client {
    /// Asks `replicas` at once which checkpoint they serve (each within a read's
    /// deadline; one that does not answer is ejected) until one serves `min` or later:
    /// those that do, and what the others said (for a message). The rest drain.
    pub(super) fn ask_served<T: Transport>(
        &self,
        t: &T,
        shard: &Shard,
        replicas: &[usize],
        min: u64,
    ) -> (Vec<usize>, Vec<String>) {
        let mut ok = Vec::new();
        let mut said = Vec::new();
        let mut waiting: Vec<(usize, T::Conn, Header, Frame, Instant, Instant)> = Vec::new();
        let name = |r: usize, b: Option<u64>| {
            format!("{}: {}", shard.replica_name(r), b.map_or("none".into(), |b| b.to_string()))
        };
        let failed = |r: usize, e: Error, said: &mut Vec<String>| {
            if retryable(&e) && shard.replicas.len() > 1 {
                self.eject(t, shard, r, &e.to_string());
            }
            said.push(format!("{}: {e}", shard.replica_name(r)));
        };
        for &r in replicas {
            let allowed = self.deadline(shard, r, Op::Served);
            let sent_at = t.now();
            let sent = self.take_conn(t, shard, r, allowed, false).and_then(|mut conn| {
                let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
                let h = Header::request(Op::Served, id, 0, 0, 0);
                t.write(&mut conn, &mut [IoSlice::new(&h.encode())])
                    .and_then(|()| t.set_nonblocking(&conn, true))
                    .map_err(|e| shard.unavailable(r, "refused served", &e))?;
                Ok((conn, h))
            });
            match sent {
                Ok((conn, h)) => waiting.push((r, conn, h, Frame::default(), sent_at, sent_at + allowed)),
                Err(e) => failed(r, e, &mut said),
            }
        }
        let mut ready: Vec<bool> = Vec::new();
        while !waiting.is_empty() && ok.is_empty() {
            let now = t.now();
            let wake = waiting.iter().map(|w| w.5).min().unwrap();
            t.wait(waiting.iter_mut().map(|w| &mut w.1), wake.saturating_duration_since(now), &mut ready);
            let now = t.now();
            let mut k = waiting.len();
            while k > 0 {
                k -= 1;
                let w = &mut waiting[k];
                let got = if ready[k] { t.read(&mut w.1, &mut w.3) } else { Ok(None) };
                match got {
                    Ok(None) if w.5 > now => continue,
                    Ok(None) => {
                        let (r, _, _, _, sent_at, deadline) = waiting.swap_remove(k);
                        Counters::bump(&shard.replicas[r].counters.deadlines_missed);
                        let e = Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "{} did not answer served within {} ms",
                                shard.replica_name(r),
                                (deadline - sent_at).as_millis()
                            ),
                        );
                        failed(r, e, &mut said);
                    }
                    Ok(Some((rh, body))) => {
                        let (r, conn, h, _, _, _) = waiting.swap_remove(k);
                        let served = check_reply(shard, r, &h, &rh, body).and_then(|body| {
                            serde_json::from_slice::<serde_json::Value>(&body)
                                .map_err(|e| Error::corrupt(format!("bad served reply: {e}")))
                        });
                        match served {
                            Ok(v) => {
                                if t.set_nonblocking(&conn, false).is_ok() {
                                    t.keep(shard, r, conn);
                                }
                                let b = v["batch_id"].as_u64();
                                *shard.replicas[r].served.lock() = b;
                                if b.is_some_and(|b| b >= min) {
                                    ok.push(r);
                                } else {
                                    said.push(name(r, b));
                                }
                            }
                            Err(e) => failed(r, e, &mut said),
                        }
                    }
                    Err(e) => {
                        let (r, ..) = waiting.swap_remove(k);
                        failed(r, shard.unavailable(r, "failed during served", &e), &mut said);
                    }
                }
            }
        }
        for (r, conn, _, frame, sent_at, deadline) in waiting {
            let mut d = t.draining(shard, r);
            if d.len() < DRAINING_MAX {
                d.push(Draining { conn, frame, deadline, allowed: deadline - sent_at });
            }
        }
        (ok, said)
    }

    /// The newest checkpoint (at least `min`) a replica of `shard` in rotation serves now,
    /// asked (all at once; the first to serve `min` or later answers).
    pub(super) fn serving_now(&self, shard: &Shard, min: u64) -> Result<u64> {
        let n = shard.replicas.len();
        let (mut in_rotation, ejected): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&r| !shard.replicas[r].rotation.ejected.load(Ordering::Relaxed));
        if in_rotation.is_empty() {
            in_rotation = ejected;
        }
        let (ok, said) = self.ask_served(&Wire::default(), shard, &in_rotation, min);
        let newest = ok.iter().filter_map(|&r| *shard.replicas[r].served.lock()).max();
        newest.ok_or_else(|| {
            Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no replica of shard {} serves checkpoint {min} or later yet ({})",
                    shard.index,
                    said.join(", ")
                ),
            )
        })
    }

    /// Asks replica `r` which checkpoint it serves, waiting at most `budget` (and caches
    /// the answer).
    pub(super) fn served_within<T: Transport>(
        &self,
        t: &T,
        shard: &Shard,
        r: usize,
        budget: Duration,
    ) -> Result<Option<u64>> {
        Ok(self.served_reply_within(t, shard, r, budget)?["batch_id"].as_u64())
    }

    /// Replica `r`'s whole answer to `Served` (its batch id cached).
    pub(super) fn served_reply(&self, shard: &Shard, r: usize) -> Result<serde_json::Value> {
        self.served_reply_within(&Wire::default(), shard, r, self.deadline(shard, r, Op::Served))
    }

    pub(super) fn served_reply_within<T: Transport>(
        &self,
        t: &T,
        shard: &Shard,
        r: usize,
        budget: Duration,
    ) -> Result<serde_json::Value> {
        let mut conn = self.take_conn(t, shard, r, budget, false)?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::Served, id, 0, 0, 0);
        t.write(&mut conn, &mut [IoSlice::new(&h.encode())]).map_err(|e| shard.unavailable(r, "refused served", &e))?;
        let (rh, body) = t.read_blocking(&mut conn).map_err(|e| shard.unavailable(r, "failed during served", &e))?;
        let body = check_reply(shard, r, &h, &rh, body)?;
        t.keep(shard, r, conn);
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad served reply: {e}")))?;
        *shard.replicas[r].served.lock() = v["batch_id"].as_u64();
        Ok(v)
    }
}
