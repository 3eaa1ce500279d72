//! The update stream end to end, with real brokers (a Kafka broker in KRaft mode from
//! tools/kafka, a `redis-server`) and real `embank serve` replicas.
//!
//! - A training store (an mmap table with Adagrad, a block table behind a small row
//!   cache with Adam) trains and checkpoints 24 times, publishing every checkpoint to a
//!   stream of two partitions, while the replica of partition 1 is SIGKILLed at random
//!   20 times (`EMBANK_REPLICA_KILLS`; `make test-long`: 1,000) and restarted, and the broker is killed and
//!   restarted once mid-stream. At the end the replica's export equals the trainer's
//!   export at the last checkpoint, restricted to the partition's keys, row for row.
//! - A publisher whose broker stays down fails `notify` loudly past `checkpoints_pending_max`,
//!   then catches up with a full snapshot once the broker is back.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{http_get, sigkill};
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_core::{MediumKind, Optimizer, Placement, Store, StoreOptions, TableOptions};
use embank_net::proto::shard_of;
use embank_net::stream::{PublishOptions, Publisher, Replica, ReplicaOptions, StreamConfig, TransportKind};
use embank_net::{Client, ClientOptions};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

const DIM: usize = 8;
const KEYS: u64 = 3000;
const PARTS: u32 = 2;

type Rows = BTreeMap<u64, Vec<u32>>;

fn trainer(path: &Path) -> Arc<Store> {
    let store = Store::open(path, StoreOptions { cache_bytes: 64 << 10, ..Default::default() }).unwrap();
    let mut o = TableOptions::new(DIM as u32);
    o.optimizer = Optimizer::Adagrad { lr: 0.1, eps: 1e-8, initial_accumulator_value: 0.1 };
    store.create_table("emb", o.clone()).unwrap();
    o.medium = MediumKind::Block;
    o.placement = Placement::Cache;
    o.optimizer = Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
    store.create_table("blk", o).unwrap();
    Arc::new(store)
}

/// One training batch: pulls and gradients on skewed keys, a few new keys pushed, a few deleted.
fn step(store: &Store, b: u64, rng: &mut rand::rngs::StdRng) {
    for name in ["emb", "blk"] {
        let t = store.table(name).unwrap();
        let keys: Vec<u64> = (0..256).map(|_| (rng.random::<f64>().powi(3) * KEYS as f64) as u64).collect();
        let mut rows = vec![0f32; keys.len() * DIM];
        t.pull(&keys, &mut rows).unwrap();
        let grads: Vec<f32> = (0..rows.len()).map(|_| rng.random::<f32>() - 0.5).collect();
        t.push_grad(&keys, &grads).unwrap();
        let fresh: Vec<u64> = (0..8).map(|i| KEYS + b * 8 + i).collect();
        t.push(&fresh, &vec![b as f32; fresh.len() * DIM]).unwrap();
        let gone: Vec<u64> = (0..4).map(|_| rng.random_range(0..KEYS + b * 8)).collect();
        t.delete(&gone).unwrap();
    }
}

fn rows_of(keys: &[u64], rows: &[f32], (partition, parts): (u32, u32), out: &mut Rows) {
    for (i, &k) in keys.iter().enumerate() {
        if shard_of(k, parts) == partition {
            out.insert(k, rows[i * DIM..(i + 1) * DIM].iter().map(|x| x.to_bits()).collect());
        }
    }
}

/// The trainer's table at checkpoint `batch`, keys of `partition` only.
fn trainer_at(store: &Store, name: &str, batch: u64, partition: (u32, u32)) -> Rows {
    let mut out = Rows::new();
    store
        .export_checkpoint(name, batch, 4096, |k, r| {
            rows_of(k, r, partition, &mut out);
            Ok(())
        })
        .unwrap();
    out
}

fn same(got: &Rows, want: &Rows, what: &str) {
    if got == want {
        return;
    }
    let keys: std::collections::BTreeSet<u64> = got.keys().chain(want.keys()).copied().collect();
    let diff: Vec<u64> = keys.into_iter().filter(|k| got.get(k) != want.get(k)).collect();
    panic!(
        "{what}: {} of {} keys differ; key {}: replica {:?}, trainer {:?}",
        diff.len(),
        want.len(),
        diff[0],
        got.get(&diff[0]).map(|r| r.iter().map(|&x| f32::from_bits(x)).collect::<Vec<_>>()),
        want.get(&diff[0]).map(|r| r.iter().map(|&x| f32::from_bits(x)).collect::<Vec<_>>()),
    );
}

fn stream(kind: BrokerKind, broker: &LocalBroker, topic: &str) -> StreamConfig {
    let t = if kind == BrokerKind::Kafka { TransportKind::Kafka } else { TransportKind::Redis };
    let mut s = StreamConfig::new(t, broker.brokers());
    s.topic = topic.into();
    s.timeout_seconds = 5.0;
    s
}

/// Starts `embank serve` as a replica: its process, protocol address and admin address
/// (empty without one).
fn start_replica_admin(config: &Path) -> (Child, String, String) {
    let r = spawn_replica(config);
    (r.child, r.addr, r.admin)
}

fn start_replica(config: &Path) -> (Child, String) {
    let r = spawn_replica(config);
    (r.child, r.addr)
}

fn spawn_replica(config: &Path) -> common::Serve {
    let r = common::serve(config, &[], common::Stderr::Hidden);
    assert!(r.line.contains("replica of"), "unexpected first line {:?}", r.line);
    r
}

/// Waits until the replica at `addr` serves publisher seq `seq`; returns its export.
fn replica_rows(addr: &str, seq: u64) -> (Rows, Rows) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let client = loop {
        match Client::connect(&[addr.to_string()], ClientOptions::default()) {
            Ok(c) => {
                let served = c.served().unwrap();
                if served[0]["seq"].as_u64() == Some(seq) {
                    break c;
                }
                assert!(
                    Instant::now() < deadline,
                    "the replica still serves {:?} after 120 s, want seq {seq}",
                    served[0]
                );
            }
            Err(e) => assert!(Instant::now() < deadline, "replica unreachable: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out: [Rows; 2] = Default::default();
    for (i, name) in ["emb", "blk"].into_iter().enumerate() {
        client
            .table(name)
            .unwrap()
            .export(4096, |k, r| {
                for (j, &key) in k.iter().enumerate() {
                    assert!(out[i]
                        .insert(key, r[j * DIM..(j + 1) * DIM].iter().map(|x| x.to_bits()).collect())
                        .is_none());
                }
                Ok(())
            })
            .unwrap();
    }
    let [a, b] = out;
    (a, b)
}

fn replica_survives_kills_and_a_broker_restart(kind: BrokerKind) {
    let kills: u64 = std::env::var("EMBANK_REPLICA_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 =
        std::env::var("EMBANK_REPLICA_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| rand::rng().random());
    eprintln!("{kind:?} replica test: {kills} kills, EMBANK_REPLICA_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut broker = LocalBroker::start(kind, &dir.path().join("broker")).unwrap();
    let stream = stream(kind, &broker, "updates");
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream.clone());
    opts.partitions = PARTS;
    opts.message_bytes = 16 << 10; // many messages per checkpoint
    opts.checkpoints_pending_max = 1000;
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    let config = dir.path().join("replica.toml");
    let (transport, brokers) = (if kind == BrokerKind::Kafka { "kafka" } else { "redis" }, broker.brokers());
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\n[updates]\ntransport = \"{transport}\"\nbrokers = \"{brokers}\"\n\
             topic = \"updates\"\npartition = 1\ntimeout_seconds = 5.0\n",
            dir.path().join("replica").display().to_string()
        ),
    )
    .unwrap();
    let replica = Arc::new(Mutex::new(start_replica(&config)));
    let done = AtomicBool::new(false);
    let mut kill_rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let killed = std::thread::scope(|s| {
        let killer = s.spawn(|| {
            let mut n = 0;
            while n < kills {
                std::thread::sleep(Duration::from_millis(kill_rng.random_range(20..300)));
                let mut r = replica.lock();
                sigkill(&mut r.0);
                *r = start_replica(&config);
                n += 1;
                if done.load(Ordering::Relaxed) && n >= kills {
                    break;
                }
            }
            n
        });
        let mut b = 0;
        for c in 1..=24u64 {
            for _ in 0..3 {
                b += 1;
                step(&store, b, &mut rng);
            }
            store.checkpoint(b).unwrap();
            publisher.notify().unwrap();
            if c == 12 {
                broker.restart().unwrap();
            }
            std::thread::sleep(Duration::from_millis(rng.random_range(0..150)));
        }
        done.store(true, Ordering::Relaxed);
        killer.join().unwrap()
    });
    assert_eq!(killed, kills);
    publisher.flush(Duration::from_secs(120)).unwrap();
    let status = publisher.status();
    let last = store.checkpoints().unwrap().pop().unwrap();
    assert_eq!(status.published_seq, Some(last.seq), "{status:?}");
    let addr = replica.lock().1.clone();
    let (emb, blk) = replica_rows(&addr, last.seq);
    same(&emb, &trainer_at(&store, "emb", last.batch_id, (1, PARTS)), "emb");
    same(&blk, &trainer_at(&store, "blk", last.batch_id, (1, PARTS)), "blk");
    assert!(emb.len() > 1000 && blk.len() > 1000, "{} {}", emb.len(), blk.len());
    eprintln!("{kind:?}: {status:?}");
    sigkill(&mut replica.lock().0);
}

/// Waits until an in-process replica (one partition) serves the trainer's newest
/// checkpoint, then compares both tables row for row.
fn replica_equals_trainer(replica: &Replica, replica_store: &Store, trainer: &Store, what: &str) {
    let last = trainer.checkpoints().unwrap().pop().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while replica.status().checkpoint_seq != Some(last.seq) {
        assert!(Instant::now() < deadline, "{what}: {:?}", replica.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    for name in ["emb", "blk"] {
        let mut got = Rows::new();
        replica_store
            .table(name)
            .unwrap()
            .export(4096, |k, r| {
                rows_of(k, r, (0, 1), &mut got);
                Ok(())
            })
            .unwrap();
        same(&got, &trainer_at(trainer, name, last.batch_id, (0, 1)), &format!("{what}: {name}"));
    }
}

#[test]
fn kafka_replica_killed_at_random_ends_equal_to_the_trainer() {
    replica_survives_kills_and_a_broker_restart(BrokerKind::Kafka);
}

#[test]
fn redis_replica_killed_at_random_ends_equal_to_the_trainer() {
    replica_survives_kills_and_a_broker_restart(BrokerKind::Redis);
}

#[test]
fn publisher_fails_loudly_while_the_broker_is_down_then_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "loud");
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream.clone());
    opts.checkpoints_pending_max = 2;
    let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut b = 0;
    let mut checkpoint = |rng: &mut rand::rngs::StdRng| {
        b += 1;
        step(&store, b, rng);
        store.checkpoint(b).unwrap();
        publisher.notify()
    };
    checkpoint(&mut rng).unwrap();
    publisher.flush(Duration::from_secs(30)).unwrap();
    broker.kill();
    checkpoint(&mut rng).unwrap();
    // A checkpoint fails loudly once an attempt has failed: wait for the publisher
    // thread's first failed attempt (on a busy machine it may not have run yet, and
    // checkpoints are quick enough to get ahead of it).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while publisher.status().last_error.is_none() {
        assert!(std::time::Instant::now() < deadline, "no publish attempt failed with the broker down");
        std::thread::sleep(Duration::from_millis(10));
    }
    checkpoint(&mut rng).unwrap();
    let err = checkpoint(&mut rng).unwrap_err();
    let msg = err.to_string();
    assert_eq!(err.kind(), embank_core::ErrorKind::Unavailable, "{msg}");
    assert!(msg.contains("3 checkpoints wait") && msg.contains("loud") && msg.contains("full snapshot"), "{msg}");
    let e = publisher.flush(Duration::from_millis(300)).unwrap_err();
    assert_eq!(e.kind(), embank_core::ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("cannot"), "names the broker's error: {e}");
    // The publisher gave up its pin: the next checkpoint (failing loudly too) drops the
    // ones it kept, back to keep_checkpoints.
    assert!(store.checkpoints().unwrap().len() > 2);
    assert!(checkpoint(&mut rng).is_err());
    assert_eq!(store.checkpoints().unwrap().len(), 2);
    broker.restart().unwrap();
    publisher.flush(Duration::from_secs(30)).unwrap();
    let status = publisher.status();
    assert_eq!(status.full_snapshots, 2, "{status:?}");
    // A replica in this process applies the whole stream: equal to the trainer at the end.
    let replica_store = Arc::new(Store::open(dir.path().join("replica"), StoreOptions::default()).unwrap());
    let mut replica = Replica::start(Arc::clone(&replica_store), ReplicaOptions::new(stream)).unwrap();
    replica_equals_trainer(&replica, &replica_store, &store, "after the broker came back");
    let s = replica.status();
    assert!(s.commits >= 2 && s.state == "ingesting", "{s:?}");
    replica.close();
}

/// Waits until every replica of the client's one shard serves batch `batch`.
fn wait_served(client: &Client, batch: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all = client.served_all();
        if all[0].iter().all(|v| v["batch_id"].as_u64() == Some(batch)) {
            return;
        }
        assert!(Instant::now() < deadline, "replicas serve {all:?}, want batch {batch}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reads_fail_over_between_replicas_and_respect_min_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let stream = stream(BrokerKind::Redis, &broker, "failover");
    let store = trainer(&dir.path().join("trainer"));
    let publisher = Publisher::start(Arc::clone(&store), PublishOptions::new(stream)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for b in 1..=3 {
        step(&store, b, &mut rng);
        store.checkpoint(b).unwrap();
        publisher.notify().unwrap();
    }
    publisher.flush(Duration::from_secs(30)).unwrap();
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        let config = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "store = {:?}\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[updates]\ntransport = \"redis\"\nbrokers = \"{}\"\ntopic = \"failover\"\n",
                dir.path().join(name).display().to_string(),
                broker.brokers()
            ),
        )
        .unwrap();
        replicas.push(start_replica_admin(&config));
    }
    let group = vec![vec![replicas[0].1.clone(), replicas[1].1.clone()]];
    let opts = ClientOptions { timeout: Duration::from_secs(2), ..Default::default() };
    let client = Client::connect_groups(&group, opts.clone()).unwrap();
    wait_served(&client, 3);
    let want = trainer_at(&store, "emb", 3, (0, 1));
    let keys: Vec<u64> = (0..KEYS + 100).collect();
    // Writes go to the primary, which refuses them: it is a replica.
    let t = client.table("emb").unwrap();
    let err = t.push(&[1], &[0.0; DIM]).unwrap_err();
    assert!(err.to_string().contains("replica of") && err.to_string().contains("replica 0"), "{err}");
    // Readers while replica 0 hangs (SIGSTOP) for 2 s, then is SIGKILLed: every read
    // succeeds, matches, and ends within the client's 2 s timeout.
    let stop = AtomicBool::new(false);
    let reads = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (client, keys, want, stop) = (client.clone(), &keys, &want, &stop);
                s.spawn(move || {
                    let t = client.table("emb").unwrap();
                    let mut rng = rand::rngs::StdRng::seed_from_u64(r);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let batch: Vec<u64> = (0..256).map(|_| keys[rng.random_range(0..keys.len())]).collect();
                        let mut rows = vec![0f32; batch.len() * DIM];
                        let mut found = vec![false; batch.len()];
                        let started = Instant::now();
                        t.lookup(&batch, &mut rows, &mut found).unwrap_or_else(|e| panic!("read {n} failed: {e}"));
                        let took = started.elapsed();
                        assert!(took < Duration::from_secs(2), "read {n} took {took:?}, not within the 2 s timeout");
                        for (i, k) in batch.iter().enumerate() {
                            let got: Option<Vec<u32>> =
                                found[i].then(|| rows[i * DIM..(i + 1) * DIM].iter().map(|x| x.to_bits()).collect());
                            assert_eq!(got.as_ref(), want.get(k), "key {k} in read {n}");
                        }
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let pid = replicas[0].0.id() as i32;
        // SAFETY: signals to a child this test started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(2000));
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(300));
        sigkill(&mut replicas[0].0);
        std::thread::sleep(Duration::from_millis(1000));
        stop.store(true, Ordering::Relaxed);
        readers.into_iter().map(|r| r.join().unwrap()).sum::<u64>()
    });
    assert!(reads > 20, "only {reads} reads");
    // The surviving replica reports what it serves in /metrics and /healthz.
    let admin = &replicas[1].2;
    let metrics = http_get(admin, "/metrics");
    for line in [
        "embank_replica_checkpoint_batch_id{partition=\"0\"} 3",
        "embank_replica_lag_messages{partition=\"0\"} 0",
        "embank_replica_up{partition=\"0\"} 1",
        "embank_replica_ingest_rows_per_second{partition=\"0\"}",
    ] {
        assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
    }
    let health = http_get(admin, "/healthz");
    assert!(
        health.contains("replica ingesting")
            && health.contains("\"checkpoint_batch_id\":3")
            && health.ends_with("ok\n"),
        "{health}"
    );
    // Versioned reads: checkpoint 4 is not served anywhere yet.
    let mut rows = vec![0f32; DIM];
    let mut found = [false];
    let err = t.lookup_min(&[1], &mut rows, &mut found, Some(4)).unwrap_err();
    assert!(err.to_string().contains("serves checkpoint 4 or later"), "{err}");
    step(&store, 4, &mut rng);
    store.checkpoint(4).unwrap();
    publisher.notify().unwrap();
    publisher.flush(Duration::from_secs(30)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while t.lookup_min(&[1], &mut rows, &mut found, Some(4)).is_err() {
        assert!(Instant::now() < deadline, "replica b never served checkpoint 4");
        std::thread::sleep(Duration::from_millis(20));
    }
    let strict = Client::connect_groups(&group, ClientOptions { min_checkpoint: Some(4), ..opts }).unwrap();
    let mut found = vec![false; keys.len()];
    let mut rows = vec![0f32; keys.len() * DIM];
    strict.table("emb").unwrap().lookup(&keys, &mut rows, &mut found).unwrap();
    let want = trainer_at(&store, "emb", 4, (0, 1));
    assert_eq!(found.iter().filter(|&&f| f).count(), want.len());
    sigkill(&mut replicas[1].0);
}

/// `embank publish` on a closed store: the first run sends every table whole, the next
/// only the changes since; a replica applying the stream equals the store each time.
#[test]
fn embank_publish_sends_the_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let path = dir.path().join("trainer");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let replica_store = Arc::new(Store::open(dir.path().join("replica"), StoreOptions::default()).unwrap());
    let mut replica =
        Replica::start(Arc::clone(&replica_store), ReplicaOptions::new(stream(BrokerKind::Redis, &broker, "once")))
            .unwrap();
    for (round, batches) in [(1u64, 1..=3u64), (2, 4..=6)] {
        {
            let store = if round == 1 {
                trainer(&path)
            } else {
                Arc::new(Store::open(&path, StoreOptions::default()).unwrap())
            };
            for b in batches.clone() {
                step(&store, b, &mut rng);
            }
            store.checkpoint(*batches.end()).unwrap();
            // A change after the checkpoint: not published (the checkpoint's rows are).
            store.table("emb").unwrap().push(&[1], &[9.0; DIM]).unwrap();
        }
        let out = Command::new(env!("CARGO_BIN_EXE_embank"))
            .args(["publish", "--transport", "redis", "--topic", "once", "--brokers", &broker.brokers(), "--store"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains(&format!("published checkpoint batch {}", batches.end())), "{text}");
        assert_eq!(text.contains("(full snapshot)"), round == 1, "{text}");
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        replica_equals_trainer(&replica, &replica_store, &store, &format!("round {round}"));
    }
    replica.close();
}

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
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut b = 1;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            b += 1;
            let keys: Vec<u64> =
                (0..500).map(|_| rng.random_range(0..rows_total)).chain(known.iter().copied()).collect();
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
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut b = 1;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            b += 1;
            let keys: Vec<u64> =
                (0..500).map(|_| rng.random_range(0..rows_total)).chain(known.iter().copied()).collect();
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
        broker.restart().unwrap();
        // Kills in turn while the replicas apply the snapshot (each kill sends the killed
        // one back to its last commit, so the resync goes on past the kills).
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
        (in_process.join().unwrap(), served.join().unwrap())
    });
    eprintln!("whole checkpoints: {reads:?} reads (in-process, served) of 2 x {ROWS} keys; {:?}", replica.status());
    assert!(reads.0 > 5 && reads.1 > 5, "{reads:?}");
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
