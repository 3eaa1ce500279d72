//! `embank serve` as real processes: two shards driven through the Rust client and
//! checked against a model, a shard killed with SIGKILL and restarted, bad input on
//! raw sockets, metrics, and a graceful shutdown.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod common;

use common::http_get;
use embank_core::{ErrorKind, Initializer, Optimizer, TableOptions};
use embank_net::proto::{self, Header, Op, HEADER_BYTES};
use embank_net::{Client, ClientOptions};
use rand::{Rng, SeedableRng};

struct Shard {
    child: Child,
    addr: String,
    admin: String,
    store: PathBuf,
    config: PathBuf,
}

impl Shard {
    /// Starts `embank serve` on free ports and waits for its "listening" line.
    fn start(dir: &Path, name: &str, extra_config: &str) -> Shard {
        let store = dir.join(name);
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "store = {:?}\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n{extra_config}",
                store.display().to_string()
            ),
        )
        .unwrap();
        Self::start_with(store, config, None)
    }

    fn start_with(store: PathBuf, config: PathBuf, listen: Option<&str>) -> Shard {
        let args: Vec<&str> = listen.map_or(vec![], |l| vec!["--listen", l]);
        let common::Serve { child, addr, admin, .. } = common::serve(&config, &args, common::Stderr::Shown);
        Shard { child, addr, admin, store, config }
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Starts it again on the same port (the client's address list does not change).
    fn restart(&mut self) {
        let addr = self.addr.clone();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let started = common::try_serve(&self.config, &["--listen", &addr], common::Stderr::Hidden, &[]);
            if let Some(s) = started {
                self.child = s.child;
                return;
            }
            // The port may linger for a moment: try again.
            assert!(Instant::now() < deadline, "shard could not listen on {addr} again");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn terminate(mut self) -> (bool, String) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let mut out = String::new();
        self.child.stdout.as_mut().unwrap().read_to_string(&mut out).unwrap();
        let status = self.child.wait().unwrap();
        (status.success(), out)
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(shards: &[&Shard]) -> Client {
    let addrs: Vec<String> = shards.iter().map(|s| s.addr.clone()).collect();
    // Small requests so that batches split into several per shard.
    Client::connect(&addrs, ClientOptions { keys_per_request_max: 37, ..Default::default() }).unwrap()
}

fn row_of(key: u64, version: u32, dim: usize) -> Vec<f32> {
    (0..dim).map(|j| (key as f32) * 0.5 + version as f32 + j as f32 * 0.001).collect()
}

/// Random batches of every operation against a HashMap model, through two shards.
#[test]
fn two_shards_match_a_model() {
    let dir = tempfile::tempdir().unwrap();
    // Shard a sends every pull/lookup reply zero-copy, shard b copies (rows this small
    // are copied by default): the model checks both paths.
    let a = Shard::start(dir.path(), "a", "[limits]\nzero_copy_row_bytes_min = 0\n");
    let b = Shard::start(dir.path(), "b", "");
    let c = client(&[&a, &b]);
    let dim = 6;
    let mut o = TableOptions::new(dim as u32);
    o.init = Initializer::Uniform { low: -1.0, high: 1.0 };
    o.capacity = 16; // grows during the run
    let t = c.create_table("model", o).unwrap();
    assert_eq!(c.tables().unwrap(), vec!["model".to_string()]);
    let seed: u64 =
        std::env::var("EMBANK_NET_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| rand::rng().random());
    eprintln!("seed {seed} (EMBANK_NET_SEED replays)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut model: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut version = 0;
    for step in 0..300 {
        let n = rng.random_range(0..200);
        let keys: Vec<u64> = (0..n).map(|_| rng.random_range(0..600u64)).collect();
        match rng.random_range(0..6) {
            0 => {
                let mut out = vec![0f32; n * dim];
                t.pull(&keys, &mut out).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    let row = &out[i * dim..(i + 1) * dim];
                    match model.get(k) {
                        Some(m) => assert_eq!(row, &m[..], "step {step}: pull of {k}"),
                        None => {
                            assert!(row.iter().all(|x| (-1.0..1.0).contains(x)), "initializer row");
                            model.insert(*k, row.to_vec());
                        }
                    }
                }
            }
            1 => {
                let mut out = vec![0f32; n * dim];
                let mut found = vec![false; n];
                t.lookup(&keys, &mut out, &mut found).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    assert_eq!(found[i], model.contains_key(k), "step {step}: found {k}");
                    let want = model.get(k).cloned().unwrap_or_else(|| vec![0.0; dim]);
                    assert_eq!(&out[i * dim..(i + 1) * dim], &want[..], "step {step}: lookup of {k}");
                }
                // The same rows as stored (f32: the little-endian floats), mask alike.
                let mut stored = vec![0u8; n * dim * 4];
                let mut found_stored = vec![false; n];
                t.lookup_stored(&keys, &mut stored, &mut found_stored).unwrap();
                assert_eq!(found_stored, found, "step {step}: lookup_stored's mask");
                let decoded: Vec<f32> =
                    stored.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                assert_eq!(decoded, out, "step {step}: lookup_stored");
            }
            2 | 3 => {
                version += 1;
                let rows: Vec<f32> =
                    keys.iter().enumerate().flat_map(|(i, &k)| row_of(k, version * 1000 + i as u32, dim)).collect();
                t.push(&keys, &rows).unwrap();
                for (i, &k) in keys.iter().enumerate() {
                    model.insert(k, rows[i * dim..(i + 1) * dim].to_vec());
                }
            }
            4 => {
                let gone = t.delete(&keys).unwrap();
                let mut uniq = keys.clone();
                uniq.sort();
                uniq.dedup();
                let want = uniq.iter().filter(|k| model.remove(k).is_some()).count();
                assert_eq!(gone, want as u64, "step {step}: delete count");
            }
            _ => assert_eq!(t.len().unwrap(), model.len() as u64, "step {step}: len"),
        }
    }
    // Keys are spread over both shards, and the export is the model.
    let stats = t.stats().unwrap();
    let per_shard: Vec<u64> = stats["shards"].as_array().unwrap().iter().map(|s| s["rows"].as_u64().unwrap()).collect();
    assert!(per_shard.iter().all(|&r| r > 0), "{per_shard:?}");
    let mut exported = HashMap::new();
    t.export(50, |keys, rows| {
        for (i, &k) in keys.iter().enumerate() {
            assert!(exported.insert(k, rows[i * dim..(i + 1) * dim].to_vec()).is_none(), "key {k} exported twice");
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(exported, model);
    // A second client (another process would do the same) routes every key alike.
    let c2 = client(&[&a, &b]);
    let t2 = c2.table("model").unwrap();
    let keys: Vec<u64> = model.keys().copied().collect();
    let mut out = vec![0f32; keys.len() * dim];
    let mut found = vec![false; keys.len()];
    t2.lookup(&keys, &mut out, &mut found).unwrap();
    assert!(found.iter().all(|&f| f));
    let counter = |shard: &Shard, name: &str| -> u64 {
        let m = http_get(&shard.admin, "/metrics");
        let line = m.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} missing"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert!(counter(&a, "embank_replies_zero_copy_total") > 0);
    assert_eq!(counter(&a, "embank_replies_copied_total"), 0);
    assert_eq!(counter(&b, "embank_replies_zero_copy_total"), 0);
    assert!(counter(&b, "embank_replies_copied_total") > 0);
    c.drop_table("model").unwrap();
    assert!(c.tables().unwrap().is_empty());
    let e = t2.pull(&[1], &mut [0.0; 6]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed, "a dropped table's handle is closed, as embedded: {e}");
}

/// Compact rows cross the wire as stored (`lookup_stored`): decoded, exactly what
/// `lookup` returns, from a shard that sends them zero-copy and one that copies; a
/// missing key's row is the missing default, encoded; an int8 row of dim 128 takes 136
/// bytes a row in the replies, not 512.
#[test]
fn compact_rows_cross_the_wire_as_stored() {
    use embank_core::RecordLayout;
    use embank_core::{DType, MissingDefault};
    let dir = tempfile::tempdir().unwrap();
    let a = Shard::start(dir.path(), "a", "[limits]\nzero_copy_row_bytes_min = 0\n");
    let b = Shard::start(dir.path(), "b", "[limits]\nzero_copy = false\n");
    let c = client(&[&a, &b]);
    let bytes_out = |shards: &[&Shard]| -> u64 {
        shards
            .iter()
            .map(|s| {
                let m = http_get(&s.admin, "/metrics");
                let line = m.lines().find(|l| l.starts_with("embank_sent_bytes_total")).expect("sent bytes");
                line.split_whitespace().last().unwrap().parse::<u64>().unwrap()
            })
            .sum()
    };
    let dim = 128;
    let keys: Vec<u64> = (0..2_000).collect();
    let rows: Vec<f32> = (0..keys.len() * dim).map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 5.0).collect();
    let ask: Vec<u64> = (0..1_000u64).map(|i| i * 2 + 1).chain([10_000, 10_001]).collect();
    for dtype in [DType::F16, DType::Int8] {
        let mut o = TableOptions::new(dim as u32);
        o.dtype = dtype;
        o.missing = MissingDefault::Value { value: 0.5 };
        let t = c.create_table(&format!("c_{dtype}"), o).unwrap();
        t.push(&keys, &rows).unwrap();
        let (mut want, mut want_found) = (vec![0f32; ask.len() * dim], vec![false; ask.len()]);
        let before = bytes_out(&[&a, &b]);
        t.lookup(&ask, &mut want, &mut want_found).unwrap();
        let decoded_bytes = bytes_out(&[&a, &b]) - before;
        let rb = dtype.row_bytes(dim);
        let (mut stored, mut found) = (vec![0u8; ask.len() * rb], vec![false; ask.len()]);
        let before = bytes_out(&[&a, &b]);
        t.lookup_stored(&ask, &mut stored, &mut found).unwrap();
        let stored_bytes = bytes_out(&[&a, &b]) - before;
        assert_eq!(found, want_found, "{dtype}: mask");
        assert_eq!(found.iter().filter(|&&f| !f).count(), 2, "{dtype}: the two missing keys");
        let plain = RecordLayout::new(dim, 0, dtype);
        let mut got = vec![0f32; ask.len() * dim];
        for (s, r) in stored.chunks_exact(rb).zip(got.chunks_exact_mut(dim)) {
            plain.decode_row(s, r);
        }
        assert_eq!(got, want, "{dtype}: decoded stored rows are lookup's rows");
        assert!(got[got.len() - dim..].iter().all(|&v| v == 0.5), "{dtype}: the missing default");
        let ratio = stored_bytes as f64 / decoded_bytes as f64;
        let expect = rb as f64 / (dim * 4) as f64;
        assert!((ratio - expect).abs() < 0.02, "{dtype}: reply bytes {stored_bytes} against {decoded_bytes}");
        // A wrong-sized buffer is refused before anything is sent.
        let e = t.lookup_stored(&ask, &mut [0u8; 3], &mut found).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    }
}

/// push_grad over the wire gives exactly the embedded result, duplicates included.
#[test]
fn push_grad_matches_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let a = Shard::start(dir.path(), "a", "");
    let b = Shard::start(dir.path(), "b", "");
    let c = client(&[&a, &b]);
    let local = embank_core::Store::open(dir.path().join("local"), Default::default()).unwrap();
    let mut o = TableOptions::new(4);
    o.init = Initializer::Normal { mean: 0.0, std: 0.1 };
    o.optimizer = Optimizer::Adagrad { lr: 0.1, eps: 1e-8, initial_accumulator_value: 0.0 };
    let remote = c.create_table("emb", o.clone()).unwrap();
    let embedded = local.create_table("emb", o).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..30 {
        let keys: Vec<u64> = (0..120).map(|_| rng.random_range(0..80u64)).collect();
        let grads: Vec<f32> = (0..keys.len() * 4).map(|_| rng.random_range(-1.0..1.0)).collect();
        remote.push_grad(&keys, &grads).unwrap();
        embedded.push_grad(&keys, &grads).unwrap();
    }
    remote.set_lr(0.01).unwrap();
    let keys: Vec<u64> = (0..80).collect();
    remote.push_grad(&keys, &vec![0.5; 320]).unwrap();
    embedded.set_lr(0.01).unwrap();
    embedded.push_grad(&keys, &vec![0.5; 320]).unwrap();
    let (mut r, mut e) = (vec![0f32; 320], vec![0f32; 320]);
    remote.pull(&keys, &mut r).unwrap();
    embedded.pull(&keys, &mut e).unwrap();
    assert_eq!(r, e);
    let bad = remote.push_grad(&[1, 2], &[0.0, 0.0, 0.0, f32::NAN, 0.0, 0.0, 0.0, 0.0]).unwrap_err();
    assert_eq!(bad.kind(), ErrorKind::InvalidInput);
    remote.pull(&keys, &mut r).unwrap();
    assert_eq!(r, e, "a refused push_grad wrote nothing");
}

/// SIGKILL a shard while a writer runs; restart it; the client reconnects and every
/// row flushed before the kill is there.
#[test]
fn killed_shard_restarts_with_flushed_rows() {
    let dir = tempfile::tempdir().unwrap();
    let a = Shard::start(dir.path(), "a", "");
    let mut b = Shard::start(dir.path(), "b", "");
    let c = client(&[&a, &b]);
    let dim = 8;
    let t = c.create_table("t", TableOptions::new(dim as u32)).unwrap();
    let mut flushed: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut round = 0u32;
    let mut errors = 0;
    let killed_at = 5;
    let mut restarted = false;
    while round < 15 {
        let keys: Vec<u64> = (0..400).map(|i| (i * 7 + round as u64 * 13) % 1000).collect();
        let rows: Vec<f32> = keys.iter().flat_map(|&k| row_of(k, round, dim)).collect();
        if round == killed_at && !restarted {
            b.kill9();
        }
        match t.push(&keys, &rows).and_then(|_| c.flush()) {
            Ok(()) => {
                for (i, &k) in keys.iter().enumerate() {
                    flushed.insert(k, rows[i * dim..(i + 1) * dim].to_vec());
                }
                round += 1;
            }
            Err(e) => {
                // Only while shard b is down, and the error names it.
                assert!(round == killed_at && !restarted, "unexpected error {e}");
                assert!(matches!(e.kind(), ErrorKind::Unavailable), "{e}");
                assert!(e.to_string().contains(&format!("shard 1 ({})", b.addr)), "{e}");
                errors += 1;
                b.restart();
                restarted = true;
            }
        }
    }
    assert!(errors >= 1 && restarted);
    let keys: Vec<u64> = flushed.keys().copied().collect();
    let mut out = vec![0f32; keys.len() * dim];
    let mut found = vec![false; keys.len()];
    t.lookup(&keys, &mut out, &mut found).unwrap();
    for (i, k) in keys.iter().enumerate() {
        assert!(found[i], "flushed key {k} lost");
        assert_eq!(&out[i * dim..(i + 1) * dim], &flushed[k][..], "key {k}");
    }
    let _ = &b.store;
}

fn raw(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn send(s: &mut TcpStream, op: u16, table: u32, count: u32, body: &[u8]) {
    let h = Header { opcode: op, request_id: 9, table_id: table, count, body_len: body.len() as u32, status: 0 };
    s.write_all(&h.encode()).unwrap();
    s.write_all(body).unwrap();
}

/// Reads one reply; `None` if the server closed the connection.
fn recv(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut hdr = [0u8; HEADER_BYTES];
    s.read_exact(&mut hdr).ok()?;
    let h = Header::decode(&hdr).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    Some((h, body))
}

fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

/// A pull through a fresh client works: the server is still serving.
fn still_serving(addr: &str, token: Option<&str>) {
    let c = Client::connect(&[addr], ClientOptions { token: token.map(String::from), ..Default::default() }).unwrap();
    let t = c.table("t").unwrap();
    let mut out = vec![0f32; 4];
    t.pull(&[42], &mut out).unwrap();
}

#[test]
fn bad_input_gets_errors_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let a = Shard::start(dir.path(), "a", "[limits]\nkeys_per_request_max = 1000\nframe_bytes_max = 100000\n");
    let c = client(&[&a]);
    let t = c.create_table("t", TableOptions::new(4)).unwrap();
    t.push(&[1, 2, 3], &[1.0; 12]).unwrap();
    let id = {
        let mut s = raw(&a.addr);
        send(&mut s, Op::OpenTable as u16, 0, 0, b"t");
        recv(&mut s).unwrap().0.table_id
    };

    // A client holding a connection open across every attack below.
    let mut bystander = raw(&a.addr);

    // Garbage bytes: a BAD_FRAME reply, then the connection is closed.
    let mut s = raw(&a.addr);
    s.write_all(&[0xAB; 100]).unwrap();
    let (h, body) = recv(&mut s).unwrap();
    assert_eq!(h.status, proto::status::BAD_FRAME);
    assert!(String::from_utf8_lossy(&body).contains("bad magic"), "{}", String::from_utf8_lossy(&body));
    assert!(closed(&mut s));

    // Truncated frames: a header cut short, and a body cut short, then hang-ups.
    let mut s = raw(&a.addr);
    s.write_all(&Header::request(Op::Pull, 1, id, 3, 24).encode()[..10]).unwrap();
    drop(s);
    let mut s = raw(&a.addr);
    s.write_all(&Header::request(Op::Pull, 1, id, 3, 24).encode()).unwrap();
    s.write_all(&[0u8; 7]).unwrap();
    drop(s);

    // A huge count: refused, connection goes on (the body was within the frame limit).
    let mut s = raw(&a.addr);
    send(&mut s, Op::Pull as u16, id, 5000, &[0u8; 5000 * 8]);
    let (h, body) = recv(&mut s).unwrap();
    assert_eq!(h.status, proto::status::TOO_LARGE, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("keys_per_request_max"));
    send(&mut s, Op::Pull as u16, id, 1, &7u64.to_le_bytes());
    let (h, body) = recv(&mut s).unwrap();
    assert_eq!((h.status, body.len()), (0, 16), "the connection still works");

    // A frame over frame_bytes_max: refused and closed without reading 4 GiB.
    let mut s = raw(&a.addr);
    s.write_all(&Header::request(Op::Pull, 1, id, u32::MAX, u32::MAX).encode()).unwrap();
    let (h, _) = recv(&mut s).unwrap();
    assert_eq!(h.status, proto::status::TOO_LARGE);
    assert!(closed(&mut s));

    // Wrong dim: a push of rows of dim 3 to a table of dim 4.
    let mut s = raw(&a.addr);
    let mut body = 9u64.to_le_bytes().to_vec();
    body.extend_from_slice(proto::as_bytes(&[1.0f32, 2.0, 3.0]));
    send(&mut s, Op::Push as u16, id, 1, &body);
    let (h, msg) = recv(&mut s).unwrap();
    assert_eq!(h.status, proto::status::BAD_FRAME);
    assert!(String::from_utf8_lossy(&msg).contains("dim 4"), "{}", String::from_utf8_lossy(&msg));

    // Unknown opcode, unknown table id (as a dropped table: closed) and unknown table
    // name: error replies on the same connection.
    send(&mut s, 999, id, 0, &[]);
    assert_eq!(recv(&mut s).unwrap().0.status, proto::status::UNKNOWN_OPCODE);
    send(&mut s, Op::Pull as u16, 4242, 1, &1u64.to_le_bytes());
    let (h, msg) = recv(&mut s).unwrap();
    assert_eq!(proto::error_of(h.status, String::new()).kind(), ErrorKind::Closed, "{}", String::from_utf8_lossy(&msg));
    send(&mut s, Op::OpenTable as u16, 0, 0, b"nope");
    assert_eq!(proto::error_of(recv(&mut s).unwrap().0.status, String::new()).kind(), ErrorKind::NotFound);

    // A NaN push is refused and nothing is written.
    let mut body = 1u64.to_le_bytes().to_vec();
    body.extend_from_slice(proto::as_bytes(&[f32::NAN, 0.0, 0.0, 0.0]));
    send(&mut s, Op::Push as u16, id, 1, &body);
    assert_eq!(proto::error_of(recv(&mut s).unwrap().0.status, String::new()).kind(), ErrorKind::InvalidInput);

    // Random byte strings (fuzzing the decoder through the server): never a crash.
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for _ in 0..200 {
        let mut s = raw(&a.addr);
        let mut junk: Vec<u8> = (0..rng.random_range(1..200)).map(|_| rng.random()).collect();
        if rng.random_bool(0.5) {
            // A valid header with random fields and a random body.
            let h = Header {
                opcode: rng.random_range(0..40),
                request_id: 1,
                table_id: id,
                count: rng.random_range(0..20),
                body_len: junk.len() as u32,
                status: 0,
            };
            let mut v = h.encode().to_vec();
            v.append(&mut junk);
            junk = v;
        }
        let _ = s.write_all(&junk);
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let _ = s.read(&mut [0u8; 256]);
    }

    // The bystander's connection and new clients are served; nothing was lost.
    send(&mut bystander, Op::Len as u16, id, 0, &[]);
    let (h, body) = recv(&mut bystander).unwrap();
    assert_eq!(h.status, 0);
    let rows = u64::from_le_bytes(body.try_into().unwrap());
    assert!(rows >= 3, "rows {rows}");
    still_serving(&a.addr, None);
    let mut out = vec![0f32; 12];
    t.pull(&[1, 2, 3], &mut out).unwrap();
    assert_eq!(out, vec![1.0; 12]);

    // Metrics saw the errors; health is fine.
    let metrics = http_get(&a.admin, "/metrics");
    assert!(metrics.contains("embank_requests_total{op=\"pull\"}"), "{metrics}");
    assert!(metrics.contains("embank_request_errors_total{kind=\"bad_frame\"}"), "{metrics}");
    assert!(metrics.contains("embank_request_duration_seconds_bucket{op=\"pull\",le=\"+Inf\"}"));
    assert!(metrics.contains("embank_table_rows{table=\"t\"}"));
    assert!(metrics.contains("embank_replies_zero_copy_total"));
    assert!(http_get(&a.admin, "/healthz").ends_with("ok\n"));
    assert!(http_get(&a.admin, "/nope").starts_with("HTTP/1.1 404"));
}

#[test]
fn token_is_checked_and_required_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let a = Shard::start(dir.path(), "a", "token = \"s3cret\"\n[[tables]]\nname = \"t\"\ndim = 4\n");
    // Right token: served.
    still_serving(&a.addr, Some("s3cret"));
    // Wrong token and no token: refused with Unauthorized.
    for token in [Some("s3cre"), None] {
        let e =
            Client::connect(&[a.addr.as_str()], ClientOptions { token: token.map(String::from), ..Default::default() })
                .err()
                .unwrap_or_else(|| panic!("token {token:?} was accepted"));
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    }
    // Skipping HELLO: refused, connection closed.
    let mut s = raw(&a.addr);
    send(&mut s, Op::ListTables as u16, 0, 0, &[]);
    assert_eq!(recv(&mut s).unwrap().0.status, proto::status::UNAUTHORIZED);
    assert!(closed(&mut s));
    still_serving(&a.addr, Some("s3cret"));

    // Binding beyond loopback without a token is refused with a clear error.
    let config = dir.path().join("open.toml");
    std::fs::write(
        &config,
        format!("store = {:?}\nlisten = \"0.0.0.0:0\"\n", dir.path().join("o").display().to_string()),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_embank")).args(["serve", "--config"]).arg(&config).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requires an auth token"), "{err}");
}

#[test]
fn bad_config_is_named_and_sigterm_shuts_down_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "store = \"s\"\n[[tables]]\nname = \"t\"\ndim = 4\nmediun = \"block\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_embank")).args(["serve", "--config"]).arg(&config).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mediun") && err.contains("tables[0]") && err.contains("bad.toml"), "{err}");

    let a = Shard::start(dir.path(), "a", "[[tables]]\nname = \"t\"\ndim = 4\n");
    let c = client(&[&a]);
    let t = c.table("t").unwrap();
    t.push(&[5], &[2.0; 4]).unwrap(); // not flushed: the shutdown must flush it
    let store = a.store.clone();
    let (ok, out) = a.terminate();
    assert!(ok && out.contains("stopped cleanly"), "{out}");
    // The store closed cleanly: reopening needs no repair, and the row is there.
    let s = embank_core::Store::open(&store, Default::default()).unwrap();
    let t = s.table("t").unwrap();
    assert!(t.stats().unwrap().recovered.is_none(), "store was not closed cleanly");
    let mut out = vec![0f32; 4];
    t.pull(&[5], &mut out).unwrap();
    assert_eq!(out, vec![2.0; 4]);
}

#[test]
fn idle_sockets_cannot_lock_out_a_client_with_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let config = "token = \"s3cret\"\n[limits]\nconnections_max = 16\npending_max = 8\nauth_timeout_seconds = 2\n";
    let shard = Shard::start(dir.path(), "a", config);
    // Twice connections_max sockets that never send a byte (no token, nothing).
    let idle: Vec<TcpStream> = (0..32).map(|_| TcpStream::connect(&shard.addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let options = ClientOptions { token: Some("s3cret".into()), ..Default::default() };
    let client = Client::connect(std::slice::from_ref(&shard.addr), options).unwrap();
    let t = client.create_table("t", TableOptions::new(4)).unwrap();
    let mut out = vec![0f32; 4];
    t.pull(&[1], &mut out).unwrap();
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(1), "a client with the token was served after {waited:?}");
    // Every idle socket is closed: evicted to make room, or at its authentication deadline.
    for (i, mut s) in idle.into_iter().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("idle socket {i} was not closed by the server: {other:?}"),
        }
    }
    // The authenticated client outlived the deadline that closed the idle ones.
    t.pull(&[2], &mut out).unwrap();
    let metrics = http_get(&shard.admin, "/metrics");
    assert!(metrics.contains("embank_connections_evicted_total"), "{metrics}");
}

/// Many processes' worth of clients connecting at once past `pending_per_peer_max`: the
/// server closes the oldest connections that have not said hello, and each client
/// connects again instead of failing its call.
#[test]
fn connections_closed_before_their_hello_are_opened_again() {
    let dir = tempfile::tempdir().unwrap();
    let shard = Shard::start(dir.path(), "a", "[limits]\npending_per_peer_max = 1\n");
    {
        let c = Client::connect(std::slice::from_ref(&shard.addr), ClientOptions::default()).unwrap();
        c.create_table("t", TableOptions::new(4)).unwrap().push(&[1], &[1.0; 4]).unwrap();
    }
    let evicted = || -> u64 {
        let m = http_get(&shard.admin, "/metrics");
        m.lines()
            .find(|l| l.starts_with("embank_connections_evicted_total"))
            .and_then(|l| l.split_whitespace().last())
            .map_or(0, |v| v.parse().unwrap())
    };
    let before = evicted();
    let start = std::sync::Barrier::new(16);
    let failures: Vec<String> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let (addr, start) = (shard.addr.clone(), &start);
                s.spawn(move || -> Result<(), String> {
                    start.wait();
                    // Each round a new client: new connections, each with its hello.
                    for _ in 0..5 {
                        let c = Client::connect(std::slice::from_ref(&addr), ClientOptions::default())
                            .map_err(|e| e.to_string())?;
                        let t = c.table("t").map_err(|e| e.to_string())?;
                        let mut out = vec![0f32; 4];
                        t.pull(&[1], &mut out).map_err(|e| e.to_string())?;
                        assert_eq!(out, vec![1.0; 4]);
                    }
                    Ok(())
                })
            })
            .collect();
        threads.into_iter().filter_map(|t| t.join().unwrap().err()).collect()
    });
    let closed = evicted() - before;
    assert!(
        failures.is_empty(),
        "{} of 16 clients failed ({closed} connections closed unanswered): {failures:?}",
        failures.len()
    );
    assert!(closed > 0, "no connection was closed before its hello: the test did not test the retry");
}

fn tls_config(files: &embank_cli::cert::CertFiles, mutual: bool) -> String {
    let mut c = format!(
        "token = \"s3cret\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        files.server_cert.display().to_string(),
        files.server_key.display().to_string()
    );
    if mutual {
        c += &format!("client_ca_file = {:?}\n", files.ca.display().to_string());
    }
    c
}

fn tls_client(addr: &str, ca: &Path, cert: Option<(&Path, &Path)>) -> embank_core::Result<Client> {
    let tls = embank_net::ClientTls::load(&embank_net::ClientTlsFiles {
        ca_file: ca.to_owned(),
        cert_file: cert.map(|c| c.0.to_owned()),
        key_file: cert.map(|c| c.1.to_owned()),
        server_name: None,
    })?;
    let options = ClientOptions { token: Some("s3cret".into()), tls: Some(tls), ..Default::default() };
    Client::connect(&[addr], options)
}

#[test]
fn tls_serves_and_refuses_a_wrong_ca_and_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let files = embank_cli::cert::write(&dir.path().join("tls"), &[], false).unwrap();
    let other = embank_cli::cert::write(&dir.path().join("other"), &[], false).unwrap();
    let shard = Shard::start(dir.path(), "a", &tls_config(&files, false));
    let c = tls_client(&shard.addr, &files.ca, None).unwrap();
    let t = c.create_table("t", TableOptions::new(300)).unwrap();
    let keys: Vec<u64> = (0..2000).collect();
    let rows: Vec<f32> = (0..2000 * 300).map(|i| i as f32).collect();
    t.push(&keys, &rows).unwrap();
    let mut out = vec![0f32; rows.len()];
    t.pull(&keys, &mut out).unwrap();
    assert_eq!(out, rows, "rows over TLS (1200-byte rows: the vectored reply path)");
    let e = tls_client(&shard.addr, &other.ca, None).err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("TLS handshake failed") && e.to_string().contains("certificate"), "{e}");
    let plain =
        Client::connect(&[shard.addr.as_str()], ClientOptions { token: Some("s3cret".into()), ..Default::default() });
    let e = plain.err().expect("a plaintext client is refused");
    assert!(e.to_string().contains("requires TLS"), "{e}");
}

#[test]
fn mutual_tls_needs_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let files = embank_cli::cert::write(&dir.path().join("tls"), &[], false).unwrap();
    let other = embank_cli::cert::write(&dir.path().join("other"), &[], false).unwrap();
    let shard = Shard::start(dir.path(), "a", &tls_config(&files, true));
    let e = tls_client(&shard.addr, &files.ca, None).err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().to_lowercase().contains("certificate"), "missing client certificate: {e}");
    let e = tls_client(&shard.addr, &files.ca, Some((&other.client_cert, &other.client_key))).err().expect("refused");
    assert!(e.to_string().to_lowercase().contains("certificate") || e.to_string().contains("alert"), "{e}");
    let c = tls_client(&shard.addr, &files.ca, Some((&files.client_cert, &files.client_key))).unwrap();
    let t = c.create_table("t", TableOptions::new(4)).unwrap();
    let mut out = vec![0f32; 4];
    t.pull(&[9], &mut out).unwrap();
}

#[test]
fn a_non_loopback_listener_needs_tls_or_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(embank_core::Store::open(dir.path().join("s"), Default::default()).unwrap());
    let opts = embank_net::ServerOptions { token: Some("t".into()), ..Default::default() };
    let e = embank_net::Server::bind("0.0.0.0:0", std::sync::Arc::clone(&store), opts.clone()).err().unwrap();
    assert!(e.to_string().contains("requires TLS"), "{e}");
    let insecure = embank_net::ServerOptions { insecure: true, ..opts };
    embank_net::Server::bind("0.0.0.0:0", store, insecure).expect("insecure = true is allowed, loudly");
}
