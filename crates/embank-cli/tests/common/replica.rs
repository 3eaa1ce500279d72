//! What the replica tests share: a trainer with two tables (Adagrad on mmap, Adam on a
//! block medium behind a small cache), training steps, its exports, and starting
//! `embank serve` replicas.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_core::{MediumKind, Optimizer, Placement, Store, StoreOptions, TableOptions};
use embank_net::proto::shard_of;
use embank_net::stream::{Replica, StreamConfig, TransportKind};
use embank_net::{Client, ClientOptions};
use rand::Rng;

pub const DIM: usize = 8;
pub const KEYS: u64 = 3000;
pub const PARTS: u32 = 2;

pub type Rows = BTreeMap<u64, Vec<u32>>;

pub fn trainer(path: &Path) -> Arc<Store> {
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
pub fn step(store: &Store, b: u64, rng: &mut rand::rngs::StdRng) {
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

pub fn rows_of(keys: &[u64], rows: &[f32], (partition, parts): (u32, u32), out: &mut Rows) {
    for (i, &k) in keys.iter().enumerate() {
        if shard_of(k, parts) == partition {
            out.insert(k, rows[i * DIM..(i + 1) * DIM].iter().map(|x| x.to_bits()).collect());
        }
    }
}

/// The trainer's table at checkpoint `batch`, keys of `partition` only.
pub fn trainer_at(store: &Store, name: &str, batch: u64, partition: (u32, u32)) -> Rows {
    let mut out = Rows::new();
    store
        .export_checkpoint(name, batch, 4096, |k, r| {
            rows_of(k, r, partition, &mut out);
            Ok(())
        })
        .unwrap();
    out
}

pub fn same(got: &Rows, want: &Rows, what: &str) {
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

pub fn stream(kind: BrokerKind, broker: &LocalBroker, topic: &str) -> StreamConfig {
    let t = if kind == BrokerKind::Kafka { TransportKind::Kafka } else { TransportKind::Redis };
    let mut s = StreamConfig::new(t, broker.brokers());
    s.topic = topic.into();
    s.timeout_seconds = 5.0;
    s
}

/// Starts `embank serve` as a replica: its process, protocol address and admin address
/// (empty without one).
pub fn start_replica_admin(config: &Path) -> (Child, String, String) {
    let r = spawn_replica(config);
    (r.child, r.addr, r.admin)
}

pub fn start_replica(config: &Path) -> (Child, String) {
    let r = spawn_replica(config);
    (r.child, r.addr)
}

pub fn spawn_replica(config: &Path) -> super::Serve {
    let r = super::serve(config, &[], super::Stderr::Hidden);
    assert!(r.line.contains("replica of"), "unexpected first line {:?}", r.line);
    r
}

/// Waits until the replica at `addr` serves publisher seq `seq`; returns its export.
pub fn replica_rows(addr: &str, seq: u64) -> (Rows, Rows) {
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

/// Waits until an in-process replica (one partition) serves the trainer's newest
/// checkpoint, then compares both tables row for row.
pub fn replica_equals_trainer(replica: &Replica, replica_store: &Store, trainer: &Store, what: &str) {
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

/// Waits until every replica of the client's one shard serves batch `batch`.
pub fn wait_served(client: &Client, batch: u64) {
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
