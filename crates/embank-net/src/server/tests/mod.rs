//! The server's logic in process: a `Server` over a store in a temporary directory,
//! listening on 127.0.0.1:0 and run on a thread of the test, and a bare peer that speaks
//! the frames byte by byte. No `embank serve` process, no brokers, and no sleeping but in
//! the one test of a peer slow on purpose (`limits.rs`): every wait is a blocking read of
//! a reply or of the end of a connection (a read timeout only turns a server that never
//! answers into a failure instead of a hang). Randomized runs are seeded and print their
//! seed on failure.
//!
//! The loop is driven over loopback sockets rather than a byte buffer: `conn.rs` reads
//! through `tls::Stream`, whose socket also carries the read timeouts the loop uses to
//! notice a shutdown, an idle peer and the auth deadline; the sockets are the smallest
//! seam that runs that code as it runs in `embank serve`. The pending set is logic of its
//! own and is driven directly (`limits.rs`).

mod auth;
mod export;
mod limits;
mod model;
mod refused;

use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use embank_core::{ErrorKind, Initializer, Optimizer, Result, Store, StoreOptions, TableOptions};

use super::{Ctx, Server, ServerOptions};
use crate::metrics::Metrics;
use crate::proto::{self, status, Header, Op, HEADER_BYTES, REPLY_BIT};

/// How long a peer waits for a byte before calling the server stuck.
const STUCK: Duration = Duration::from_secs(20);
/// Dim of the tables the tests make.
const DIM: usize = 4;

/// A running server over its own store.
struct Served {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ctx: Arc<Ctx>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Served {
    fn start(opts: ServerOptions) -> Served {
        Served::start_with(opts, |_| {})
    }

    /// A server over a fresh store that `setup` prepares before the first connection.
    fn start_with(opts: ServerOptions, setup: impl FnOnce(&Store)) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path(), StoreOptions::default()).unwrap());
        setup(&store);
        let server = Server::bind("127.0.0.1:0", Arc::clone(&store), opts).unwrap();
        let (addr, metrics, ctx) = (server.local_addr(), server.metrics(), Arc::clone(&server.ctx));
        let shutdown = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let shutdown = Arc::clone(&shutdown);
            move || server.run(&shutdown, Duration::from_secs(10))
        });
        Served { _dir: dir, store, addr, metrics, ctx, shutdown, thread: Some(thread) }
    }

    fn peer(&self) -> Peer {
        Peer::connect(self.addr)
    }

    fn open(&self) -> u64 {
        self.metrics.connections_open.load(Ordering::Relaxed)
    }

    fn pending(&self) -> Vec<u64> {
        self.ctx.pending.lock().iter().map(|p| p.id).collect()
    }

    /// Waits until `f` holds (a connection's thread updates the counters after its peer
    /// has gone); fails after `STUCK`.
    fn until(&self, what: &str, f: impl Fn(&Served) -> bool) {
        let start = Instant::now();
        while !f(self) {
            assert!(start.elapsed() < STUCK, "{what}: never happened");
            std::thread::yield_now();
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let run = t.join();
            if !std::thread::panicking() {
                run.expect("the accept loop does not panic").expect("run returns Ok after a shutdown");
            }
        }
    }
}

/// One reply: its header and body.
struct Reply {
    h: Header,
    body: Vec<u8>,
}

impl Reply {
    fn message(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The reply, which must be OK.
    fn ok(self, what: &str) -> Reply {
        assert_eq!(self.h.status, status::OK, "{what}: expected OK, got status {}: {}", self.h.status, self.message());
        self
    }

    /// The error message of a reply that must have `want` as its status.
    fn refused(&self, want: u16, what: &str) -> String {
        assert_eq!(self.h.status, want, "{what}: expected status {want}, got {}: {}", self.h.status, self.message());
        self.message()
    }

    fn u64(&self) -> u64 {
        assert_eq!(self.body.len(), 8, "a u64 reply of {} bytes", self.body.len());
        u64::from_le_bytes(self.body[..8].try_into().unwrap())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.message()))
    }

    /// A lookup's reply: which keys were found, and the rows.
    fn found_rows(&self) -> (Vec<bool>, Vec<f32>) {
        let n = self.h.count as usize;
        let mask = &self.body[..proto::mask_bytes(n)];
        let found = (0..n).map(|i| mask[i / 8] & (1 << (i % 8)) != 0).collect();
        (found, floats(&self.body[proto::mask_bytes(n)..]))
    }
}

fn floats(b: &[u8]) -> Vec<f32> {
    assert_eq!(b.len() % 4, 0, "rows of {} bytes", b.len());
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// A bare peer: frames out, replies in, nothing checked but what the test asks.
struct Peer {
    stream: TcpStream,
    next_request: u64,
}

impl Peer {
    fn connect(addr: SocketAddr) -> Peer {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(STUCK)).unwrap();
        stream.set_nodelay(true).unwrap();
        Peer { stream, next_request: 1 }
    }

    fn raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// Sends a request of any opcode (known or not); returns its request id.
    fn send(&mut self, opcode: u16, table: u32, count: u32, body: &[u8]) -> u64 {
        let id = self.next_request;
        self.next_request += 1;
        let h = Header { opcode, request_id: id, table_id: table, count, body_len: body.len() as u32, status: 0 };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(body);
        self.raw(&frame);
        id
    }

    fn reply(&mut self) -> Reply {
        let mut head = [0u8; HEADER_BYTES];
        self.stream.read_exact(&mut head).unwrap_or_else(|e| panic!("no reply header: {e}"));
        let h = Header::decode(&head).expect("a reply header decodes");
        let mut body = vec![0u8; h.body_len as usize];
        self.stream.read_exact(&mut body).unwrap_or_else(|e| panic!("no reply body: {e}"));
        Reply { h, body }
    }

    /// One request and its reply (which must be to it).
    fn call_raw(&mut self, opcode: u16, table: u32, count: u32, body: &[u8]) -> Reply {
        let id = self.send(opcode, table, count, body);
        let r = self.reply();
        assert_eq!((r.h.request_id, r.h.opcode), (id, opcode | REPLY_BIT), "a reply to another request");
        r
    }

    fn call(&mut self, op: Op, table: u32, count: u32, body: &[u8]) -> Reply {
        self.call_raw(op as u16, table, count, body)
    }

    /// True once the server has closed the connection (and sent nothing more).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        loop {
            return match self.stream.read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) if e.kind() == IoErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), IoErrorKind::ConnectionReset | IoErrorKind::ConnectionAborted) => true,
                Err(e) => panic!("the connection neither closed nor spoke: {e}"),
            };
        }
    }

    fn hello(&mut self, token: &str) -> Reply {
        self.call(Op::Hello, 0, 0, token.as_bytes())
    }

    /// Creates `name` over the wire; its table id.
    fn create(&mut self, name: &str, options: &TableOptions) -> u32 {
        let body = serde_json::json!({ "name": name, "options": options }).to_string();
        let r = self.call(Op::CreateTable, 0, 0, body.as_bytes()).ok("create_table");
        assert_eq!(r.h.count as usize, options.dim as usize, "create_table answers the dim in count");
        r.h.table_id
    }

    /// A keyed request of `op`: the prefix words, the keys, then the rows.
    fn keyed(&mut self, op: Op, table: u32, prefix: &[u64], keys: &[u64], rows: &[f32]) -> Reply {
        self.call(op, table, keys.len() as u32, &keyed_body(prefix, keys, rows))
    }

    fn lookup(&mut self, table: u32, keys: &[u64]) -> (Vec<bool>, Vec<f32>) {
        self.keyed(Op::Lookup, table, &[], keys, &[]).ok("lookup").found_rows()
    }

    fn push(&mut self, table: u32, keys: &[u64], rows: &[f32]) {
        self.keyed(Op::Push, table, &[], keys, rows).ok("push");
    }
}

fn keyed_body(prefix: &[u64], keys: &[u64], rows: &[f32]) -> Vec<u8> {
    let mut b: Vec<u8> = prefix.iter().chain(keys).flat_map(|k| k.to_le_bytes()).collect();
    b.extend(rows.iter().flat_map(|x| x.to_le_bytes()));
    b
}

/// A small table of `DIM` with rows that differ per key when created, and SGD.
fn options() -> TableOptions {
    TableOptions {
        init: Initializer::Uniform { low: -1.0, high: 1.0 },
        seed: 7,
        capacity: 4096,
        optimizer: Optimizer::Sgd { lr: 0.5 },
        ..TableOptions::new(DIM as u32)
    }
}

/// Distinct rows for `keys`: key k's row is k, k + 0.25, ...
fn rows_of(keys: &[u64]) -> Vec<f32> {
    keys.iter().flat_map(|&k| (0..DIM).map(move |j| k as f32 + j as f32 * 0.25)).collect()
}

fn status_of(kind: ErrorKind) -> u16 {
    proto::status_of(kind)
}

/// A server with table "t" holding keys 1..=8 (rows `rows_of`), and a peer on it.
fn with_rows(opts: ServerOptions) -> (Served, Peer, u32) {
    let s = Served::start(opts);
    let mut p = s.peer();
    let t = p.create("t", &options());
    p.push(t, &KEPT, &rows_of(&KEPT));
    (s, p, t)
}

/// The keys `with_rows` writes.
const KEPT: [u64; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// Checks that table `t` still holds `KEPT` as written, over a fresh connection.
fn kept(s: &Served, t: u32, at: &str) {
    let mut p = s.peer();
    let (found, rows) = p.lookup(t, &KEPT);
    assert!(found.iter().all(|&f| f), "{at}: a key written before is gone: {found:?}");
    assert_eq!(rows, rows_of(&KEPT), "{at}: the rows written before changed");
}
