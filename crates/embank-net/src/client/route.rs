//! Routing a call: which replica of a shard takes each request (writes the primary,
//! reads spread round-robin over the replicas in rotation serving the checkpoint asked
//! for), sending, and waiting for the replies of all of a call's requests at once, each
//! within its deadline: a read not answered within its group's hedging delay is sent to
//! a sibling as well (the first answer is taken), and one that fails or passes its
//! deadline ejects its replica and goes to another.
//!
//! Deadlines come from what the client observes: a keyed request may take
//! `DEADLINE_P99_FACTOR` times its replica's recent p99, at least `deadline_min` when a
//! sibling could take it over and `deadline_alone_min` when none could (a write, a
//! single replica), at most `timeout`; store-wide operations (checkpoint, flush, restore,
//! export pages, ...) get `timeout`, split over the replicas a read may try.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};

use super::health::Counters;
use super::pool::{check_reply, Draining, Frame, Shard, DRAINING_MAX};
use super::transport::{Transport, Wire};
use super::Client;
use crate::proto::{Header, Op};

/// A keyed request may take this many times its replica's recent p99.
pub(super) const DEADLINE_P99_FACTOR: u32 = 10;
/// The hedging delay is never shorter (a request answered in less is not worth a copy).
pub(super) const HEDGE_DELAY_MIN: Duration = Duration::from_millis(1);
/// The hedging delay of a group with too few latencies measured yet.
pub(super) const HEDGE_DELAY_UNKNOWN: Duration = Duration::from_millis(20);

/// A request sent and waiting for its reply.
pub(super) struct Sent<C> {
    pub(super) conn: C,
    /// Its index in the call's requests.
    pub(super) req: usize,
    pub(super) header: Header,
    /// The replica of its shard it went to.
    pub(super) replica: usize,
    pub(super) sent_at: Instant,
    pub(super) deadline: Instant,
    /// The reply as it arrives.
    pub(super) frame: Frame,
    /// A copy sent because the first was slow.
    pub(super) hedge: bool,
    /// Readable (or failed) at the last poll.
    pub(super) ready: bool,
    /// Its deadline was extended: no other replica was left to take it over.
    pub(super) extended: bool,
}

/// One request of a call.
pub(super) struct Req {
    /// Its shard, of the shard map the call took when it began (every request of a call
    /// goes by the same map).
    pub(super) shard: Arc<Shard>,
    pub(super) op: Op,
    /// The table's name (its id on each server is learnt on first use).
    pub(super) table: Option<Arc<str>>,
    pub(super) count: u32,
    pub(super) body: Vec<u8>,
    /// Reads only: replicas serving at least this checkpoint.
    pub(super) min_checkpoint: Option<u64>,
}

/// Whether `op` is a keyed request of a table (its latency is measured and sets the
/// deadlines), as opposed to a store-wide operation that may take long.
fn keyed(op: Op) -> bool {
    // A held pull waits for other workers by design: it keeps the timeout.
    (op.has_keys() && op != Op::PullHeld) || matches!(op, Op::Len | Op::Served | Op::SetLr)
}

/// What a call's requests are doing: the replies awaited, and each request's copies.
struct Call<'a, C> {
    reqs: &'a [Req],
    /// Replicas that failed each request (with why).
    tried: Vec<Vec<(usize, Error)>>,
    in_flight: Vec<Sent<C>>,
    /// Each request answered.
    done: Vec<bool>,
    /// A hedge was sent (or could not be) for each request.
    hedged: Vec<bool>,
}

impl<C> Call<'_, C> {
    fn copies(&self, i: usize) -> usize {
        self.in_flight.iter().filter(|s| s.req == i).count()
    }

    /// Whether request i could still go to a replica of its shard other than `r`: one in
    /// rotation that has not failed it and does not have a copy of it.
    fn others_left(&self, i: usize, r: usize) -> bool {
        let shard = &self.reqs[i].shard;
        let busy = self.busy(i);
        (0..shard.replicas.len()).any(|q| {
            q != r
                && !busy.contains(&q)
                && !shard.replicas[q].rotation.ejected.load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// Replicas request i may not go to now: those that failed it, those it waits on.
    fn busy(&self, i: usize) -> Vec<usize> {
        self.tried[i]
            .iter()
            .map(|(r, _)| *r)
            .chain(self.in_flight.iter().filter(|s| s.req == i).map(|s| s.replica))
            .collect()
    }
}

impl Client {
    /// Whether `op` may go to any replica of the shard (and fail over).
    pub(super) fn spreads(&self, shard: &Shard, op: Op) -> bool {
        match op {
            Op::Lookup
            | Op::LookupAt
            | Op::LookupStored
            | Op::ExportAt
            | Op::Len
            | Op::TableStats
            | Op::StoreStats
            | Op::ListTables
            | Op::OpenTable
            | Op::Served => true,
            Op::Pull => shard.replicas[0].read_only.load(Ordering::Relaxed),
            _ => false,
        }
    }

    /// How long replica `r` may take to answer an `op` request.
    pub(super) fn deadline(&self, shard: &Shard, r: usize, op: Op) -> Duration {
        self.deadline_for(shard, r, op, !self.spreads(shard, op) || shard.replicas.len() == 1)
    }

    /// [`deadline`](Self::deadline), `alone`: when no other replica could take the request.
    fn deadline_for(&self, shard: &Shard, r: usize, op: Op, alone: bool) -> Duration {
        let o = &self.inner.opts;
        if !keyed(op) {
            // A read may fail over past every replica within the timeout.
            return if alone { o.timeout } else { o.timeout / shard.replicas.len() as u32 };
        }
        let floor = if alone { o.deadline_alone_min } else { o.deadline_min };
        let observed = shard.replicas[r].latency.lock().p99().map_or(Duration::ZERO, |p| p * DEADLINE_P99_FACTOR);
        observed.max(floor).min(o.timeout)
    }

    /// How long a read of `shard` waits before a copy goes to a sibling; `None`: never.
    pub(super) fn hedge_delay(&self, shard: &Shard) -> Option<Duration> {
        if shard.replicas.len() < 2 {
            return None;
        }
        match self.inner.opts.hedge_delay {
            Some(d) if d.is_zero() => None,
            Some(d) => Some(d),
            None => Some(shard.latency.lock().p95().map_or(HEDGE_DELAY_UNKNOWN, |p| p.max(HEDGE_DELAY_MIN))),
        }
    }

    /// The replicas request `req` may try, in order: for a read, those in rotation serving
    /// `min_checkpoint`, round-robin, then the ejected ones; else the primary.
    /// Replicas in `skip` (those that failed the request, or have a copy of it) are left out.
    pub(super) fn candidates<T: Transport>(&self, t: &T, req: &Req, skip: &[usize]) -> Result<Vec<usize>> {
        let shard = &req.shard;
        let n = shard.replicas.len();
        // Writes, and reads of a single server with no checkpoint to check: no choice.
        if !self.spreads(shard, req.op) || (n == 1 && req.min_checkpoint.is_none()) {
            return Ok(vec![0]);
        }
        let start = shard.next.fetch_add(1, Ordering::Relaxed);
        let (mut up, mut down): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|i| (start + i) % n)
            .filter(|r| !skip.contains(r))
            .partition(|&r| !shard.replicas[r].rotation.ejected.load(Ordering::Relaxed));
        up.append(&mut down);
        let Some(min) = req.min_checkpoint else { return Ok(up) };
        // Replicas whose cached checkpoint is older than asked: while another is known to
        // serve it, the prober asks them in the background (the read does not wait);
        // else they are asked now, all at once, each within a read's deadline (one that
        // does not answer is ejected): those in rotation, then the ejected ones.
        let mut ok = Vec::new();
        let mut stale = Vec::new();
        for r in up {
            match *shard.replicas[r].served.lock() {
                Some(b) if b >= min => ok.push(r),
                _ => stale.push(r),
            }
        }
        if !ok.is_empty() {
            if !stale.is_empty() {
                self.refresh_served();
            }
            return Ok(ok);
        }
        let (in_rotation, ejected): (Vec<usize>, Vec<usize>) =
            stale.into_iter().partition(|&r| !shard.replicas[r].rotation.ejected.load(Ordering::Relaxed));
        let (mut ok, mut seen) = self.ask_served(t, shard, &in_rotation, min);
        if ok.is_empty() && !ejected.is_empty() {
            let (more, said) = self.ask_served(t, shard, &ejected, min);
            ok = more;
            seen.extend(said);
        }
        if ok.is_empty() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no replica of shard {} serves checkpoint {min} or later yet ({})",
                    shard.index,
                    seen.join(", ")
                ),
            ));
        }
        Ok(ok)
    }

    /// Sends request `i` to the first of its candidate replicas not in `busy` that takes
    /// it; a replica that cannot be reached is ejected and added to `tried`. `Ok(None)`: no
    /// candidate is left but others wait on copies of it (`tried` then stays as it is).
    fn dispatch<T: Transport>(
        &self,
        t: &T,
        call: &mut Call<T::Conn>,
        i: usize,
        hedge: bool,
    ) -> Result<Option<Sent<T::Conn>>> {
        let reqs = call.reqs;
        let shard = &reqs[i].shard;
        // Each round tries the candidates not tried yet; when they all fail to take it,
        // the next round's may be replicas passed over as behind, asked now.
        loop {
            let busy = call.busy(i);
            let candidates = match self.candidates(t, &reqs[i], &busy) {
                Ok(c) => c,
                // A hedge, or a copy still awaited: nothing more to send now.
                Err(_) if hedge || call.copies(i) > 0 => return Ok(None),
                // Say what the replicas tried already said too.
                Err(e) if !call.tried[i].is_empty() => {
                    let tried: Vec<Error> = call.tried[i].drain(..).map(|(_, e)| e).collect();
                    return Err(Error::new(e.kind(), format!("{e}; before: {}", join_errors(&tried))));
                }
                Err(e) => return Err(e),
            };
            let fresh: Vec<usize> = candidates.into_iter().filter(|r| !busy.contains(r)).collect();
            if fresh.is_empty() {
                break;
            }
            for r in fresh {
                let allowed = self.deadline(shard, r, reqs[i].op);
                let sent_at = t.now();
                let alone = !self.spreads(shard, reqs[i].op);
                let attempt =
                    self.take_conn(t, shard, r, allowed, alone).and_then(|conn| self.send(t, conn, &reqs[i], r));
                match attempt {
                    Ok((conn, header)) => {
                        if let Err(e) = t.set_nonblocking(&conn, true) {
                            call.tried[i].push((r, shard.unavailable(r, "socket setup failed", &e)));
                            continue;
                        }
                        if hedge {
                            Counters::bump(&shard.replicas[r].counters.hedges_sent);
                        }
                        let deadline = sent_at + allowed;
                        return Ok(Some(Sent {
                            conn,
                            req: i,
                            header,
                            replica: r,
                            sent_at,
                            deadline,
                            frame: Frame::default(),
                            hedge,
                            ready: false,
                            extended: false,
                        }));
                    }
                    Err(e) if retryable(&e) && self.spreads(shard, reqs[i].op) => {
                        self.eject(t, shard, r, &e.to_string());
                        call.tried[i].push((r, e));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if hedge || call.copies(i) > 0 {
            return Ok(None);
        }
        let errors: Vec<Error> = call.tried[i].drain(..).map(|(_, e)| e).collect();
        Err(match errors.len() {
            0 => Error::new(
                ErrorKind::Unavailable,
                format!("no replica of shard {} to send {} to", shard.index, reqs[i].op.name()),
            ),
            1 => errors.into_iter().next().unwrap(),
            _ => Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no replica of shard {} could serve {}: {}",
                    shard.index,
                    reqs[i].op.name(),
                    join_errors(&errors)
                ),
            ),
        })
    }

    /// Sends request i again after its copy on replica `r` failed with `e` (a read:
    /// ejecting `r` unless `keep`), unless another copy is still awaited; a write's
    /// failure is the call's.
    fn fail_over<T: Transport>(
        &self,
        t: &T,
        call: &mut Call<T::Conn>,
        i: usize,
        r: usize,
        e: Error,
        eject: bool,
    ) -> Result<()> {
        let shard = &call.reqs[i].shard;
        if !self.spreads(shard, call.reqs[i].op) {
            return Err(e);
        }
        if eject {
            self.eject(t, shard, r, &e.to_string());
        }
        call.tried[i].push((r, e));
        if call.copies(i) > 0 {
            return Ok(());
        }
        if let Some(s) = self.dispatch(t, call, i, false)? {
            call.in_flight.push(s);
        }
        Ok(())
    }

    /// Sends every request and calls `on_reply(i, replica, header, body)` for request i's
    /// reply (in no particular order across shards), once each. A read not answered
    /// within its group's hedging delay is sent to a sibling too (the first reply is
    /// taken; the other connection drains); one whose replica fails or passes its
    /// deadline goes to another replica of its shard.
    pub(super) fn run(
        &self,
        reqs: &[Req],
        on_reply: impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        self.run_over(&Wire::default(), reqs, on_reply)
    }

    /// [`run`](Self::run) over the transport `t`.
    pub(super) fn run_over<T: Transport>(
        &self,
        t: &T,
        reqs: &[Req],
        mut on_reply: impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let shards = reqs.iter().map(|r| r.shard.index + 1).max().unwrap_or(0);
        let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); shards];
        for (i, r) in reqs.iter().enumerate() {
            queues[r.shard.index].push_back(i);
        }
        let mut call = Call {
            reqs,
            tried: (0..reqs.len()).map(|_| Vec::new()).collect(),
            in_flight: Vec::new(),
            done: vec![false; reqs.len()],
            hedged: vec![false; reqs.len()],
        };
        let mut pooled: Vec<(&Shard, usize, T::Conn)> = Vec::new();
        let mut ready: Vec<bool> = Vec::new();
        let result = (|| {
            for q in queues.iter_mut() {
                for _ in 0..q.len().min(self.inner.opts.in_flight_per_shard) {
                    let i = q.pop_front().unwrap();
                    if let Some(s) = self.dispatch(t, &mut call, i, false)? {
                        call.in_flight.push(s);
                    }
                }
            }
            let hedge_delays: Vec<Option<Duration>> = {
                let mut d = vec![None; shards];
                for r in reqs {
                    d[r.shard.index] = self.hedge_delay(&r.shard);
                }
                d
            };
            while !call.in_flight.is_empty() {
                // Wait until a reply arrives, a deadline passes or a hedge is due.
                let now = t.now();
                let mut wake = call.in_flight.iter().map(|s| s.deadline).min().unwrap();
                for s in &call.in_flight {
                    if let Some(d) = hedge_delays[reqs[s.req].shard.index] {
                        if !call.hedged[s.req] && self.spreads(&reqs[s.req].shard, reqs[s.req].op) {
                            wake = wake.min(s.sent_at + d);
                        }
                    }
                }
                t.wait(call.in_flight.iter_mut().map(|s| &mut s.conn), wake.saturating_duration_since(now), &mut ready);
                for (s, &ready) in call.in_flight.iter_mut().zip(&ready) {
                    s.ready = ready;
                }
                // Replies (and failures) first, then deadlines, then hedges. Copies sent
                // meanwhile wait for the next poll.
                let mut k = 0;
                while k < call.in_flight.len() {
                    if !call.in_flight[k].ready {
                        k += 1;
                        continue;
                    }
                    call.in_flight[k].ready = false;
                    if !self.read_copy(t, &mut call, &mut queues, &mut pooled, k, &mut on_reply)? {
                        k += 1;
                    }
                }
                let now = t.now();
                let mut k = 0;
                while k < call.in_flight.len() {
                    if call.in_flight[k].deadline > now {
                        k += 1;
                        continue;
                    }
                    // A reply that came while the loop was busy (connecting for another
                    // request, handling a reply) came in time: read before it is late.
                    if self.read_copy(t, &mut call, &mut queues, &mut pooled, k, &mut on_reply)? {
                        continue;
                    }
                    // A read on the last replica it can go to: no sibling would answer
                    // sooner, so it gets the deadline of a request no other can take.
                    let (i, r) = (call.in_flight[k].req, call.in_flight[k].replica);
                    if !call.in_flight[k].extended
                        && self.spreads(&reqs[i].shard, reqs[i].op)
                        && !call.others_left(i, r)
                    {
                        let longer = self.deadline_for(&reqs[i].shard, r, reqs[i].op, true);
                        let s = &mut call.in_flight[k];
                        s.extended = true;
                        s.deadline = s.sent_at + longer;
                        if s.deadline > now {
                            k += 1;
                            continue;
                        }
                    }
                    let s = call.in_flight.swap_remove(k);
                    let (i, r) = (s.req, s.replica);
                    let shard = &*reqs[i].shard;
                    Counters::bump(&shard.replicas[r].counters.deadlines_missed);
                    let allowed = s.deadline - s.sent_at;
                    let e = Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "{} did not answer a {} request within {} ms ({}){}",
                            shard.replica_name(r),
                            reqs[i].op.name(),
                            allowed.as_millis(),
                            self.deadline_why(shard, r, reqs[i].op, s.extended),
                            if self.spreads(shard, reqs[i].op) {
                                ""
                            } else {
                                "; the request may or may not have been applied"
                            }
                        ),
                    );
                    // Its state is unknown: the connection is dropped.
                    drop(s);
                    if self.spreads(shard, reqs[i].op) {
                        self.fail_over(t, &mut call, i, r, e, true)?;
                    } else {
                        self.eject(t, shard, r, &e.to_string());
                        return Err(e);
                    }
                }
                let mut k = 0;
                while k < call.in_flight.len() {
                    let (i, sent_at) = (call.in_flight[k].req, call.in_flight[k].sent_at);
                    k += 1;
                    if call.hedged[i] || !self.spreads(&reqs[i].shard, reqs[i].op) {
                        continue;
                    }
                    let Some(d) = hedge_delays[reqs[i].shard.index] else { continue };
                    if now < sent_at + d {
                        continue;
                    }
                    call.hedged[i] = true;
                    match self.dispatch(t, &mut call, i, true) {
                        Ok(Some(s)) => call.in_flight.push(s),
                        Ok(None) => {}
                        Err(e) => tracing::debug!(error = %e, "no hedge sent"),
                    }
                }
            }
            Ok(())
        })();
        // What is still in flight (the call failed) drains.
        for s in call.in_flight.drain(..) {
            self.drain(t, &reqs[s.req].shard, s);
        }
        for (s, r, conn) in pooled {
            if t.set_nonblocking(&conn, false).is_ok() {
                t.keep(s, r, conn);
            }
        }
        result
    }

    /// Reads what copy `k` of `call.in_flight` has received: a whole reply is handled, a
    /// failure fails the request over. Whether the copy is done (out of `in_flight`).
    #[allow(clippy::too_many_arguments)]
    fn read_copy<'a, T: Transport>(
        &self,
        t: &T,
        call: &mut Call<'a, T::Conn>,
        queues: &mut [VecDeque<usize>],
        pooled: &mut Vec<(&'a Shard, usize, T::Conn)>,
        k: usize,
        on_reply: &mut impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>,
    ) -> Result<bool> {
        let reqs = call.reqs;
        let s = &mut call.in_flight[k];
        match t.read(&mut s.conn, &mut s.frame) {
            Ok(None) => Ok(false),
            Ok(Some((rh, body))) => {
                let s = call.in_flight.swap_remove(k);
                self.on_answer(t, call, queues, pooled, s, rh, body, on_reply)?;
                Ok(true)
            }
            Err(e) => {
                let s = call.in_flight.swap_remove(k);
                let (i, r) = (s.req, s.replica);
                let shard = &*reqs[i].shard;
                let e = shard.unavailable(r, &format!("failed during {}", reqs[i].op.name()), &e);
                self.fail_over(t, call, i, r, e, true)?;
                Ok(true)
            }
        }
    }

    /// Handles request i's reply from one of its copies.
    #[allow(clippy::too_many_arguments)]
    fn on_answer<'a, T: Transport>(
        &self,
        t: &T,
        call: &mut Call<'a, T::Conn>,
        queues: &mut [VecDeque<usize>],
        pooled: &mut Vec<(&'a Shard, usize, T::Conn)>,
        s: Sent<T::Conn>,
        rh: Header,
        body: Vec<u8>,
        on_reply: &mut impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let reqs = call.reqs;
        let Sent { conn, req: i, header: h, replica: r, sent_at, hedge, .. } = s;
        let shard: &'a Shard = &reqs[i].shard;
        let body = check_reply(shard, r, &h, &rh, body);
        // A replica that takes no reads yet (it is copying a sibling's checkpoint) or no
        // longer holds the checkpoint of an exact read: another of the group may answer
        // (the error names what each holds if none does).
        if self.spreads(shard, reqs[i].op) && shard.replicas.len() > 1 {
            if let Err(e) = &body {
                let exact = matches!(reqs[i].op, Op::LookupAt | Op::ExportAt);
                if e.kind() == ErrorKind::Unavailable || (exact && e.kind() == ErrorKind::NotFound) {
                    pooled.push((shard, r, conn));
                    return self.fail_over(t, call, i, r, body.unwrap_err(), !exact);
                }
            }
        }
        // An error reply leaves the connection in step: keep it.
        pooled.push((shard, r, conn));
        let ep = &shard.replicas[r];
        Counters::bump(&ep.counters.answered);
        if keyed(reqs[i].op) && body.is_ok() {
            let took = t.now().saturating_duration_since(sent_at);
            ep.latency.lock().record(took);
            shard.latency.lock().record(took);
        }
        if hedge {
            Counters::bump(&ep.counters.hedges_won);
        }
        call.done[i] = true;
        // The other copies lose: their connections drain.
        let mut k = 0;
        while k < call.in_flight.len() {
            if call.in_flight[k].req == i {
                let other = call.in_flight.swap_remove(k);
                self.drain(t, shard, other);
            } else {
                k += 1;
            }
        }
        if body.is_ok() {
            if let Some(next) = queues[shard.index].pop_front() {
                if let Some(s) = self.dispatch(t, call, next, false)? {
                    call.in_flight.push(s);
                }
            }
        }
        on_reply(i, r, &rh, body?)
    }

    /// Hands a copy no one waits for any more to its replica's draining connections.
    fn drain<T: Transport>(&self, t: &T, shard: &Shard, s: Sent<T::Conn>) {
        let mut d = t.draining(shard, s.replica);
        if d.len() < DRAINING_MAX {
            d.push(Draining { conn: s.conn, frame: s.frame, deadline: s.deadline, allowed: s.deadline - s.sent_at });
        }
    }

    /// How request deadlines of replica `r` are set, for a message.
    fn deadline_why(&self, shard: &Shard, r: usize, op: Op, extended: bool) -> String {
        let o = &self.inner.opts;
        if !keyed(op) {
            return "the timeout".to_string();
        }
        let alone = extended || !self.spreads(shard, op) || shard.replicas.len() == 1;
        let (floor, name) =
            if alone { (o.deadline_alone_min, "deadline_alone_min") } else { (o.deadline_min, "deadline_min") };
        match shard.replicas[r].latency.lock().p99() {
            Some(p) => format!(
                "{DEADLINE_P99_FACTOR}x its recent p99 of {:.1} ms, at least {name} {} ms, at most the timeout",
                p.as_secs_f64() * 1e3,
                floor.as_millis()
            ),
            None => format!("{name} {} ms: too few latencies measured yet", floor.as_millis()),
        }
    }

    pub(super) fn send<T: Transport>(
        &self,
        t: &T,
        mut conn: T::Conn,
        req: &Req,
        r: usize,
    ) -> Result<(T::Conn, Header)> {
        let shard = &req.shard;
        let table_id = match &req.table {
            None => 0,
            Some(name) => self.table_id(t, &mut conn, shard, r, name)?,
        };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(req.op, id, table_id, req.count, req.body.len() as u32);
        t.write(&mut conn, &mut [IoSlice::new(&h.encode()), IoSlice::new(&req.body)])
            .map_err(|e| shard.unavailable(r, &format!("refused a {} request", req.op.name()), &e))?;
        Ok((conn, h))
    }

    /// The table's id on replica `r`, opened there by name on `conn` the first time.
    pub(super) fn table_id<T: Transport>(
        &self,
        t: &T,
        conn: &mut T::Conn,
        shard: &Shard,
        r: usize,
        name: &str,
    ) -> Result<u32> {
        if let Some(&id) = shard.replicas[r].tables.lock().get(name) {
            return Ok(id);
        }
        let rid = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::OpenTable, rid, 0, 0, name.len() as u32);
        t.write(conn, &mut [IoSlice::new(&h.encode()), IoSlice::new(name.as_bytes())])
            .map_err(|e| shard.unavailable(r, "refused open_table", &e))?;
        let (rh, body) = t.read_blocking(conn).map_err(|e| shard.unavailable(r, "failed during open_table", &e))?;
        check_reply(shard, r, &h, &rh, body)?;
        shard.replicas[r].tables.lock().insert(name.to_string(), rh.table_id);
        Ok(rh.table_id)
    }

    /// One request to every shard (store-level operations).
    pub(super) fn broadcast(&self, op: Op, body: &[u8], table: Option<&Arc<str>>) -> Result<Vec<(Header, Vec<u8>)>> {
        Ok(self.broadcast_from(op, body, table)?.into_iter().map(|(_, _, h, b)| (h, b)).collect())
    }

    /// [`broadcast`](Self::broadcast) with the shard and the replica that answered, in shard order.
    pub(super) fn broadcast_from(&self, op: Op, body: &[u8], table: Option<&Arc<str>>) -> Result<Vec<Answer>> {
        let topo = self.topology();
        let reqs: Vec<Req> = topo
            .shards
            .iter()
            .map(|s| Req {
                shard: Arc::clone(s),
                op,
                table: table.cloned(),
                count: 0,
                body: body.to_vec(),
                min_checkpoint: None,
            })
            .collect();
        let mut out: Vec<Option<(usize, Header, Vec<u8>)>> = vec![None; reqs.len()];
        self.run(&reqs, |i, r, h, b| {
            out[i] = Some((r, *h, b));
            Ok(())
        })?;
        Ok(out
            .into_iter()
            .zip(&topo.shards)
            .map(|(o, s)| {
                let (r, h, b) = o.expect("every shard replied");
                (Arc::clone(s), r, h, b)
            })
            .collect())
    }
}

/// One shard's answer to a broadcast: the shard, the replica that answered, its reply.
pub(super) type Answer = (Arc<Shard>, usize, Header, Vec<u8>);

/// Whether a failed attempt may be tried on another replica: the replica was unreachable
/// or timed out (an error reply is the answer).
pub(super) fn retryable(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout)
}

pub(super) fn join_errors(errors: &[Error]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}
