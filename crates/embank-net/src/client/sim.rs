//! A simulated network for the client's tests: replicas a test scripts (answer after a
//! while, never answer, refuse connections, serve an older checkpoint, answer
//! `unavailable`), on a clock that moves only while the client waits. Every request
//! written is logged with what the client knew when it went out, so a test checks
//! invariants over a whole run. No sockets, no threads, no sleeping: latencies are drawn
//! from a seeded generator, so a run replays exactly from its seed.

use std::cell::{Cell, RefCell, RefMut};
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};

use super::pool::{Draining, Endpoint, Frame, Shard};
use super::transport::Transport;
use super::Client;
use crate::proto::{self, Header, Op, HEADER_BYTES};

/// How a replica behaves. A test changes it between calls (or from a call's reply).
#[derive(Clone, Debug)]
pub(super) struct Behaviour {
    /// Refuses connections, and its open ones end (a killed process, a host gone); the
    /// connections of before stay ended when it is up again (a restart).
    pub(super) down: bool,
    /// Takes connections and requests but answers nothing, not even a hello (a stopped
    /// process, a frozen disk); what it holds is answered when it resumes.
    pub(super) silent: bool,
    /// Each answer takes a time drawn evenly from this range.
    pub(super) latency: (Duration, Duration),
    /// The checkpoint it serves (`None`: none yet).
    pub(super) served: Option<u64>,
    /// Exact reads also find this many checkpoints before `served`.
    pub(super) keeps: u64,
    /// Answers reads `unavailable` (it copies a sibling's checkpoint).
    pub(super) unavailable: bool,
    /// Its hello says read-only (a replica fed by the update stream).
    pub(super) read_only: bool,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            down: false,
            silent: false,
            latency: (Duration::from_millis(1), Duration::from_millis(2)),
            served: Some(1),
            keeps: 0,
            unavailable: false,
            read_only: true,
        }
    }
}

/// A simulated connection to one replica.
pub(super) struct SimConn {
    addr: String,
    /// Its replica and the replica's group in the map the client took it for.
    replica: Arc<Endpoint>,
    group: Vec<Arc<Endpoint>>,
    shard: usize,
    /// The replica's life it was opened in (see [`Sim::restarts`]).
    life: u64,
    /// What a blocking read waits at most (the client's budget when it took it).
    budget: Duration,
    /// The request written and not yet answered: when its answer is due (`None` while
    /// the replica is silent) and the answer.
    pending: Option<(Option<Duration>, Header, Vec<u8>)>,
}

/// A request as the simulated replica saw it, with what the client knew when it sent it.
#[derive(Clone, Debug)]
pub(super) struct Request {
    /// The test's mark when it was sent (see [`Sim::mark`]).
    pub(super) mark: u64,
    pub(super) at: Duration,
    pub(super) addr: String,
    /// The shard the client sent it as (its index in the client's map).
    pub(super) shard: usize,
    pub(super) op: Op,
    /// Its keys (after the words before them, `LOOKUP_AT`'s checkpoint, say).
    pub(super) keys: Vec<u64>,
    /// The checkpoint the replica served then.
    pub(super) served: Option<u64>,
    /// The replica was out of the rotation then.
    pub(super) ejected: bool,
    /// Its group's replicas then: address, in the rotation, the checkpoint the client had
    /// last heard it serves.
    pub(super) group: Vec<(String, bool, Option<u64>)>,
}

/// The simulated network: replicas by address, their pooled and draining connections,
/// the clock and the log.
pub(super) struct Sim {
    start: Instant,
    clock: Cell<Duration>,
    rng: Cell<u64>,
    mark: Cell<u64>,
    /// Waits in a row that found nothing to read and let no time pass.
    spins: Cell<u32>,
    replicas: RefCell<HashMap<String, Behaviour>>,
    /// Times each replica went down: a connection of an earlier life is closed.
    restarts: RefCell<HashMap<String, u64>>,
    /// When each replica's behaviour last changed.
    changed: RefCell<HashMap<String, Duration>>,
    /// Pooled and draining connections per replica of the client's maps (by its
    /// endpoint, as the client keeps them: a replica new to a map starts with none).
    pools: RefCell<HashMap<usize, Vec<SimConn>>>,
    draining: RefCell<HashMap<usize, Vec<Draining<SimConn>>>>,
    log: RefCell<Vec<Request>>,
}

/// Waits in a row with nothing to read and no time passing that make a livelock.
const SPINS_MAX: u32 = 10_000;

/// The table id every simulated replica gives.
const TABLE_ID: u32 = 7;

impl Sim {
    pub(super) fn new(seed: u64) -> Sim {
        Sim {
            start: Instant::now(),
            clock: Cell::new(Duration::ZERO),
            rng: Cell::new(seed),
            mark: Cell::new(0),
            spins: Cell::new(0),
            replicas: RefCell::new(HashMap::new()),
            restarts: RefCell::new(HashMap::new()),
            changed: RefCell::new(HashMap::new()),
            pools: RefCell::new(HashMap::new()),
            draining: RefCell::new(HashMap::new()),
            log: RefCell::new(Vec::new()),
        }
    }

    /// The time since the simulation began.
    pub(super) fn elapsed(&self) -> Duration {
        self.clock.get()
    }

    pub(super) fn advance(&self, by: Duration) {
        self.clock.set(self.clock.get() + by);
    }

    /// Runs `f` as another thread would, beside a call: the time it takes (connecting to
    /// silent replicas, say) does not pass for the call.
    pub(super) fn aside<R>(&self, f: impl FnOnce() -> R) -> R {
        let now = self.clock.get();
        let r = f();
        self.clock.set(now);
        r
    }

    /// Tags the requests logged from now on (a test's call number, say).
    pub(super) fn mark(&self, mark: u64) {
        self.mark.set(mark);
    }

    pub(super) fn behaviour(&self, addr: &str) -> Behaviour {
        self.replicas.borrow().get(addr).cloned().unwrap_or_default()
    }

    /// Changes how `addr` behaves. A silent replica that resumes answers what it holds now.
    pub(super) fn set(&self, addr: &str, change: impl FnOnce(&mut Behaviour)) {
        let mut b = self.behaviour(addr);
        let was_down = b.down;
        change(&mut b);
        if b.down && !was_down {
            *self.restarts.borrow_mut().entry(addr.to_string()).or_default() += 1;
        }
        let silent = b.silent;
        self.replicas.borrow_mut().insert(addr.to_string(), b);
        self.changed.borrow_mut().insert(addr.to_string(), self.clock.get());
        if !silent {
            let now = self.clock.get();
            for d in self.draining.borrow_mut().values_mut().flatten().filter(|d| d.conn.addr == addr) {
                if let Some((due @ None, ..)) = &mut d.conn.pending {
                    *due = Some(now);
                }
            }
        }
    }

    /// How long `addr` has behaved as it does now.
    pub(super) fn unchanged_for(&self, addr: &str) -> Duration {
        self.clock.get() - self.changed.borrow().get(addr).copied().unwrap_or_default()
    }

    /// Every request written so far.
    pub(super) fn log(&self) -> Vec<Request> {
        self.log.borrow().clone()
    }

    /// A number from the seeded generator.
    pub(super) fn next_u64(&self) -> u64 {
        let x = embank_core::splitmix64(self.rng.get());
        self.rng.set(x);
        x
    }

    fn draw(&self, (low, high): (Duration, Duration)) -> Duration {
        let span = high.saturating_sub(low).as_micros() as u64;
        low + Duration::from_micros(if span == 0 { 0 } else { self.next_u64() % (span + 1) })
    }

    /// Replica `r`'s key in the pools: its endpoint (kept alive by its connections).
    fn key(shard: &Shard, r: usize) -> usize {
        Arc::as_ptr(&shard.replicas[r]) as usize
    }

    fn life(&self, addr: &str) -> u64 {
        self.restarts.borrow().get(addr).copied().unwrap_or(0)
    }

    /// Whether the replica's end of `conn` is closed: it is down, or restarted since.
    fn closed(&self, conn: &SimConn) -> bool {
        conn.life != self.life(&conn.addr) || self.replicas.borrow().get(&conn.addr).is_some_and(|b| b.down)
    }

    /// When `conn`'s answer is due: at once for a closed connection (the end of file),
    /// never while nothing is pending or the replica is silent.
    fn due(&self, conn: &SimConn) -> Option<Duration> {
        if self.closed(conn) {
            return Some(self.clock.get());
        }
        if self.behaviour(&conn.addr).silent {
            return None;
        }
        conn.pending.as_ref().and_then(|p| p.0)
    }

    fn conn(&self, shard: &Shard, r: usize, budget: Duration) -> SimConn {
        SimConn {
            addr: shard.replicas[r].addr.clone(),
            replica: Arc::clone(&shard.replicas[r]),
            group: shard.replicas.clone(),
            shard: shard.index,
            life: self.life(&shard.replicas[r].addr),
            budget,
            pending: None,
        }
    }

    /// What replica `addr` (behaving as `b`) answers to `h` with `body`.
    fn answer(b: &Behaviour, h: &Header, op: Option<Op>, body: &[u8]) -> (Header, Vec<u8>) {
        let error = |kind: ErrorKind, message: String| {
            let message = message.into_bytes();
            (h.reply(0, message.len(), proto::status_of(kind)), message)
        };
        let word = |i: usize| u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().unwrap());
        match op {
            Some(Op::OpenTable) => (Header { table_id: TABLE_ID, ..h.reply(0, 0, 0) }, Vec::new()),
            Some(Op::Served) => {
                let batch_id = if b.unavailable { None } else { b.served };
                let v = serde_json::json!({ "batch_id": batch_id, "readable": !b.unavailable }).to_string();
                (h.reply(0, v.len(), 0), v.into_bytes())
            }
            Some(op) if b.unavailable && op != Op::Push => {
                error(ErrorKind::Unavailable, "copying a sibling's checkpoint".into())
            }
            Some(op @ (Op::LookupAt | Op::ExportAt)) => {
                let at = word(0);
                let held = b.served.is_some_and(|s| at <= s && at + b.keeps >= s);
                if held {
                    (h.reply(h.count, 0, 0), Vec::new())
                } else {
                    error(ErrorKind::NotFound, format!("{} of checkpoint {at}: not held ({:?})", op.name(), b.served))
                }
            }
            _ => (h.reply(h.count, 0, 0), Vec::new()),
        }
    }
}

impl Transport for Sim {
    type Conn = SimConn;
    type Drains<'a> = RefMut<'a, Vec<Draining<SimConn>>>;

    fn now(&self) -> Instant {
        self.start + self.clock.get()
    }

    fn open(&self, _client: &Client, shard: &Shard, r: usize, budget: Duration) -> Result<SimConn> {
        let b = self.behaviour(&shard.replicas[r].addr);
        if b.down {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("{} is unreachable: connection refused (simulated)", shard.replica_name(r)),
            ));
        }
        if b.silent {
            // The connection is taken, the hello never answered.
            self.advance(budget);
            return Err(shard.unavailable(r, "did not answer the hello", &io::ErrorKind::WouldBlock.into()));
        }
        shard.replicas[r].read_only.store(b.read_only, Ordering::Relaxed);
        Ok(self.conn(shard, r, budget))
    }

    fn pooled(&self, shard: &Shard, r: usize, budget: Duration) -> Result<Option<SimConn>> {
        loop {
            let Some(mut conn) = self.pools.borrow_mut().get_mut(&Sim::key(shard, r)).and_then(Vec::pop) else {
                return Ok(None);
            };
            if self.closed(&conn) {
                continue;
            }
            // The map it was taken for may be a newer one.
            let fresh = self.conn(shard, r, budget);
            conn.group = fresh.group;
            conn.shard = fresh.shard;
            conn.budget = budget;
            return Ok(Some(conn));
        }
    }

    fn keep(&self, shard: &Shard, r: usize, conn: SimConn) {
        assert!(conn.pending.is_none(), "{}: a connection pooled with a request unanswered", conn.addr);
        self.pools.borrow_mut().entry(Sim::key(shard, r)).or_default().push(conn);
    }

    fn has_pooled(&self, shard: &Shard, r: usize) -> bool {
        self.pools.borrow().get(&Sim::key(shard, r)).is_some_and(|p| !p.is_empty())
    }

    fn clear_pool(&self, shard: &Shard, r: usize) {
        self.pools.borrow_mut().remove(&Sim::key(shard, r));
    }

    fn draining<'a>(&'a self, shard: &'a Shard, r: usize) -> Self::Drains<'a> {
        RefMut::map(self.draining.borrow_mut(), |m| m.entry(Sim::key(shard, r)).or_default())
    }

    fn write(&self, conn: &mut SimConn, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
        if self.closed(conn) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        assert!(conn.pending.is_none(), "{}: a second request on a connection before the first's answer", conn.addr);
        let bytes: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        let h = Header::decode(bytes[..HEADER_BYTES].try_into().unwrap()).expect("a request header");
        let body = &bytes[HEADER_BYTES..];
        assert_eq!(body.len(), h.body_len as usize, "{}: the body's length is not the header's", conn.addr);
        let op = Op::from_u16(h.opcode);
        let b = self.behaviour(&conn.addr);
        if let Some(op) = op.filter(|&op| op != Op::OpenTable) {
            let words: Vec<u64> = body.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())).collect();
            let prefix = if op.has_keys() { op.prefix_words().min(words.len()) } else { words.len() };
            let keys = if op.has_keys() { words[prefix..prefix + h.count as usize].to_vec() } else { Vec::new() };
            self.log.borrow_mut().push(Request {
                mark: self.mark.get(),
                at: self.clock.get(),
                addr: conn.addr.clone(),
                shard: conn.shard,
                op,
                keys,
                served: b.served,
                ejected: conn.replica.rotation.ejected.load(Ordering::Relaxed),
                group: conn
                    .group
                    .iter()
                    .map(|e| (e.addr.clone(), !e.rotation.ejected.load(Ordering::Relaxed), *e.served.lock()))
                    .collect(),
            });
        }
        let (rh, reply) = Sim::answer(&b, &h, op, body);
        let due = (!b.silent).then(|| self.clock.get() + self.draw(b.latency));
        conn.pending = Some((due, rh, reply));
        Ok(())
    }

    fn read_blocking(&self, conn: &mut SimConn) -> io::Result<(Header, Vec<u8>)> {
        match self.due(conn) {
            _ if self.closed(conn) => Err(io::ErrorKind::UnexpectedEof.into()),
            Some(due) if due <= self.clock.get() + conn.budget => {
                self.clock.set(self.clock.get().max(due));
                let (_, h, body) = conn.pending.take().expect("a request was written");
                Ok((h, body))
            }
            _ => {
                self.advance(conn.budget);
                Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out (simulated)"))
            }
        }
    }

    fn read(&self, conn: &mut SimConn, _frame: &mut Frame) -> io::Result<Option<(Header, Vec<u8>)>> {
        if self.closed(conn) {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        match self.due(conn) {
            Some(due) if due <= self.clock.get() => {
                let (_, h, body) = conn.pending.take().expect("an answer is due");
                Ok(Some((h, body)))
            }
            _ => Ok(None),
        }
    }

    fn set_nonblocking(&self, _conn: &SimConn, _on: bool) -> io::Result<()> {
        Ok(())
    }

    fn wait<'c>(&self, conns: impl Iterator<Item = &'c mut SimConn>, timeout: Duration, ready: &mut Vec<bool>) {
        let due: Vec<Option<Duration>> = conns.map(|c| self.due(c)).collect();
        ready.clear();
        if timeout.is_zero() {
            let idle = !due.iter().flatten().any(|&d| d <= self.clock.get());
            self.spins.set(if idle { self.spins.get() + 1 } else { 0 });
            assert!(
                self.spins.get() < SPINS_MAX,
                "the client spins: {SPINS_MAX} waits with nothing to read, no time passing"
            );
            ready.resize(due.len(), true);
            return;
        }
        self.spins.set(0);
        let limit = self.clock.get() + timeout;
        let first = due.iter().flatten().min().copied().filter(|&d| d <= limit);
        self.clock.set(self.clock.get().max(first.unwrap_or(limit)));
        ready.extend(due.iter().map(|d| d.is_some_and(|d| d <= self.clock.get())));
    }
}
