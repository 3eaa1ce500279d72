//! The shards' replicas: their addresses, pooled connections, health (marked down after
//! a failure) and the checkpoint each last said it serves; opening a connection (TLS,
//! the hello and its token) and reading a reply frame.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;

use super::Client;
use crate::proto::{self, Header, Op, HEADER_BYTES, REPLY_BIT};
use crate::server::write_all_vectored;
use crate::tls::Stream;

/// One server of a shard's replica group.
pub(super) struct Endpoint {
    pub(super) addr: String,
    pub(super) pool: Mutex<Vec<Stream>>,
    /// Reads skip it until then (it failed a request).
    pub(super) down_until: Mutex<Option<Instant>>,
    /// The checkpoint (batch id) it last said it serves.
    pub(super) served: Mutex<Option<u64>>,
    /// A read-only replica (its HELLO says so): pulls may go to any replica of the group.
    pub(super) read_only: AtomicBool,
    /// Tables' ids on this server, by name (learnt on first use; forgotten when it fails).
    pub(super) tables: Mutex<HashMap<String, u32>>,
    /// Requests it answered (reads and writes), for the share of reads each replica takes.
    pub(super) answered: AtomicU64,
}

impl Endpoint {
    pub(super) fn new(addr: &str) -> Endpoint {
        Endpoint {
            addr: addr.trim().trim_start_matches("tcp://").to_string(),
            pool: Mutex::new(Vec::new()),
            down_until: Mutex::new(None),
            served: Mutex::new(None),
            read_only: AtomicBool::new(false),
            tables: Mutex::new(HashMap::new()),
            answered: AtomicU64::new(0),
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
    pub(super) fn mark_down(&self, shard: &Shard, r: usize) {
        *shard.replicas[r].down_until.lock() = Some(Instant::now() + self.inner.opts.replica_retry_after);
        shard.replicas[r].pool.lock().clear();
        shard.replicas[r].tables.lock().clear();
        // A replica that fails may have been retired: look for a new shard map.
        self.hint_map();
    }

    /// A new authenticated connection. A server closes connections that have not said
    /// hello yet when too many from one address (or in all) wait (`pending_per_peer_max`,
    /// `pending_max`): many trainer processes on one host that connect at once can lose a
    /// fresh connection that way before its hello is read. A hello answered by a closed
    /// connection is therefore tried again on a new one (a hello changes nothing), up to
    /// 8 times, each pause drawn from a range that doubles (1-11 ms, ..., 1-1,281 ms). A
    /// hello that times out is not tried again: the server may hang, and the call has
    /// its timeout. A server at `connections_max` answers BUSY, which is final.
    pub(super) fn open_conn(&self, shard: &Shard, r: usize) -> Result<Stream> {
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
    pub(super) fn open_conn_once(&self, shard: &Shard, r: usize) -> std::result::Result<Stream, (Error, bool)> {
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
            .map_err(|e| (Error::config(resolve_error(&shard.replica_name(r), &ep.addr, &e)), false))?
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
            // A server that knows a newer shard map: look for it now.
            if info["map_version"].as_u64().is_some_and(|v| v > self.topology().version) {
                self.hint_map();
            }
        }
        Ok(s)
    }

    pub(super) fn take_conn(&self, shard: &Shard, r: usize) -> Result<Stream> {
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
