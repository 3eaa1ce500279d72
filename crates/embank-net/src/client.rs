//! The client: a remote store of N shards with the same operations as an embedded one.
//!
//! Keys are routed by [`proto::shard_of`] (a consistent hash, identical in every
//! client). A batch is split by shard, then into requests of at most
//! `keys_per_request_max` keys; the requests go out at once, each on its own pooled
//! connection (up to `in_flight_per_shard` per shard), and the replies are put back
//! in the caller's order. One request per connection at a time: a server thread
//! never blocks writing a reply that nobody reads, so big batches cannot deadlock.
//!
//! Connections are opened on demand and kept; a pooled connection whose server went
//! away (restart, crash) is noticed before use and replaced, so a restarted shard is
//! picked up by the next call. A shard that cannot be reached fails the call with
//! `Unavailable`, naming the shard.

use std::collections::{HashSet, VecDeque};
use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::catalog::TableMeta;
use embank_core::{Error, ErrorKind, ExportCursor, Result, TableOptions};
use parking_lot::Mutex;

use crate::proto::{self, as_bytes, mask_bytes, Header, Op, HEADER_BYTES, REPLY_BIT};
use crate::server::write_all_vectored;
use crate::tls::{ClientTls, Stream};

/// How a client talks to its shards.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Token the servers require (sent in HELLO on every new connection).
    pub token: Option<String>,
    /// Most keys per request; a larger batch is split. Default 500.
    pub keys_per_request_max: usize,
    /// Longest wait for a reply (or for a request to be taken). Default 30 s. For a shard
    /// of n replicas each attempt gets `timeout / n`, so a read that fails over past
    /// replicas that hang still ends within `timeout`.
    pub timeout: Duration,
    /// Longest wait to connect. Default 5 s.
    pub connect_timeout: Duration,
    /// Most requests of one call in flight to one shard. Default 8.
    pub in_flight_per_shard: usize,
    /// TLS to the shards (the CA to verify them, optionally a client certificate).
    /// Default none: plain TCP.
    pub tls: Option<ClientTls>,
    /// Reads go only to replicas serving at least this checkpoint (the publisher's batch
    /// id, see [`Client::served`]); a shard with none fails the call, naming what each
    /// replica serves. Default none.
    pub min_checkpoint: Option<u64>,
    /// A replica that failed a request is skipped by reads for this long. Default 1 s.
    pub replica_retry_after: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            token: None,
            keys_per_request_max: 500,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            in_flight_per_shard: 8,
            tls: None,
            min_checkpoint: None,
            replica_retry_after: Duration::from_secs(1),
        }
    }
}

/// One server of a shard's replica group.
struct Endpoint {
    addr: String,
    pool: Mutex<Vec<Stream>>,
    /// Reads skip it until then (it failed a request).
    down_until: Mutex<Option<Instant>>,
    /// The checkpoint (batch id) it last said it serves.
    served: Mutex<Option<u64>>,
    /// A read-only replica (its HELLO says so): pulls may go to any replica of the group.
    read_only: AtomicBool,
}

/// A key range: a group of replicas, the first of which takes the writes.
struct Shard {
    index: usize,
    replicas: Vec<Endpoint>,
    /// Round-robin start of reads.
    next: AtomicUsize,
}

struct Inner {
    shards: Vec<Shard>,
    opts: ClientOptions,
    next_id: AtomicU64,
    closed: AtomicBool,
}

/// A connection to a set of shards; cheap to clone, usable from many threads.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// A table's id on every replica of every shard (ids are each server's own), learnt
/// as replicas are first used.
pub(crate) struct TableIds {
    name: String,
    ids: Vec<Vec<AtomicU32>>,
}

const UNKNOWN_ID: u32 = u32::MAX;

/// One request of a call.
struct Req {
    shard: usize,
    op: Op,
    table: Option<Arc<TableIds>>,
    count: u32,
    body: Vec<u8>,
    /// Reads only: replicas serving at least this checkpoint.
    min_checkpoint: Option<u64>,
}

impl Shard {
    fn name(&self) -> String {
        format!(
            "shard {} ({})",
            self.index,
            self.replicas.iter().map(|r| r.addr.as_str()).collect::<Vec<_>>().join(" | ")
        )
    }

    fn replica_name(&self, r: usize) -> String {
        if self.replicas.len() == 1 {
            format!("shard {} ({})", self.index, self.replicas[0].addr)
        } else {
            format!("shard {} replica {r} ({})", self.index, self.replicas[r].addr)
        }
    }

    fn unavailable(&self, r: usize, what: &str, e: &io::Error) -> Error {
        let kind = if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            ErrorKind::Timeout
        } else {
            ErrorKind::Unavailable
        };
        Error::new(kind, format!("{} {what}: {e}", self.replica_name(r)))
    }
}

/// Whether a pooled connection still has its server (no EOF, reset, or stray bytes waiting).
fn alive(s: &mut Stream) -> bool {
    if s.buffered() {
        return false;
    }
    let tcp = s.tcp();
    if tcp.set_nonblocking(true).is_err() {
        return false;
    }
    let ok = matches!(tcp.peek(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    ok && tcp.set_nonblocking(false).is_ok()
}

impl Client {
    /// Connects to every shard (checking the token), so a wrong address fails here. An
    /// address `a:7070|b:7070` is a shard of two replicas (see [`connect_groups`](Self::connect_groups)).
    pub fn connect<S: AsRef<str>>(addrs: &[S], opts: ClientOptions) -> Result<Client> {
        let groups: Vec<Vec<String>> = addrs
            .iter()
            .map(|a| a.as_ref().split('|').filter(|s| !s.trim().is_empty()).map(str::to_string).collect())
            .collect();
        Self::connect_groups(&groups, opts)
    }

    /// Connects to shards of several replicas each (`groups[i]`: shard i's replicas, the
    /// first its primary). Reads (lookup, len, stats, and pull on read-only replicas) are
    /// spread over a shard's healthy replicas and fail over to another on an error or a
    /// timeout; writes go to the primary alone. At least one replica of every shard must
    /// answer now; one that does not is skipped until it does.
    pub fn connect_groups<S: AsRef<str>>(groups: &[Vec<S>], opts: ClientOptions) -> Result<Client> {
        if groups.is_empty() || groups.iter().any(|g| g.is_empty()) {
            return Err(Error::config("connect: give at least one shard, each with at least one address"));
        }
        if opts.keys_per_request_max == 0 || opts.in_flight_per_shard == 0 {
            return Err(Error::config("keys_per_request_max and in_flight_per_shard must be at least 1"));
        }
        let shards = groups
            .iter()
            .enumerate()
            .map(|(index, g)| Shard {
                index,
                replicas: g
                    .iter()
                    .map(|a| Endpoint {
                        addr: a.as_ref().trim().trim_start_matches("tcp://").to_string(),
                        pool: Mutex::new(Vec::new()),
                        down_until: Mutex::new(None),
                        served: Mutex::new(None),
                        read_only: AtomicBool::new(false),
                    })
                    .collect(),
                next: AtomicUsize::new(index),
            })
            .collect();
        let client = Client {
            inner: Arc::new(Inner { shards, opts, next_id: AtomicU64::new(1), closed: AtomicBool::new(false) }),
        };
        for shard in &client.inner.shards {
            let mut errors = Vec::new();
            for r in 0..shard.replicas.len() {
                match client.open_conn(shard, r) {
                    Ok(conn) => shard.replicas[r].pool.lock().push(conn),
                    Err(e) if shard.replicas.len() > 1 && e.kind() == ErrorKind::Unavailable => {
                        client.mark_down(shard, r);
                        errors.push(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            if errors.len() == shard.replicas.len() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("no replica of {} answers: {}", shard.name(), join_errors(&errors)),
                ));
            }
        }
        Ok(client)
    }

    pub fn shard_count(&self) -> usize {
        self.inner.shards.len()
    }

    /// The shards' primary addresses, in routing order.
    pub fn addrs(&self) -> Vec<String> {
        self.inner.shards.iter().map(|s| s.replicas[0].addr.clone()).collect()
    }

    /// Every shard's replica addresses, in routing order.
    pub fn groups(&self) -> Vec<Vec<String>> {
        self.inner.shards.iter().map(|s| s.replicas.iter().map(|r| r.addr.clone()).collect()).collect()
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    fn mark_down(&self, shard: &Shard, r: usize) {
        *shard.replicas[r].down_until.lock() = Some(Instant::now() + self.inner.opts.replica_retry_after);
        shard.replicas[r].pool.lock().clear();
    }

    /// A new authenticated connection. A server closes connections that have not said
    /// hello yet when too many from one address (or in all) wait (`pending_per_peer_max`,
    /// `pending_max`): many trainer processes on one host that connect at once can lose a
    /// fresh connection that way before its hello is read. A hello answered by a closed
    /// connection is therefore tried again on a new one (a hello changes nothing), up to
    /// 8 times, each pause drawn from a range that doubles (1-11 ms, ..., 1-1,281 ms). A
    /// hello that times out is not tried again: the server may hang, and the call has
    /// its timeout. A server at `max_connections` answers BUSY, which is final.
    fn open_conn(&self, shard: &Shard, r: usize) -> Result<Stream> {
        let mut tries = 0;
        loop {
            match self.open_conn_once(shard, r) {
                Err((e, true)) if tries < HELLO_RETRIES => {
                    tries += 1;
                    // Full jitter: clients closed together must not come back together.
                    let nanos = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos());
                    let seed = embank_core::hash::splitmix64(
                        u64::from(nanos) ^ self.inner.next_id.fetch_add(1, Ordering::Relaxed),
                    );
                    let pause = Duration::from_micros(1_000 + seed % (5_000u64 << tries.min(8)));
                    tracing::debug!(replica = %shard.replica_name(r), tries, error = %e, "hello closed unanswered; connecting again");
                    std::thread::sleep(pause);
                }
                Err((e, _)) => return Err(e),
                Ok(s) => return Ok(s),
            }
        }
    }

    /// One try of [`open_conn`](Self::open_conn); the flag says the server closed the
    /// connection before answering the hello.
    fn open_conn_once(&self, shard: &Shard, r: usize) -> std::result::Result<Stream, (Error, bool)> {
        let closed = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            )
        };
        let opts = &self.inner.opts;
        let ep = &shard.replicas[r];
        let addrs: Vec<SocketAddr> = ep
            .addr
            .to_socket_addrs()
            .map_err(|e| (Error::config(format!("{}: address does not resolve: {e}", shard.replica_name(r))), false))?
            .collect();
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, opts.connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let tcp = match stream {
            Some(s) => s,
            None => {
                let e = last.unwrap_or_else(|| io::Error::other("no address"));
                return Err((
                    Error::new(ErrorKind::Unavailable, format!("{} is unreachable: {e}", shard.replica_name(r))),
                    false,
                ));
            }
        };
        // A shard of n replicas gives each attempt 1/n of the timeout, so a read that
        // fails over past a replica that hangs (a stopped process still accepts) ends
        // within the call's timeout.
        let attempt = opts.timeout / shard.replicas.len() as u32;
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(attempt))?;
            s.set_write_timeout(Some(attempt))
        };
        setup(&tcp).map_err(|e| (shard.unavailable(r, "socket setup failed", &e), false))?;
        let mut s = match &opts.tls {
            Some(tls) => tls.connect(tcp, &ep.addr).map_err(|e| {
                let hint = if e.to_string().contains("corrupt message") { " (does the server speak TLS?)" } else { "" };
                (shard.unavailable(r, &format!("TLS handshake failed{hint}"), &e), closed(&e))
            })?,
            None => Stream::Plain(tcp),
        };
        let token = opts.token.clone().unwrap_or_default();
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::Hello, id, 0, 0, token.len() as u32);
        write_all_vectored(&mut s, &mut [IoSlice::new(&h.encode()), IoSlice::new(token.as_bytes())])
            .map_err(|e| (shard.unavailable(r, "refused the hello", &e), closed(&e)))?;
        if !s.is_tls() {
            // A TLS server answers clear text with an alert record (content type 21).
            let mut first = [0u8; 1];
            if matches!(s.tcp().peek(&mut first), Ok(1)) && first[0] == 0x15 {
                return Err((
                    Error::new(
                        ErrorKind::Unavailable,
                        format!("{} requires TLS: connect with its CA file (tls_ca_file)", shard.replica_name(r)),
                    ),
                    false,
                ));
            }
        }
        let (rh, body) = read_hello_reply(&mut s).map_err(|e| match e {
            HelloReply::Io(e) => (shard.unavailable(r, "did not answer the hello", &e), closed(&e)),
            HelloReply::Foreign(what) => (
                Error::new(
                    ErrorKind::Unavailable,
                    format!("{} is not an embank server: it answered the hello with {what}", shard.replica_name(r)),
                ),
                false,
            ),
        })?;
        let body = check_reply(shard, r, &h, &rh, body).map_err(|e| (e, false))?;
        if let Ok(info) = serde_json::from_slice::<serde_json::Value>(&body) {
            ep.read_only.store(info["read_only"].as_bool() == Some(true), Ordering::Relaxed);
        }
        Ok(s)
    }

    fn take_conn(&self, shard: &Shard, r: usize) -> Result<Stream> {
        if self.inner.closed.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Closed, "the remote store is closed"));
        }
        loop {
            let pooled = shard.replicas[r].pool.lock().pop();
            match pooled {
                Some(mut s) => {
                    if alive(&mut s) {
                        return Ok(s);
                    }
                    tracing::debug!(replica = %shard.replica_name(r), "dropping a dead pooled connection");
                }
                None => return self.open_conn(shard, r),
            }
        }
    }

    /// Whether `op` may go to any replica of the shard (and fail over).
    fn spreads(&self, shard: &Shard, op: Op) -> bool {
        match op {
            Op::Lookup
            | Op::LookupAt
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
    fn candidates(&self, req: &Req) -> Result<Vec<usize>> {
        let shard = &self.inner.shards[req.shard];
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
    fn served_by(&self, shard: &Shard, r: usize) -> Result<Option<u64>> {
        Ok(self.served_reply(shard, r)?["batch_id"].as_u64())
    }

    /// Replica `r`'s whole answer to `Served` (its batch id cached).
    fn served_reply(&self, shard: &Shard, r: usize) -> Result<serde_json::Value> {
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
    fn dispatch(
        &self,
        reqs: &[Req],
        i: usize,
        tried: &mut Vec<(usize, Error)>,
    ) -> Result<(Stream, usize, Header, usize)> {
        let shard = &self.inner.shards[reqs[i].shard];
        for r in self.candidates(&reqs[i])? {
            if tried.iter().any(|(t, _)| *t == r) {
                continue;
            }
            let attempt = self.take_conn(shard, r).and_then(|conn| self.send(conn, &reqs[i], r));
            match attempt {
                Ok((conn, h)) => return Ok((conn, i, h, r)),
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
    fn run(&self, reqs: &[Req], mut on_reply: impl FnMut(usize, usize, &Header, Vec<u8>) -> Result<()>) -> Result<()> {
        let shards = &self.inner.shards;
        let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); shards.len()];
        for (i, r) in reqs.iter().enumerate() {
            queues[r.shard].push_back(i);
        }
        let mut tried: Vec<Vec<(usize, Error)>> = (0..reqs.len()).map(|_| Vec::new()).collect();
        let mut in_flight: VecDeque<(Stream, usize, Header, usize)> = VecDeque::new();
        let mut pooled: Vec<(usize, usize, Stream)> = Vec::new();
        let result = (|| {
            for q in queues.iter_mut() {
                for _ in 0..q.len().min(self.inner.opts.in_flight_per_shard) {
                    let i = q.pop_front().unwrap();
                    in_flight.push_back(self.dispatch(reqs, i, &mut tried[i])?);
                }
            }
            while let Some((mut conn, i, h, r)) = in_flight.pop_front() {
                let shard = &shards[reqs[i].shard];
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
                // A replica that no longer holds the checkpoint of an exact read: another
                // of the group may (the error names what each holds if none does).
                if reqs[i].op == Op::LookupAt && shard.replicas.len() > 1 {
                    if let Err(e) = &body {
                        if e.kind() == ErrorKind::NotFound {
                            pooled.push((reqs[i].shard, r, conn));
                            tried[i].push((r, body.unwrap_err()));
                            in_flight.push_back(self.dispatch(reqs, i, &mut tried[i])?);
                            continue;
                        }
                    }
                }
                // An error reply leaves the connection in step: keep it.
                match queues[reqs[i].shard].pop_front() {
                    Some(next) if body.is_ok() => {
                        pooled.push((reqs[i].shard, r, conn));
                        in_flight.push_back(self.dispatch(reqs, next, &mut tried[next])?);
                    }
                    _ => pooled.push((reqs[i].shard, r, conn)),
                }
                on_reply(i, r, &rh, body?)?;
            }
            Ok(())
        })();
        for (s, r, conn) in pooled {
            shards[s].replicas[r].pool.lock().push(conn);
        }
        result
    }

    fn send(&self, mut conn: Stream, req: &Req, r: usize) -> Result<(Stream, Header)> {
        let shard = &self.inner.shards[req.shard];
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
    fn table_id(&self, conn: &mut Stream, shard: &Shard, r: usize, t: &TableIds) -> Result<u32> {
        let slot = &t.ids[shard.index][r];
        let id = slot.load(Ordering::Relaxed);
        if id != UNKNOWN_ID {
            return Ok(id);
        }
        let rid = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let h = Header::request(Op::OpenTable, rid, 0, 0, t.name.len() as u32);
        write_all_vectored(conn, &mut [IoSlice::new(&h.encode()), IoSlice::new(t.name.as_bytes())])
            .map_err(|e| shard.unavailable(r, "refused open_table", &e))?;
        let (rh, body) = read_reply(conn).map_err(|e| shard.unavailable(r, "failed during open_table", &e))?;
        check_reply(shard, r, &h, &rh, body)?;
        slot.store(rh.table_id, Ordering::Relaxed);
        Ok(rh.table_id)
    }

    /// One request to every shard (store-level operations).
    fn broadcast(&self, op: Op, body: &[u8], table: Option<&Arc<TableIds>>) -> Result<Vec<(Header, Vec<u8>)>> {
        Ok(self.broadcast_from(op, body, table)?.into_iter().map(|(_, h, b)| (h, b)).collect())
    }

    /// [`broadcast`](Self::broadcast) with the replica that answered each shard.
    fn broadcast_from(
        &self,
        op: Op,
        body: &[u8],
        table: Option<&Arc<TableIds>>,
    ) -> Result<Vec<(usize, Header, Vec<u8>)>> {
        let reqs: Vec<Req> = (0..self.shard_count())
            .map(|s| Req { shard: s, op, table: table.cloned(), count: 0, body: body.to_vec(), min_checkpoint: None })
            .collect();
        let mut out: Vec<Option<(usize, Header, Vec<u8>)>> = vec![None; reqs.len()];
        self.run(&reqs, |i, r, h, b| {
            out[i] = Some((r, *h, b));
            Ok(())
        })?;
        Ok(out.into_iter().map(|o| o.expect("every shard replied")).collect())
    }

    /// Creates a table on every shard.
    pub fn create_table(&self, name: &str, options: TableOptions) -> Result<RemoteTable> {
        embank_core::table::validate_name(name)?;
        options.validate()?;
        let body = serde_json::json!({ "name": name, "options": options }).to_string();
        let replies = self.broadcast_from(Op::CreateTable, body.as_bytes(), None)?;
        self.table_from(name, replies)
    }

    /// Opens a table that exists on every shard.
    pub fn table(&self, name: &str) -> Result<RemoteTable> {
        let replies = self.broadcast_from(Op::OpenTable, name.as_bytes(), None)?;
        self.table_from(name, replies)
    }

    fn table_from(&self, name: &str, replies: Vec<(usize, Header, Vec<u8>)>) -> Result<RemoteTable> {
        let ids = TableIds {
            name: name.to_string(),
            ids: self
                .inner
                .shards
                .iter()
                .map(|s| s.replicas.iter().map(|_| AtomicU32::new(UNKNOWN_ID)).collect())
                .collect(),
        };
        let mut meta: Option<TableMeta> = None;
        for (s, (r, h, body)) in replies.into_iter().enumerate() {
            let shard = &self.inner.shards[s];
            let m: TableMeta = serde_json::from_slice(&body)
                .map_err(|e| Error::corrupt(format!("{}: bad table description: {e}", shard.replica_name(r))))?;
            if let Some(first) = &meta {
                if first.dim != m.dim {
                    return Err(Error::config(format!(
                        "table {name:?} has dim {} on shard 0 but {} on {}",
                        first.dim,
                        m.dim,
                        shard.replica_name(r)
                    )));
                }
            }
            ids.ids[s][r].store(h.table_id, Ordering::Relaxed);
            meta.get_or_insert(m);
        }
        let meta = meta.expect("at least one shard");
        Ok(RemoteTable {
            client: self.clone(),
            name: name.to_string(),
            dim: meta.dim as usize,
            ids: Arc::new(ids),
            meta,
        })
    }

    /// Names of the tables on the servers (their union), sorted.
    pub fn tables(&self) -> Result<Vec<String>> {
        let mut names = std::collections::BTreeSet::new();
        for (_, body) in self.broadcast(Op::ListTables, &[], None)? {
            let list: Vec<String> =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad table list: {e}")))?;
            names.extend(list);
        }
        Ok(names.into_iter().collect())
    }

    pub fn drop_table(&self, name: &str) -> Result<()> {
        self.broadcast(Op::DropTable, name.as_bytes(), None).map(|_| ())
    }

    /// Makes every write acknowledged before this call durable on every shard.
    pub fn flush(&self) -> Result<()> {
        self.broadcast(Op::Flush, &[], None).map(|_| ())
    }

    /// Store statistics with the embedded store's fields, summed over the shards
    /// (tables matched by name), and each shard's own under `"shards"`.
    pub fn stats(&self) -> Result<serde_json::Value> {
        let mut shards = Vec::new();
        for (s, (r, _, body)) in self.broadcast_from(Op::StoreStats, &[], None)?.into_iter().enumerate() {
            let mut v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad stats: {e}")))?;
            v["shard"] = serde_json::json!(self.inner.shards[s].replicas[r].addr);
            shards.push(v);
        }
        let mut total = merge_stats(&shards);
        total["path"] = serde_json::json!(self.url());
        total["shards"] = serde_json::Value::Array(shards);
        Ok(total)
    }

    /// A checkpoint of every shard at this batch boundary (call it between batches).
    pub fn checkpoint(&self, batch_id: u64) -> Result<()> {
        self.checkpoint_with_meta(batch_id, &[])
    }

    /// A checkpoint of every shard at `batch_id` that keeps `meta` (at most 64 KiB) with it.
    pub fn checkpoint_with_meta(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        let mut body = batch_id.to_le_bytes().to_vec();
        body.extend_from_slice(meta);
        self.broadcast(Op::Checkpoint, &body, None).map(|_| ())
    }

    /// The checkpoints every shard retains, oldest first.
    /// Which checkpoint each shard serves (`{"batch_id", "seq", "replica", "state"}`, in
    /// shard order): a replica's the publisher's checkpoint it applied last, a primary's
    /// its newest retained checkpoint.
    pub fn served(&self) -> Result<Vec<serde_json::Value>> {
        self.broadcast_from(Op::Served, &[], None)?
            .into_iter()
            .enumerate()
            .map(|(s, (r, _, body))| {
                let mut v: serde_json::Value =
                    serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad served reply: {e}")))?;
                *self.inner.shards[s].replicas[r].served.lock() = v["batch_id"].as_u64();
                v["address"] = serde_json::json!(self.inner.shards[s].replicas[r].addr);
                Ok(v)
            })
            .collect()
    }

    /// Which checkpoint every replica serves: `[shard][replica]`, each `{"batch_id", "seq",
    /// "replica", "state", "readable", "address"}` or `{"error": ...}` for one that does
    /// not answer.
    pub fn served_all(&self) -> Vec<Vec<serde_json::Value>> {
        self.inner
            .shards
            .iter()
            .map(|shard| {
                (0..shard.replicas.len())
                    .map(|r| match self.served_reply(shard, r) {
                        Ok(mut v) => {
                            v["address"] = serde_json::json!(shard.replicas[r].addr);
                            v
                        }
                        Err(e) => serde_json::json!({"error": e.to_string(), "address": shard.replicas[r].addr}),
                    })
                    .collect()
            })
            .collect()
    }

    pub fn checkpoints(&self) -> Result<Vec<embank_core::store::CheckpointInfo>> {
        let mut common: Option<Vec<embank_core::store::CheckpointInfo>> = None;
        for (_, body) in self.broadcast(Op::Checkpoints, &[], None)? {
            let list: Vec<embank_core::store::CheckpointInfo> =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad checkpoint list: {e}")))?;
            common = Some(match common {
                None => list,
                Some(c) => c.into_iter().filter(|x| list.iter().any(|y| y.batch_id == x.batch_id)).collect(),
            });
        }
        Ok(common.unwrap_or_default())
    }

    /// Returns every shard to checkpoint `batch_id`.
    pub fn restore(&self, batch_id: u64) -> Result<()> {
        self.broadcast(Op::Restore, &batch_id.to_le_bytes(), None).map(|_| ())
    }

    /// `tcp://host:port,host:port` (a shard's replicas joined by `|`).
    pub fn url(&self) -> String {
        format!("tcp://{}", self.groups().iter().map(|g| g.join("|")).collect::<Vec<_>>().join(","))
    }

    /// Closes every pooled connection; later calls fail with `Closed`. The servers keep running.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Relaxed);
        for s in &self.inner.shards {
            for r in &s.replicas {
                r.pool.lock().clear();
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Relaxed)
    }
}

/// Reads one reply frame.
fn read_reply(conn: &mut Stream) -> io::Result<(Header, Vec<u8>)> {
    let mut hdr = [0u8; HEADER_BYTES];
    conn.read_exact(&mut hdr)?;
    let h = Header::decode(&hdr).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    conn.read_exact(&mut body)?;
    Ok((h, body))
}

/// Why a hello got no embank reply.
enum HelloReply {
    Io(io::Error),
    /// Something else answered (an HTTP server, say): what it said, for the message.
    Foreign(String),
}

/// The reply to a hello. Bytes that do not start an embank frame fail at once, naming
/// what answered (`HTTP/1.1 400 Bad Request` from the admin port, say): such a peer is
/// not tried again.
fn read_hello_reply(conn: &mut Stream) -> std::result::Result<(Header, Vec<u8>), HelloReply> {
    let mut hdr = [0u8; HEADER_BYTES];
    let mut n = 0;
    while n < HEADER_BYTES {
        match conn.read(&mut hdr[n..]) {
            Ok(0) if n == 0 => return Err(HelloReply::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if n == 0 => return Err(HelloReply::Io(e)),
            Err(_) => break,
        }
        if n >= 4 && hdr[..4] != proto::MAGIC.to_le_bytes() {
            break;
        }
    }
    let foreign = || {
        let text: String = String::from_utf8_lossy(&hdr[..n]).lines().next().unwrap_or("").chars().take(60).collect();
        let printable = !text.is_empty() && text.chars().all(|c| !c.is_control());
        HelloReply::Foreign(if printable {
            format!("{text:?}")
        } else {
            format!("{n} bytes that are not an embank frame")
        })
    };
    if n < HEADER_BYTES {
        return Err(foreign());
    }
    let h = Header::decode(&hdr).map_err(|_| foreign())?;
    let mut body = vec![0u8; h.body_len as usize];
    conn.read_exact(&mut body).map_err(HelloReply::Io)?;
    Ok((h, body))
}

/// Checks that a reply answers `req`, and turns an error status into the error.
fn check_reply(shard: &Shard, r: usize, req: &Header, reply: &Header, body: Vec<u8>) -> Result<Vec<u8>> {
    if reply.status != 0 {
        let message = String::from_utf8_lossy(&body).into_owned();
        return Err(proto::error_of(reply.status, message).context(shard.replica_name(r)));
    }
    if reply.opcode != req.opcode | REPLY_BIT || reply.request_id != req.request_id {
        return Err(Error::corrupt(format!(
            "{}: reply (opcode {:#x}, id {}) does not match the request (opcode {:#x}, id {})",
            shard.replica_name(r),
            reply.opcode,
            reply.request_id,
            req.opcode,
            req.request_id
        )));
    }
    Ok(body)
}

/// New connections tried again after a server closed them before answering the hello.
const HELLO_RETRIES: u32 = 8;

/// Whether a failed attempt may be tried on another replica: the replica was unreachable
/// or timed out (an error reply is the answer).
fn retryable(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout)
}

fn join_errors(errors: &[Error]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

/// A table of a remote store: the operations of `embank_core::Table`, over the wire.
#[derive(Clone)]
pub struct RemoteTable {
    client: Client,
    name: String,
    dim: usize,
    /// The table's id on each replica of each shard.
    ids: Arc<TableIds>,
    meta: TableMeta,
}

impl std::fmt::Debug for RemoteTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTable").field("name", &self.name).field("dim", &self.dim).finish()
    }
}

/// Requests for a keyed operation, with each request's positions in the caller's batch.
struct Plan {
    reqs: Vec<Req>,
    positions: Vec<Vec<usize>>,
}

impl RemoteTable {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table's description (from shard 0; every shard was created alike).
    pub fn meta(&self) -> TableMeta {
        self.meta.clone()
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    fn check_rows(&self, what: &str, keys: usize, rows: usize) -> Result<()> {
        if rows != keys * self.dim {
            return Err(Error::invalid(format!(
                "{what}: table {:?} has dim {}, so {keys} keys need {} row elements, got {rows}",
                self.name,
                self.dim,
                keys * self.dim
            )));
        }
        Ok(())
    }

    /// Splits `keys` by shard and into requests; `rows` (if any) travel after the keys.
    fn plan(&self, op: Op, keys: &[u64], rows: Option<&[f32]>) -> Plan {
        self.plan_with(op, &[], keys, rows)
    }

    /// [`plan`](Self::plan) with `prefix` words before each request's keys.
    fn plan_with(&self, op: Op, prefix: &[u64], keys: &[u64], rows: Option<&[f32]>) -> Plan {
        let n = self.client.shard_count();
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); n];
        if n == 1 {
            by_shard[0] = (0..keys.len()).collect();
        } else {
            for (i, &k) in keys.iter().enumerate() {
                by_shard[proto::shard_of(k, n as u32) as usize].push(i);
            }
        }
        let max = self.client.inner.opts.keys_per_request_max;
        let d = self.dim;
        let mut plan = Plan { reqs: Vec::new(), positions: Vec::new() };
        for (shard, positions) in by_shard.into_iter().enumerate() {
            for chunk in positions.chunks(max) {
                let rows_len = rows.map_or(0, |_| chunk.len() * proto::row_bytes(d));
                let mut body = Vec::with_capacity(prefix.len() * 8 + chunk.len() * 8 + rows_len);
                for w in prefix {
                    body.extend_from_slice(&w.to_le_bytes());
                }
                for &i in chunk {
                    body.extend_from_slice(&keys[i].to_le_bytes());
                }
                if let Some(rows) = rows {
                    for &i in chunk {
                        body.extend_from_slice(as_bytes(&rows[i * d..(i + 1) * d]));
                    }
                }
                plan.reqs.push(Req {
                    shard,
                    op,
                    table: Some(Arc::clone(&self.ids)),
                    count: chunk.len() as u32,
                    body,
                    min_checkpoint: self.client.inner.opts.min_checkpoint,
                });
                plan.positions.push(chunk.to_vec());
            }
        }
        plan
    }

    /// Copies reply rows (`body[at..]`, one per position) into `out`.
    fn scatter(&self, body: &[u8], at: usize, positions: &[usize], out: &mut [f32]) -> Result<()> {
        let row_bytes = proto::row_bytes(self.dim);
        if body.len() != at + positions.len() * row_bytes {
            return Err(Error::corrupt(format!(
                "reply of {} bytes for {} rows of dim {}",
                body.len(),
                positions.len(),
                self.dim
            )));
        }
        let d = self.dim;
        for (j, &i) in positions.iter().enumerate() {
            let src = &body[at + j * row_bytes..at + (j + 1) * row_bytes];
            let dst = &mut out[i * d..(i + 1) * d];
            for (x, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Ok(())
    }

    /// Rows of `keys` into `out`; missing rows are created with the initializer.
    pub fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.pull_min(keys, out, self.client.inner.opts.min_checkpoint)
    }

    /// [`pull`](Self::pull) from replicas serving checkpoint `min_checkpoint` or later
    /// (for a read-only replica group; a writable primary takes pulls alone).
    pub fn pull_min(&self, keys: &[u64], out: &mut [f32], min_checkpoint: Option<u64>) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let mut plan = self.plan(Op::Pull, keys, None);
        let min_checkpoint = min_checkpoint.or(self.client.inner.opts.min_checkpoint);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min_checkpoint);
        self.client.run(&plan.reqs, |i, _, _, body| self.scatter(&body, 0, &plan.positions[i], out))
    }

    /// Rows of `keys` and a found mask; never creates rows.
    pub fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.lookup_min(keys, out, found, self.client.inner.opts.min_checkpoint)
    }

    /// [`lookup`](Self::lookup) from replicas serving checkpoint `min_checkpoint` or later
    /// (the publisher's batch id): a model never mixes rows of different training
    /// checkpoints unknowingly. Fails if a shard has no such replica yet. `None`: the
    /// client's `min_checkpoint`.
    pub fn lookup_min(
        &self,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
        min_checkpoint: Option<u64>,
    ) -> Result<()> {
        self.check_rows("lookup", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let mut plan = self.plan(Op::Lookup, keys, None);
        let min_checkpoint = min_checkpoint.or(self.client.inner.opts.min_checkpoint);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min_checkpoint);
        self.client.run(&plan.reqs, |i, _, _, body| self.read_mask(&body, &plan.positions[i], out, found))
    }

    /// Rows of `keys` and a found mask exactly as they were at the publisher's checkpoint
    /// `batch_id` (a replica group fed by an update stream; a primary: its retained
    /// checkpoint of that batch id), every shard at that same checkpoint: a model reading
    /// several tables at one `batch_id` never mixes two. Each shard's replicas holding it
    /// answer (see [`Client::served`]'s `readable`); fails with `NotFound` when none does.
    pub fn lookup_at(&self, batch_id: u64, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.check_rows("lookup_at", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let mut plan = self.plan_with(Op::LookupAt, &[batch_id], keys, None);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = Some(batch_id));
        self.client.run(&plan.reqs, |i, _, _, body| self.read_mask(&body, &plan.positions[i], out, found))
    }

    /// Reads a lookup reply (found mask, then rows) into `out` and `found`.
    fn read_mask(&self, body: &[u8], positions: &[usize], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let m = mask_bytes(positions.len());
        if body.len() < m {
            return Err(Error::corrupt("lookup reply shorter than its mask"));
        }
        for (j, &p) in positions.iter().enumerate() {
            found[p] = body[j / 8] & (1 << (j % 8)) != 0;
        }
        self.scatter(body, m, positions, out)
    }

    fn check_finite(&self, what: &str, keys: &[u64], rows: &[f32]) -> Result<()> {
        if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "{what}: row of key {} holds a non-finite value ({}); nothing was written",
                keys[i / self.dim],
                rows[i]
            )));
        }
        Ok(())
    }

    /// Writes rows; with duplicate keys the last row wins (as embedded).
    pub fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        self.check_rows("push", keys.len(), rows.len())?;
        self.check_finite("push", keys, rows)?;
        // Requests run in parallel: keep only each key's last row so order cannot matter.
        let mut seen = HashSet::with_capacity(keys.len());
        let mut last: Vec<usize> = (0..keys.len()).rev().filter(|&i| seen.insert(keys[i])).collect();
        last.reverse();
        let (ukeys, urows) = if last.len() == keys.len() {
            (keys.to_vec(), rows.to_vec())
        } else {
            let d = self.dim;
            (
                last.iter().map(|&i| keys[i]).collect(),
                last.iter().flat_map(|&i| rows[i * d..(i + 1) * d].iter().copied()).collect(),
            )
        };
        let plan = self.plan(Op::Push, &ukeys, Some(&urows));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// Applies the table's optimizer; gradients of duplicate keys are summed first.
    pub fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.check_rows("push_grad", keys.len(), grads.len())?;
        self.check_finite("push_grad", keys, grads)?;
        let (ukeys, sums) = embank_core::optim::sum_duplicates(keys, grads, self.dim);
        let plan = self.plan(Op::PushGrad, &ukeys, Some(&sums));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// A training worker's pull under the table's staleness bound (see
    /// `embank_core::Table::pull_held`). Keys are deduplicated per shard request by the
    /// server; `timeout` bounds the wait of each shard.
    ///
    /// Holds are taken in one global order, (shard, key), so that workers pulling
    /// overlapping batches cannot deadlock across shards: the requests go out one after
    /// the other, shard 0's first, each shard's keys sorted (the server takes a request's
    /// keys in sorted order). Slower than a plain pull's parallel requests, but two
    /// workers each holding a key the other waits for on another shard would otherwise
    /// wait until their timeouts.
    pub fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_unstable_by_key(|&i| (self.shard_of(keys[i]), keys[i]));
        let sorted: Vec<u64> = order.iter().map(|&i| keys[i]).collect();
        let plan = self.plan_with(Op::PullHeld, &[worker, timeout.as_millis() as u64], &sorted, None);
        let mut rows = vec![0f32; out.len()];
        for (i, req) in plan.reqs.iter().enumerate() {
            self.client.run(std::slice::from_ref(req), |_, _, _, body| {
                self.scatter(&body, 0, &plan.positions[i], &mut rows)
            })?;
        }
        let d = self.dim;
        for (j, &i) in order.iter().enumerate() {
            out[i * d..(i + 1) * d].copy_from_slice(&rows[j * d..(j + 1) * d]);
        }
        Ok(())
    }

    /// A training worker's push_grad: applies it and gives back the worker's holds.
    pub fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.check_rows("push_grad", keys.len(), grads.len())?;
        self.check_finite("push_grad", keys, grads)?;
        let (ukeys, sums) = embank_core::optim::sum_duplicates(keys, grads, self.dim);
        let plan = self.plan_with(Op::PushGradHeld, &[worker], &ukeys, Some(&sums));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// Gives back every hold of `worker` on every shard; returns how many.
    pub fn release(&self, worker: u64) -> Result<u64> {
        let replies = self.client.broadcast(Op::Release, &worker.to_le_bytes(), Some(&self.ids))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    /// Deletes keys; returns how many were present.
    pub fn delete(&self, keys: &[u64]) -> Result<u64> {
        let mut seen = HashSet::with_capacity(keys.len());
        let uniq: Vec<u64> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let plan = self.plan(Op::Delete, &uniq, None);
        let mut gone = 0;
        self.client.run(&plan.reqs, |_, _, _, body| {
            gone += u64_reply(&body)?;
            Ok(())
        })?;
        Ok(gone)
    }

    /// Asks each shard to load these rows into its row cache. `false` if any shard dropped the hint.
    pub fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        let plan = self.plan(Op::Lookahead, keys, None);
        let mut all = true;
        self.client.run(&plan.reqs, |_, _, _, body| {
            all &= u64_reply(&body)? == 1;
            Ok(())
        })?;
        Ok(all)
    }

    /// Live rows over every shard.
    pub fn len(&self) -> Result<u64> {
        let replies = self.client.broadcast(Op::Len, &[], Some(&self.ids))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Evicts rows past their TTL on every shard; returns how many.
    pub fn evict_expired(&self) -> Result<u64> {
        let replies = self.client.broadcast(Op::EvictExpired, &[], Some(&self.ids))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    /// Changes the optimizer's learning rate on every shard.
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        self.client.broadcast(Op::SetLr, &lr.to_le_bytes(), Some(&self.ids)).map(|_| ())
    }

    /// The table's statistics with the embedded table's fields, summed over the
    /// shards, and each shard's own under `"shards"`.
    pub fn stats(&self) -> Result<serde_json::Value> {
        let replies = self.client.broadcast_from(Op::TableStats, &[], Some(&self.ids))?;
        let mut shards = Vec::new();
        for (s, (r, _, body)) in replies.into_iter().enumerate() {
            let mut v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad stats: {e}")))?;
            v["shard"] = serde_json::json!(self.client.inner.shards[s].replicas[r].addr);
            shards.push(v);
        }
        let mut total = merge_stats(&shards);
        total["shards"] = serde_json::Value::Array(shards);
        Ok(total)
    }

    /// Streams every `(key, row)`, shard after shard, in chunks of at most `chunk_keys`.
    pub fn export(&self, chunk_keys: usize, mut f: impl FnMut(&[u64], &[f32]) -> Result<()>) -> Result<()> {
        let d = self.dim;
        for shard in 0..self.client.shard_count() {
            let mut cursor = ExportCursor::START;
            loop {
                let mut body = Vec::with_capacity(24);
                body.extend_from_slice(&cursor.generation.to_le_bytes());
                body.extend_from_slice(&cursor.bucket.to_le_bytes());
                body.extend_from_slice(&(chunk_keys as u64).to_le_bytes());
                let req = Req {
                    shard,
                    op: Op::Export,
                    table: Some(Arc::clone(&self.ids)),
                    count: 0,
                    body,
                    min_checkpoint: None,
                };
                let mut page = None;
                self.client.run(std::slice::from_ref(&req), |_, _, h, b| {
                    page = Some((h.count as usize, b));
                    Ok(())
                })?;
                let (n, b) = page.expect("one reply");
                if b.len() != 24 + n * 8 + n * proto::row_bytes(d) {
                    return Err(Error::corrupt("export page of the wrong length"));
                }
                let word = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
                let (generation, bucket, done) = (word(0), word(8), word(16));
                let keys: Vec<u64> = (0..n).map(|i| word(24 + i * 8)).collect();
                let mut rows = vec![0f32; n * d];
                let positions: Vec<usize> = (0..n).collect();
                self.scatter(&b, 24 + n * 8, &positions, &mut rows)?;
                if n > 0 {
                    f(&keys, &rows)?;
                }
                if done == 1 {
                    break;
                }
                cursor = ExportCursor { generation, bucket };
            }
        }
        Ok(())
    }

    /// Which shard serves `key` (for tests and tools).
    pub fn shard_of(&self, key: u64) -> usize {
        proto::shard_of(key, self.client.shard_count() as u32) as usize
    }
}

fn u64_reply(body: &[u8]) -> Result<u64> {
    let b: [u8; 8] = body.try_into().map_err(|_| Error::corrupt("expected an 8-byte reply"))?;
    Ok(u64::from_le_bytes(b))
}

/// Numeric statistics that are the same on every shard, not parts of a total.
const KEEP_FIRST: [&str; 5] = ["dim", "io_align", "depth", "admit_after", "staleness_bound"];

/// Sums statistics documents field by field: numbers add up, arrays of numbers add up
/// element-wise, `tables` are merged by name, ratios are recomputed from their parts,
/// anything else is taken from the first document.
pub fn merge_stats(docs: &[serde_json::Value]) -> serde_json::Value {
    use serde_json::Value;
    let Some(first) = docs.first() else { return Value::Null };
    match first {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                let parts: Vec<Value> = docs.iter().map(|d| d.get(k).cloned().unwrap_or(Value::Null)).collect();
                let merged = if k == "tables" {
                    merge_tables(&parts)
                } else if k == "shard" || k == "path" {
                    continue;
                } else if KEEP_FIRST.contains(&k.as_str()) {
                    v.clone()
                } else {
                    match v {
                        Value::Number(_) | Value::Object(_) => merge_stats(&parts),
                        Value::Array(a) if a.iter().all(Value::is_number) => {
                            let n = parts.iter().filter_map(Value::as_array).map(Vec::len).max().unwrap_or(0);
                            Value::Array(
                                (0..n)
                                    .map(|i| {
                                        merge_stats(&parts.iter().filter_map(|p| p.get(i).cloned()).collect::<Vec<_>>())
                                    })
                                    .collect(),
                            )
                        }
                        _ => v.clone(),
                    }
                };
                out.insert(k.clone(), merged);
            }
            let num = |out: &serde_json::Map<String, Value>, k: &str| out.get(k).and_then(Value::as_f64);
            if let (Some(rows), Some(slots)) = (num(&out, "rows"), num(&out, "slots")) {
                if slots > 0.0 {
                    out.insert("load_factor".into(), serde_json::json!(rows / slots));
                }
            }
            if let (Some(h), Some(m)) = (num(&out, "cache_hits"), num(&out, "cache_misses")) {
                let rate = if h + m > 0.0 { serde_json::json!(h / (h + m)) } else { Value::Null };
                out.insert("cache_hit_rate".into(), rate);
            }
            Value::Object(out)
        }
        Value::Number(_) => {
            if docs.iter().all(|d| d.as_u64().is_some()) {
                serde_json::json!(docs.iter().filter_map(Value::as_u64).sum::<u64>())
            } else {
                serde_json::json!(docs.iter().filter_map(Value::as_f64).sum::<f64>())
            }
        }
        other => other.clone(),
    }
}

fn merge_tables(parts: &[serde_json::Value]) -> serde_json::Value {
    let mut by_name: Vec<(String, Vec<serde_json::Value>)> = Vec::new();
    for list in parts.iter().filter_map(serde_json::Value::as_array) {
        for t in list {
            let name = t["name"].as_str().unwrap_or_default().to_string();
            match by_name.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push(t.clone()),
                None => by_name.push((name, vec![t.clone()])),
            }
        }
    }
    serde_json::Value::Array(by_name.iter().map(|(_, docs)| merge_stats(docs)).collect())
}

impl embank_core::TableApi for RemoteTable {
    fn name(&self) -> &str {
        RemoteTable::name(self)
    }
    fn dim(&self) -> usize {
        RemoteTable::dim(self)
    }
    fn meta(&self) -> TableMeta {
        RemoteTable::meta(self)
    }
    fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        RemoteTable::pull(self, keys, out)
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        RemoteTable::lookup(self, keys, out, found)
    }
    fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        RemoteTable::push(self, keys, rows)
    }
    fn delete(&self, keys: &[u64]) -> Result<u64> {
        RemoteTable::delete(self, keys)
    }
    fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        RemoteTable::push_grad(self, keys, grads)
    }
    fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()> {
        RemoteTable::pull_held(self, worker, keys, out, timeout)
    }
    fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        RemoteTable::push_grad_held(self, worker, keys, grads)
    }
    fn release(&self, worker: u64) -> Result<u64> {
        RemoteTable::release(self, worker)
    }
    fn set_lr(&self, lr: f32) -> Result<()> {
        RemoteTable::set_lr(self, lr)
    }
    fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        RemoteTable::lookahead(self, keys)
    }
    fn evict_expired(&self) -> Result<u64> {
        RemoteTable::evict_expired(self)
    }
    fn len(&self) -> Result<u64> {
        RemoteTable::len(self)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        RemoteTable::stats(self)
    }
    fn lookup_min(&self, keys: &[u64], out: &mut [f32], found: &mut [bool], min: Option<u64>) -> Result<()> {
        RemoteTable::lookup_min(self, keys, out, found, min)
    }
    fn export(&self, chunk_keys: usize, f: embank_core::api::ChunkSink<'_>) -> Result<()> {
        RemoteTable::export(self, chunk_keys, f)
    }
}

impl embank_core::StoreApi for Client {
    fn location(&self) -> String {
        self.url()
    }
    fn served(&self) -> Result<serde_json::Value> {
        Ok(serde_json::Value::Array(Client::served(self)?))
    }
    fn lookup_checkpoint(
        &self,
        name: &str,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        Client::table(self, name)?.lookup_at(batch_id, keys, out, found)
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn is_closed(&self) -> bool {
        Client::is_closed(self)
    }
    fn create_table(&self, name: &str, options: TableOptions) -> Result<std::sync::Arc<dyn embank_core::TableApi>> {
        Ok(std::sync::Arc::new(Client::create_table(self, name, options)?))
    }
    fn table(&self, name: &str) -> Result<std::sync::Arc<dyn embank_core::TableApi>> {
        Ok(std::sync::Arc::new(Client::table(self, name)?))
    }
    fn tables(&self) -> Result<Vec<String>> {
        Client::tables(self)
    }
    fn drop_table(&self, name: &str) -> Result<()> {
        Client::drop_table(self, name)
    }
    fn flush(&self) -> Result<()> {
        Client::flush(self)
    }
    fn close(&self) -> Result<()> {
        if Client::is_closed(self) {
            return Ok(());
        }
        // Read-only replica groups (fed by an update stream) take no writes to flush.
        let read_only = self.inner.shards.iter().all(|s| s.replicas[0].read_only.load(Ordering::Relaxed));
        let flushed = if read_only { Ok(()) } else { Client::flush(self) };
        Client::close(self);
        flushed
    }
    fn checkpoint(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        self.checkpoint_with_meta(batch_id, meta)
    }
    fn checkpoints(&self) -> Result<Vec<embank_core::CheckpointInfo>> {
        Client::checkpoints(self)
    }
    fn restore(&self, batch_id: u64) -> Result<()> {
        Client::restore(self, batch_id)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        Client::stats(self)
    }
}

#[cfg(test)]
mod tests {
    use super::merge_stats;
    use serde_json::json;

    #[test]
    fn stats_merge_sums_and_recomputes_ratios() {
        let a = json!({"rows": 3, "slots": 10, "load_factor": 0.3, "dim": 4, "medium": "mmap",
                       "probe_histogram": [3, 0], "cache_hits": 1, "cache_misses": 1, "cache_hit_rate": 0.5,
                       "tables": [{"name": "t", "rows": 3}], "shard": "a"});
        let b = json!({"rows": 5, "slots": 10, "load_factor": 0.5, "dim": 4, "medium": "mmap",
                       "probe_histogram": [4, 1], "cache_hits": 3, "cache_misses": 0, "cache_hit_rate": 1.0,
                       "tables": [{"name": "t", "rows": 5}, {"name": "u", "rows": 1}], "shard": "b"});
        let m = merge_stats(&[a, b]);
        assert_eq!(m["rows"], 8);
        assert_eq!(m["dim"], 4);
        assert_eq!(m["load_factor"], 0.4);
        assert_eq!(m["cache_hit_rate"], 0.8);
        assert_eq!(m["probe_histogram"], json!([7, 1]));
        assert_eq!(m["medium"], "mmap");
        assert_eq!(m["tables"], json!([{"name": "t", "rows": 8}, {"name": "u", "rows": 1}]));
        assert!(m.get("shard").is_none());
    }
}
