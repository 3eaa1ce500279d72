//! The update stream's retention, with real brokers and real `embank serve` replicas:
//! the publisher trims the stream to a full snapshot (Redis `XTRIM MINID`, Kafka
//! `DeleteRecords`), so its length stays bounded however long training runs, and no
//! replica is stranded: one started after the trims, and one stopped early and restarted
//! far behind (its position trimmed away), both end equal to the trainer.

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::replica::*;
use common::sigkill;
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_core::Store;
use embank_net::stream::{PublishOptions, Publisher};
use rand::{Rng, SeedableRng};

/// Checkpoints the stream keeps in these tests.
const KEEP: usize = 4;

/// A training step that rewrites a third of each table and adds and deletes a few keys:
/// the changes of a few checkpoints outweigh the table, so full snapshots come every
/// `KEEP` checkpoints.
fn heavy_step(store: &Store, b: u64, rng: &mut rand::rngs::StdRng) {
    step(store, b, rng);
    for name in ["emb", "blk"] {
        let t = store.table(name).unwrap();
        let keys: Vec<u64> = (0..KEYS / 3).map(|_| rng.random_range(0..KEYS)).collect();
        t.push(&keys, &vec![b as f32; keys.len() * DIM]).unwrap();
    }
}

fn replica_config(
    dir: &std::path::Path,
    name: &str,
    kind: BrokerKind,
    broker: &LocalBroker,
    topic: &str,
) -> std::path::PathBuf {
    let config = dir.join(format!("{name}.toml"));
    let transport = if kind == BrokerKind::Kafka { "kafka" } else { "redis" };
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\n[updates]\ntransport = \"{transport}\"\nbrokers = \"{}\"\n\
             topic = \"{topic}\"\npartition = 1\ntimeout_seconds = 5.0\n",
            dir.join(name).display().to_string(),
            broker.brokers()
        ),
    )
    .unwrap();
    config
}

/// Entries in a Redis stream key (0 when it is missing).
fn xlen(broker: &LocalBroker, key: &str) -> u64 {
    let out = Command::new("redis-cli").args(["-p", &broker.port.to_string(), "XLEN", key]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Waits until the replica at `addr` serves the trainer's newest checkpoint, then
/// compares both tables (partition 1's keys) row for row.
fn equals_trainer(replica: &(Child, String), store: &Store, what: &str) {
    let last = store.checkpoints().unwrap().pop().unwrap();
    let (emb, blk) = replica_rows(&replica.1, last.seq);
    same(&emb, &trainer_at(store, "emb", last.batch_id, (1, PARTS)), &format!("{what}: emb"));
    same(&blk, &trainer_at(store, "blk", last.batch_id, (1, PARTS)), &format!("{what}: blk"));
    assert!(emb.len() > 500 && blk.len() > 500, "{what}: {} {}", emb.len(), blk.len());
}

/// Trains and publishes `checkpoints` checkpoints (the publisher restarted halfway, so
/// its retention state comes back from `PUBLISHED-<topic>.json`), with a replica that
/// stops after checkpoint 3; after each, `after(checkpoint)`. Then a replica started
/// afterwards and the stopped one restarted both end equal to the trainer.
fn no_replica_is_stranded(kind: BrokerKind, topic: &str, checkpoints: u64, mut after: impl FnMut(&LocalBroker, u64)) {
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(kind, &dir.path().join("broker")).unwrap();
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream(kind, &broker, topic));
    opts.partitions = PARTS;
    opts.message_bytes = 16 << 10; // many messages per checkpoint
    opts.keep_checkpoints = KEEP;
    let mut publisher = Publisher::start(Arc::clone(&store), opts.clone()).unwrap();
    let early = replica_config(dir.path(), "early", kind, &broker, topic);
    let mut stopped = Some(start_replica(&early));
    let mut rng = rand::rngs::StdRng::seed_from_u64(58);
    let (mut trims, mut snapshots) = (0, 0);
    for c in 1..=checkpoints {
        heavy_step(&store, c, &mut rng);
        store.checkpoint(c).unwrap();
        publisher.notify().unwrap();
        publisher.flush(Duration::from_secs(60)).unwrap();
        if c == 3 {
            let mut r = stopped.take().unwrap();
            equals_trainer(&r, &store, "the early replica at checkpoint 3");
            sigkill(&mut r.0);
        }
        if c == checkpoints / 2 {
            let s = publisher.status();
            (trims, snapshots) = (s.trims, s.retention_snapshots);
            publisher.close();
            publisher = Publisher::start(Arc::clone(&store), opts.clone()).unwrap();
        }
        after(&broker, c);
    }
    let s = publisher.status();
    eprintln!("{kind:?}: before the publisher's restart {trims} trims, {snapshots} snapshots; after: {s:?}");
    assert!(s.trims + trims >= checkpoints / (3 * KEEP as u64), "too few trims: {trims} + {}", s.trims);
    assert!(s.trims >= 1, "the restarted publisher did not trim: {s:?}");
    assert!(s.retention_snapshots >= 2 && s.full_snapshots == 0, "{s:?}");
    // The early replica served checkpoint 3, long trimmed away: it must read the
    // snapshot the stream begins with.
    assert!(s.trimmed_to_seq.unwrap() > 3 + KEEP as u64, "{s:?}");
    let mut late = start_replica(&replica_config(dir.path(), "late", kind, &broker, topic));
    equals_trainer(&late, &store, "a replica started after the trims");
    let mut early = start_replica(&early);
    equals_trainer(&early, &store, "a replica restarted far behind");
    // And both go on with the next checkpoints as usual.
    for c in checkpoints + 1..=checkpoints + 2 {
        heavy_step(&store, c, &mut rng);
        store.checkpoint(c).unwrap();
        publisher.notify().unwrap();
    }
    publisher.flush(Duration::from_secs(60)).unwrap();
    equals_trainer(&late, &store, "the late replica, two checkpoints on");
    equals_trainer(&early, &store, "the restarted replica, two checkpoints on");
    sigkill(&mut late.0);
    sigkill(&mut early.0);
}

#[test]
fn redis_stream_stays_bounded_and_no_replica_is_stranded() {
    let mut lengths = Vec::new();
    no_replica_is_stranded(BrokerKind::Redis, "kept", 50, |broker, c| {
        let n = xlen(broker, "kept.0") + xlen(broker, "kept.1");
        lengths.push((c, n));
    });
    eprintln!("XLEN of both partitions after each checkpoint: {lengths:?}");
    // Steady by 3 x KEEP checkpoints (a snapshot, KEEP more, the next): no longer after.
    let early_max = lengths.iter().take(3 * KEEP + 1).map(|&(_, n)| n).max().unwrap();
    let (c, late_max) = lengths.iter().skip(3 * KEEP + 1).copied().max_by_key(|&(_, n)| n).unwrap();
    assert!(
        late_max <= early_max * 5 / 4,
        "the stream grows: {late_max} entries after checkpoint {c}, at most {early_max} in the first {}",
        3 * KEEP + 1
    );
    // Untrimmed it would hold every checkpoint: 50 of them, about 12x what it keeps.
    let per_checkpoint = lengths[2].1 / 3;
    assert!(lengths.last().unwrap().1 < per_checkpoint * 25, "{lengths:?}");
}

#[test]
fn kafka_stream_is_trimmed_and_no_replica_is_stranded() {
    no_replica_is_stranded(BrokerKind::Kafka, "kept", 20, |_, _| {});
}

/// Redis `used_memory` while a trainer publishes for `EMBANK_RETENTION_SECONDS` (default
/// 120) with `keep_checkpoints` 8 and 0 (never trimmed): `cargo test --release -p
/// embank-cli --test stream_retention -- --ignored --nocapture`.
#[test]
#[ignore]
fn redis_used_memory_with_and_without_trimming() {
    let seconds: f64 = std::env::var("EMBANK_RETENTION_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(120.0);
    for keep in [8usize, 0] {
        let dir = tempfile::tempdir().unwrap();
        let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
        let store = trainer(&dir.path().join("trainer"));
        let mut opts = PublishOptions::new(stream(BrokerKind::Redis, &broker, "memory"));
        opts.partitions = PARTS;
        opts.keep_checkpoints = keep;
        let publisher = Publisher::start(Arc::clone(&store), opts).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let started = Instant::now();
        let (mut c, mut samples, mut next) = (0u64, Vec::new(), 0.0);
        while started.elapsed().as_secs_f64() < seconds {
            c += 1;
            step(&store, c, &mut rng);
            store.checkpoint(c).unwrap();
            publisher.notify().unwrap();
            publisher.flush(Duration::from_secs(60)).unwrap();
            let t = started.elapsed().as_secs_f64();
            if t >= next {
                let info = Command::new("redis-cli")
                    .args(["-p", &broker.port.to_string(), "INFO", "memory"])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&info.stdout).to_string();
                let used: u64 = text
                    .lines()
                    .find_map(|l| l.strip_prefix("used_memory:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap();
                let len = xlen(&broker, "memory.0") + xlen(&broker, "memory.1");
                samples.push(format!("{t:.0}s ckpt {c}: {:.1} MB, {len} entries", used as f64 / 1e6));
                next += seconds / 8.0;
            }
        }
        let s = publisher.status();
        eprintln!(
            "keep_checkpoints {keep}: {c} checkpoints in {seconds} s, {} trims, {} snapshots for retention, {:.1} MB \
             published; used_memory {}",
            s.trims,
            s.retention_snapshots,
            s.bytes as f64 / 1e6,
            samples.join(" | ")
        );
    }
}

/// A training step of a table whose size stays put (a soak measures the stream over time,
/// not over a growing table): `step`'s pulls and gradients, then 8 keys of a window past
/// `KEYS` pushed and the 8 pushed `KEYS / 16` steps before deleted.
fn steady_step(store: &Store, b: u64, rng: &mut rand::rngs::StdRng) {
    for name in ["emb", "blk"] {
        let t = store.table(name).unwrap();
        let keys: Vec<u64> = (0..256).map(|_| (rng.random::<f64>().powi(3) * KEYS as f64) as u64).collect();
        let mut rows = vec![0f32; keys.len() * DIM];
        t.pull(&keys, &mut rows).unwrap();
        let grads: Vec<f32> = (0..rows.len()).map(|_| rng.random::<f32>() - 0.5).collect();
        t.push_grad(&keys, &grads).unwrap();
        let window = |c: u64| (0..8).map(move |i| KEYS + (c * 8 + i) % KEYS);
        t.push(&window(b).collect::<Vec<_>>(), &vec![b as f32; 8 * DIM]).unwrap();
        t.delete(&window(b + KEYS / 16).collect::<Vec<_>>()).unwrap();
    }
}

/// Resident memory of process `pid` in bytes (`VmRSS`).
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Redis `used_memory`.
fn redis_used(broker: &LocalBroker) -> u64 {
    let out = Command::new("redis-cli").args(["-p", &broker.port.to_string(), "INFO", "memory"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The soak of days in minutes: a trainer of tables that keep their size (`steady_step`)
/// publishing a checkpoint every 0.5 s to Redis and Kafka at once (default retention, `keep_checkpoints` 8) for `EMBANK_SOAK_SECONDS`
/// (default 1800), an `embank serve` replica on each broker read by a client throughout.
/// Sampled every `seconds / 360`: Redis `used_memory` and its streams' length, the Kafka
/// broker's resident memory and the topic's bytes on disk, the replicas' resident memory.
/// Passes when every read succeeded and no broker figure drifts: its mean over the last
/// sixth of the run within 10 % of its mean over the sixth before. Writes `soak.csv` into `EMBANK_SOAK_OUT` if set.
///
/// `EMBANK_SOAK_SECONDS=1800 cargo test --release -p embank-cli --test stream_retention -- --ignored --nocapture broker_memory`
#[test]
#[ignore]
fn broker_memory_stays_flat_over_a_soak_with_replicas_serving() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let seconds: f64 = std::env::var("EMBANK_SOAK_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1800.0);
    let dir = tempfile::tempdir().unwrap();
    let store = trainer(&dir.path().join("trainer"));
    let kinds = [BrokerKind::Redis, BrokerKind::Kafka];
    let brokers: Vec<LocalBroker> =
        kinds.iter().map(|&k| LocalBroker::start(k, &dir.path().join(format!("{k:?}"))).unwrap()).collect();
    let publishers: Vec<Publisher> = kinds
        .iter()
        .zip(&brokers)
        .map(|(&k, b)| {
            let mut opts = PublishOptions::new(stream(k, b, "soak"));
            opts.partitions = PARTS;
            Publisher::start(Arc::clone(&store), opts).unwrap()
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(30);
    // A first checkpoint, so the replicas start on a stream with data.
    steady_step(&store, 1, &mut rng);
    store.checkpoint(1).unwrap();
    for p in &publishers {
        p.notify().unwrap();
        p.flush(Duration::from_secs(120)).unwrap();
    }
    let replicas: Vec<(Child, String)> = kinds
        .iter()
        .zip(&brokers)
        .map(|(&k, b)| start_replica(&replica_config(dir.path(), &format!("replica-{k:?}"), k, b, "soak")))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = replicas
        .iter()
        .map(|(_, addr)| {
            let (addr, stop) = (addr.clone(), Arc::clone(&stop));
            let keys: Vec<u64> = (0..KEYS).filter(|&k| embank_net::proto::shard_of(k, PARTS) == 1).take(500).collect();
            let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
            let c = Arc::clone(&counts);
            let handle = std::thread::spawn(move || {
                let client = embank_net::Client::connect(&[addr], embank_net::ClientOptions::default()).unwrap();
                // Reads count from the replica's first checkpoint on (`/readyz`'s moment).
                let deadline = Instant::now() + Duration::from_secs(120);
                let table = loop {
                    match client.table("emb") {
                        Ok(t) => break t,
                        Err(e) => assert!(Instant::now() < deadline, "the replica serves no table after 120 s: {e}"),
                    }
                    std::thread::sleep(Duration::from_millis(50));
                };
                let (mut out, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
                while !stop.load(Ordering::Relaxed) {
                    match table.lookup(&keys, &mut out, &mut found) {
                        Ok(()) => c.0.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            eprintln!("a read failed: {e}");
                            c.1.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
            (handle, counts)
        })
        .collect();
    let kafka_logs = brokers[1].dir().join("logs");
    let topic_bytes = || -> u64 {
        std::fs::read_dir(&kafka_logs)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("soak-"))
                    .map(|e| dir_bytes(&e.path()))
                    .sum()
            })
            .unwrap_or(0)
    };
    let started = Instant::now();
    let (mut c, mut next) = (1u64, 0.0);
    let mut csv = String::from("seconds,checkpoint,redis_used_mb,redis_entries,kafka_rss_mb,kafka_topic_mb,replica_redis_rss_mb,replica_kafka_rss_mb\n");
    let mut samples: Vec<[f64; 4]> = Vec::new();
    while started.elapsed().as_secs_f64() < seconds {
        c += 1;
        steady_step(&store, c, &mut rng);
        store.checkpoint(c).unwrap();
        for p in &publishers {
            p.notify().unwrap();
        }
        let t = started.elapsed().as_secs_f64();
        if t >= next {
            let mb = |b: u64| b as f64 / 1e6;
            let row = [
                mb(redis_used(&brokers[0])),
                mb(rss(brokers[1].pid().unwrap())),
                mb(topic_bytes()),
                (xlen(&brokers[0], "soak.0") + xlen(&brokers[0], "soak.1")) as f64,
            ];
            let line = format!(
                "{t:.0},{c},{:.2},{},{:.1},{:.2},{:.1},{:.1}",
                row[0],
                row[3],
                row[1],
                row[2],
                mb(rss(replicas[0].0.id())),
                mb(rss(replicas[1].0.id()))
            );
            eprintln!("soak: {line}");
            csv.push_str(&line);
            csv.push('\n');
            samples.push(row);
            next += seconds / 360.0;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for p in &publishers {
        p.flush(Duration::from_secs(120)).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let mut reads = Vec::new();
    for (h, counts) in readers {
        h.join().unwrap();
        reads.push((counts.0.load(Ordering::Relaxed), counts.1.load(Ordering::Relaxed)));
    }
    let statuses: Vec<_> = publishers.iter().map(|p| p.status()).collect();
    eprintln!(
        "soak: {c} checkpoints in {seconds} s; reads (ok, failed) Redis replica {:?}, Kafka replica {:?}",
        reads[0], reads[1]
    );
    for (k, s) in kinds.iter().zip(&statuses) {
        eprintln!(
            "soak: {k:?} publisher: {} trims, {} retention snapshots, {:.1} MB published",
            s.trims,
            s.retention_snapshots,
            s.bytes as f64 / 1e6
        );
    }
    if let Some(out) = std::env::var_os("EMBANK_SOAK_OUT") {
        std::fs::write(std::path::Path::new(&out).join("soak.csv"), &csv).unwrap();
    }
    for mut r in replicas {
        sigkill(&mut r.0);
    }
    assert!(reads.iter().all(|&(ok, failed)| ok > 0 && failed == 0), "reads (ok, failed): {reads:?}");
    // Trimming at snapshots makes each figure a sawtooth (it grows between two trims):
    // flat means no drift, the mean of the last sixth of the run within 10 % of the sixth
    // before it (the last 10 minutes of 30, in two halves).
    let n = samples.len();
    let (before, last) = (&samples[n * 4 / 6..n * 5 / 6], &samples[n * 5 / 6..]);
    for (i, what) in ["Redis used_memory", "Kafka broker RSS", "Kafka topic bytes"].iter().enumerate() {
        let mean = |w: &[[f64; 4]]| w.iter().map(|s| s[i]).sum::<f64>() / w.len() as f64;
        let (lo, hi) = last.iter().fold((f64::MAX, 0f64), |(lo, hi), s| (lo.min(s[i]), hi.max(s[i])));
        let (a, b) = (mean(before), mean(last));
        eprintln!(
            "soak: {what}: mean {a:.2} MB then {b:.2} MB ({:+.1} %), last sixth {lo:.2}-{hi:.2}",
            (b / a - 1.0) * 100.0
        );
        assert!((b / a - 1.0).abs() <= 0.1, "{what} drifts: mean {a:.2} MB, then {b:.2} MB");
    }
}
