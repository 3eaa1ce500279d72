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

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::replica::*;
use common::{http_get, sigkill};
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_core::{Store, StoreOptions};
use embank_net::stream::{PublishOptions, Publisher, Replica, ReplicaOptions};
use embank_net::{Client, ClientOptions};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

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
