//! The applier's rules, message by message, without a broker.
use super::*;
use crate::stream::TransportKind;
use embank_core::StoreOptions;

const DIM: usize = 4;

fn shared(dir: &std::path::Path) -> Shared {
    let store = Arc::new(Store::open(dir, StoreOptions::default()).unwrap());
    let opts = ReplicaOptions::new(StreamConfig::new(TransportKind::Redis, "redis://127.0.0.1:1"));
    Shared {
        store,
        view: Arc::new(ServedView::new(STAGED_BYTES_MAX_DEFAULT)),
        opts,
        status: Mutex::new(ReplicaStatus::default()),
        stop: AtomicBool::new(false),
        commits_left: AtomicU64::new(NO_HOLD),
        held: AtomicBool::new(false),
    }
}

fn message(kind: Kind, seq: u64, keys: std::ops::Range<u64>) -> message::Message {
    let keys: Vec<u64> = keys.collect();
    let rows = vec![seq as f32; if kind == Kind::Rows { keys.len() * DIM } else { 0 }];
    let checkpoint = message::CheckpointId { seq, batch_id: seq, unix_micros: 0 };
    let table = if kind == Kind::Commit { String::new() } else { "emb".into() };
    message::Message { kind, checkpoint, table, dim: DIM as u32, count: 0, keys, rows }
}

/// Applies `messages` in order as the applier does (a commit sweeps); returns the
/// keys present after each message.
fn run(s: &Shared, messages: &[message::Message]) -> Vec<Vec<u64>> {
    let mut resyncs = HashMap::new();
    messages
        .iter()
        .map(|m| {
            apply(s, m, &mut resyncs, &mut Pacer::new(1.0, &s.view)).unwrap();
            if m.kind == Kind::Commit {
                sweep(s, &mut resyncs, m.checkpoint.seq).unwrap();
            }
            present(s)
        })
        .collect()
}

fn present(s: &Shared) -> Vec<u64> {
    let mut keys = Vec::new();
    s.store
        .table("emb")
        .unwrap()
        .export(1024, |k, _| {
            keys.extend_from_slice(k);
            Ok(())
        })
        .unwrap();
    keys.sort_unstable();
    keys
}

fn serving(s: &Shared, keys: std::ops::Range<u64>) {
    run(s, &[message(Kind::Rows, 1, keys), message(Kind::Commit, 1, 0..0)]);
}

#[test]
fn a_held_replica_stops_at_a_checkpoint_boundary_and_goes_on_when_let() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(shared(dir.path()));
    // Held after one commit, set while nothing is applied yet.
    s.commits_left.store(1, Ordering::Release);
    let (tx, rx) = std::sync::mpsc::sync_channel(64);
    for seq in 1..=3u64 {
        let keys = (seq - 1) * 10..seq * 10;
        tx.send(Ok((format!("{seq}-rows"), message(Kind::Rows, seq, keys)))).unwrap();
        tx.send(Ok((format!("{seq}-commit"), message(Kind::Commit, seq, 0..0)))).unwrap();
    }
    let applier = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            let mut applied = Applied { meta: None, next_batch: 1 };
            apply_all(&s, &mut applied, &rx)
        })
    };
    let wait_for = |what: &dyn Fn() -> bool| {
        let until = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < until, "timed out");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_for(&|| s.status.lock().state == "held");
    std::thread::sleep(Duration::from_millis(100));
    {
        let st = s.status.lock();
        assert_eq!((st.commits, st.checkpoint_seq), (1, Some(1)), "one checkpoint, then held");
    }
    // Nothing of checkpoint 2 was applied: held between checkpoints, nothing kept.
    assert_eq!(present(&s), (0..10).collect::<Vec<_>>());
    assert_eq!(s.view.staged_bytes(), 0);
    // Let one more through, then all.
    s.commits_left.store(1, Ordering::Release);
    wait_for(&|| s.status.lock().commits == 2 && s.status.lock().state == "held");
    assert_eq!(present(&s), (0..20).collect::<Vec<_>>());
    s.commits_left.store(NO_HOLD, Ordering::Release);
    wait_for(&|| s.status.lock().commits == 3);
    assert_eq!(present(&s), (0..30).collect::<Vec<_>>());
    // A hold asked for while a checkpoint is half applied waits for its commit.
    tx.send(Ok(("4-rows".into(), message(Kind::Rows, 4, 30..40)))).unwrap();
    wait_for(&|| s.status.lock().rows == 40);
    s.commits_left.store(0, Ordering::Release);
    // Past a receive timeout, so the applier looks at the hold before the commit comes.
    std::thread::sleep(Duration::from_millis(250));
    tx.send(Ok(("4-commit".into(), message(Kind::Commit, 4, 0..0)))).unwrap();
    tx.send(Ok(("5-rows".into(), message(Kind::Rows, 5, 40..50)))).unwrap();
    tx.send(Ok(("5-commit".into(), message(Kind::Commit, 5, 0..0)))).unwrap();
    wait_for(&|| s.status.lock().state == "held");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(s.status.lock().commits, 4);
    assert_eq!(present(&s), (0..40).collect::<Vec<_>>());
    s.commits_left.store(NO_HOLD, Ordering::Release);
    wait_for(&|| s.status.lock().commits == 5);
    drop(tx);
    applier.join().unwrap().unwrap();
    assert_eq!(present(&s), (0..50).collect::<Vec<_>>());
}

#[test]
fn a_snapshot_keeps_every_key_until_its_commit_then_sweeps_the_ones_it_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let s = shared(dir.path());
    serving(&s, 0..100);
    let after = run(
        &s,
        &[
            message(Kind::Reset, 5, 0..0),
            message(Kind::Rows, 5, 0..50),
            message(Kind::Rows, 5, 100..120),
            message(Kind::Commit, 5, 0..0),
        ],
    );
    for (i, keys) in after[..3].iter().enumerate() {
        assert!((0..100).all(|k| keys.binary_search(&k).is_ok()), "a key went missing after message {i}");
    }
    assert_eq!(after[3], (0..50).chain(100..120).collect::<Vec<_>>(), "after the commit");
}

#[test]
fn a_retried_snapshot_starts_over_and_an_abandoned_one_sweeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = shared(dir.path());
    serving(&s, 0..100);
    // The publisher's first attempt (checkpoint 5) broke off; its retry is checkpoint 6.
    let after = run(
        &s,
        &[
            message(Kind::Reset, 5, 0..0),
            message(Kind::Rows, 5, 90..110),
            message(Kind::Reset, 6, 0..0),
            message(Kind::Rows, 6, 0..30),
            message(Kind::Commit, 6, 0..0),
        ],
    );
    assert_eq!(after[4], (0..30).collect::<Vec<_>>(), "the retry's commit sweeps the first attempt's rows too");
    // A snapshot broken off and followed by an incremental publish (a publisher that
    // restarted from its last published place): its rows stay, nothing is swept.
    let after = run(
        &s,
        &[
            message(Kind::Reset, 7, 0..0),
            message(Kind::Rows, 7, 0..10),
            message(Kind::Rows, 8, 200..201),
            message(Kind::Commit, 8, 0..0),
        ],
    );
    assert_eq!(after[3], (0..30).chain(200..201).collect::<Vec<_>>());
}

#[test]
fn a_message_larger_than_a_chunk_is_applied_whole_and_reads_see_the_served_rows_until_its_commit() {
    let dir = tempfile::tempdir().unwrap();
    let s = shared(dir.path());
    let n = (INGEST_CHUNK_ROWS * 2 + 7) as u64;
    serving(&s, 0..n);
    s.view.commit(1);
    let t = s.store.table("emb").unwrap();
    let keys: Vec<u64> = (0..n).collect();
    let (mut out, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
    // Checkpoint 2 rewrites every key, three chunks of one message, with reads between.
    let mut resyncs = HashMap::new();
    let mut pacer = Pacer::new(0.5, &s.view);
    apply(&s, &message(Kind::Rows, 2, 0..n), &mut resyncs, &mut pacer).unwrap();
    s.view.lookup(&t, &keys, &mut out, &mut found).unwrap();
    assert!(out.iter().all(|&x| x == 1.0) && found.iter().all(|&f| f), "reads see checkpoint 1 until the commit");
    s.view.commit(2);
    s.view.lookup(&t, &keys, &mut out, &mut found).unwrap();
    assert!(out.iter().all(|&x| x == 2.0), "every chunk was applied");
}

#[test]
fn reads_during_apply_never_mix_two_checkpoints() {
    // Two threads: an applier rewriting every key in each checkpoint (128 messages of 16
    // keys in a shuffled order), and a reader whose every batch (2000 keys: a long read) must come from one
    // checkpoint (all rows equal) that only moves forward. The applier goes on until
    // the reader has read 3000 batches.
    let dir = tempfile::tempdir().unwrap();
    let s = shared(dir.path());
    let n = 2048u64;
    serving(&s, 0..n);
    s.view.commit(1);
    let t = s.store.table("emb").unwrap();
    let (stop, reads) = (AtomicBool::new(false), std::sync::atomic::AtomicU64::new(0));
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let (mut last, mut x) = (1.0f32, 0x9e37_79b9_7f4a_7c15u64);
            let (mut out, mut found) = (vec![0f32; 2000 * DIM], vec![false; 2000]);
            while !stop.load(Ordering::Acquire) {
                let keys: Vec<u64> = (0..2000)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % n
                    })
                    .collect();
                s.view.lookup(&t, &keys, &mut out, &mut found).unwrap();
                let r = reads.fetch_add(1, Ordering::Relaxed);
                assert!(found.iter().all(|&f| f), "read {r}: a key was missing");
                let first = out[0];
                if let Some(i) = out.iter().position(|&v| v != first) {
                    panic!(
                        "read {r} mixes checkpoints: key {} has {} and key {} has {first}",
                        keys[i / DIM],
                        out[i],
                        keys[0]
                    );
                }
                assert!(first >= last, "read {r} went back from checkpoint {last} to {first}");
                last = first;
            }
        });
        let mut resyncs = HashMap::new();
        let mut pacer = Pacer::new(1.0, &s.view);
        let mut seq = 2u64;
        while reads.load(Ordering::Relaxed) < 3000 && seq < 5000 && !reader.is_finished() {
            for i in 0..128u64 {
                let part = (i * 37) % 128;
                apply(&s, &message(Kind::Rows, seq, part * 16..(part + 1) * 16), &mut resyncs, &mut pacer).unwrap();
            }
            s.view.commit(seq);
            seq += 1;
        }
        stop.store(true, Ordering::Release);
        reader.join().unwrap();
        assert!(
            reads.load(Ordering::Relaxed) >= 3000,
            "only {} reads in {seq} checkpoints",
            reads.load(Ordering::Relaxed)
        );
    });
}

#[test]
fn the_applier_rests_only_after_reads_and_in_proportion_to_its_share_and_their_load() {
    let view = ServedView::new(STAGED_BYTES_MAX_DEFAULT);
    let work = Duration::from_millis(20);
    let mut pacer = Pacer::new(0.25, &view);
    // No read since the last look: no rest.
    std::thread::sleep(work);
    let started = Instant::now();
    pacer.after(&view, work);
    assert!(started.elapsed() < Duration::from_millis(50), "rested {:?} with no reads", started.elapsed());
    // Readers kept a core busy throughout: it rests work * (1 / 0.25 - 1) = 60 ms.
    std::thread::sleep(work);
    view.count_read_time(work * 2);
    let started = Instant::now();
    pacer.after(&view, work);
    let rested = started.elapsed();
    assert!(rested >= Duration::from_millis(60), "rested {rested:?} after saturating reads");
    // Light reads (a tenth of the window at most): a tenth of that rest at most.
    std::thread::sleep(work);
    view.count_read_time(work / 10);
    let started = Instant::now();
    pacer.after(&view, work);
    let rested = started.elapsed();
    assert!(rested < Duration::from_millis(40), "rested {rested:?} after light reads");
    // Share 1.0 never rests.
    let mut full = Pacer::new(1.0, &view);
    std::thread::sleep(work);
    view.count_read_time(work * 2);
    let started = Instant::now();
    full.after(&view, work);
    assert!(started.elapsed() < Duration::from_millis(50));
}

#[test]
fn an_ingest_share_outside_zero_to_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), StoreOptions::default()).unwrap());
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let mut opts = ReplicaOptions::new(StreamConfig::new(TransportKind::Redis, "redis://127.0.0.1:1"));
        opts.ingest_share = bad;
        let e = Replica::start(Arc::clone(&store), opts).err().expect("refused");
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("ingest_share"), "{e}");
    }
}
