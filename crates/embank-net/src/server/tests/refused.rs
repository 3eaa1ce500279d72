//! Bad input is answered, never crashes the server, and loses nothing: a header that
//! cannot be trusted gets an error reply and its connection closes (the stream cannot be
//! resynchronised); any other bad request gets an error reply of its kind and the
//! connection goes on. After each, the rows written before are all there.

use super::*;

/// A header of a lookup of one key, with `bytes` changed.
fn corrupt_header(at: usize, bytes: &[u8]) -> Vec<u8> {
    let mut frame = Header::request(Op::Lookup, 1, 1, 1, 8).encode().to_vec();
    frame[at..at + bytes.len()].copy_from_slice(bytes);
    frame.extend_from_slice(&1u64.to_le_bytes());
    frame
}

#[test]
fn a_header_that_cannot_be_trusted_is_answered_and_its_connection_closed() {
    let (s, _, t) = with_rows(ServerOptions::default());
    let cases = [
        ("bad magic", corrupt_header(0, b"XMBN"), "bad magic"),
        ("another protocol version", corrupt_header(4, &9u16.to_le_bytes()), "protocol version 9"),
        ("reserved bytes set", corrupt_header(30, &[1, 0]), "reserved"),
    ];
    for (what, frame, says) in cases {
        let mut p = s.peer();
        p.raw(&frame);
        let r = p.reply();
        let message = r.refused(status::BAD_FRAME, what);
        assert!(message.contains(says), "{what}: the message {message:?} does not say {says:?}");
        assert!(p.closed(), "{what}: the connection stays open after a header that cannot be trusted");
        kept(&s, t, what);
    }
    assert_eq!(s.metrics.errors_of(status::BAD_FRAME), 3);
}

#[test]
fn a_body_over_frame_bytes_max_is_refused_before_it_is_read() {
    let limit = 4096;
    let (s, mut p, t) = with_rows(ServerOptions { frame_bytes_max: limit, ..ServerOptions::default() });
    // A lookup of exactly the limit's bytes is taken...
    let keys: Vec<u64> = (0..limit as u64 / 8).collect();
    p.keyed(Op::Lookup, t, &[], &keys, &[]).ok("a body of frame_bytes_max bytes");
    // ... one byte more is refused from its header alone, before any body arrives.
    let mut q = s.peer();
    q.raw(&Header::request(Op::Push, 9, t, 1, limit + 1).encode());
    let message = q.reply().refused(status::TOO_LARGE, "a body of frame_bytes_max + 1 bytes");
    assert!(message.contains("frame_bytes_max"), "{message}");
    assert!(q.closed(), "the stream cannot be trusted after a body left unread");
    kept(&s, t, "after a body over the limit");
}

#[test]
fn too_many_keys_is_refused_and_the_connection_goes_on() {
    let (s, mut p, t) = with_rows(ServerOptions { keys_per_request_max: 8, ..ServerOptions::default() });
    let nine: Vec<u64> = (1..=9).collect();
    for op in [Op::Pull, Op::Lookup, Op::Push, Op::Delete] {
        let rows = if op.has_rows() { vec![0.0; 9 * DIM] } else { Vec::new() };
        let message = p.keyed(op, t, &[], &nine, &rows).refused(status::TOO_LARGE, op.name());
        assert!(message.contains("keys_per_request_max"), "{message}");
    }
    // The limit itself is taken, on the same connection.
    p.keyed(Op::Lookup, t, &[], &KEPT, &[]).ok("keys_per_request_max keys");
    kept(&s, t, "after too many keys");
    assert_eq!(s.store.table("t").unwrap().len().unwrap(), KEPT.len() as u64, "the refused pull created rows");
}

#[test]
fn a_body_of_the_wrong_length_is_refused_and_the_connection_goes_on() {
    let (s, mut p, t) = with_rows(ServerOptions::default());
    // Rows of dim 3 pushed to a table of dim 4: the count and body disagree.
    let r = p.call(Op::Push, t, 2, &keyed_body(&[], &[1, 2], &[9.0; 2 * (DIM - 1)]));
    let message = r.refused(status::BAD_FRAME, "push of the wrong dim");
    assert!(message.contains("wrong dim?") && message.contains("(dim 4)"), "{message}");
    // Keys short of the count, or over it.
    p.call(Op::Lookup, t, 3, &keyed_body(&[], &[1, 2], &[])).refused(status::BAD_FRAME, "lookup short of its count");
    p.call(Op::Delete, t, 1, &keyed_body(&[], &[1, 2], &[])).refused(status::BAD_FRAME, "delete over its count");
    p.call(Op::Lookup, t, 1, &[0; 7]).refused(status::BAD_FRAME, "a key of 7 bytes");
    // A prefix missing: a held pull without its timeout word.
    p.call(Op::PullHeld, t, 1, &keyed_body(&[3], &[1], &[])).refused(status::BAD_FRAME, "pull_held without a timeout");
    // The fixed-length bodies.
    let fixed: [(Op, u32, &[u8]); 6] = [
        (Op::Checkpoint, 0, &[0; 4]),
        (Op::Restore, 0, &[0; 16]),
        (Op::SetLr, t, &[0; 8]),
        (Op::Release, t, &[0; 4]),
        (Op::Export, t, &[0; 16]),
        (Op::ExportAt, t, &[0; 24]),
    ];
    for (op, table, body) in fixed {
        p.call(op, table, 0, body).refused(status::BAD_FRAME, op.name());
    }
    // Names and options that are not UTF-8 or not JSON.
    p.call(Op::OpenTable, 0, 0, &[0xff, 0xfe]).refused(status::BAD_FRAME, "open of a name not UTF-8");
    p.call(Op::DropTable, 0, 0, &[0xff]).refused(status::BAD_FRAME, "drop of a name not UTF-8");
    p.call(Op::CreateTable, 0, 0, b"{\"name\": 1}").refused(status_of(ErrorKind::Config), "create of bad JSON");
    let zero = serde_json::json!({ "name": "z", "options": TableOptions::default() }).to_string();
    let e = s.store.create_table("z", TableOptions::default()).unwrap_err();
    p.call(Op::CreateTable, 0, 0, zero.as_bytes()).refused(status_of(e.kind()), "create of dim 0");
    assert_eq!(s.store.tables().unwrap(), ["t"], "a refused create made a table");
    // Still the same connection, and nothing lost.
    assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT), "rows on the connection that was refused");
    kept(&s, t, "after bodies of the wrong length");
}

#[test]
fn an_unknown_opcode_or_table_is_refused_and_the_connection_goes_on() {
    let (s, mut p, t) = with_rows(ServerOptions::default());
    // Past the last opcode there is (so a new one does not make this test stale).
    let next = Op::ALL.iter().map(|&o| o as u16).max().unwrap() + 1;
    for opcode in [0, 8, 15, next, 0x7fff, REPLY_BIT | Op::Lookup as u16] {
        let message = p.call_raw(opcode, t, 0, &[]).refused(status::UNKNOWN_OPCODE, "an unknown opcode");
        assert!(message.contains(&opcode.to_string()), "{message}");
    }
    let stranger = t + 1000;
    let message = p.keyed(Op::Lookup, stranger, &[], &[1], &[]).refused(status_of(ErrorKind::Closed), "unknown table");
    assert!(message.contains(&format!("table id {stranger}")), "{message}");
    p.call(Op::Len, stranger, 0, &[]).refused(status_of(ErrorKind::Closed), "len of an unknown table");
    let e = s.store.table("nope").unwrap_err();
    p.call(Op::OpenTable, 0, 0, b"nope").refused(status_of(e.kind()), "open of an unknown name");
    p.call(Op::DropTable, 0, 0, b"nope").refused(status_of(e.kind()), "drop of an unknown name");
    assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT), "rows on the connection that was refused");
}

#[test]
fn an_engine_error_is_answered_with_its_kind() {
    // No optimizer: the core refuses gradients, and the server says so in the core's kind.
    let plain = TableOptions { optimizer: Optimizer::None, ..options() };
    let s = Served::start_with(ServerOptions::default(), |store| {
        store.create_table("plain", plain.clone()).unwrap();
    });
    let direct = s.store.table("plain").unwrap();
    let e = direct.push_grad(&[1], &[1.0; DIM]).unwrap_err();
    let mut p = s.peer();
    // Found by id though no connection opened it through this server.
    let id = direct.meta().id;
    let message = p.keyed(Op::PushGrad, id, &[], &[1], &[1.0; DIM]).refused(status_of(e.kind()), "push_grad");
    assert_eq!(message, e.to_string(), "the core's message");
    let e = direct.set_lr(f32::NAN).unwrap_err();
    p.call(Op::SetLr, id, 0, &f32::NAN.to_le_bytes()).refused(status_of(e.kind()), "set_lr NaN");
    p.keyed(Op::Push, id, &[], &[1], &[3.0; DIM]).ok("a push after the errors");
}

#[test]
fn a_peer_gone_inside_a_frame_leaves_the_server_serving() {
    let (s, _, t) = with_rows(ServerOptions::default());
    // A push whose body stops halfway, then the peer goes: the half is not applied.
    let mut q = s.peer();
    let body = keyed_body(&[], &[1, 2], &[0.0; 2 * DIM]);
    let mut frame = Header::request(Op::Push, 1, t, 2, body.len() as u32).encode().to_vec();
    frame.extend_from_slice(&body[..body.len() / 2]);
    q.raw(&frame);
    drop(q);
    // And one that sends half a header.
    let mut q = s.peer();
    q.raw(&Header::request(Op::Len, 1, t, 0, 0).encode()[..10]);
    drop(q);
    kept(&s, t, "after peers gone inside a frame");
    s.until("every connection ended", |s| s.open() == 0 && s.pending().is_empty());
}
