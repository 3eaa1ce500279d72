//! Every opcode the server dispatches answers what the core's own call answers: seeded
//! random runs of requests over the wire, each replayed on a twin table in a store of its
//! own (same options, same seed) and the replies compared bit for bit, on a server that
//! sends rows zero-copy and on one that copies them. `EMBANK_SERVER_SEED=n` runs seed n
//! alone.

use embank_core::{ExportCursor, Table};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const SEEDS: u64 = 6;
const STEPS: usize = 60;
/// Keys come from this range: hits, misses and repeats within one request.
const KEYS: u64 = 48;

/// The zero-copy server (every row size borrows from the mapping) and the copying one.
fn servers() -> [(&'static str, ServerOptions); 2] {
    [
        ("zero-copy", ServerOptions { zero_copy: true, zero_copy_row_bytes_min: 0, ..ServerOptions::default() }),
        ("copied", ServerOptions { zero_copy: false, ..ServerOptions::default() }),
    ]
}

fn seeds() -> Vec<u64> {
    match std::env::var("EMBANK_SERVER_SEED") {
        Ok(s) => vec![s.parse().expect("EMBANK_SERVER_SEED is a number")],
        Err(_) => (0..SEEDS).collect(),
    }
}

fn keys(rng: &mut StdRng) -> Vec<u64> {
    let n = rng.random_range(1..=12);
    (0..n).map(|_| rng.random_range(0..KEYS)).collect()
}

/// The whole table, sorted by key.
fn export_direct(t: &Table) -> Vec<(u64, Vec<f32>)> {
    let (mut cursor, mut all) = (Some(ExportCursor::START), Vec::new());
    while let Some(c) = cursor {
        let (mut keys, mut rows) = (Vec::new(), Vec::new());
        cursor = t.export_page(c, 16, &mut keys, &mut rows).unwrap();
        all.extend(keys.iter().zip(rows.chunks(DIM)).map(|(&k, r)| (k, r.to_vec())));
    }
    all.sort_by_key(|e| e.0);
    all
}

/// The whole table over the wire, page by page (pages of at most `page` keys), sorted.
fn export_wire(p: &mut Peer, t: u32, page: u64) -> Vec<(u64, Vec<f32>)> {
    let (mut generation, mut bucket, mut all) = (u64::MAX, 0u64, Vec::new());
    for pages in 0.. {
        assert!(pages < 10_000, "an export that never ends");
        let body: Vec<u8> = [generation, bucket, page].iter().flat_map(|w| w.to_le_bytes()).collect();
        let r = p.call(Op::Export, t, 0, &body).ok("export");
        let word = |i: usize| u64::from_le_bytes(r.body[i * 8..i * 8 + 8].try_into().unwrap());
        let n = r.h.count as usize;
        let keys: Vec<u64> = (0..n).map(|i| word(3 + i)).collect();
        let rows = floats(&r.body[24 + n * 8..]);
        all.extend(keys.iter().zip(rows.chunks(DIM)).map(|(&k, r)| (k, r.to_vec())));
        if word(2) == 1 {
            break;
        }
        (generation, bucket) = (word(0), word(1));
    }
    all.sort_by_key(|e| e.0);
    all
}

/// One seeded run: `STEPS` random requests, each compared with the twin's answer.
fn run(seed: u64, name: &str, opts: ServerOptions) {
    let at = |step: usize, what: &str| format!("seed {seed} ({name} server), step {step}, {what}");
    let mut rng = StdRng::seed_from_u64(seed);
    let served = Served::start(opts);
    let twin_dir = tempfile::tempdir().unwrap();
    let twin_store = Store::open(twin_dir.path(), StoreOptions::default()).unwrap();
    // Adagrad: records carry state, so the state requests move more than rows.
    let opts_t = TableOptions {
        optimizer: Optimizer::Adagrad { lr: 0.5, eps: 1e-8, initial_accumulator_value: 0.1 },
        ..options()
    };
    let twin = twin_store.create_table("t", opts_t.clone()).unwrap();
    let mut p = served.peer();
    let t = p.create("t", &opts_t);
    for step in 0..STEPS {
        let ks = keys(&mut rng);
        let n = ks.len();
        match rng.random_range(0..10) {
            0 => {
                let r = p.keyed(Op::Pull, t, &[], &ks, &[]).ok(&at(step, "pull"));
                let mut want = vec![0f32; n * DIM];
                twin.pull(&ks, &mut want).unwrap();
                assert_eq!(floats(&r.body), want, "{}: rows of {ks:?}", at(step, "pull"));
            }
            1 => {
                let (found, rows) = p.lookup(t, &ks);
                let (mut want, mut want_found) = (vec![0f32; n * DIM], vec![false; n]);
                twin.lookup(&ks, &mut want, &mut want_found).unwrap();
                assert_eq!((found, rows), (want_found, want), "{}: keys {ks:?}", at(step, "lookup"));
            }
            2 => {
                let r = p.keyed(Op::LookupStored, t, &[], &ks, &[]).ok(&at(step, "lookup_stored"));
                let rb = twin.row_bytes();
                let (mut want, mut want_found) = (vec![0u8; n * rb], vec![false; n]);
                twin.lookup_stored(&ks, &mut want, &mut want_found).unwrap();
                let mask = proto::found_mask(&want_found);
                assert_eq!(r.body[..mask.len()], mask[..], "{}: found of {ks:?}", at(step, "lookup_stored"));
                assert_eq!(r.body[mask.len()..], want[..], "{}: rows of {ks:?}", at(step, "lookup_stored"));
            }
            3 => {
                let rows: Vec<f32> = (0..n * DIM).map(|_| rng.random_range(-4.0..4.0)).collect();
                p.push(t, &ks, &rows);
                twin.push(&ks, &rows).unwrap();
            }
            4 => {
                let grads: Vec<f32> = (0..n * DIM).map(|_| rng.random_range(-1.0..1.0)).collect();
                p.keyed(Op::PushGrad, t, &[], &ks, &grads).ok(&at(step, "push_grad"));
                twin.push_grad(&ks, &grads).unwrap();
            }
            5 => {
                let gone = p.keyed(Op::Delete, t, &[], &ks, &[]).ok(&at(step, "delete")).u64();
                assert_eq!(gone, twin.delete(&ks).unwrap(), "{}: rows deleted of {ks:?}", at(step, "delete"));
            }
            6 => {
                let len = p.call(Op::Len, t, 0, &[]).ok(&at(step, "len")).u64();
                assert_eq!(len, twin.len().unwrap(), "{}", at(step, "len"));
            }
            7 => {
                let r = p.keyed(Op::LookupWithState, t, &[], &ks, &[]).ok(&at(step, "lookup_with_state"));
                let w = DIM + twin.state_len();
                let (mut want, mut want_found) = (vec![0f32; n * w], vec![false; n]);
                twin.lookup_with_state(&ks, &mut want, &mut want_found).unwrap();
                let mask = proto::found_mask(&want_found);
                assert_eq!(r.body[..mask.len()], mask[..], "{}: found of {ks:?}", at(step, "lookup_with_state"));
                assert_eq!(floats(&r.body[mask.len()..]), want, "{}: records of {ks:?}", at(step, "lookup_with_state"));
            }
            8 => {
                // Records the optimizer can reach: the twin's own, rows moved.
                let w = DIM + twin.state_len();
                let (mut recs, mut found) = (vec![0f32; n * w], vec![false; n]);
                twin.lookup_with_state(&ks, &mut recs, &mut found).unwrap();
                for r in recs.chunks_mut(w) {
                    r[..DIM].iter_mut().for_each(|x| *x += rng.random_range(-1.0..1.0));
                }
                p.keyed(Op::PushWithState, t, &[], &ks, &recs).ok(&at(step, "push_with_state"));
                twin.push_with_state(&ks, &recs).unwrap();
            }
            _ => {
                let queued = p.keyed(Op::Lookahead, t, &[], &ks, &[]).ok(&at(step, "lookahead")).u64();
                assert_eq!(queued, twin.lookahead(&ks).unwrap() as u64, "{}", at(step, "lookahead"));
            }
        }
    }
    let page = rng.random_range(1..=20);
    assert_eq!(export_wire(&mut p, t, page), export_direct(&twin), "seed {seed} ({name}): export in pages of {page}");
    // The served store holds what the twin does, read directly.
    assert_eq!(export_direct(&served.store.table("t").unwrap()), export_direct(&twin), "seed {seed} ({name}): store");
}

#[test]
fn every_keyed_request_answers_what_the_core_answers() {
    for (name, opts) in servers() {
        for seed in seeds() {
            run(seed, name, opts.clone());
        }
    }
}

#[test]
fn rows_go_zero_copy_only_when_the_server_is_asked_to() {
    for (name, opts) in servers() {
        let zero_copy = opts.zero_copy;
        let (s, mut p, t) = with_rows(opts);
        p.keyed(Op::Pull, t, &[], &KEPT, &[]).ok("pull");
        p.lookup(t, &KEPT);
        p.keyed(Op::LookupStored, t, &[], &KEPT, &[]).ok("lookup_stored");
        let counts = |s: &Served| {
            (s.metrics.replies_zero_copy.load(Ordering::Relaxed), s.metrics.replies_copied.load(Ordering::Relaxed))
        };
        // Counted once the reply is out: after the peer may have read it.
        s.until("three replies counted", |s| counts(s).0 + counts(s).1 == 3);
        let (sent, copied) = counts(&s);
        let want = if zero_copy { (3, 0) } else { (0, 3) };
        assert_eq!((sent, copied), want, "{name} server: replies (zero-copy, copied)");
    }
}

/// `v` as a peer reads it from the wire (JSON text parsed back: floats as the parser rounds them).
fn as_sent(v: &impl serde::Serialize) -> serde_json::Value {
    serde_json::from_slice(&serde_json::to_vec(v).unwrap()).unwrap()
}

#[test]
fn the_store_requests_answer_what_the_store_answers() {
    let (s, mut p, t) = with_rows(ServerOptions::default());
    let names: Vec<String> = serde_json::from_value(p.call(Op::ListTables, 0, 0, &[]).ok("list").json()).unwrap();
    assert_eq!(names, s.store.tables().unwrap());
    // Opening by name gives the id create gave, and the meta the store holds.
    let open = p.call(Op::OpenTable, 0, 0, b"t").ok("open");
    assert_eq!((open.h.table_id, open.h.count), (t, DIM as u32));
    assert_eq!(open.json(), as_sent(&s.store.table("t").unwrap().meta()));
    // A checkpoint, then writes after it: an exact read at it answers the rows of then.
    let mut body = 5u64.to_le_bytes().to_vec();
    body.extend_from_slice(b"meta of 5");
    p.call(Op::Checkpoint, 0, 0, &body).ok("checkpoint");
    p.push(t, &KEPT[..2], &[0.0; 2 * DIM]);
    let list = p.call(Op::Checkpoints, 0, 0, &[]).ok("checkpoints");
    assert_eq!(list.h.count, 1);
    assert_eq!(list.json(), as_sent(&s.store.checkpoints().unwrap()));
    let served = p.call(Op::Served, 0, 0, &[]).ok("served").json();
    assert_eq!((served["batch_id"].as_u64(), served["replica"].as_bool()), (Some(5), Some(false)), "{served}");
    let (found, rows) = p.keyed(Op::LookupAt, t, &[5], &KEPT, &[]).ok("lookup_at").found_rows();
    assert!(found.iter().all(|&f| f));
    assert_eq!(rows, rows_of(&KEPT), "lookup_at 5 answers the rows at checkpoint 5");
    let at_unknown = p.keyed(Op::LookupAt, t, &[6], &KEPT, &[]);
    let mut want = vec![0f32; KEPT.len() * DIM];
    let e = s.store.lookup_checkpoint("t", 6, &KEPT, &mut want, &mut [false; KEPT.len()]).unwrap_err();
    at_unknown.refused(status_of(e.kind()), "lookup_at an unknown checkpoint");
    // Restore undoes the push after the checkpoint; the table id stays valid.
    p.call(Op::Restore, 0, 0, &5u64.to_le_bytes()).ok("restore");
    assert_eq!(p.lookup(t, &KEPT).1, rows_of(&KEPT), "rows after restore");
    p.call(Op::Flush, 0, 0, &[]).ok("flush");
    let stats = p.call(Op::StoreStats, 0, 0, &[]).ok("store stats").json();
    assert!(stats.is_object(), "{stats}");
    let stats = p.call(Op::TableStats, t, 0, &[]).ok("table stats").json();
    assert!(stats.is_object(), "{stats}");
    // set_lr reaches the table: a gradient then moves rows by the new rate.
    p.call(Op::SetLr, t, 0, &2.0f32.to_le_bytes()).ok("set_lr");
    p.keyed(Op::PushGrad, t, &[], &[1], &[1.0; DIM]).ok("push_grad");
    let want: Vec<f32> = rows_of(&[1]).iter().map(|x| x - 2.0).collect();
    assert_eq!(p.lookup(t, &[1]).1, want, "a gradient of 1 at lr 2");
    // Drop forgets the id: a request to it is refused as to a closed table.
    p.call(Op::DropTable, 0, 0, b"t").ok("drop");
    assert!(s.store.tables().unwrap().is_empty());
    p.call(Op::Len, t, 0, &[]).refused(status_of(ErrorKind::Closed), "len of a dropped table");
}

#[test]
fn held_pulls_and_gradients_answer_what_the_core_answers() {
    let held = TableOptions { staleness_bound: Some(1), ..options() };
    let s = Served::start(ServerOptions::default());
    let twin_dir = tempfile::tempdir().unwrap();
    let twin_store = Store::open(twin_dir.path(), StoreOptions::default()).unwrap();
    let twin = twin_store.create_table("h", held.clone()).unwrap();
    let mut p = s.peer();
    let t = p.create("h", &held);
    let (worker, timeout_ms) = (3u64, 1000u64);
    let r = p.keyed(Op::PullHeld, t, &[worker, timeout_ms], &KEPT, &[]).ok("pull_held");
    let mut want = vec![0f32; KEPT.len() * DIM];
    twin.pull_held(worker, &KEPT, &mut want, Duration::from_millis(timeout_ms)).unwrap();
    assert_eq!(floats(&r.body), want, "pull_held rows");
    let grads = rows_of(&KEPT);
    p.keyed(Op::PushGradHeld, t, &[worker], &KEPT, &grads).ok("push_grad_held");
    twin.push_grad_held(worker, &KEPT, &grads).unwrap();
    p.keyed(Op::PullHeld, t, &[worker, timeout_ms], &KEPT[..3], &[]).ok("pull_held again");
    twin.pull_held(worker, &KEPT[..3], &mut want[..3 * DIM], Duration::from_millis(timeout_ms)).unwrap();
    let gone = p.call(Op::Release, t, 0, &worker.to_le_bytes()).ok("release").u64();
    assert_eq!(gone, twin.release(worker), "holds released");
    assert_eq!(export_wire(&mut p, t, 4), export_direct(&twin), "the held table after its gradients");
}
