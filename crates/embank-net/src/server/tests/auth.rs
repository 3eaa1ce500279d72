//! The hello, the token, and what a read-only replica refuses.

use super::*;
use crate::stream::view::ServedView;

const TOKEN: &str = "s3cret-token";

fn with_token() -> ServerOptions {
    ServerOptions { token: Some(TOKEN.into()), ..ServerOptions::default() }
}

#[test]
fn hello_says_what_the_server_is_and_takes() {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("shards.toml");
    std::fs::write(&map, "version = 7\n[[shards]]\nreplicas = [\"a:1\"]\n").unwrap();
    let opts = ServerOptions {
        frame_bytes_max: 1 << 20,
        keys_per_request_max: 1000,
        shard_map: Some(map.clone()),
        ..ServerOptions::default()
    };
    let s = Served::start(opts);
    let mut p = s.peer();
    let info = p.hello("").ok("hello").json();
    assert_eq!(info["server"], "embank", "{info}");
    assert_eq!(info["protocol"].as_u64(), Some(proto::VERSION as u64), "{info}");
    assert_eq!(info["keys_per_request_max"].as_u64(), Some(1000), "{info}");
    assert_eq!(info["frame_bytes_max"].as_u64(), Some(1 << 20), "{info}");
    assert_eq!(info["read_only"].as_bool(), Some(false), "{info}");
    assert_eq!(info["map_version"].as_u64(), Some(7), "{info}");
    // A newer map: the next hello names it.
    std::fs::write(&map, "version = 8\n").unwrap();
    assert_eq!(s.peer().hello("").ok("hello").json()["map_version"].as_u64(), Some(8));
    std::fs::remove_file(&map).unwrap();
    assert!(s.peer().hello("").ok("hello").json()["map_version"].is_null(), "an unreadable map names no version");
}

#[test]
fn a_token_is_required_before_anything_else() {
    let s = Served::start(with_token());
    // Any request before the hello, a hello without the token and one with another token:
    // each refused, and its connection closed.
    let mut p = s.peer();
    let message = p.call(Op::ListTables, 0, 0, &[]).refused(status::UNAUTHORIZED, "a request before the hello");
    assert!(message.contains("send HELLO"), "{message}");
    assert!(p.closed(), "a connection refused for its token stays open");
    let wrong = [("", "requires a token"), ("s3cret-toke", "wrong token"), ("s3cret-token!", "wrong token")];
    for (token, says) in wrong {
        let mut p = s.peer();
        let message = p.hello(token).refused(status::UNAUTHORIZED, &format!("hello with {token:?}"));
        assert!(message.contains(says), "hello with {token:?}: {message}");
        assert!(p.closed(), "hello with {token:?}: the connection stays open");
    }
    assert_eq!(s.metrics.errors_of(status::UNAUTHORIZED), 4);
    assert_eq!(s.open(), 0, "a connection refused its token counts as established");
    // The token: then everything.
    let mut p = s.peer();
    p.hello(TOKEN).ok("hello with the token");
    assert_eq!(s.open(), 1);
    let t = p.create("t", &options());
    p.push(t, &KEPT, &rows_of(&KEPT));
    assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT));
    // An unknown opcode before the hello is refused as any frame but a HELLO is (FORMAT.md,
    // "Authentication"), not answered as unknown on a connection left open; after it, as
    // unknown.
    let mut q = s.peer();
    q.call_raw(99, 0, 0, &[]).refused(status::UNAUTHORIZED, "unknown opcode before the hello");
    assert!(q.closed(), "an unknown opcode kept a connection open without the token");
    p.call_raw(99, 0, 0, &[]).refused(status::UNKNOWN_OPCODE, "unknown opcode after the hello");
    assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT), "the connection after an unknown opcode");
}

#[test]
fn a_server_without_a_token_refuses_a_client_that_sends_one() {
    let s = Served::start(ServerOptions::default());
    let mut p = s.peer();
    let message = p.hello("a token").refused(status::UNAUTHORIZED, "a token to a server without one");
    assert!(message.contains("takes no token"), "{message}");
    assert!(p.closed());
    // Without one it is in, hello or no hello.
    s.peer().hello("").ok("hello without a token");
    s.peer().call(Op::ListTables, 0, 0, &[]).ok("a first request without a hello");
}

/// A read-only server over a store that holds table "t" with `KEPT`.
fn replica(opts: ServerOptions) -> (Served, u32) {
    let opts = ServerOptions { read_only: Some("a replica of the stream".into()), ..opts };
    let s = Served::start_with(opts, |store| {
        let t = store.create_table("t", options()).unwrap();
        t.push(&KEPT, &rows_of(&KEPT)).unwrap();
    });
    let t = s.store.table("t").unwrap().meta().id;
    (s, t)
}

#[test]
fn a_read_only_server_refuses_every_write_and_reads_without_creating() {
    for zero_copy in [true, false] {
        let (s, t) = replica(ServerOptions { zero_copy, zero_copy_row_bytes_min: 0, ..ServerOptions::default() });
        let at = if zero_copy { "zero-copy" } else { "copied" };
        let mut p = s.peer();
        assert_eq!(p.hello("").ok("hello").json()["read_only"].as_bool(), Some(true));
        let unsupported = status_of(ErrorKind::Unsupported);
        let create = serde_json::json!({ "name": "u", "options": options() }).to_string();
        let writes: [(Op, u32, Vec<u8>); 12] = [
            (Op::CreateTable, 0, create.into_bytes()),
            (Op::DropTable, 0, b"t".to_vec()),
            (Op::Push, 1, keyed_body(&[], &[1], &[0.0; DIM])),
            (Op::Delete, 1, keyed_body(&[], &[1], &[])),
            (Op::PushGrad, 1, keyed_body(&[], &[1], &[1.0; DIM])),
            (Op::SetLr, 0, 1.0f32.to_le_bytes().to_vec()),
            (Op::PullHeld, 1, keyed_body(&[1, 10], &[1], &[])),
            (Op::PushGradHeld, 1, keyed_body(&[1], &[1], &[1.0; DIM])),
            (Op::Release, 0, 1u64.to_le_bytes().to_vec()),
            (Op::Checkpoint, 0, 1u64.to_le_bytes().to_vec()),
            (Op::Restore, 0, 1u64.to_le_bytes().to_vec()),
            (Op::EvictExpired, 0, Vec::new()),
        ];
        for (op, count, body) in writes {
            assert!(op.writes(), "{} is no write", op.name());
            let message = p.call(op, t, count, &body).refused(unsupported, &format!("{at}: {}", op.name()));
            assert!(message.contains("a replica of the stream"), "{at}: {}: {message}", op.name());
        }
        // Reads are served; a pull of keys it lacks answers the missing-row default and
        // creates nothing, as a lookup does.
        let asked = [1, 2, 100, 3, 101];
        let r = p.keyed(Op::Pull, t, &[], &asked, &[]).ok(&format!("{at}: pull"));
        let direct = s.store.table("t").unwrap();
        let (mut want, mut found) = (vec![0f32; asked.len() * DIM], vec![false; asked.len()]);
        direct.lookup(&asked, &mut want, &mut found).unwrap();
        assert_eq!(floats(&r.body), want, "{at}: a replica's pull");
        assert_eq!(found, [true, true, false, true, false], "{at}: a replica's pull created rows");
        assert_eq!(
            p.call(Op::Len, t, 0, &[]).ok("len").u64(),
            KEPT.len() as u64,
            "{at}: a replica's pull created rows"
        );
        assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT), "{at}: lookup");
        p.keyed(Op::LookupStored, t, &[], &KEPT, &[]).ok("lookup_stored");
        p.call(Op::Flush, 0, 0, &[]).ok("flush");
        assert_eq!(s.store.tables().unwrap(), ["t"], "{at}: tables");
        kept(&s, t, at);
    }
}

#[test]
fn a_replica_copying_a_checkpoint_refuses_table_requests_as_unavailable() {
    let (s, t) = replica(ServerOptions::default());
    let view = Arc::new(ServedView::new(1 << 20));
    view.set_bootstrapping(true);
    assert!(s.ctx.view.set(Arc::clone(&view)).is_ok(), "the view is set once");
    let mut p = s.peer();
    let unavailable = status_of(ErrorKind::Unavailable);
    p.keyed(Op::Lookup, t, &[], &KEPT, &[]).refused(unavailable, "lookup while bootstrapping");
    p.call(Op::OpenTable, 0, 0, b"t").refused(unavailable, "open while bootstrapping");
    p.call(Op::Len, t, 0, &[]).refused(unavailable, "len while bootstrapping");
    // What a client asks to route by is still answered.
    for op in [Op::Hello, Op::Served, Op::StoreStats, Op::ListTables, Op::Checkpoints] {
        p.call(op, 0, 0, &[]).ok(&format!("{} while bootstrapping", op.name()));
    }
    // Copied: the replica reads through its view (nothing kept in it: the live table).
    view.set_bootstrapping(false);
    assert_eq!(p.lookup(t, &KEPT), (vec![true; KEPT.len()], rows_of(&KEPT)), "a lookup once it serves");
}
