//! One client connection: reading frames (the frame timeout, a shutdown between
//! frames), the token and the connection limit, and the replies. What each request does
//! is in `ops`, by opcode family.

use std::io::{self, IoSlice, Read};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Table};

use super::Ctx;
use crate::proto::write_all_vectored;
use crate::proto::{self, as_bytes_mut, status, Header, Op, HEADER_BYTES};
use crate::tls::Stream;

/// What ended a frame read.
enum ReadEnd {
    Frame,
    /// Peer closed, or shutdown between frames.
    Closed,
}

/// One error reply, and whether the connection must close after it.
pub(super) struct Refusal {
    pub(super) status: u16,
    pub(super) message: String,
    pub(super) close: bool,
}

/// Why a request got no OK reply.
pub(super) enum Failure {
    /// Answered with an error reply; the connection goes on unless the refusal closes it.
    Refused(Refusal),
    /// The socket failed (the reply could not be written): the connection ends.
    Socket(io::Error),
}

/// What running a request gives.
pub(super) type Handled = std::result::Result<(), Failure>;

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Failure {
        Failure::Refused(r)
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Failure {
        Failure::Socket(e)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Refused(Refusal::engine(e))
    }
}

impl Refusal {
    pub(super) fn engine(e: Error) -> Refusal {
        Refusal { status: proto::status_of(e.kind()), message: e.to_string(), close: false }
    }
    pub(super) fn frame(status: u16, message: String) -> Refusal {
        Refusal { status, message, close: false }
    }
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Refusal {
        Refusal::engine(e)
    }
}

pub(super) struct Conn<'a> {
    pub(super) ctx: &'a Ctx,
    pub(super) stream: Stream,
    pub(super) peer: SocketAddr,
    pub(super) id: u64,
    pub(super) accepted: Instant,
    pub(super) authed: bool,
    /// Counted against `connections_max` (and no longer pending).
    pub(super) established: bool,
    pub(super) body: Vec<u64>,
    pub(super) rows: Vec<f32>,
}

impl<'a> Conn<'a> {
    pub(super) fn new(ctx: &'a Ctx, stream: Stream, peer: SocketAddr, id: u64) -> Conn<'a> {
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
    /// the pending set and counts against `connections_max`, or is refused if at it.
    pub(super) fn establish(&mut self) -> std::result::Result<(), Refusal> {
        self.ctx.forget_pending(self.id);
        let limit = self.ctx.opts.connections_max as u64;
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

    pub(super) fn serve(&mut self, shutdown: &AtomicBool) -> io::Result<()> {
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
            if h.body_len > self.ctx.opts.frame_bytes_max {
                self.ctx.metrics.record(Op::from_u16(h.opcode), 0, 0, status::TOO_LARGE);
                let message = format!(
                    "frame body of {} bytes is over this server's limit of {} (frame_bytes_max)",
                    h.body_len, self.ctx.opts.frame_bytes_max
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
                        Err(Failure::Refused(refusal)) => refusal.status,
                        Err(Failure::Socket(_)) => 0,
                    };
                    self.ctx.metrics.record(op, keys, t0.elapsed().as_micros() as u64, st);
                    r
                }
            };
            self.body = body;
            match result {
                Ok(()) => {}
                Err(Failure::Refused(refusal)) => {
                    let close = refusal.close;
                    self.refuse(&h, refusal)?;
                    if close {
                        return Ok(());
                    }
                }
                Err(Failure::Socket(io_error)) => return Err(io_error),
            }
        }
    }

    /// Fills `buf`. Between frames (`at_start` and nothing read yet) a shutdown or a
    /// closed peer ends the connection quietly; inside a frame the frame timeout applies,
    /// counted from the frame's first byte and checked after every read, so a peer that
    /// trickles bytes cannot keep a frame (or a connection that has not authenticated)
    /// open past its time.
    fn read_exact(&mut self, buf: &mut [u8], at_start: bool, shutdown: &AtomicBool) -> io::Result<ReadEnd> {
        let mut n = 0;
        let called = Instant::now();
        // When the frame's first byte came (a body's: when its header was whole).
        let mut begun = if at_start { None } else { Some(called) };
        while n < buf.len() {
            match self.stream.read(&mut buf[n..]) {
                Ok(0) => {
                    return if begun.is_none() {
                        Ok(ReadEnd::Closed)
                    } else {
                        Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed inside a frame"))
                    }
                }
                Ok(r) => {
                    n += r;
                    let begun = *begun.get_or_insert_with(Instant::now);
                    if n < buf.len() {
                        self.frame_late(begun)?;
                    }
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => match begun {
                    None => {
                        if shutdown.load(Ordering::Relaxed) {
                            return Ok(ReadEnd::Closed);
                        }
                        if called.elapsed() > self.ctx.opts.idle_timeout {
                            tracing::debug!(peer = %self.peer, "closing idle connection");
                            return Ok(ReadEnd::Closed);
                        }
                        if self.auth_expired() {
                            tracing::info!(peer = %self.peer, "closing a connection that did not authenticate in time");
                            return Ok(ReadEnd::Closed);
                        }
                    }
                    Some(begun) => self.frame_late(begun)?,
                },
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ReadEnd::Frame)
    }

    /// An error once a frame begun at `begun` is past its time: the connection's time to
    /// authenticate while it is pending, else the frame timeout.
    fn frame_late(&self, begun: Instant) -> io::Result<()> {
        if self.auth_expired() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no authentication within auth_timeout"));
        }
        if begun.elapsed() > self.ctx.opts.frame_timeout {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "frame not completed within frame_timeout"));
        }
        Ok(())
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

    pub(super) fn send(&mut self, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
        let bytes: usize = parts.iter().map(|p| p.len()).sum();
        self.ctx.metrics.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
        write_all_vectored(&mut self.stream, parts)
    }

    pub(super) fn reply_bytes(&mut self, h: &Header, count: u32, body: &[u8]) -> std::result::Result<(), io::Error> {
        let head = h.reply(count, body.len(), status::OK).encode();
        self.send(&mut [IoSlice::new(&head), IoSlice::new(body)])
    }

    /// An OK reply of `count` and `body`.
    pub(super) fn answer(&mut self, h: &Header, count: u32, body: &[u8]) -> Handled {
        Ok(self.reply_bytes(h, count, body)?)
    }

    /// An OK reply already framed in `parts` (its header first).
    pub(super) fn answer_parts(&mut self, parts: &mut [IoSlice<'_>]) -> Handled {
        Ok(self.send(parts)?)
    }

    pub(super) fn table(&self, id: u32) -> std::result::Result<Table, Refusal> {
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
}
