//! The server: a thin, run-to-completion loop over a [`Store`].
//!
//! One thread per client connection reads a frame, runs it on the store and writes
//! the reply before reading the next (clients get parallelism from several
//! connections; the sharding client keeps a pool of them). Blocking sockets and
//! threads, not an async runtime, because a zero-copy reply holds the table's read
//! lock and an epoch guard while its rows leave through `writev` — state that must
//! not cross an `.await` — and because every request is short, CPU-bound work on
//! memory or on the store's own io_uring.
//!
//! Malformed input never crashes the server: a frame whose header cannot be trusted
//! (bad magic or version, a body over the frame limit) gets an error reply and its
//! connection is closed, since the stream cannot be resynchronised; any other bad
//! request (unknown opcode or table, wrong lengths, too many keys) gets an error
//! reply and the connection goes on.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, ExportCursor, Result, Store, Table, TableOptions};
use parking_lot::{Mutex, RwLock};
use serde::Deserialize;

use crate::metrics::Metrics;
use crate::proto::{self, as_bytes, as_bytes_mut, mask_bytes, status, Header, Op, HEADER_BYTES};
use crate::tls::{ServerTls, Stream};

/// Limits and behaviour of a server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Shared secret every connection must present (HELLO) before anything else.
    /// Required when listening on anything but loopback.
    pub token: Option<String>,
    /// TLS for every connection (with a client CA: mutual TLS). Required when listening
    /// on anything but loopback, unless `insecure`.
    pub tls: Option<ServerTls>,
    /// Allow a non-loopback listener without TLS (the token and every row then cross
    /// the network in clear text; logged loudly). Default false.
    pub insecure: bool,
    /// Largest request body accepted. Default 64 MiB.
    pub max_frame_bytes: u32,
    /// Most keys in one request. Default 65 536.
    pub keys_per_request_max: u32,
    /// Most established client connections at once (authenticated, or past their
    /// first frame on a server without a token). Default 1024.
    pub max_connections: usize,
    /// A new connection must authenticate (or, without a token, send its first whole
    /// frame) within this, or it is closed. Default 5 s.
    pub auth_timeout: Duration,
    /// Most connections not yet established at once; a new one past it evicts the
    /// oldest such connection, so sockets that never speak cannot lock out a client
    /// with the token. Default 64.
    pub pending_max: usize,
    /// The same bound per peer address (a peer past it loses its own oldest pending
    /// connection first). Default 16.
    pub pending_per_peer_max: usize,
    /// A connection silent this long is closed. Default 10 minutes.
    pub idle_timeout: Duration,
    /// A frame must arrive whole within this once its first byte has. Default 30 s.
    pub frame_timeout: Duration,
    /// Send pull/lookup rows straight from the mapped rows file with vectored writes
    /// (no copy into a reply buffer). Default true.
    pub zero_copy: bool,
    /// ... but only for rows of at least this many bytes. Default 1024: measured on
    /// loopback, 512-byte rows went out ~15 % faster copied into one buffer (the kernel's
    /// per-segment cost outweighs the copy), 2 KiB rows ~23 % faster zero-copy.
    pub zero_copy_min_row_bytes: usize,
    /// A replica fed by the update stream: requests that would change rows are refused
    /// with this reason, and `pull` answers missing rows with the table's missing-row
    /// default without creating them (as `lookup` does). None: a writable server.
    pub read_only: Option<String>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            token: None,
            tls: None,
            insecure: false,
            max_frame_bytes: 64 << 20,
            keys_per_request_max: 65_536,
            max_connections: 1024,
            auth_timeout: Duration::from_secs(5),
            pending_max: 64,
            pending_per_peer_max: 16,
            idle_timeout: Duration::from_secs(600),
            frame_timeout: Duration::from_secs(30),
            zero_copy: true,
            zero_copy_min_row_bytes: 1024,
            read_only: None,
        }
    }
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    ctx: Arc<Ctx>,
}

struct Ctx {
    store: Arc<Store>,
    opts: ServerOptions,
    /// A replica's served view: pulls and lookups read the last committed checkpoint
    /// through it, whole (copied, never zero-copy).
    view: std::sync::OnceLock<Arc<crate::stream::view::ServedView>>,
    metrics: Arc<Metrics>,
    /// Open tables by their id on this store.
    tables: RwLock<HashMap<u32, Table>>,
    /// Connection threads still running.
    live: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Established connections.
    open: AtomicU64,
    /// Connections not yet established, oldest first (a handle to shut each down).
    pending: Mutex<std::collections::VecDeque<Pending>>,
    next_conn_id: AtomicU64,
}

/// A connection that has not authenticated (or sent its first frame) yet.
struct Pending {
    id: u64,
    peer: std::net::IpAddr,
    stream: TcpStream,
}

impl Ctx {
    /// Registers a new connection as pending, evicting the oldest pending connections
    /// of its peer, then of anyone, past the bounds.
    fn admit_pending(&self, id: u64, peer: SocketAddr, stream: &TcpStream) {
        let mut pending = self.pending.lock();
        let evict = |p: Pending, why: &str| {
            tracing::info!(peer = %p.peer, why, "closing a connection that has not authenticated");
            self.metrics.connections_evicted.fetch_add(1, Ordering::Relaxed);
            let _ = p.stream.shutdown(std::net::Shutdown::Both);
        };
        while pending.iter().filter(|p| p.peer == peer.ip()).count() >= self.opts.pending_per_peer_max {
            let i = pending.iter().position(|p| p.peer == peer.ip()).expect("counted above");
            evict(pending.remove(i).expect("in range"), "pending_per_peer_max");
        }
        while pending.len() >= self.opts.pending_max {
            evict(pending.pop_front().expect("not empty"), "pending_max");
        }
        if let Ok(handle) = stream.try_clone() {
            pending.push_back(Pending { id, peer: peer.ip(), stream: handle });
        }
    }

    fn forget_pending(&self, id: u64) {
        self.pending.lock().retain(|p| p.id != id);
    }
}

impl Server {
    /// Binds `addr`. Anything but a loopback address needs `opts.token`.
    pub fn bind(addr: &str, store: Arc<Store>, opts: ServerOptions) -> Result<Server> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::config(format!("listen address {addr:?} does not resolve: {e}")))?
            .collect();
        if opts.token.is_none() {
            if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
                return Err(Error::config(format!(
                    "listening on {a} (not loopback) requires an auth token: set `token` (or `token_file`) in the config"
                )));
            }
        }
        if opts.token.as_deref() == Some("") {
            return Err(Error::config("the auth token is empty"));
        }
        if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
            match (&opts.tls, opts.insecure) {
                (Some(_), _) => {}
                (None, true) => tracing::warn!(
                    listen = %a,
                    "INSECURE: listening on a non-loopback address without TLS; the token and every row cross the network in clear text"
                ),
                (None, false) => {
                    return Err(Error::config(format!(
                        "listening on {a} (not loopback) requires TLS: set [tls] cert_file and key_file in the config (or insecure = true to accept clear text)"
                    )))
                }
            }
        }
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| Error::io(format!("cannot listen on {addr}"), e))?;
        Ok(Server {
            listener,
            ctx: Arc::new(Ctx {
                store,
                opts,
                view: std::sync::OnceLock::new(),
                metrics: Arc::new(Metrics::default()),
                tables: RwLock::new(HashMap::new()),
                live: Mutex::new(Vec::new()),
                open: AtomicU64::new(0),
                pending: Mutex::new(std::collections::VecDeque::new()),
                next_conn_id: AtomicU64::new(1),
            }),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.ctx.metrics)
    }

    /// Serves pulls and lookups through a replica's view (its last committed checkpoint,
    /// whole). Set once, before [`serve`](Self::serve).
    pub fn set_view(&self, view: Arc<crate::stream::view::ServedView>) {
        let _ = self.ctx.view.set(view);
    }

    /// Serves until `shutdown` is set, then stops accepting, lets every connection
    /// finish the request it is in, and returns once they have closed (or after
    /// `drain` has passed). Flushing the store is the caller's business.
    pub fn run(&self, shutdown: &Arc<AtomicBool>, drain: Duration) -> Result<()> {
        let fd = self.listener.as_raw_fd();
        self.listener.set_nonblocking(true).map_err(|e| Error::io("listener", e))?;
        while !shutdown.load(Ordering::Relaxed) {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 100) };
            loop {
                match self.listener.accept() {
                    Ok((stream, peer)) => self.spawn(stream, peer, shutdown),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        // EMFILE and friends: back off rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        std::thread::sleep(Duration::from_millis(50));
                        break;
                    }
                }
            }
            self.ctx.live.lock().retain(|h| !h.is_finished());
        }
        tracing::info!("shutting down: no new connections; waiting for requests in flight");
        let deadline = Instant::now() + drain;
        loop {
            let live: Vec<_> = std::mem::take(&mut *self.ctx.live.lock());
            let (done, running): (Vec<_>, Vec<_>) = live.into_iter().partition(|h| h.is_finished());
            for h in done {
                let _ = h.join();
            }
            if running.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    connections = running.len(),
                    "connections still busy after the drain time; leaving them"
                );
                break;
            }
            self.ctx.live.lock().extend(running);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn spawn(&self, stream: TcpStream, peer: SocketAddr, shutdown: &Arc<AtomicBool>) {
        let ctx = Arc::clone(&self.ctx);
        ctx.metrics.connections_total.fetch_add(1, Ordering::Relaxed);
        // Every connection starts pending; the limit of established connections is
        // checked when it authenticates (`Conn::establish`).
        let id = ctx.next_conn_id.fetch_add(1, Ordering::Relaxed);
        ctx.admit_pending(id, peer, &stream);
        let shutdown = Arc::clone(shutdown);
        let spawned = std::thread::Builder::new().name("embank-conn".into()).spawn({
            let ctx = Arc::clone(&ctx);
            move || {
                let stream = match &ctx.opts.tls {
                    Some(tls) => match tls.accept(stream) {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "cannot start a TLS session");
                            ctx.forget_pending(id);
                            return;
                        }
                    },
                    None => Stream::Plain(stream),
                };
                let mut conn = Conn::new(&ctx, stream, peer, id);
                if let Err(e) = conn.serve(&shutdown) {
                    tracing::debug!(%peer, error = %e, "connection ended");
                }
                if conn.established {
                    ctx.open.fetch_sub(1, Ordering::Relaxed);
                    ctx.metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
                } else {
                    ctx.forget_pending(id);
                }
            }
        });
        match spawned {
            Ok(h) => ctx.live.lock().push(h),
            Err(e) => {
                tracing::error!(error = %e, "cannot start a connection thread");
                ctx.forget_pending(id);
            }
        }
    }
}

/// What ended a frame read.
enum ReadEnd {
    Frame,
    /// Peer closed, or shutdown between frames.
    Closed,
}

/// One error reply, and whether the connection must close after it.
struct Refusal {
    status: u16,
    message: String,
    close: bool,
}

impl Refusal {
    fn engine(e: Error) -> Refusal {
        Refusal { status: proto::status_of(e.kind()), message: e.to_string(), close: false }
    }
    fn frame(status: u16, message: String) -> Refusal {
        Refusal { status, message, close: false }
    }
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Refusal {
        Refusal::engine(e)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    name: String,
    options: TableOptions,
}

struct Conn<'a> {
    ctx: &'a Ctx,
    stream: Stream,
    peer: SocketAddr,
    id: u64,
    accepted: Instant,
    authed: bool,
    /// Counted against `max_connections` (and no longer pending).
    established: bool,
    body: Vec<u64>,
    rows: Vec<f32>,
}

impl<'a> Conn<'a> {
    fn new(ctx: &'a Ctx, stream: Stream, peer: SocketAddr, id: u64) -> Conn<'a> {
        Conn {
            ctx,
            stream,
            peer,
            id,
            accepted: Instant::now(),
            authed: ctx.opts.token.is_none(),
            established: false,
            body: Vec::new(),
            rows: Vec::new(),
        }
    }

    /// The connection authenticated (or, without a token, sent a whole frame): it leaves
    /// the pending set and counts against `max_connections`, or is refused if at it.
    fn establish(&mut self) -> std::result::Result<(), Refusal> {
        self.ctx.forget_pending(self.id);
        let limit = self.ctx.opts.max_connections as u64;
        let claimed = self.ctx.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1));
        if claimed.is_err() {
            self.ctx.metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %self.peer, limit, "connection refused: at the connection limit");
            return Err(Refusal {
                status: status::BUSY,
                message: format!("server is at its limit of {limit} connections"),
                close: true,
            });
        }
        self.established = true;
        self.ctx.metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// True when a connection that is still pending has used up its time to authenticate.
    fn auth_expired(&self) -> bool {
        !self.established && self.accepted.elapsed() > self.ctx.opts.auth_timeout
    }

    fn serve(&mut self, shutdown: &AtomicBool) -> io::Result<()> {
        let tcp = self.stream.tcp();
        tcp.set_nonblocking(false)?;
        tcp.set_nodelay(true)?;
        // Short read timeouts let an idle connection notice a shutdown.
        tcp.set_read_timeout(Some(Duration::from_millis(100)))?;
        tcp.set_write_timeout(Some(self.ctx.opts.frame_timeout))?;
        tracing::debug!(peer = %self.peer, "connection opened");
        let mut hdr = [0u8; HEADER_BYTES];
        loop {
            match self.read_exact(&mut hdr, true, shutdown)? {
                ReadEnd::Closed => return Ok(()),
                ReadEnd::Frame => {}
            }
            let h = match Header::decode(&hdr) {
                Ok(h) => h,
                Err(e) => {
                    let h = Header { opcode: 0, request_id: 0, table_id: 0, count: 0, body_len: 0, status: 0 };
                    self.ctx.metrics.record(None, 0, 0, status::BAD_FRAME);
                    return self.refuse(
                        &h,
                        Refusal { status: status::BAD_FRAME, message: format!("bad frame: {e}"), close: true },
                    );
                }
            };
            if h.body_len > self.ctx.opts.max_frame_bytes {
                self.ctx.metrics.record(Op::from_u16(h.opcode), 0, 0, status::TOO_LARGE);
                let message = format!(
                    "frame body of {} bytes is over this server's limit of {} (max_frame_bytes)",
                    h.body_len, self.ctx.opts.max_frame_bytes
                );
                return self.refuse(&h, Refusal { status: status::TOO_LARGE, message, close: true });
            }
            let words = (h.body_len as usize).div_ceil(8);
            if self.body.len() < words {
                self.body.resize(words, 0);
            }
            let mut body = std::mem::take(&mut self.body);
            let end = self.read_exact(&mut as_bytes_mut(&mut body)[..h.body_len as usize], false, shutdown);
            self.ctx.metrics.bytes_in.fetch_add(HEADER_BYTES as u64 + h.body_len as u64, Ordering::Relaxed);
            let result = match end? {
                ReadEnd::Closed => return Ok(()),
                ReadEnd::Frame => {
                    let t0 = Instant::now();
                    let r = self.handle(&h, &body);
                    let op = Op::from_u16(h.opcode);
                    let keys = if op.is_some_and(Op::has_keys) { h.count as u64 } else { 0 };
                    let st = match &r {
                        Ok(()) => 0,
                        Err(Ok(refusal)) => refusal.status,
                        Err(Err(_)) => 0,
                    };
                    self.ctx.metrics.record(op, keys, t0.elapsed().as_micros() as u64, st);
                    r
                }
            };
            self.body = body;
            match result {
                Ok(()) => {}
                Err(Ok(refusal)) => {
                    let close = refusal.close;
                    self.refuse(&h, refusal)?;
                    if close {
                        return Ok(());
                    }
                }
                Err(Err(io_error)) => return Err(io_error),
            }
        }
    }

    /// Fills `buf`. Between frames (`at_start` and nothing read yet) a shutdown or a
    /// closed peer ends the connection quietly; inside a frame the frame timeout applies.
    fn read_exact(&mut self, buf: &mut [u8], at_start: bool, shutdown: &AtomicBool) -> io::Result<ReadEnd> {
        let mut n = 0;
        let started = Instant::now();
        while n < buf.len() {
            match self.stream.read(&mut buf[n..]) {
                Ok(0) => {
                    return if n == 0 && at_start {
                        Ok(ReadEnd::Closed)
                    } else {
                        Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed inside a frame"))
                    }
                }
                Ok(r) => n += r,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    if n == 0 && at_start {
                        if shutdown.load(Ordering::Relaxed) {
                            return Ok(ReadEnd::Closed);
                        }
                        if started.elapsed() > self.ctx.opts.idle_timeout {
                            tracing::debug!(peer = %self.peer, "closing idle connection");
                            return Ok(ReadEnd::Closed);
                        }
                        if self.auth_expired() {
                            tracing::info!(peer = %self.peer, "closing a connection that did not authenticate in time");
                            return Ok(ReadEnd::Closed);
                        }
                    } else if self.auth_expired() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "no authentication within auth_timeout"));
                    } else if started.elapsed() > self.ctx.opts.frame_timeout {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "frame not completed within frame_timeout",
                        ));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ReadEnd::Frame)
    }

    fn refuse(&mut self, h: &Header, r: Refusal) -> io::Result<()> {
        if r.status == status::UNAUTHORIZED || r.close {
            tracing::info!(peer = %self.peer, status = r.status, message = %r.message, "refusing request");
        } else {
            tracing::debug!(peer = %self.peer, status = r.status, message = %r.message, "error reply");
        }
        let reply = h.reply(0, r.message.len(), r.status).encode();
        self.send(&mut [IoSlice::new(&reply), IoSlice::new(r.message.as_bytes())])
    }

    fn send(&mut self, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
        let bytes: usize = parts.iter().map(|p| p.len()).sum();
        self.ctx.metrics.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
        write_all_vectored(&mut self.stream, parts)
    }

    fn reply_bytes(&mut self, h: &Header, count: u32, body: &[u8]) -> std::result::Result<(), io::Error> {
        let head = h.reply(count, body.len(), status::OK).encode();
        self.send(&mut [IoSlice::new(&head), IoSlice::new(body)])
    }

    fn table(&self, id: u32) -> std::result::Result<Table, Refusal> {
        if let Some(t) = self.ctx.tables.read().get(&id) {
            return Ok(t.clone());
        }
        // Not opened through this server yet (or opened by another connection's OPEN_TABLE
        // before a restart): find it by id.
        for name in self.ctx.store.tables()? {
            let t = self.ctx.store.table(&name)?;
            if t.meta().id == id {
                self.ctx.tables.write().insert(id, t.clone());
                return Ok(t);
            }
        }
        // Closed, as an embedded table handle is after its table was dropped.
        Err(Refusal::engine(Error::new(
            ErrorKind::Closed,
            format!("table id {id} is not open on this server (dropped? open the table again by name)"),
        )))
    }

    /// Runs one request. `Err(Ok(_))`: reply with an error; `Err(Err(_))`: the socket failed.
    fn handle(&mut self, h: &Header, body: &[u64]) -> std::result::Result<(), std::result::Result<Refusal, io::Error>> {
        let Some(op) = Op::from_u16(h.opcode) else {
            return Err(Ok(Refusal::frame(status::UNKNOWN_OPCODE, format!("unknown opcode {}", h.opcode))));
        };
        let raw = &as_bytes(body)[..h.body_len as usize];
        if !self.authed {
            if op != Op::Hello {
                return Err(Ok(Refusal {
                    status: status::UNAUTHORIZED,
                    message: "this server requires a token: send HELLO with it first".into(),
                    close: true,
                }));
            }
            let expected = self.ctx.opts.token.as_deref().unwrap_or("").as_bytes();
            if !proto::token_eq(raw, expected) {
                let message = match (raw.is_empty(), expected.is_empty()) {
                    (true, _) => "this server requires a token: connect with token=...",
                    (false, true) => "this server takes no token: connect without one",
                    (false, false) => "wrong token",
                };
                return Err(Ok(Refusal { status: status::UNAUTHORIZED, message: message.into(), close: true }));
            }
            self.authed = true;
        }
        if !self.established {
            self.establish().map_err(Ok)?;
        }
        if let Some(why) = &self.ctx.opts.read_only {
            if op.writes() {
                return Err(Ok(Refusal::engine(Error::new(
                    embank_core::ErrorKind::Unsupported,
                    format!("{} refused: {why}", op.name()),
                ))));
            }
        }
        match op {
            Op::Hello => {
                let info = serde_json::json!({
                    "server": "embank",
                    "version": env!("CARGO_PKG_VERSION"),
                    "protocol": proto::VERSION,
                    "keys_per_request_max": self.ctx.opts.keys_per_request_max,
                    "max_frame_bytes": self.ctx.opts.max_frame_bytes,
                    "read_only": self.ctx.opts.read_only.is_some(),
                });
                self.reply_bytes(h, 0, info.to_string().as_bytes()).map_err(Err)
            }
            Op::ListTables => {
                let names = self.ctx.store.tables().map_err(|e| Ok(e.into()))?;
                let body = serde_json::to_vec(&names).expect("names serialize");
                self.reply_bytes(h, names.len() as u32, &body).map_err(Err)
            }
            Op::OpenTable | Op::CreateTable => {
                let text = std::str::from_utf8(raw)
                    .map_err(|_| Ok(Refusal::frame(status::BAD_FRAME, "table name or options are not UTF-8".into())))?;
                let table = if op == Op::OpenTable {
                    self.ctx.store.table(text)
                } else {
                    let c: CreateBody = serde_json::from_str(text)
                        .map_err(|e| Ok(Refusal::engine(Error::config(format!("bad create_table request: {e}")))))?;
                    self.ctx.store.create_table(&c.name, c.options)
                }
                .map_err(|e| Ok(e.into()))?;
                let meta = table.meta();
                self.ctx.tables.write().insert(meta.id, table);
                let body = serde_json::to_vec(&meta).expect("meta serializes");
                let head = Header { table_id: meta.id, ..*h }.reply(meta.dim, body.len(), status::OK).encode();
                self.send(&mut [IoSlice::new(&head), IoSlice::new(&body)]).map_err(Err)
            }
            Op::DropTable => {
                let name = std::str::from_utf8(raw)
                    .map_err(|_| Ok(Refusal::frame(status::BAD_FRAME, "table name is not UTF-8".into())))?;
                let id = self.ctx.store.table(name).map(|t| t.meta().id).ok();
                self.ctx.store.drop_table(name).map_err(|e| Ok(e.into()))?;
                if let Some(id) = id {
                    self.ctx.tables.write().remove(&id);
                }
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::StoreStats => {
                let s = self.ctx.store.stats().map_err(|e| Ok(e.into()))?;
                self.reply_bytes(h, 0, &serde_json::to_vec(&s).expect("stats serialize")).map_err(Err)
            }
            Op::Flush => {
                self.ctx.store.flush().map_err(|e| Ok(e.into()))?;
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::Checkpoint | Op::Restore => {
                // CHECKPOINT: the batch id, then the checkpoint's metadata blob (any length).
                if h.body_len < 8 || (op == Op::Restore && h.body_len != 8) {
                    return Err(Ok(Refusal::frame(
                        status::BAD_FRAME,
                        format!("{} takes an 8-byte batch id", op.name()),
                    )));
                }
                if op == Op::Checkpoint {
                    let meta = &as_bytes(body)[8..h.body_len as usize];
                    self.ctx.store.checkpoint_with_meta(body[0], meta).map_err(|e| Ok(e.into()))?;
                } else {
                    self.ctx.store.restore(body[0]).map_err(|e| Ok(e.into()))?;
                    // Every table handle was reopened: forget the old ones (ids stay the same).
                    self.ctx.tables.write().clear();
                }
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::Served => {
                let reply = match self.ctx.metrics.replica.get() {
                    Some(f) => {
                        let r = f();
                        let readable = crate::stream::view::readable(&self.ctx.store);
                        serde_json::json!({"batch_id": r.checkpoint_batch_id, "seq": r.checkpoint_seq, "replica": true, "state": r.state, "readable": readable})
                    }
                    None => {
                        let list = self.ctx.store.checkpoints().map_err(|e| Ok(e.into()))?;
                        let readable: Vec<u64> = list.iter().map(|c| c.batch_id).collect();
                        let last = list.last();
                        serde_json::json!({"batch_id": last.map(|c| c.batch_id), "seq": last.map(|c| c.seq), "replica": false, "state": "primary", "readable": readable})
                    }
                };
                self.reply_bytes(h, 0, reply.to_string().as_bytes()).map_err(Err)
            }
            Op::Checkpoints => {
                let list = self.ctx.store.checkpoints().map_err(|e| Ok(e.into()))?;
                self.reply_bytes(h, list.len() as u32, &serde_json::to_vec(&list).expect("serialize")).map_err(Err)
            }
            _ => self.table_op(op, h, body),
        }
    }

    fn table_op(
        &mut self,
        op: Op,
        h: &Header,
        body: &[u64],
    ) -> std::result::Result<(), std::result::Result<Refusal, io::Error>> {
        let table = self.table(h.table_id).map_err(Ok)?;
        let dim = table.dim();
        let n = h.count as usize;
        if op.has_keys() {
            if h.count > self.ctx.opts.keys_per_request_max {
                return Err(Ok(Refusal::frame(
                    status::TOO_LARGE,
                    format!(
                        "{} keys in one request; this server takes at most {} (keys_per_request_max)",
                        h.count, self.ctx.opts.keys_per_request_max
                    ),
                )));
            }
            let want = proto::keyed_body_len(op, h.count, dim);
            if want != h.body_len as u64 {
                return Err(Ok(Refusal::frame(
                    status::BAD_FRAME,
                    format!(
                        "{} of {} keys to table {:?} (dim {dim}) needs a body of {want} bytes, got {}{}",
                        op.name(),
                        h.count,
                        table.name(),
                        h.body_len,
                        if op.has_rows() { " (wrong dim?)" } else { "" }
                    ),
                )));
            }
        }
        let eng = |e: Error| Ok(Refusal::engine(e));
        let (prefix, body) = body.split_at(op.prefix_words().min(body.len()));
        match op {
            Op::Pull | Op::Lookup => {
                let keys = &body[..n];
                // A pull on a read-only replica answers like a lookup without the mask.
                let with_mask = op == Op::Lookup;
                let create = op == Op::Pull && self.ctx.opts.read_only.is_none();
                let view = self.ctx.view.get();
                if view.is_none()
                    && self.ctx.opts.zero_copy
                    && proto::row_bytes(dim) >= self.ctx.opts.zero_copy_min_row_bytes
                {
                    let metrics = Arc::clone(&self.ctx.metrics);
                    let stream = &mut self.stream;
                    let sent = table
                        .with_rows(keys, create, |rows, found| {
                            let mask = if with_mask { found_mask(found) } else { Vec::new() };
                            let body_len = mask.len() + rows.len() * proto::row_bytes(dim);
                            let head = h.reply(h.count, body_len, status::OK).encode();
                            let mut parts = Vec::with_capacity(rows.len() + 2);
                            parts.push(IoSlice::new(&head));
                            if !mask.is_empty() {
                                parts.push(IoSlice::new(&mask));
                            }
                            parts.extend(rows.iter().map(|r| IoSlice::new(r)));
                            metrics.bytes_out.fetch_add((HEADER_BYTES + body_len) as u64, Ordering::Relaxed);
                            write_all_vectored(stream, &mut parts)
                        })
                        .map_err(eng)?;
                    if let Some(r) = sent {
                        self.ctx.metrics.replies_zero_copy.fetch_add(1, Ordering::Relaxed);
                        return r.map_err(Err);
                    }
                }
                self.ctx.metrics.replies_copied.fetch_add(1, Ordering::Relaxed);
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let mask = if create {
                    table.pull(keys, &mut rows).map_err(eng)?;
                    Vec::new()
                } else {
                    let mut found = vec![false; n];
                    match view {
                        Some(v) => v.lookup(&table, keys, &mut rows, &mut found),
                        None => table.lookup(keys, &mut rows, &mut found),
                    }
                    .map_err(eng)?;
                    if with_mask {
                        found_mask(&found)
                    } else {
                        Vec::new()
                    }
                };
                let head = h.reply(h.count, mask.len() + rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                let r = self.send(&mut [IoSlice::new(&head), IoSlice::new(&mask), IoSlice::new(as_bytes(&rows))]);
                self.rows = rows;
                r.map_err(Err)
            }
            Op::LookupAt => {
                let (batch_id, keys) = (prefix[0], &body[..n]);
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let mut found = vec![false; n];
                let read = match self.ctx.view.get() {
                    Some(v) => v.lookup_at(&self.ctx.store, &table, batch_id, keys, &mut rows, &mut found),
                    None => self.ctx.store.lookup_checkpoint(table.name(), batch_id, keys, &mut rows, &mut found),
                };
                let sent = match read {
                    Ok(()) => {
                        let mask = found_mask(&found);
                        let head =
                            h.reply(h.count, mask.len() + rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                        self.send(&mut [IoSlice::new(&head), IoSlice::new(&mask), IoSlice::new(as_bytes(&rows))])
                            .map_err(Err)
                    }
                    Err(e) => Err(eng(e)),
                };
                self.rows = rows;
                sent
            }
            Op::Push | Op::PushGrad => {
                let (keys, rows) = proto::split_keyed(&body[..n + (n * dim).div_ceil(2)], n);
                let rows = &rows[..n * dim];
                if op == Op::Push { table.push(keys, rows) } else { table.push_grad(keys, rows) }.map_err(eng)?;
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::PullHeld => {
                let (worker, timeout) = (prefix[0], std::time::Duration::from_millis(prefix[1]));
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let r = table.pull_held(worker, &body[..n], &mut rows, timeout);
                let sent = match r {
                    Ok(()) => {
                        let head = h.reply(h.count, rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                        self.send(&mut [IoSlice::new(&head), IoSlice::new(as_bytes(&rows))]).map_err(Err)
                    }
                    Err(e) => Err(eng(e)),
                };
                self.rows = rows;
                sent
            }
            Op::PushGradHeld => {
                let (keys, grads) = proto::split_keyed(&body[..n + (n * dim).div_ceil(2)], n);
                table.push_grad_held(prefix[0], keys, &grads[..n * dim]).map_err(eng)?;
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::Release => {
                if h.body_len != 8 {
                    return Err(Ok(Refusal::frame(status::BAD_FRAME, "release takes an 8-byte worker id".into())));
                }
                let n = table.release(body[0]);
                self.reply_bytes(h, 0, &n.to_le_bytes()).map_err(Err)
            }
            Op::Delete => {
                let gone = table.delete(&body[..n]).map_err(eng)?;
                self.reply_bytes(h, 0, &gone.to_le_bytes()).map_err(Err)
            }
            Op::Lookahead => {
                let queued = table.lookahead(&body[..n]).map_err(eng)?;
                self.reply_bytes(h, 0, &(queued as u64).to_le_bytes()).map_err(Err)
            }
            Op::EvictExpired => {
                let gone = table.evict_expired().map_err(eng)?;
                self.reply_bytes(h, 0, &gone.to_le_bytes()).map_err(Err)
            }
            Op::Len => {
                let len = table.len().map_err(eng)?;
                self.reply_bytes(h, 0, &len.to_le_bytes()).map_err(Err)
            }
            Op::TableStats => {
                let s = table.stats().map_err(eng)?;
                self.reply_bytes(h, 0, &serde_json::to_vec(&s).expect("stats serialize")).map_err(Err)
            }
            Op::SetLr => {
                if h.body_len != 4 {
                    return Err(Ok(Refusal::frame(status::BAD_FRAME, "set_lr takes a 4-byte f32".into())));
                }
                let lr = f32::from_le_bytes(as_bytes(body)[..4].try_into().unwrap());
                table.set_lr(lr).map_err(eng)?;
                self.reply_bytes(h, 0, &[]).map_err(Err)
            }
            Op::Export => {
                if h.body_len != 24 {
                    return Err(Ok(Refusal::frame(status::BAD_FRAME, "export takes a 24-byte cursor".into())));
                }
                let cursor = ExportCursor { generation: body[0], bucket: body[1] };
                let max = (body[2] as usize).clamp(1, self.ctx.opts.keys_per_request_max as usize);
                let mut keys = Vec::new();
                let mut rows = std::mem::take(&mut self.rows);
                let next = table.export_page(cursor, max, &mut keys, &mut rows).map_err(eng)?;
                let (g, b, done) = match next {
                    Some(c) => (c.generation, c.bucket, 0u64),
                    None => (u64::MAX, 0, 1),
                };
                let mut cur = [0u8; 24];
                cur[..8].copy_from_slice(&g.to_le_bytes());
                cur[8..16].copy_from_slice(&b.to_le_bytes());
                cur[16..].copy_from_slice(&done.to_le_bytes());
                let body_len = 24 + keys.len() * 8 + rows.len() * proto::ROW_ELEMENT_BYTES;
                let head = h.reply(keys.len() as u32, body_len, status::OK).encode();
                let r = self.send(&mut [
                    IoSlice::new(&head),
                    IoSlice::new(&cur),
                    IoSlice::new(as_bytes(&keys)),
                    IoSlice::new(as_bytes(&rows)),
                ]);
                self.rows = rows;
                r.map_err(Err)
            }
            _ => unreachable!("store-level opcodes are handled by the caller"),
        }
    }
}

/// Bit i of byte i/8 set when row i was found; padded to 8 bytes.
pub fn found_mask(found: &[bool]) -> Vec<u8> {
    let mut mask = vec![0u8; mask_bytes(found.len())];
    for (i, &f) in found.iter().enumerate() {
        if f {
            mask[i / 8] |= 1 << (i % 8);
        }
    }
    mask
}

/// Writes every byte of `parts` (the kernel may take fewer than asked, and at most
/// IOV_MAX slices, per call).
pub fn write_all_vectored(stream: &mut impl Write, mut parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        match stream.write_vectored(parts) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "peer stopped taking bytes")),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
