//! Growing and shrinking a serving cluster while it serves, with a real broker and real
//! `embank serve` replicas, and clients that reload the shard map (a cluster file):
//! a replica added to a group (it copies a sibling's checkpoint, the stream's history
//! trimmed away) and another removed while a client reads; a cluster of 2 shards
//! resharded to 3 while two clients read exact checkpoints and the trainer publishes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::replica::*;
use common::sigkill;
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_net::client::{served_range, switch_when_serving};
use embank_net::stream::{PublishOptions, Publisher};
use embank_net::{Client, MapSource};
use parking_lot::Mutex;
use rand::SeedableRng;

/// A replica's config: partition `partition` of `topic`, keeping `keep` checkpoints,
/// copying a sibling's checkpoint first when `bootstrap` names some.
fn replica_config(
    dir: &Path,
    name: &str,
    broker: &LocalBroker,
    topic: &str,
    partition: u32,
    bootstrap: &[String],
) -> PathBuf {
    let config = dir.join(format!("{name}.toml"));
    let siblings: Vec<String> = bootstrap.iter().map(|a| format!("{a:?}")).collect();
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[store_options]\nkeep_checkpoints = 4\n\
             [updates]\ntransport = \"redis\"\nbrokers = \"{}\"\ntopic = \"{topic}\"\npartition = {partition}\n\
             timeout_seconds = 5.0\nbootstrap = [{}]\n",
            dir.join(name).display().to_string(),
            broker.brokers(),
            siblings.join(", ")
        ),
    )
    .unwrap();
    config
}

/// A cluster file of `groups` (clients reload it every 0.1 s).
fn write_map(path: &Path, groups: &[Vec<String>]) {
    let mut text = String::from("reload_seconds = 0.1\ntimeout_seconds = 5.0\n");
    for g in groups {
        let addrs: Vec<String> = g.iter().map(|a| format!("{a:?}")).collect();
        text += &format!("[[shards]]\nreplicas = [{}]\n", addrs.join(", "));
    }
    std::fs::write(path, text).unwrap();
}

fn sigterm(child: &mut Child) {
    // SAFETY: signalling a child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

fn wait_version(client: &Client, version: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.map_version() < version {
        assert!(Instant::now() < deadline, "the client still uses map version {}", client.map_version());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// A client reads a group of two replicas steadily while a third joins (copying a
/// sibling's served checkpoint: the stream's history is trimmed first, so it cannot start
/// from the stream) and the second is removed (the map switched without it, then the
/// process stopped). No read fails; the new replica takes its share; its rows equal the
/// trainer's at the checkpoint it serves.
#[test]
fn a_replica_added_and_another_removed_while_a_client_reads_fails_no_read() {
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let store = trainer(&dir.path().join("trainer"));
    let publisher =
        Publisher::start(Arc::clone(&store), PublishOptions::new(stream(BrokerKind::Redis, &broker, "grow"))).unwrap();
    // Rows the reader does not read, so that copying a checkpoint takes a while.
    let bulk: Vec<u64> = (1 << 32..(1 << 32) + 300_000).collect();
    store.table("emb").unwrap().push(&bulk, &vec![0.5; bulk.len() * DIM]).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    for b in 1..=3 {
        step(&store, b, &mut rng);
        store.checkpoint(b).unwrap();
        publisher.notify().unwrap();
        publisher.flush(Duration::from_secs(60)).unwrap();
    }
    let mut a = spawn_replica(&replica_config(dir.path(), "a", &broker, "grow", 0, &[]));
    let mut b = spawn_replica(&replica_config(dir.path(), "b", &broker, "grow", 0, &[]));
    let map = dir.path().join("cluster.toml");
    write_map(&map, &[vec![a.addr.clone(), b.addr.clone()]]);
    let client = Client::connect_map(&MapSource::File(map.clone())).unwrap();
    wait_served(&client, 3);
    // The stream's history is gone: a replica starting now can only copy a sibling.
    let port = broker.brokers().rsplit(':').next().unwrap().trim_end_matches('/').to_string();
    let trimmed =
        std::process::Command::new("redis-cli").args(["-p", &port, "XTRIM", "grow.0", "MAXLEN", "0"]).output().unwrap();
    assert!(trimmed.status.success(), "{trimmed:?}");

    // Keys present now (the trainer creates rows only for the keys it pulls, about a
    // fifth of 0..KEYS): few are deleted while the test runs.
    let present = trainer_at(&store, "emb", 3, (0, 1)).keys().filter(|&&k| k < KEYS).count();
    let stop = AtomicBool::new(false);
    let last = AtomicU64::new(3);
    let mut c = None;
    let (reads, failures) = std::thread::scope(|scope| {
        // A failed step below stops the reader and the trainer (else the scope waits on
        // them forever and the failure is a hang).
        let _stopper = StopOnDrop(&stop);
        let reader = scope.spawn(|| {
            let keys: Vec<u64> = (0..KEYS).collect();
            let (mut rows, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
            let (mut reads, mut failures) = (0u64, Vec::new());
            let emb = client.table("emb").unwrap();
            while !stop.load(Ordering::Relaxed) {
                match emb.lookup(&keys, &mut rows, &mut found) {
                    // Few keys are ever deleted: an answer missing many read an empty store.
                    Ok(()) if found.iter().filter(|&&f| f).count() < present * 9 / 10 => failures.push(format!(
                        "map version {}: only {} keys found, {present} were present at checkpoint 3",
                        client.map_version(),
                        found.iter().filter(|&&f| f).count(),
                    )),
                    Ok(()) => reads += 1,
                    Err(e) => failures.push(format!("map version {}: {e}", client.map_version())),
                }
            }
            (reads, failures)
        });
        let trainer = scope.spawn(|| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(38);
            let mut n = 3;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                step(&store, n, &mut rng);
                store.checkpoint(n).unwrap();
                publisher.notify().unwrap();
                last.store(n, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        std::thread::sleep(Duration::from_millis(500));
        // Add: c copies a's or b's served checkpoint, then follows the stream. It is in
        // the map at once: until it has copied, it refuses reads and the client reads a
        // or b instead.
        let started =
            spawn_replica(&replica_config(dir.path(), "c", &broker, "grow", 0, &[a.addr.clone(), b.addr.clone()]));
        let health = common::http_get(&started.admin, "/healthz");
        let next = dir.path().join("next.toml");
        write_map(&next, &[vec![a.addr.clone(), b.addr.clone(), started.addr.clone()]]);
        let text = std::fs::read_to_string(&next).unwrap();
        std::fs::write(&map, format!("version = 1\n{text}")).unwrap();
        let copying = Instant::now();
        assert!(client.reload_map().unwrap(), "the client did not switch to version 1");
        eprintln!("the new replica's /healthz as it starts: {}", health.lines().next().unwrap_or(""));
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.served_all()[0][2]["state"] == "bootstrapping" {
            assert!(
                Instant::now() < deadline,
                "still bootstrapping after 60 s: {:?}; its /healthz: {}",
                client.served_all(),
                common::http_get(&started.admin, "/healthz")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!(
            "the new replica copied a sibling's checkpoint within {:.2} s of joining the map",
            copying.elapsed().as_secs_f64()
        );
        std::thread::sleep(Duration::from_millis(1000));
        // Remove b: the map without it first, then the process (drained).
        write_map(&next, &[vec![a.addr.clone(), started.addr.clone()]]);
        assert_eq!(switch_when_serving(&map, &next, Duration::from_secs(60), |l| eprintln!("{l}")).unwrap(), 2);
        wait_version(&client, 2);
        sigterm(&mut b.child);
        std::thread::sleep(Duration::from_millis(1000));
        c = Some(started);
        stop.store(true, Ordering::Relaxed);
        trainer.join().unwrap();
        reader.join().unwrap()
    });
    let mut c = c.unwrap();
    let counts = client.replica_counts();
    eprintln!("reads: {reads}, failed: {}; answered per replica: {counts:?}", failures.len());
    assert!(
        failures.is_empty(),
        "{} of {} reads failed: {:?}",
        failures.len(),
        reads + failures.len() as u64,
        &failures[..failures.len().min(5)]
    );
    assert!(reads > 50, "only {reads} reads");
    let answered = |addr: &str| counts[0].iter().find(|v| v["address"] == addr).unwrap()["answered"].as_u64().unwrap();
    let (on_a, on_c) = (answered(&a.addr), answered(&c.addr));
    eprintln!(
        "the new replica answered {on_c} requests, the one it stayed beside {on_a} ({:.0} % of theirs)",
        100.0 * on_c as f64 / (on_a + on_c) as f64
    );
    assert!(on_c > 10, "the new replica took {on_c} requests");
    // Its rows are the trainer's at the checkpoint it serves.
    publisher.flush(Duration::from_secs(60)).unwrap();
    let n = last.load(Ordering::Relaxed);
    let seq = store.checkpoints().unwrap().iter().find(|x| x.batch_id == n).unwrap().seq;
    let (emb, blk) = replica_rows(&c.addr, seq);
    same(&emb, &trainer_at(&store, "emb", n, (0, 1)), "the added replica: emb");
    same(&blk, &trainer_at(&store, "blk", n, (0, 1)), "the added replica: blk");
    sigkill(&mut a.child);
    sigkill(&mut c.child);
}

/// Two shards resharded to three while two clients read and the trainer publishes: a
/// second publisher feeds the three new replicas (a second topic of 3 partitions) beside
/// the first; once they serve a checkpoint at least as new as the old shards, the map
/// switches to them and the old shards are retired. Each client reads both tables exactly
/// at the checkpoint its map's shards all serve: every answer equals the trainer's export
/// of that checkpoint, and none fails, before, during and after the switch.
#[test]
fn two_shards_resharded_to_three_while_clients_read_and_the_trainer_publishes() {
    const LAST_KEY_BATCH: u64 = 80; // the readers read every key the trainer can create
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let store = trainer(&dir.path().join("trainer"));
    let mut opts = PublishOptions::new(stream(BrokerKind::Redis, &broker, "two"));
    opts.partitions = 2;
    let first = Publisher::start(Arc::clone(&store), opts).unwrap();
    let second: Mutex<Option<Publisher>> = Mutex::new(None);
    let exports: Mutex<BTreeMap<u64, (Rows, Rows)>> = Mutex::new(BTreeMap::new());
    let checkpoint = |b: u64| {
        store.checkpoint(b).unwrap();
        let both = (trainer_at(&store, "emb", b, (0, 1)), trainer_at(&store, "blk", b, (0, 1)));
        exports.lock().insert(b, both);
        first.notify().unwrap();
        if let Some(p) = second.lock().as_ref() {
            p.notify().unwrap();
        }
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    for b in 1..=3 {
        step(&store, b, &mut rng);
        checkpoint(b);
        first.flush(Duration::from_secs(60)).unwrap();
    }
    let mut old: Vec<common::Serve> = (0..2)
        .map(|p| spawn_replica(&replica_config(dir.path(), &format!("old{p}"), &broker, "two", p, &[])))
        .collect();
    let map = dir.path().join("cluster.toml");
    write_map(&map, &old.iter().map(|s| vec![s.addr.clone()]).collect::<Vec<_>>());
    let clients: Vec<Client> = (0..2).map(|_| Client::connect_map(&MapSource::File(map.clone())).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while served_range(&clients[0]).1 != Some(3) {
        assert!(Instant::now() < deadline, "{:?}", clients[0].served_all());
        std::thread::sleep(Duration::from_millis(20));
    }
    let stop = AtomicBool::new(false);
    let switching = AtomicBool::new(false);
    let mut new: Vec<common::Serve> = Vec::new();
    let results = std::thread::scope(|scope| {
        let _stopper = StopOnDrop(&stop);
        let readers: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(r, client)| {
                let (exports, stop, switching) = (&exports, &stop, &switching);
                scope.spawn(move || {
                    let keys: Vec<u64> = (0..KEYS + (LAST_KEY_BATCH + 1) * 8).collect();
                    let (mut rows, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
                    let mut per_version: BTreeMap<u64, u64> = BTreeMap::new();
                    let (mut failures, mut before, mut during) = (Vec::new(), Vec::new(), Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let version = client.map_version();
                        // The checkpoint every shard of the map in use serves.
                        let Some(n) = served_range(client).1 else {
                            failures.push(format!("reader {r}: a replica serves nothing"));
                            continue;
                        };
                        // The map `n` was read from (it may have switched since `version`).
                        let read_from = client.map_version();
                        let want = exports.lock().get(&n).cloned().unwrap();
                        for (name, want) in [("emb", &want.0), ("blk", &want.1)] {
                            let t0 = Instant::now();
                            let res = client.table(name).and_then(|t| t.lookup_at(n, &keys, &mut rows, &mut found));
                            let micros = t0.elapsed().as_secs_f64() * 1e6;
                            match res {
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
                                    same(
                                        &got,
                                        want,
                                        &format!("reader {r}: {name} at checkpoint {n}, map version {version}"),
                                    );
                                    *per_version.entry(version).or_default() += 1;
                                    if switching.load(Ordering::Relaxed) {
                                        during.push(micros)
                                    } else if version == 0 {
                                        before.push(micros)
                                    }
                                }
                                // The map switched between reading which checkpoint the map
                                // serves and this read: the new map's replicas serve at least
                                // what the old one did when it switched, which may be older than
                                // the `n` the old map served a moment later. Not a failure.
                                Err(_) if client.map_version() != read_from => {}
                                Err(e) => failures
                                    .push(format!("reader {r}: {name} at checkpoint {n}, map version {version}: {e}")),
                            }
                        }
                    }
                    (per_version, failures, before, during)
                })
            })
            .collect();
        let trainer = scope.spawn(|| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(42);
            let mut b = 3;
            while !stop.load(Ordering::Relaxed) && b < LAST_KEY_BATCH {
                b += 1;
                step(&store, b, &mut rng);
                checkpoint(b);
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        std::thread::sleep(Duration::from_millis(1500));
        switching.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        // A second partitioning of the same checkpoints: 3 partitions, a full snapshot first.
        let mut opts = PublishOptions::new(stream(BrokerKind::Redis, &broker, "three"));
        opts.partitions = 3;
        *second.lock() = Some(Publisher::start(Arc::clone(&store), opts).unwrap());
        second.lock().as_ref().unwrap().notify().unwrap();
        new = (0..3)
            .map(|p| spawn_replica(&replica_config(dir.path(), &format!("new{p}"), &broker, "three", p, &[])))
            .collect();
        let next = dir.path().join("next.toml");
        write_map(&next, &new.iter().map(|s| vec![s.addr.clone()]).collect::<Vec<_>>());
        switch_when_serving(&map, &next, Duration::from_secs(120), |l| eprintln!("{l}")).unwrap();
        for c in &clients {
            wait_version(c, 1);
        }
        // Retire the old shards and their publisher.
        for s in &mut old {
            sigterm(&mut s.child);
        }
        first.close();
        eprintln!(
            "resharded 2 -> 3 in {:.2} s (second publisher started to old shards retired)",
            t0.elapsed().as_secs_f64()
        );
        switching.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
        trainer.join().unwrap();
        readers.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let (mut before, mut during) = (Vec::new(), Vec::new());
    for (r, (per_version, failures, b, d)) in results.into_iter().enumerate() {
        eprintln!("reader {r}: exact answers per map version {per_version:?}, {} failed", failures.len());
        assert!(failures.is_empty(), "{:?}", &failures[..failures.len().min(5)]);
        assert!(
            per_version.get(&0).copied().unwrap_or(0) > 5 && per_version.get(&1).copied().unwrap_or(0) > 5,
            "{per_version:?}"
        );
        before.extend(b);
        during.extend(d);
    }
    eprintln!(
        "lookup_at of {} keys: p50/p99 {:.0}/{:.0} us before the reshard ({} reads), {:.0}/{:.0} us during it ({} reads)",
        KEYS + (LAST_KEY_BATCH + 1) * 8,
        percentile(&mut before.clone(), 0.5),
        percentile(&mut before.clone(), 0.99),
        before.len(),
        percentile(&mut during.clone(), 0.5),
        percentile(&mut during.clone(), 0.99),
        during.len()
    );
    if let Some(p) = second.lock().take() {
        p.close();
    }
    for s in &mut new {
        sigkill(&mut s.child);
    }
}

/// Serves `text` over HTTP on a free port (every GET gets the current text).
fn http_map(text: Arc<Mutex<String>>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            // The whole request first: closing with some of it unread would reset the
            // connection before the reply is read.
            let (mut req, mut buf) = (Vec::new(), [0u8; 1024]);
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let body = text.lock().clone();
            let _ = write!(s, "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        }
    });
    format!("http://{addr}/cluster.toml")
}

/// A writable `embank serve` with table `t` (dim 4), naming `map`'s version in its hellos.
fn plain_server(dir: &Path, name: &str, map: &Path) -> common::Serve {
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\nshard_map = {:?}\n[[tables]]\nname = \"t\"\ndim = 4\n",
            dir.join(name).display().to_string(),
            map.display().to_string()
        ),
    )
    .unwrap();
    common::serve(&config, &[], common::Stderr::Hidden)
}

/// The shard map from a URL, a shard given by a DNS name, versions: an older map or a
/// changed map under the same version is refused (the one in use stays), a newer one is
/// switched to; a server whose hello names a newer version makes the client look at once
/// (its own polling being hours apart).
#[test]
fn the_shard_map_reloads_from_a_url_by_version_and_on_a_servers_hint() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let (mut s1, mut s2) = (plain_server(dir.path(), "s1", &file), plain_server(dir.path(), "s2", &file));
    let port1 = s1.addr.rsplit(':').next().unwrap().to_string();
    let text = Arc::new(Mutex::new(format!(
        "version = 1\nreload_seconds = 3600\n[[shards]]\nservice = \"localhost:{port1}\"\n"
    )));
    let url = http_map(Arc::clone(&text));
    let client = Client::connect_map(&MapSource::parse(&url)).unwrap();
    assert_eq!(client.map_version(), 1);
    assert!(client.groups()[0].contains(&s1.addr), "{:?}", client.groups());
    let t = client.table("t").unwrap();
    t.push(&[1], &[1.0; 4]).unwrap();
    *text.lock() = format!("version = 0\n[[shards]]\nreplicas = [{:?}]\n", s2.addr);
    assert!(client.reload_map().unwrap_err().to_string().contains("older"));
    *text.lock() = format!("version = 1\n[[shards]]\nreplicas = [{:?}]\n", s2.addr);
    assert!(client.reload_map().unwrap_err().to_string().contains("higher version"));
    assert_eq!((client.map_version(), client.groups()[0].contains(&s1.addr)), (1, true));
    *text.lock() = format!("version = 2\n[[shards]]\nreplicas = [{:?}]\n", s2.addr);
    assert!(client.reload_map().unwrap());
    assert_eq!(client.groups(), vec![vec![s2.addr.clone()]]);
    // The table opened before the switch goes on, on the new shard.
    let (mut out, mut found) = (vec![0f32; 4], vec![false]);
    t.lookup(&[1], &mut out, &mut found).unwrap();
    assert!(!found[0], "key 1 was written to s1, not s2");

    // A server's hint: the file both read says version 3 (a third shard map) while the
    // client, polling hourly, still uses version 2 of it.
    std::fs::write(&file, format!("version = 2\nreload_seconds = 3600\n[[shards]]\nreplicas = [{:?}]\n", s1.addr))
        .unwrap();
    let mut opts = embank_net::ClientSettings {
        map: Some(file.display().to_string()),
        version: Some(2),
        reload_seconds: Some(3600.0),
        ..Default::default()
    };
    opts.keys_per_request_max = Some(10);
    let hinted = opts.connect(&[vec![s1.addr.clone()]]).unwrap();
    std::fs::write(
        &file,
        format!(
            "version = 3\nreload_seconds = 3600\n[[shards]]\nreplicas = [{:?}]\n[[shards]]\nreplicas = [{:?}]\n",
            s1.addr, s2.addr
        ),
    )
    .unwrap();
    // Requests beyond the pooled connection open new ones; their hellos name version 3.
    let keys: Vec<u64> = (0..100).collect();
    hinted.table("t").unwrap().lookup(&keys, &mut [0f32; 400], &mut [false; 100]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while hinted.map_version() < 3 {
        assert!(Instant::now() < deadline, "the hint was not followed: version {}", hinted.map_version());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(hinted.shard_count(), 2);
    sigkill(&mut s1.child);
    sigkill(&mut s2.child);
}

/// Sets its flag when dropped: however a scope's body ends, a panic included.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
