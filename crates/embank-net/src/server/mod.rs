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
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{CheckpointPin, Error, Result, Store, Table};
use parking_lot::{Mutex, RwLock};

mod conn;
mod ops;
#[cfg(test)]
mod tests;

use conn::Conn;

use crate::metrics::Metrics;
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
    pub frame_bytes_max: u32,
    /// Most keys in one request. Default 65 536.
    pub keys_per_request_max: u32,
    /// Most established client connections at once (authenticated, or past their
    /// first frame on a server without a token). Default 1024.
    pub connections_max: usize,
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
    pub zero_copy_row_bytes_min: usize,
    /// A replica fed by the update stream: requests that would change rows are refused
    /// with this reason, and `pull` answers missing rows with the table's missing-row
    /// default without creating them (as `lookup` does). None: a writable server.
    pub read_only: Option<String>,
    /// The shard map clients reload: its `version` goes out in every hello (a client on an
    /// older version looks for the new one at once). None: no version named.
    pub shard_map: Option<std::path::PathBuf>,
}

/// The `version` of the shard map file at `path` (0 without one; None if unreadable).
pub(crate) fn map_version(path: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: toml::Table = toml::from_str(&text).ok()?;
    Some(v.get("version").and_then(|v| v.as_integer()).map_or(0, |v| v.max(0) as u64))
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            token: None,
            tls: None,
            insecure: false,
            frame_bytes_max: 64 << 20,
            keys_per_request_max: 65_536,
            connections_max: 1024,
            auth_timeout: Duration::from_secs(5),
            pending_max: 64,
            pending_per_peer_max: 16,
            idle_timeout: Duration::from_secs(600),
            frame_timeout: Duration::from_secs(30),
            zero_copy: true,
            zero_copy_row_bytes_min: 1024,
            read_only: None,
            shard_map: None,
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
    /// Checkpoints being exported (`EXPORT_AT`), by seq: each kept from retention until
    /// [`EXPORT_LEASE`] after its last page was asked for.
    export_leases: Mutex<HashMap<u64, (CheckpointPin, Instant)>>,
}

/// How long a checkpoint stays retained after its last `EXPORT_AT` page: a copy that takes
/// longer than the store's retention window (a new replica copying its sibling while
/// training publishes every 100 ms) would otherwise never finish, each attempt outrun by
/// retention.
pub(crate) const EXPORT_LEASE: Duration = Duration::from_secs(30);

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

    /// Keeps the store's checkpoint `batch_id` (its own numbering) retained for
    /// [`EXPORT_LEASE`] from now: an export reads it page by page.
    fn lease_checkpoint(&self, batch_id: u64) -> Result<()> {
        let seq = self.store.checkpoints()?.iter().rev().find(|c| c.batch_id == batch_id).map(|c| c.seq).ok_or_else(
            || Error::new(embank_core::ErrorKind::NotFound, format!("no retained checkpoint {batch_id}")),
        )?;
        let mut leases = self.export_leases.lock();
        let until = Instant::now() + EXPORT_LEASE;
        if let Some(lease) = leases.get_mut(&seq) {
            lease.1 = until;
        } else {
            leases.insert(seq, (self.store.pin_checkpoint(seq)?, until));
        }
        Ok(())
    }
}

impl Server {
    /// What `bind` checks before it listens (`embank serve --check-config` runs it too):
    /// `addr` resolves, and anything but loopback has a token and TLS (or `insecure`).
    pub fn check_listen(addr: &str, opts: &ServerOptions) -> Result<Vec<SocketAddr>> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| {
                let hint = if addr.parse::<u16>().is_ok() {
                    format!(": it is a port alone; write host:port, e.g. \"127.0.0.1:{addr}\"")
                } else if !addr.contains(':') {
                    ": it has no port; write host:port".to_owned()
                } else {
                    String::new()
                };
                Error::config(format!("listen address {addr:?} does not resolve: {e}{hint}"))
            })?
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
        Ok(addrs)
    }

    /// Binds `addr`. Anything but a loopback address needs `opts.token`.
    pub fn bind(addr: &str, store: Arc<Store>, opts: ServerOptions) -> Result<Server> {
        let addrs = Server::check_listen(addr, &opts)?;
        // The accept loop evicts from the pending set: it must hold at least one.
        for (name, v) in [
            ("connections_max", opts.connections_max),
            ("pending_max", opts.pending_max),
            ("pending_per_peer_max", opts.pending_per_peer_max),
        ] {
            if v == 0 {
                return Err(Error::config(format!("server option {name} must be at least 1, got 0")));
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
                export_leases: Mutex::new(HashMap::new()),
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
            let now = Instant::now();
            self.ctx.export_leases.lock().retain(|_, (_, until)| *until > now);
        }
        self.ctx.export_leases.lock().clear();
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
