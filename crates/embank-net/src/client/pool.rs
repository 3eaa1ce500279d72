//! The shards' replicas: their addresses, pooled connections, health (see `health`) and
//! the checkpoint each last said it serves; opening a connection (TLS, the hello and its
//! token) within a deadline, and reading a reply frame, whole or as it arrives.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;

use super::health::{Counters, Latencies, Rotation};
use super::transport::Transport;
use super::Client;
use crate::proto::{self, write_all_vectored, Header, Op, HEADER_BYTES, REPLY_BIT};
use crate::tls::Stream;

/// One server of a shard's replica group.
pub(super) struct Endpoint {
    pub(super) addr: String,
    pub(super) pool: Mutex<Vec<Stream>>,
    /// In or out of the rotation.
    pub(super) rotation: Rotation,
    /// Connections whose request lost to a hedge sent to a sibling: their replies are
    /// read (and dropped) when the replica is next used, and a deadline they pass
    /// ejects it.
    pub(super) draining: Mutex<Vec<Draining>>,
    /// Its recent latencies (keyed requests): its requests' deadlines.
    pub(super) latency: Mutex<Latencies>,
    /// The checkpoint (batch id) it last said it serves.
    pub(super) served: Mutex<Option<u64>>,
    /// A read-only replica (its HELLO says so): pulls may go to any replica of the group.
    pub(super) read_only: AtomicBool,
    /// Tables' ids on this server, by name (learnt on first use; forgotten when it fails).
    pub(super) tables: Mutex<HashMap<String, u32>>,
    /// Requests answered, hedges, deadlines missed, ejections.
    pub(super) counters: Counters,
}

impl Endpoint {
    pub(super) fn new(addr: &str) -> Endpoint {
        Endpoint {
            addr: addr.trim().trim_start_matches("tcp://").to_string(),
            pool: Mutex::new(Vec::new()),
            rotation: Rotation::default(),
            draining: Mutex::new(Vec::new()),
            latency: Mutex::new(Latencies::default()),
            served: Mutex::new(None),
            read_only: AtomicBool::new(false),
            tables: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        }
    }
}

/// A key range: a group of replicas, the first of which takes the writes.
pub(super) struct Shard {
    pub(super) index: usize,
    /// Shared with the next shard map's shard that keeps the address (its connections,
    /// health and table ids go on).
    pub(super) replicas: Vec<Arc<Endpoint>>,
    /// Round-robin start of reads.
    pub(super) next: AtomicUsize,
    /// The group's recent latencies (keyed requests, every replica): its hedging delay.
    pub(super) latency: Mutex<Latencies>,
}

impl Shard {
    pub(super) fn name(&self) -> String {
        format!(
            "shard {} ({})",
            self.index,
            self.replicas.iter().map(|r| r.addr.as_str()).collect::<Vec<_>>().join(" | ")
        )
    }

    pub(super) fn replica_name(&self, r: usize) -> String {
        if self.replicas.len() == 1 {
            format!("shard {} ({})", self.index, self.replicas[0].addr)
        } else {
            format!("shard {} replica {r} ({})", self.index, self.replicas[r].addr)
        }
    }

    pub(super) fn unavailable(&self, r: usize, what: &str, e: &io::Error) -> Error {
        let kind = if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            ErrorKind::Timeout
        } else {
            ErrorKind::Unavailable
        };
        // A server that asks for client certificates ends the handshake of a client
        // without one with this alert: say what to set.
        let hint = if e.to_string().contains("CertificateRequired") {
            " (the server asks for a client certificate: set tls_cert_file and tls_key_file)"
        } else {
            ""
        };
        Error::new(kind, format!("{} {what}: {e}{hint}", self.replica_name(r)))
    }
}

/// Whether `e` says the server closed the connection.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Whether a pooled connection still has its server (no EOF, reset, or stray bytes waiting).
pub(super) fn alive(s: &mut Stream) -> bool {
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
    /// A new authenticated connection. A server closes connections that have not said
    /// hello yet when too many from one address (or in all) wait (`pending_per_peer_max`,
    /// `pending_max`): many trainer processes on one host that connect at once can lose a
    /// fresh connection that way before its hello is read. A hello answered by a closed
    /// connection is therefore tried again on a new one (a hello changes nothing), up to
    /// 8 times, each pause drawn from a range that doubles (1-11 ms, ..., 1-1,281 ms). A
    /// hello that times out is not tried again: the server may hang, and the call has
    /// its timeout. A server at `connections_max` answers BUSY, which is final. Connecting
    /// and the hello each wait at most `budget` (and connecting at most `connect_timeout`);
    /// no retry starts past `budget`.
    pub(super) fn open_conn(&self, shard: &Shard, r: usize, budget: Duration) -> Result<Stream> {
        let mut tries = 0;
        let started = Instant::now();
        loop {
            match self.open_conn_once(shard, r, budget) {
                Err((e, true)) if tries < HELLO_RETRIES && started.elapsed() < budget => {
                    tries += 1;
                    // Full jitter: clients closed together must not come back together.
                    let nanos = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos());
                    let seed =
                        embank_core::splitmix64(u64::from(nanos) ^ self.inner.next_id.fetch_add(1, Ordering::Relaxed));
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
    pub(super) fn open_conn_once(
        &self,
        shard: &Shard,
        r: usize,
        budget: Duration,
    ) -> std::result::Result<Stream, (Error, bool)> {
        let opts = &self.inner.opts;
        let ep = &shard.replicas[r];
        let addrs: Vec<SocketAddr> = ep
            .addr
            .to_socket_addrs()
            .map_err(|e| (Error::config(resolve_error(&shard.replica_name(r), &ep.addr, &e)), false))?
            .collect();
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, opts.connect_timeout.min(budget)) {
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
        // A stopped process still accepts: the hello is bounded by the budget too.
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(budget))?;
            s.set_write_timeout(Some(budget))
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
            // A server that knows a newer shard map: look for it now.
            if info["map_version"].as_u64().is_some_and(|v| v > self.topology().version) {
                self.hint_map();
            }
        }
        Ok(s)
    }

    /// A connection to replica `r` whose reads and writes wait at most `budget`: a pooled
    /// one whose server is still there, or a new one. Fails at once for a replica that
    /// let a request lost to a hedge pass its deadline (and ejects it), unless the
    /// request is one no other replica can take (`alone`: a write).
    pub(super) fn take_conn<T: Transport>(
        &self,
        t: &T,
        shard: &Shard,
        r: usize,
        budget: Duration,
        alone: bool,
    ) -> Result<T::Conn> {
        if self.inner.closed.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Closed, "the remote store is closed"));
        }
        if let Err(e) = self.reap(t, shard, r) {
            if !alone {
                return Err(e);
            }
        }
        match t.pooled(shard, r, budget)? {
            Some(conn) => Ok(conn),
            None => t.open(self, shard, r, budget),
        }
    }

    /// Reads the replies of replica `r`'s draining connections that have come (pooling the
    /// connections again); one past its deadline ejects the replica: `Err` then.
    pub(super) fn reap<T: Transport>(&self, t: &T, shard: &Shard, r: usize) -> Result<()> {
        let ep = &shard.replicas[r];
        let mut draining = t.draining(shard, r);
        if draining.is_empty() {
            return Ok(());
        }
        let now = t.now();
        let mut missed = None;
        let mut i = 0;
        while i < draining.len() {
            let d = &mut draining[i];
            match t.read(&mut d.conn, &mut d.frame) {
                Ok(None) if d.deadline > now => i += 1,
                Ok(None) => {
                    missed = Some(format!("did not answer a request within {} ms", d.allowed.as_millis()));
                    draining.swap_remove(i);
                }
                Ok(Some(_)) => {
                    let d = draining.swap_remove(i);
                    if t.set_nonblocking(&d.conn, false).is_ok() {
                        t.keep(shard, r, d.conn);
                    }
                }
                // Its server closed it (a restart, a crash): dropped, as a dead pooled
                // connection is; the next connection says whether the replica is back.
                Err(e) if closed(&e) => {
                    draining.swap_remove(i);
                }
                Err(e) => {
                    missed = Some(format!("failed a request: {e}"));
                    draining.swap_remove(i);
                }
            }
        }
        drop(draining);
        match missed {
            None => Ok(()),
            Some(why) => {
                Counters::bump(&ep.counters.deadlines_missed);
                self.eject(t, shard, r, &why);
                // A single server has no sibling to go to: a new connection is tried.
                if shard.replicas.len() == 1 {
                    return Ok(());
                }
                Err(Error::new(ErrorKind::Timeout, format!("{} {why}", shard.replica_name(r))))
            }
        }
    }
}

/// A connection whose request lost to a hedge: its reply is read and dropped.
pub(super) struct Draining<C = Stream> {
    pub(super) conn: C,
    pub(super) frame: Frame,
    pub(super) deadline: Instant,
    /// The request's deadline, as a duration (for the message).
    pub(super) allowed: Duration,
}

/// Draining connections kept per replica (more are closed).
pub(super) const DRAINING_MAX: usize = 64;

/// A reply frame read as it arrives on a non-blocking connection.
#[derive(Default)]
pub(super) struct Frame {
    head: [u8; HEADER_BYTES],
    header: Option<Header>,
    body: Vec<u8>,
    got: usize,
}

impl Frame {
    /// Reads what has arrived; the frame once whole (`Ok(None)` until then). The
    /// connection must be non-blocking.
    pub(super) fn read_from(&mut self, conn: &mut Stream) -> io::Result<Option<(Header, Vec<u8>)>> {
        loop {
            let buf = match &self.header {
                None => &mut self.head[self.got..],
                Some(h) if self.got == self.body.len() => {
                    let h = *h;
                    self.header = None;
                    self.got = 0;
                    return Ok(Some((h, std::mem::take(&mut self.body))));
                }
                Some(_) => &mut self.body[self.got..],
            };
            match conn.read(buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.got += n;
                    if self.header.is_none() && self.got == HEADER_BYTES {
                        let h = Header::decode(&self.head)
                            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                        self.body = vec![0u8; h.body_len as usize];
                        self.header = Some(h);
                        self.got = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Reads one reply frame.
pub(super) fn read_reply(conn: &mut Stream) -> io::Result<(Header, Vec<u8>)> {
    let mut hdr = [0u8; HEADER_BYTES];
    conn.read_exact(&mut hdr)?;
    let h = Header::decode(&hdr).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    conn.read_exact(&mut body)?;
    Ok((h, body))
}

/// Why a hello got no embank reply.
pub(super) enum HelloReply {
    Io(io::Error),
    /// Something else answered (an HTTP server, say): what it said, for the message.
    Foreign(String),
}

/// The reply to a hello. Bytes that do not start an embank frame fail at once, naming
/// what answered (`HTTP/1.1 400 Bad Request` from the admin port, say): such a peer is
/// not tried again.
pub(super) fn read_hello_reply(conn: &mut Stream) -> std::result::Result<(Header, Vec<u8>), HelloReply> {
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
        // Not an embank frame: read on to the end of its first line (or the header's
        // length, or the peer's end), so the message names what answered whole.
        if n >= 4 && hdr[..4] != proto::MAGIC.to_le_bytes() && hdr[..n].contains(&b'\n') {
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
pub(super) fn check_reply(shard: &Shard, r: usize, req: &Header, reply: &Header, body: Vec<u8>) -> Result<Vec<u8>> {
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
pub(super) const HELLO_RETRIES: u32 = 8;

/// Why `addr` did not resolve, for a person: a missing port said as such (the resolver's
/// own words for it are "invalid socket address").
fn resolve_error(name: &str, addr: &str, e: &io::Error) -> String {
    let has_port = match addr.strip_prefix('[') {
        Some(rest) => rest.contains("]:"),
        None => addr.contains(':'),
    };
    if has_port {
        format!("{name}: address does not resolve: {e}")
    } else {
        format!("{name}: address {addr:?} has no port: write host:port (the server's default is {addr}:7070)")
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::resolve_error;

    #[test]
    fn a_missing_port_is_named() {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "invalid socket address");
        let m = resolve_error("shard 0", "localhost", &e);
        assert!(m.contains("has no port") && m.contains("localhost:7070"), "{m}");
        assert!(resolve_error("shard 0", "[::1]", &e).contains("has no port"));
        let m = resolve_error("shard 0", "nohost.invalid:7070", &e);
        assert!(m.contains("does not resolve"), "{m}");
    }
}
