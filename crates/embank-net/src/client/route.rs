//! Routing a call: which replica of a shard takes each request (writes the primary,
//! reads spread round-robin over healthy replicas serving the checkpoint asked for),
//! sending, reading the replies in turn, and failing a read over to another replica.

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use std::collections::VecDeque;

use embank_core::{Error, ErrorKind, Result};

use super::pool::{check_reply, read_reply, Shard};
use super::Client;
use crate::proto::{Header, Op};
use crate::server::write_all_vectored;
use crate::tls::Stream;

/// A request sent and waiting for its reply.
pub(super) struct Sent {
    pub(super) conn: Stream,
    /// Its index in the call's requests.
    pub(super) req: usize,
    pub(super) header: Header,
    /// The replica of its shard it went to.
    pub(super) replica: usize,
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

    /// The replicas request `req` may try, in order: for a read, the healthy ones serving
    /// `min_checkpoint`, round-robin, then those marked down; else the primary.
    pub(super) fn candidates(&self, req: &Req) -> Result<Vec<usize>> {
        let shard = &req.shard;
        let n = shard.replicas.len();
        // Writes, and reads of a single server with no checkpoint to check: no choice.
        if !self.spreads(shard, req.op) || (n == 1 && req.min_checkpoint.is_none()) {
            return Ok(vec![0]);
        }
        let start = shard.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let (mut up, mut down): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|i| (start + i) % n)
            .partition(|&r| shard.replicas[r].down_until.lock().is_none_or(|t| t <= now));
        up.append(&mut down);
        let Some(min) = req.min_checkpoint else { return Ok(up) };
        let mut ok = Vec::new();
        let mut seen = Vec::new();
        for r in up {
            let cached = *shard.replicas[r].served.lock();
            let served = match cached {
                Some(b) if b >= min => Some(b),
                _ => self.served_by(shard, r).ok().flatten(),
            };
            if served.is_some_and(|b| b >= min) {
                ok.push(r);
            } else {
                seen.push(format!(
                    "{}: {}",
                    shard.replica_name(r),
                    served.map_or("none".to_string(), |b| b.to_string())
                ));
            }
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

    /// Asks replica `r` which checkpoint it serves (and caches the answer).
    pub(super) fn served_by(&self, shard: &Shard, r: usize) -> Result<Option<u64>> {
        Ok(self.served_reply(shard, r)?["batch_id"].as_u64())
    }

    /// Replica `r`'s whole answer to `Served` (its batch id cached).
    pub(super) fn served_reply(&self, shard: &Shard, r: usize) -> Result<serde_json::Value> {
        let mut conn = self.take_conn(shard, r)?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::Served, id, 0, 0, 0);
        write_all_vectored(&mut conn, &mut [IoSlice::new(&h.encode())])
            .map_err(|e| shard.unavailable(r, "refused served", &e))?;
        let (rh, body) = read_reply(&mut conn).map_err(|e| shard.unavailable(r, "failed during served", &e))?;
        let body = check_reply(shard, r, &h, &rh, body)?;
        shard.replicas[r].pool.lock().push(conn);
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad served reply: {e}")))?;
        *shard.replicas[r].served.lock() = v["batch_id"].as_u64();
        Ok(v)
    }

    /// Sends request `i` to the first of its candidate replicas not in `tried` that takes it.
    pub(super) fn dispatch(&self, reqs: &[Req], i: usize, tried: &mut Vec<(usize, Error)>) -> Result<Sent> {
        let shard = &reqs[i].shard;
        for r in self.candidates(&reqs[i])? {
            if tried.iter().any(|(t, _)| *t == r) {
                continue;
            }
            let attempt = self.take_conn(shard, r).and_then(|conn| self.send(conn, &reqs[i], r));
            match attempt {
                Ok((conn, header)) => return Ok(Sent { conn, req: i, header, replica: r }),
                Err(e) if retryable(&e) && self.spreads(shard, reqs[i].op) => {
                    self.mark_down(shard, r);
                    tried.push((r, e));
                }
                Err(e) => return Err(e),
            }
        }
        let errors: Vec<Error> = tried.drain(..).map(|(_, e)| e).collect();
        Err(match errors.len() {
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

    /// Sends every request and calls `on_reply(i, replica, header, body)` for request i's
    /// reply (in no particular order across shards). A read whose replica fails is sent
    /// to another replica of its shard.
    pub(super) fn run(
        &self,
        reqs: &[Req],
        mut on_reply: impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let shards = reqs.iter().map(|r| r.shard.index + 1).max().unwrap_or(0);
        let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); shards];
        for (i, r) in reqs.iter().enumerate() {
            queues[r.shard.index].push_back(i);
        }
        let mut tried: Vec<Vec<(usize, Error)>> = (0..reqs.len()).map(|_| Vec::new()).collect();
        let mut in_flight: VecDeque<Sent> = VecDeque::new();
        let mut pooled: Vec<(&Shard, usize, Stream)> = Vec::new();
        let result = (|| {
            for q in queues.iter_mut() {
                for _ in 0..q.len().min(self.inner.opts.in_flight_per_shard) {
                    let i = q.pop_front().unwrap();
                    in_flight.push_back(self.dispatch(reqs, i, &mut tried[i])?);
                }
            }
            while let Some(Sent { mut conn, req: i, header: h, replica: r }) = in_flight.pop_front() {
                let shard = &*reqs[i].shard;
                let (rh, body) = match read_reply(&mut conn) {
                    Ok(x) => x,
                    Err(e) => {
                        let e = shard.unavailable(r, &format!("failed during {}", reqs[i].op.name()), &e);
                        if self.spreads(shard, reqs[i].op) {
                            // Fail over: the request again, to another replica.
                            self.mark_down(shard, r);
                            tried[i].push((r, e));
                            in_flight.push_back(self.dispatch(reqs, i, &mut tried[i])?);
                            continue;
                        }
                        return Err(e);
                    }
                };
                let body = check_reply(shard, r, &h, &rh, body);
                // A replica that takes no reads yet (it is copying a sibling's checkpoint)
                // or no longer holds the checkpoint of an exact read: another of the group
                // may answer (the error names what each holds if none does).
                if self.spreads(shard, reqs[i].op) && shard.replicas.len() > 1 {
                    if let Err(e) = &body {
                        let exact = matches!(reqs[i].op, Op::LookupAt | Op::ExportAt);
                        if e.kind() == ErrorKind::Unavailable || (exact && e.kind() == ErrorKind::NotFound) {
                            pooled.push((shard, r, conn));
                            if !exact {
                                *shard.replicas[r].down_until.lock() =
                                    Some(Instant::now() + self.inner.opts.replica_retry_after);
                            }
                            tried[i].push((r, body.unwrap_err()));
                            in_flight.push_back(self.dispatch(reqs, i, &mut tried[i])?);
                            continue;
                        }
                    }
                }
                // An error reply leaves the connection in step: keep it.
                match queues[shard.index].pop_front() {
                    Some(next) if body.is_ok() => {
                        pooled.push((shard, r, conn));
                        in_flight.push_back(self.dispatch(reqs, next, &mut tried[next])?);
                    }
                    _ => pooled.push((shard, r, conn)),
                }
                shard.replicas[r].answered.fetch_add(1, Ordering::Relaxed);
                on_reply(i, r, &rh, body?)?;
            }
            Ok(())
        })();
        for (s, r, conn) in pooled {
            s.replicas[r].pool.lock().push(conn);
        }
        result
    }

    pub(super) fn send(&self, mut conn: Stream, req: &Req, r: usize) -> Result<(Stream, Header)> {
        let shard = &req.shard;
        let table_id = match &req.table {
            None => 0,
            Some(t) => self.table_id(&mut conn, shard, r, t)?,
        };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(req.op, id, table_id, req.count, req.body.len() as u32);
        write_all_vectored(&mut conn, &mut [IoSlice::new(&h.encode()), IoSlice::new(&req.body)])
            .map_err(|e| shard.unavailable(r, &format!("refused a {} request", req.op.name()), &e))?;
        Ok((conn, h))
    }

    /// The table's id on replica `r`, opened there by name on `conn` the first time.
    pub(super) fn table_id(&self, conn: &mut Stream, shard: &Shard, r: usize, name: &str) -> Result<u32> {
        if let Some(&id) = shard.replicas[r].tables.lock().get(name) {
            return Ok(id);
        }
        let rid = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::OpenTable, rid, 0, 0, name.len() as u32);
        write_all_vectored(conn, &mut [IoSlice::new(&h.encode()), IoSlice::new(name.as_bytes())])
            .map_err(|e| shard.unavailable(r, "refused open_table", &e))?;
        let (rh, body) = read_reply(conn).map_err(|e| shard.unavailable(r, "failed during open_table", &e))?;
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
