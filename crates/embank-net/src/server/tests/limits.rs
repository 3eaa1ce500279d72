//! The bounds on connections: established ones (`connections_max`), those not yet
//! established (`pending_max`, `pending_per_peer_max`: the oldest evicted), and the time
//! a connection has to authenticate.

use std::net::{IpAddr, Ipv4Addr, TcpListener};

use super::*;

const TOKEN: &str = "t0ken";

#[test]
fn a_connection_past_connections_max_is_refused_busy_until_one_closes() {
    let s = Served::start(ServerOptions { connections_max: 1, ..ServerOptions::default() });
    let mut a = s.peer();
    a.hello("").ok("the first connection");
    let mut b = s.peer();
    let message = b.hello("").refused(status::BUSY, "a second connection at connections_max 1");
    assert!(message.contains("limit of 1 connections"), "{message}");
    assert!(b.closed(), "a connection refused busy stays open");
    assert_eq!(s.metrics.connections_refused.load(Ordering::Relaxed), 1);
    // The first goes on; once it closes its place is free.
    a.call(Op::ListTables, 0, 0, &[]).ok("the first connection after the refusal");
    drop(a);
    s.until("the first connection's place freed", |s| s.open() == 0);
    s.peer().hello("").ok("a connection once the first closed");
    assert!(s.pending().is_empty(), "a refused or established connection left pending: {:?}", s.pending());
}

#[test]
fn a_peer_past_pending_per_peer_max_loses_its_oldest_silent_connection() {
    let opts = ServerOptions {
        token: Some(TOKEN.into()),
        pending_per_peer_max: 2,
        auth_timeout: Duration::from_secs(600),
        ..ServerOptions::default()
    };
    let s = Served::start(opts);
    let mut silent: Vec<Peer> = (0..3).map(|_| s.peer()).collect();
    // The server admits them in the order they connected: the third evicts the first.
    assert!(silent[0].closed(), "the oldest pending connection of a peer past its bound stays open");
    assert_eq!(s.metrics.connections_evicted.load(Ordering::Relaxed), 1);
    for (i, p) in silent.iter_mut().enumerate().skip(1) {
        p.hello(TOKEN).ok(&format!("pending connection {i}, within the bound"));
    }
    assert!(s.pending().is_empty(), "established connections left pending: {:?}", s.pending());
    assert_eq!(s.open(), 2);
}

/// A connected pair on loopback: the server's side and the peer's.
fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
    let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    peer.set_read_timeout(Some(STUCK)).unwrap();
    (listener.accept().unwrap().0, peer)
}

fn is_shut(peer: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    loop {
        match peer.read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return matches!(r, Ok(0)),
        }
    }
}

#[test]
fn the_pending_set_evicts_a_peers_own_oldest_first_then_the_oldest_of_all() {
    // Not running connections: the set itself, with peers at addresses of our choosing.
    let s = Served::start(ServerOptions { pending_max: 3, pending_per_peer_max: 2, ..ServerOptions::default() });
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = |last: u8| SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), 4000 + last as u16);
    let (a, b, c) = (at(1), at(2), at(3));
    // (id, peer, pending after, evicted by it)
    let steps: [(u64, SocketAddr, &[u64], &[u64]); 7] = [
        (1, b, &[1], &[]),
        (2, a, &[1, 2], &[]),
        (3, a, &[1, 2, 3], &[]),
        (4, a, &[1, 3, 4], &[2]), // a's third: a's own oldest goes, not b's older one
        (5, c, &[3, 4, 5], &[1]), // past pending_max: the oldest of all goes
        (6, c, &[4, 5, 6], &[3]),
        (7, c, &[4, 6, 7], &[5]), // c's third: c's own oldest again
    ];
    let mut peers: Vec<TcpStream> = Vec::new();
    for (id, peer, after, evicted) in steps {
        let (ours, theirs) = pair(&listener);
        s.ctx.admit_pending(id, peer, &ours);
        peers.push(theirs);
        assert_eq!(s.pending(), after, "after admitting {id} from {peer}");
        for &e in evicted {
            assert!(is_shut(&mut peers[e as usize - 1]), "admitting {id}: {e} evicted but not shut down");
        }
    }
    assert_eq!(s.metrics.connections_evicted.load(Ordering::Relaxed), 4);
    // A connection that establishes leaves the set, and makes room.
    s.ctx.forget_pending(6);
    assert_eq!(s.pending(), [4, 7]);
    let (ours, _theirs) = pair(&listener);
    s.ctx.admit_pending(8, a, &ours);
    assert_eq!(s.pending(), [4, 7, 8], "a free place after forget_pending");
    assert_eq!(s.metrics.connections_evicted.load(Ordering::Relaxed), 4);
    for id in [4, 7, 8] {
        s.ctx.forget_pending(id);
    }
}

#[test]
fn a_connection_silent_past_auth_timeout_is_closed() {
    for token in [Some(TOKEN.to_owned()), None] {
        let opts = ServerOptions { token: token.clone(), auth_timeout: Duration::ZERO, ..ServerOptions::default() };
        let s = Served::start(opts);
        let mut p = s.peer();
        assert!(p.closed(), "token {token:?}: a silent connection outlives auth_timeout");
        s.until("the silent connection forgotten", |s| s.pending().is_empty());
        assert_eq!(s.open(), 0, "token {token:?}: a silent connection counted as established");
    }
}

/// Writes `bytes` a few at a time, `gap` apart, until the server stops taking them.
fn trickle(p: &mut Peer, bytes: &[u8], chunk: usize, gap: Duration) {
    for part in bytes.chunks(chunk) {
        std::thread::sleep(gap);
        if p.stream.write_all(part).is_err() {
            return;
        }
    }
}

// The one test here that sleeps: a peer that is slow on purpose. What it asserts holds as
// long as the server's thread runs within several tenths of a second of the peer's bytes.
#[test]
fn frame_timeout_counts_from_a_frames_first_byte_and_trickled_bytes_do_not_extend_it() {
    let opts = ServerOptions { frame_timeout: Duration::from_millis(1000), ..ServerOptions::default() };
    let (s, mut p, t) = with_rows(opts);
    let frame = |p: &mut Peer| {
        let mut f = Header::request(Op::Lookup, p.next_request, t, 1, 8).encode().to_vec();
        p.next_request += 1;
        f.extend_from_slice(&1u64.to_le_bytes());
        f
    };
    // Idle longer than frame_timeout, then a frame whose header comes in two parts, a
    // read timeout of the server's apart: well within its time, counted from its first byte.
    std::thread::sleep(Duration::from_millis(1200));
    let f = frame(&mut p);
    trickle(&mut p, &f, 16, Duration::from_millis(300));
    let (found, rows) = p.reply().ok("a frame split after an idle connection").found_rows();
    assert_eq!((found, rows), (vec![true], rows_of(&[1])));
    // Bytes trickled faster than the server's read timeout, for longer than frame_timeout:
    // cut, not answered.
    let mut q = s.peer();
    let f = frame(&mut q);
    trickle(&mut q, &f, 1, Duration::from_millis(50));
    assert!(q.closed(), "a frame trickled over twice frame_timeout was answered");
    kept(&s, t, "after a trickled frame");
}

#[test]
fn a_bound_of_zero_is_refused_when_the_server_binds() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), StoreOptions::default()).unwrap());
    for (name, opts) in [
        ("connections_max", ServerOptions { connections_max: 0, ..ServerOptions::default() }),
        ("pending_max", ServerOptions { pending_max: 0, ..ServerOptions::default() }),
        ("pending_per_peer_max", ServerOptions { pending_per_peer_max: 0, ..ServerOptions::default() }),
    ] {
        let Err(e) = Server::bind("127.0.0.1:0", Arc::clone(&store), opts) else {
            panic!("a server with {name} 0 was bound (its accept loop would panic)")
        };
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains(name), "{e}");
    }
}
