//! Serving that never blinks, end to end with real brokers and real `embank serve`
//! replicas: a resync after a broker outage never empties a replica (with replicas
//! SIGKILLed during it), reads see one checkpoint whole while the next is applied, and
//! exact reads at a checkpoint equal the trainer's export of it.

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::replica::*;
use common::sigkill;
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_core::{Store, StoreOptions};
use embank_net::stream::{PublishOptions, Publisher, Replica, ReplicaOptions};
use embank_net::{Client, ClientOptions};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

/// The one batch id of all rows (each row holds the number of the checkpoint that wrote
/// it), or a panic naming the keys missing or the mix.
fn one_checkpoint(rows: &[f32], found: &[bool], what: &str) -> u64 {
    let missing = found.iter().filter(|&&f| !f).count();
    assert_eq!(missing, 0, "{what}: {missing} of {} keys missing", found.len());
    let first = rows[0];
    if let Some(i) = rows.iter().position(|&x| x != first) {
        panic!("{what}: a mix of checkpoints: key 0 from batch {first}, key {} from batch {}", i / DIM, rows[i]);
    }
    first as u64
}

/// With the broker down: checkpoints 2, 3, ... each rewrite 500 random keys and the
/// `known` ones with their batch id and delete 50 keys not known, until the publisher
/// gives up its place (`notify` fails past `checkpoints_pending_max`). The last batch id.
fn train_through_the_outage(
    store: &Store,
    publisher: &Publisher,
    known: &[u64],
    rows_total: u64,
    every: u64,
    seed: u64,
) -> u64 {
    let emb = store.table("emb").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut b = 1;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        b += 1;
        let keys: Vec<u64> = (0..500).map(|_| rng.random_range(0..rows_total)).chain(known.iter().copied()).collect();
        emb.push(&keys, &vec![b as f32; keys.len() * DIM]).unwrap();
        let gone: Vec<u64> = (0..50).map(|_| rng.random_range(0..rows_total)).filter(|k| k % every != 0).collect();
        emb.delete(&gone).unwrap();
        store.checkpoint(b).unwrap();
        if publisher.notify().is_err() {
            break;
        }
        assert!(Instant::now() < deadline, "the publisher never gave up: {:?}", publisher.status());
        std::thread::sleep(Duration::from_millis(50));
    }
    b
}

/// A broker outage makes the publisher give up its place and resync with a full
/// snapshot of 1 M rows; the replica applies it beside what it serves. A reader of 1,000
/// keys present at every checkpoint (each checkpoint rewrites them with its own number),
/// reading through the served view throughout, never misses one and never gets rows of
/// two checkpoints in one answer, nor an older checkpoint after a newer; at the end the
/// replica equals the trainer, so the keys the snapshot lacks (deleted during the
/// outage) were swept.
#[test]
fn a_resync_after_a_broker_outage_never_empties_the_replica() {
    let rows_total: u64 = std::env::var("EMBANK_RESYNC_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let every = rows_total / 1000; // keys 0, every, 2 * every, ... are never deleted
    let dir = tempfile::tempdir().unwrap();
    let mut broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "resync");
    let store = trainer(&dir.path().join("trainer"));
    let emb = store.table("emb").unwrap();
    let all: Vec<u64> = (0..rows_total).collect();
    for chunk in all.chunks(50_000) {
        emb.push(chunk, &vec![1.0; chunk.len() * DIM]).unwrap();
    }
    let mut opts = PublishOptions::new(stream.clone());
    opts.checkpoints_pending_max = 1;
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    store.checkpoint(1).unwrap();
    publisher.notify().unwrap();
    publisher.flush(Duration::from_secs(60)).unwrap();
    let replica_store = Arc::new(Store::open(dir.path().join("replica"), StoreOptions::default()).unwrap());
    let replica = Replica::start(Arc::clone(&replica_store), ReplicaOptions::new(stream)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while replica.status().checkpoint_batch_id != Some(1) {
        assert!(Instant::now() < deadline, "the replica never served checkpoint 1: {:?}", replica.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    // The reader: lookups of 1,000 known keys, as fast as it can, until told to stop.
    let (stop, resyncing) = (AtomicBool::new(false), AtomicBool::new(false));
    let known: Vec<u64> = (0..rows_total).step_by(every as usize).collect();
    let replica_table = replica_store.table("emb").unwrap();
    let view = replica.view();
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let (mut lookups, mut during, mut seen) = (0u64, 0u64, 1u64);
            let mut rows = vec![0f32; known.len() * DIM];
            let mut found = vec![false; known.len()];
            while !stop.load(Ordering::Relaxed) {
                view.lookup(&replica_table, &known, &mut rows, &mut found).unwrap();
                let b = one_checkpoint(&rows, &found, &format!("lookup {lookups}"));
                assert!(b >= seen, "lookup {lookups}: checkpoint {b} after checkpoint {seen}");
                seen = b;
                lookups += 1;
                during += resyncing.load(Ordering::Relaxed) as u64;
            }
            (lookups, during, seen)
        });
        // The outage: checkpoints pile up until the publisher gives up its place.
        broker.kill();
        let b = train_through_the_outage(&store, &publisher, &known, rows_total, every, 11);
        resyncing.store(true, Ordering::Relaxed);
        let resync_started = Instant::now();
        broker.restart().unwrap();
        publisher.flush(Duration::from_secs(60)).unwrap();
        assert!(publisher.status().full_snapshots >= 2, "{:?}", publisher.status());
        let last = store.checkpoints().unwrap().pop().unwrap();
        while replica.status().checkpoint_seq != Some(last.seq) {
            assert!(resync_started.elapsed() < Duration::from_secs(120), "{:?}", replica.status());
            std::thread::sleep(Duration::from_millis(1));
        }
        let resync_seconds = resync_started.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        let (lookups, during, seen) = reader.join().unwrap();
        eprintln!(
            "resync of {rows_total} rows: {resync_seconds:.2} s from the broker's restart to the snapshot's commit; \
             {lookups} lookups of {} known keys ({during} during the resync), none missing a key or mixing \
             checkpoints; replica {:?}",
            known.len(),
            replica.status()
        );
        replica_equals_trainer(&replica, &replica_store, &store, "after the resync");
        assert!(during > 0, "no lookup ran during the resync");
        assert_eq!(seen, b, "the reader never saw the last checkpoint");
        assert_eq!(replica.status().checkpoints_not_atomic, 0, "{:?}", replica.status());
    });
}

/// The resync above with a shard's two `embank serve` replicas SIGKILLed during it, in
/// turn: a killed replica reopens at its last commit (before the reset, whole) and reads
/// the reset again, while reads fail over to the other. No read fails, none misses a
/// known key or mixes checkpoints, and both replicas end equal to the trainer.
#[test]
fn a_resync_with_replicas_killed_during_it_never_misses_a_key() {
    let rows_total: u64 = std::env::var("EMBANK_RESYNC_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    // 500 known keys: one request, answered whole by one replica.
    let (every, kills) = (rows_total / 500, 6usize);
    let dir = tempfile::tempdir().unwrap();
    let mut broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "resync-kill");
    let store = trainer(&dir.path().join("trainer"));
    let emb = store.table("emb").unwrap();
    let all: Vec<u64> = (0..rows_total).collect();
    for chunk in all.chunks(50_000) {
        emb.push(chunk, &vec![1.0; chunk.len() * DIM]).unwrap();
    }
    let mut opts = PublishOptions::new(stream);
    opts.checkpoints_pending_max = 1;
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    store.checkpoint(1).unwrap();
    publisher.notify().unwrap();
    publisher.flush(Duration::from_secs(60)).unwrap();
    let configs: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|name| {
            let config = dir.path().join(format!("{name}.toml"));
            std::fs::write(
                &config,
                format!(
                    "store = {:?}\nlisten = \"127.0.0.1:0\"\n[updates]\ntransport = \"redis\"\nbrokers = \"{}\"\n\
                     topic = \"resync-kill\"\ntimeout_seconds = 5.0\n",
                    dir.path().join(name).display().to_string(),
                    broker.brokers()
                ),
            )
            .unwrap();
            config
        })
        .collect();
    // Each replica keeps its port across restarts, so the client's group stays valid.
    let mut replicas: Vec<(Child, String)> = configs.iter().map(|c| start_replica(c)).collect();
    for (config, (_, addr)) in configs.iter().zip(&replicas) {
        let text = std::fs::read_to_string(config).unwrap().replace("127.0.0.1:0", addr);
        std::fs::write(config, text).unwrap();
    }
    let group = vec![replicas.iter().map(|r| r.1.clone()).collect::<Vec<_>>()];
    let client =
        Client::connect_groups(&group, ClientOptions { timeout: Duration::from_secs(5), ..Default::default() })
            .unwrap();
    wait_served(&client, 1);
    let known: Vec<u64> = (0..rows_total).step_by(every as usize).collect();
    assert_eq!(known.len(), 500);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let t = client.table("emb").unwrap();
            let mut lookups = 0u64;
            let mut rows = vec![0f32; known.len() * DIM];
            let mut found = vec![false; known.len()];
            while !stop.load(Ordering::Relaxed) {
                t.lookup(&known, &mut rows, &mut found).unwrap_or_else(|e| panic!("lookup {lookups} failed: {e}"));
                // Not monotonic: a read that fails over may meet the other replica
                // behind.
                one_checkpoint(&rows, &found, &format!("lookup {lookups}"));
                lookups += 1;
            }
            lookups
        });
        broker.kill();
        let b = train_through_the_outage(&store, &publisher, &known, rows_total, every, 12);
        broker.restart().unwrap();
        // Kills in turn while the replicas apply the snapshot (each kill sends the killed
        // one back to its last commit, so the resync goes on past the kills).
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for k in 0..kills {
            std::thread::sleep(Duration::from_millis(rng.random_range(100..400)));
            let r = &mut replicas[k % 2];
            sigkill(&mut r.0);
            *r = start_replica(&configs[k % 2]);
        }
        publisher.flush(Duration::from_secs(60)).unwrap();
        wait_served(&client, b);
        stop.store(true, Ordering::Relaxed);
        let lookups = reader.join().unwrap();
        eprintln!(
            "resync of {rows_total} rows with {kills} replica kills: {lookups} lookups of {} known keys, none \
             missing a key or mixing checkpoints",
            known.len()
        );
        assert!(lookups > 10, "only {lookups} lookups");
    });
    let last = store.checkpoints().unwrap().pop().unwrap();
    for (child, addr) in &mut replicas {
        let (got_emb, got_blk) = replica_rows(addr, last.seq);
        same(&got_emb, &trainer_at(&store, "emb", last.batch_id, (0, 1)), "emb");
        same(&got_blk, &trainer_at(&store, "blk", last.batch_id, (0, 1)), "blk");
        sigkill(child);
    }
}

/// Reads through a replica's served view see one checkpoint whole: every checkpoint
/// rewrites every key of two tables with its own batch id, and a reader of all keys,
/// running while checkpoints are applied, must get rows all of one batch id, never going
/// back; in-process (all keys), and through `embank serve` (one request's keys). At the
/// end the replica equals the trainer.
#[test]
fn reads_see_one_checkpoint_whole_while_the_next_is_applied() {
    const ROWS: u64 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "whole");
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream.clone());
    opts.message_bytes = 64 << 10; // many messages per checkpoint
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    let keys: Vec<u64> = (0..ROWS).collect();
    let write = |b: u64| {
        for name in ["emb", "blk"] {
            store.table(name).unwrap().push(&keys, &vec![b as f32; keys.len() * DIM]).unwrap();
        }
        store.checkpoint(b).unwrap();
        publisher.notify().unwrap();
    };
    write(1);
    publisher.flush(Duration::from_secs(60)).unwrap();
    let replica_store = Arc::new(Store::open(dir.path().join("replica"), StoreOptions::default()).unwrap());
    let replica = Replica::start(Arc::clone(&replica_store), ReplicaOptions::new(stream.clone())).unwrap();
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\n[updates]\ntransport = \"redis\"\nbrokers = \"{}\"\ntopic = \"whole\"\n",
            dir.path().join("served").display().to_string(),
            broker.brokers()
        ),
    )
    .unwrap();
    let (mut child, addr) = start_replica(&config);
    let client = Client::connect(&[addr], ClientOptions::default()).unwrap();
    wait_served(&client, 1);
    let deadline = Instant::now() + Duration::from_secs(60);
    while replica.status().checkpoint_batch_id != Some(1) {
        assert!(Instant::now() < deadline, "{:?}", replica.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    let view = replica.view();
    let stop = AtomicBool::new(false);
    let last = 16;
    let reads = std::thread::scope(|scope| {
        let in_process = scope.spawn(|| {
            let (mut reads, mut seen) = (0u64, 1u64);
            let mut rows = vec![0f32; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            while !stop.load(Ordering::Relaxed) {
                for name in ["emb", "blk"] {
                    let t = replica_store.table(name).unwrap();
                    view.lookup(&t, &keys, &mut rows, &mut found).unwrap();
                    let b = one_checkpoint(&rows, &found, &format!("in-process read {reads} of {name}"));
                    assert!(b >= seen, "read {reads} of {name}: batch {b} after batch {seen}");
                    seen = b;
                }
                reads += 1;
            }
            reads
        });
        let served = scope.spawn(|| {
            // One request's worth (the client splits a call into requests of at most 500
            // keys, and each request is answered whole; a call of several requests may
            // straddle a commit).
            let keys: Vec<u64> = (0..ROWS).step_by(40).collect();
            assert_eq!(keys.len(), 500);
            let (mut reads, mut seen) = (0u64, 1u64);
            let mut rows = vec![0f32; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            while !stop.load(Ordering::Relaxed) {
                for name in ["emb", "blk"] {
                    client.table(name).unwrap().lookup(&keys, &mut rows, &mut found).unwrap();
                    let b = one_checkpoint(&rows, &found, &format!("served read {reads} of {name}"));
                    assert!(b >= seen, "served read {reads} of {name}: batch {b} after batch {seen}");
                    seen = b;
                }
                reads += 1;
            }
            reads
        });
        // A whole call of 20,000 keys: 40 requests, read at one checkpoint (the client
        // pins the shard's part of a call to the checkpoint its replicas serve when it
        // begins).
        let whole = scope.spawn(|| {
            let (mut reads, mut seen) = (0u64, 1u64);
            let mut rows = vec![0f32; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            while !stop.load(Ordering::Relaxed) {
                for name in ["emb", "blk"] {
                    client.table(name).unwrap().lookup(&keys, &mut rows, &mut found).unwrap();
                    let b = one_checkpoint(&rows, &found, &format!("whole-call read {reads} of {name}"));
                    assert!(b >= seen, "whole-call read {reads} of {name}: batch {b} after batch {seen}");
                    seen = b;
                }
                reads += 1;
            }
            reads
        });
        for b in 2..=last {
            write(b);
            std::thread::sleep(Duration::from_millis(100));
        }
        publisher.flush(Duration::from_secs(60)).unwrap();
        wait_served(&client, last);
        let deadline = Instant::now() + Duration::from_secs(60);
        while replica.status().checkpoint_batch_id != Some(last) {
            assert!(Instant::now() < deadline, "{:?}", replica.status());
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
        (in_process.join().unwrap(), served.join().unwrap(), whole.join().unwrap())
    });
    eprintln!(
        "whole checkpoints: {reads:?} reads (in-process, served, whole calls) of 2 x {ROWS} keys; {:?}",
        replica.status()
    );
    assert!(reads.0 > 5 && reads.1 > 5 && reads.2 > 5, "{reads:?}");
    assert_eq!(replica.status().checkpoints_not_atomic, 0);
    replica_equals_trainer(&replica, &replica_store, &store, "at the end");
    sigkill(&mut child);
}

/// Exact reads of an older checkpoint (`lookup_at`) on a serving cluster of 2 shards,
/// each a group of 2 `embank serve` replicas keeping 3 checkpoints: two readers read both
/// tables at a checkpoint N still held while N+1.. are published and applied (and one
/// replica of each group is SIGKILLed and restarted). Every answer equals the trainer's
/// export of N, row for row, both tables; a checkpoint no replica holds any more is
/// refused (NotFound), never answered from another.
#[test]
fn reads_at_a_checkpoint_equal_the_trainers_export_of_it_while_later_ones_apply() {
    const KEEP: u64 = 3;
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "exact");
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream.clone());
    opts.partitions = PARTS;
    opts.message_bytes = 16 << 10; // many messages per checkpoint
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(33);
    // The trainer's export of each checkpoint as it is taken: (emb, blk), all keys.
    let exports: Mutex<BTreeMap<u64, (Rows, Rows)>> = Mutex::new(BTreeMap::new());
    let checkpoint = |b: u64| {
        store.checkpoint(b).unwrap();
        let both = (trainer_at(&store, "emb", b, (0, 1)), trainer_at(&store, "blk", b, (0, 1)));
        exports.lock().insert(b, both);
        publisher.notify().unwrap();
    };
    for b in 1..=3 {
        step(&store, b, &mut rng);
        checkpoint(b);
        publisher.flush(Duration::from_secs(60)).unwrap(); // each its own (not coalesced)
    }
    let configs: Vec<Vec<std::path::PathBuf>> = (0..PARTS)
        .map(|p| {
            ["a", "b"]
                .into_iter()
                .map(|r| {
                    let config = dir.path().join(format!("{p}{r}.toml"));
                    std::fs::write(
                        &config,
                        format!(
                            "store = {:?}\nlisten = \"127.0.0.1:0\"\n[store_options]\nkeep_checkpoints = {KEEP}\n\
                             [updates]\ntransport = \"redis\"\nbrokers = \"{}\"\ntopic = \"exact\"\npartition = {p}\n\
                             timeout_seconds = 5.0\n",
                            dir.path().join(format!("{p}{r}")).display().to_string(),
                            broker.brokers()
                        ),
                    )
                    .unwrap();
                    config
                })
                .collect()
        })
        .collect();
    let mut servers: Vec<Vec<(Child, String)>> =
        configs.iter().map(|g| g.iter().map(|c| start_replica(c)).collect()).collect();
    for (group, started) in configs.iter().zip(&servers) {
        for (config, (_, addr)) in group.iter().zip(started) {
            let text = std::fs::read_to_string(config).unwrap().replace("127.0.0.1:0", addr);
            std::fs::write(config, text).unwrap();
        }
    }
    let groups: Vec<Vec<String>> = servers.iter().map(|g| g.iter().map(|r| r.1.clone()).collect()).collect();
    let client =
        Client::connect_groups(&groups, ClientOptions { timeout: Duration::from_secs(5), ..Default::default() })
            .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !client.served_all().iter().flatten().all(|v| v["batch_id"].as_u64() == Some(3)) {
        assert!(Instant::now() < deadline, "replicas serve {:?}", client.served_all());
        std::thread::sleep(Duration::from_millis(20));
    }
    let readable = client.served_all()[0][0]["readable"].clone();
    assert_eq!(readable, serde_json::json!([1, 2, 3]), "{:?}", client.served_all());
    let last = 14u64;
    let newest = std::sync::atomic::AtomicU64::new(3);
    let stop = AtomicBool::new(false);
    let (checked, refused) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..2u64)
            .map(|r| {
                let (client, exports, newest, stop) = (&client, &exports, &newest, &stop);
                scope.spawn(move || {
                    let (mut checked, mut refused) = (0u64, 0u64);
                    let keys: Vec<u64> = (0..KEYS + (last + 1) * 8).collect();
                    let mut rows = vec![0f32; keys.len() * DIM];
                    let mut found = vec![false; keys.len()];
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        // The newest the trainer has published, or one or two before it.
                        let n = newest.load(Ordering::Relaxed).saturating_sub((i + r) % KEEP).max(1);
                        let want = exports.lock().get(&n).cloned().unwrap();
                        for (name, want) in [("emb", &want.0), ("blk", &want.1)] {
                            match client.table(name).unwrap().lookup_at(n, &keys, &mut rows, &mut found) {
                                Ok(()) => {
                                    let mut got = Rows::new();
                                    for (j, &k) in keys.iter().enumerate() {
                                        if found[j] {
                                            got.insert(
                                                k,
                                                rows[j * DIM..(j + 1) * DIM].iter().map(|x| x.to_bits()).collect(),
                                            );
                                        }
                                    }
                                    same(&got, want, &format!("reader {r}: {name} at checkpoint {n}"));
                                    checked += 1;
                                }
                                Err(e) => {
                                    let msg = e.to_string();
                                    // Not applied yet by a shard, or dropped by all of a group.
                                    assert!(
                                        msg.contains("not readable") || msg.contains("or later yet"),
                                        "reader {r}: {name} at checkpoint {n}: {e}"
                                    );
                                    refused += 1;
                                }
                            }
                        }
                    }
                    (checked, refused)
                })
            })
            .collect();
        for b in 4..=last {
            step(&store, b, &mut rng);
            checkpoint(b);
            newest.store(b, Ordering::Relaxed);
            if b == 8 {
                for (g, group) in servers.iter_mut().enumerate() {
                    sigkill(&mut group[0].0);
                    group[0] = start_replica(&configs[g][0]);
                }
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        publisher.flush(Duration::from_secs(60)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !client.served_all().iter().flatten().all(|v| v["batch_id"].as_u64() == Some(last)) {
            assert!(Instant::now() < deadline, "replicas serve {:?}", client.served_all());
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        readers.into_iter().map(|h| h.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    eprintln!("exact reads: {checked} answers equal to the trainer's export, {refused} refused");
    assert!(checked > 20, "only {checked} answers checked ({refused} refused)");
    // Older than what the replicas keep: refused, naming what they hold.
    let err = client.table("emb").unwrap().lookup_at(1, &[1], &mut [0.0; DIM], &mut [false]).unwrap_err();
    assert!(err.to_string().contains("not readable"), "{err}");
    for group in &mut servers {
        for (child, _) in group {
            sigkill(child);
        }
    }
}
