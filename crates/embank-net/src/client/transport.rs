//! What the client does with connections, as one trait: [`Wire`], the sockets, and in the
//! tests a simulated network of scripted replicas on a clock the tests move (`sim`).
//! Routing, failover, hedging, ejection, the prober's rounds and the map switch are
//! written once over it (`route`, `served`, `health`, `map`), so every decision they make
//! runs the same over either. A connection is pooled per replica; one whose request lost
//! to a hedge drains (see `pool`).

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::ops::DerefMut;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use embank_core::Result;

use super::pool::{alive, read_reply, Draining, Frame, Shard};
use super::Client;
use crate::proto::{write_all_vectored, Header};
use crate::tls::Stream;

/// The connections of a client, and the time.
pub(super) trait Transport {
    /// A connection to one replica.
    type Conn;
    /// A replica's draining connections, held while they are read.
    type Drains<'a>: DerefMut<Target = Vec<Draining<Self::Conn>>>
    where
        Self: 'a;

    fn now(&self) -> Instant;
    /// A new connection to replica `r`, its hello answered, within `budget`.
    fn open(&self, client: &Client, shard: &Shard, r: usize, budget: Duration) -> Result<Self::Conn>;
    /// A pooled connection to replica `r` whose server is still there, its reads and
    /// writes bounded by `budget`; `None` if there is none.
    fn pooled(&self, shard: &Shard, r: usize, budget: Duration) -> Result<Option<Self::Conn>>;
    /// Puts a connection back into replica `r`'s pool.
    fn keep(&self, shard: &Shard, r: usize, conn: Self::Conn);
    fn has_pooled(&self, shard: &Shard, r: usize) -> bool;
    /// Drops replica `r`'s pooled connections.
    fn clear_pool(&self, shard: &Shard, r: usize);
    /// Replica `r`'s connections whose request lost to a hedge.
    fn draining<'a>(&'a self, shard: &'a Shard, r: usize) -> Self::Drains<'a>;
    fn write(&self, conn: &mut Self::Conn, parts: &mut [IoSlice<'_>]) -> io::Result<()>;
    /// One reply frame, waiting for it (at most the connection's budget).
    fn read_blocking(&self, conn: &mut Self::Conn) -> io::Result<(Header, Vec<u8>)>;
    /// What has arrived of a reply; the frame once whole. The connection is non-blocking.
    fn read(&self, conn: &mut Self::Conn, frame: &mut Frame) -> io::Result<Option<(Header, Vec<u8>)>>;
    fn set_nonblocking(&self, conn: &Self::Conn, on: bool) -> io::Result<()>;
    /// Waits until one of `conns` is readable (or failed) or `timeout` passes, and says
    /// which are in `ready`; a zero `timeout` marks them all ready at once.
    fn wait<'c>(&self, conns: impl Iterator<Item = &'c mut Self::Conn>, timeout: Duration, ready: &mut Vec<bool>)
    where
        Self::Conn: 'c;
}

/// The sockets: TCP (or TLS over it), `ppoll` to wait, the pools in the endpoints.
#[derive(Default)]
pub(super) struct Wire {
    fds: RefCell<Vec<libc::pollfd>>,
}

impl Transport for Wire {
    type Conn = Stream;
    type Drains<'a> = parking_lot::MutexGuard<'a, Vec<Draining>>;

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn open(&self, client: &Client, shard: &Shard, r: usize, budget: Duration) -> Result<Stream> {
        client.open_conn(shard, r, budget)
    }

    fn pooled(&self, shard: &Shard, r: usize, budget: Duration) -> Result<Option<Stream>> {
        loop {
            let pooled = shard.replicas[r].pool.lock().pop();
            let Some(mut s) = pooled else { return Ok(None) };
            if alive(&mut s) {
                let tcp = s.tcp();
                tcp.set_read_timeout(Some(budget))
                    .and_then(|()| tcp.set_write_timeout(Some(budget)))
                    .map_err(|e| shard.unavailable(r, "socket setup failed", &e))?;
                return Ok(Some(s));
            }
            tracing::debug!(replica = %shard.replica_name(r), "dropping a dead pooled connection");
        }
    }

    fn keep(&self, shard: &Shard, r: usize, conn: Stream) {
        shard.replicas[r].pool.lock().push(conn);
    }

    fn has_pooled(&self, shard: &Shard, r: usize) -> bool {
        !shard.replicas[r].pool.lock().is_empty()
    }

    fn clear_pool(&self, shard: &Shard, r: usize) {
        shard.replicas[r].pool.lock().clear();
    }

    fn draining<'a>(&'a self, shard: &'a Shard, r: usize) -> Self::Drains<'a> {
        shard.replicas[r].draining.lock()
    }

    fn write(&self, conn: &mut Stream, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
        write_all_vectored(conn, parts)
    }

    fn read_blocking(&self, conn: &mut Stream) -> io::Result<(Header, Vec<u8>)> {
        read_reply(conn)
    }

    fn read(&self, conn: &mut Stream, frame: &mut Frame) -> io::Result<Option<(Header, Vec<u8>)>> {
        frame.read_from(conn)
    }

    fn set_nonblocking(&self, conn: &Stream, on: bool) -> io::Result<()> {
        conn.tcp().set_nonblocking(on)
    }

    fn wait<'c>(&self, conns: impl Iterator<Item = &'c mut Stream>, timeout: Duration, ready: &mut Vec<bool>) {
        let mut fds = self.fds.borrow_mut();
        fds.clear();
        let mut ready_now = false;
        for s in conns {
            ready_now |= s.buffered();
            fds.push(libc::pollfd { fd: s.tcp().as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        if !ready_now && !timeout.is_zero() {
            poll(&mut fds, timeout);
        } else {
            fds.iter_mut().for_each(|f| f.revents = libc::POLLIN);
        }
        ready.clear();
        ready.extend(fds.iter().map(|f| f.revents != 0));
    }
}

/// Waits until one of `fds` is readable (or fails) or `wait` passes.
fn poll(fds: &mut [libc::pollfd], wait: Duration) {
    let ts = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd; a null signal mask.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
    if n < 0 {
        // EINTR: the loop looks again.
        fds.iter_mut().for_each(|f| f.revents = 0);
    }
}
