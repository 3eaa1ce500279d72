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
