//! A silent replica costs a read milliseconds: one shard served by a group of `embank
//! serve` replicas fed by Redis Streams, a trainer publishing a checkpoint every 0.3 s,
//! and two readers of 200-key lookups that ask each time for at least the newest
//! checkpoint they have seen. One replica of the group then fails silently, one fault at
//! a time:
//!
//! - **frozen**: `SIGSTOP` (its sockets stay open, nothing answers), then `SIGCONT`;
//! - **slow**: `SIGSTOP`/`SIGCONT` pulses (40 ms stopped, 40 ms running);
//! - **partition**: every packet to and from it dropped (`iptables -j DROP` in its network
//!   namespace: no reset, no refusal), then healed;
//! - **broker cut**: only its update stream dropped: it answers, but falls behind.
//!
//! The last two need root, `ip` and `iptables` (each replica runs in a network namespace
//! of its own on a veth link); without them the test says so and runs the first two on
//! loopback. Every answer is checked (one checkpoint whole, never older than asked), no
//! read may fail or take over 5 s, and after each fault the replica must be back in the
//! rotation (within 15 s here; the goal, 5 s, is measured); throughput and latency are
//! printed, not asserted. Each window lasts 2 s (`EMBANK_SILENT_SECONDS` for longer: the results table of
//! docs/BENCHMARKS.md is `EMBANK_SILENT_SECONDS=8 cargo test --release -p embank-cli
//! --test silent_replica -- --nocapture --test-threads 1`). `EMBANK_SILENT_FAULTS=none`
//! measures the healthy group alone, `EMBANK_SILENT_HEDGE_DELAY=0` without hedged reads
//! (what hedging costs a healthy group: alternate the two); `EMBANK_SILENT_LOOPBACK=1` runs
//! on loopback even as root.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::sigkill;
use embank_core::{Store, StoreOptions, TableOptions};
use embank_net::stream::{PublishOptions, Publisher, StreamConfig, TransportKind};
use embank_net::{Client, ClientOptions};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

const DIM: usize = 8;
const ROWS: u64 = 2000;
const BATCH: usize = 200;
/// The replicas' token (beyond loopback they need one; TLS is left out: `insecure`).
const TOKEN: &str = "silent-replica";

/// How long each window (before, during a fault) lasts.
fn window() -> Duration {
    Duration::from_secs_f64(std::env::var("EMBANK_SILENT_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2.0))
}

/// Where the replicas run: network namespaces on veth links (root), or loopback.
struct Net {
    /// Namespace names, one per replica; empty on loopback.
    namespaces: Vec<String>,
    /// This set's number in the test process (tests run at once: each its own names and
    /// addresses).
    set: usize,
}

/// Sets of namespaces made so far by this process.
static SETS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Net {
    /// Namespaces `eb<pid>s<set>r<i>` with veth links 10.<k>.<i>.1 (host) <-> 10.<k>.<i>.2
    /// (replica), `k` from the process and the set.
    fn namespaces(n: usize) -> Option<Net> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || std::env::var("EMBANK_SILENT_LOOPBACK").is_ok_and(|v| v == "1") {
            return None;
        }
        let ok = |cmd: &str, args: &[&str]| {
            Command::new(cmd).args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
        };
        if !ok("ip", &["netns", "list"]) || !ok("iptables", &["--version"]) {
            return None;
        }
        let pid = std::process::id();
        let set = SETS.fetch_add(1, Ordering::Relaxed);
        let mut net = Net { namespaces: Vec::new(), set };
        for i in 0..n {
            let ns = format!("eb{pid}s{set}r{i}");
            let (host, peer) = (format!("eb{pid}s{set}h{i}"), format!("eb{pid}s{set}p{i}"));
            let (host_ip, peer_ip) = (format!("{}/24", net.host_ip(i)), format!("{}/24", net.ip(i, 2)));
            let steps: [&[&str]; 8] = [
                &["netns", "add", &ns],
                &["link", "add", &host, "type", "veth", "peer", "name", &peer],
                &["link", "set", &peer, "netns", &ns],
                &["addr", "add", &host_ip, "dev", &host],
                &["link", "set", &host, "up"],
                &["-n", &ns, "addr", "add", &peer_ip, "dev", &peer],
                &["-n", &ns, "link", "set", &peer, "up"],
                &["-n", &ns, "link", "set", "lo", "up"],
            ];
            let failed = steps.iter().find(|s| !ok("ip", s)).map(|s| s.join(" "));
            net.namespaces.push(ns.clone());
            if let Some(step) = failed {
                eprintln!("silent replica: `ip {step}` failed: network namespaces unavailable");
                return None;
            }
        }
        Some(net)
    }

    fn ip(&self, i: usize, end: u8) -> String {
        format!("10.{}.{}.{end}", 100 + (std::process::id() as usize * 8 + self.set) % 150, i + 1)
    }

    /// The host's end of replica i's link.
    fn host_ip(&self, i: usize) -> String {
        self.ip(i, 1)
    }

    /// The address replica i listens on.
    fn listen(&self, i: usize) -> String {
        if self.namespaces.is_empty() {
            "127.0.0.1:0".into()
        } else {
            format!("{}:0", self.ip(i, 2))
        }
    }

    /// The broker as replica i reaches it.
    fn broker(&self, i: usize, port: u16) -> String {
        if self.namespaces.is_empty() {
            format!("redis://127.0.0.1:{port}")
        } else {
            format!("redis://{}:{port}", self.host_ip(i))
        }
    }

    fn iptables(&self, i: usize, args: &[&str]) {
        let st =
            Command::new("ip").args(["netns", "exec", &self.namespaces[i], "iptables"]).args(args).status().unwrap();
        assert!(st.success(), "iptables {args:?} in {} failed", self.namespaces[i]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A Redis server every namespace reaches (bound to all addresses, no persistence).
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(dir: &Path) -> Redis {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "0.0.0.0", "--protected-mode", "no", "--save", ""])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (install it: the update stream's tests need it)");
        let until = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "redis-server not listening on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis { child, port }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        sigkill(&mut self.child);
    }
}

/// `embank serve` replica i (in its namespace when there are namespaces).
fn start_replica(net: &Net, i: usize, dir: &Path, redis: &Redis) -> (Child, String) {
    let config = dir.join(format!("replica{i}.toml"));
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = {:?}\ntoken = \"{TOKEN}\"\ninsecure = {}\n[updates]\ntransport = \"redis\"\nbrokers = {:?}\ntopic = \"silent\"\n",
            dir.join(format!("replica{i}")).display().to_string(),
            net.listen(i),
            !net.namespaces.is_empty(),
            net.broker(i, redis.port),
        ),
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_embank");
    let mut cmd = if net.namespaces.is_empty() {
        Command::new(bin)
    } else {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &net.namespaces[i], bin]);
        c
    };
    let mut child =
        cmd.arg("serve").arg("--config").arg(&config).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains("listening on"), "replica {i} did not start: {line:?}");
    let addr = line.split("listening on ").nth(1).unwrap().split_whitespace().next().unwrap();
    (child, addr.trim_end_matches(',').to_string())
}

/// The replica processes, stopped however the test ends (a failed assertion included).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            signal(c, libc::SIGCONT);
            sigkill(c);
        }
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: a signal to a child this test started.
    unsafe { libc::kill(child.id() as i32, sig) };
}

/// One read: when it started (since the readers began) and how long it took.
type Read = (Duration, Duration);

/// Reads started in `[from, to)`: count a second, p50, p99, longest (ms).
fn summary(reads: &[Read], from: Duration, to: Duration) -> (f64, f64, f64, f64) {
    let mut lat: Vec<f64> = reads.iter().filter(|r| r.0 >= from && r.0 < to).map(|r| r.1.as_secs_f64() * 1e3).collect();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if lat.is_empty() {
        return (0.0, 0.0, 0.0, 0.0);
    }
    let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    (lat.len() as f64 / (to - from).as_secs_f64(), at(0.5), at(0.99), *lat.last().unwrap())
}

/// A fault on replica 0, held for a window.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Frozen,
    Slow,
    Partition,
    BrokerCut,
}

/// Runs the faults on one group of `replicas`; prints a table; checks every bound.
fn silent_replica(replicas: usize, faults: &[Fault]) {
    // One group at a time: the two tests would otherwise share the 2 cores.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock();
    let dir = tempfile::tempdir().unwrap();
    let net = Net::namespaces(replicas);
    let faults: Vec<Fault> =
        if std::env::var("EMBANK_SILENT_FAULTS").is_ok_and(|v| v == "none") { Vec::new() } else { faults.to_vec() };
    let faults: Vec<Fault> = match &net {
        Some(_) => faults,
        None => {
            eprintln!(
                "silent replica: partition and broker cut skipped (they need root, `ip` and `iptables`); frozen and slow run on loopback"
            );
            faults.iter().copied().filter(|f| matches!(f, Fault::Frozen | Fault::Slow)).collect()
        }
    };
    let net = net.unwrap_or(Net { namespaces: Vec::new(), set: 0 });
    let redis = Redis::start(dir.path());
    let store = Arc::new(Store::open(dir.path().join("trainer"), StoreOptions::default()).unwrap());
    store.create_table("emb", TableOptions::new(DIM as u32)).unwrap();
    let mut stream = StreamConfig::new(TransportKind::Redis, format!("redis://127.0.0.1:{}", redis.port));
    stream.topic = "silent".into();
    stream.timeout_seconds = 5.0;
    let publisher = Publisher::start(Arc::clone(&store), PublishOptions::new(stream)).unwrap();
    let keys: Vec<u64> = (0..ROWS).collect();
    let write = |b: u64| {
        store.table("emb").unwrap().push(&keys, &vec![b as f32; keys.len() * DIM]).unwrap();
        store.checkpoint(b).unwrap();
        publisher.notify().unwrap();
    };
    write(1);
    publisher.flush(Duration::from_secs(30)).unwrap();
    let mut children = Children(Vec::new());
    let mut addrs = Vec::new();
    for i in 0..replicas {
        let (c, a) = start_replica(&net, i, dir.path(), &redis);
        children.0.push(c);
        addrs.push(a);
    }
    let hedge_delay =
        std::env::var("EMBANK_SILENT_HEDGE_DELAY").ok().map(|v| Duration::from_secs_f64(v.parse().unwrap()));
    let opts = ClientOptions { token: Some(TOKEN.into()), hedge_delay, ..Default::default() };
    let client = Client::connect_groups(&[addrs.clone()], opts).unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    while !client.served_all()[0].iter().all(|v| v["batch_id"].as_u64() == Some(1)) {
        assert!(Instant::now() < until, "replicas never served checkpoint 1: {:?}", client.served_all());
        std::thread::sleep(Duration::from_millis(20));
    }
    let stop = AtomicBool::new(false);
    let reads: Mutex<Vec<Read>> = Mutex::new(Vec::new());
    let began = Instant::now();
    let w = window();
    let mut rows_out = Vec::new();
    std::thread::scope(|s| {
        let trainer = s.spawn(|| {
            let mut b = 1;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(300));
                b += 1;
                write(b);
            }
            b
        });
        let readers: Vec<_> = (0..2u64)
            .map(|seed| {
                let (client, reads, stop) = (client.clone(), &reads, &stop);
                s.spawn(move || {
                    let t = client.table("emb").unwrap();
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                    let (mut rows, mut found) = (vec![0f32; BATCH * DIM], vec![false; BATCH]);
                    let mut seen = 1u64;
                    let mut mine = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let batch: Vec<u64> = (0..BATCH).map(|_| rng.random_range(0..ROWS)).collect();
                        let started = Instant::now();
                        t.lookup_min(&batch, &mut rows, &mut found, Some(seen))
                            .unwrap_or_else(|e| panic!("read {} failed: {e}", mine.len()));
                        mine.push((started - began, started.elapsed()));
                        assert!(found.iter().all(|&f| f), "read {}: keys missing", mine.len());
                        let b = rows[0] as u64;
                        assert!(rows.iter().all(|&x| x == rows[0]), "read {}: a mix of checkpoints", mine.len());
                        assert!(b >= seen, "read {}: checkpoint {b}, older than asked ({seen})", mine.len());
                        seen = b;
                        if mine.len() % 256 == 0 {
                            reads.lock().append(&mut mine);
                        }
                    }
                    reads.lock().append(&mut mine);
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        let mut windows = Vec::new();
        let t0 = began.elapsed();
        std::thread::sleep(w);
        windows.push(("none (before)".to_string(), t0, began.elapsed(), None));
        for &fault in &faults {
            let counts_before = client.replica_counts()[0].clone();
            let from = began.elapsed();
            match fault {
                Fault::Frozen => {
                    signal(&children.0[0], libc::SIGSTOP);
                    std::thread::sleep(w);
                    signal(&children.0[0], libc::SIGCONT);
                }
                Fault::Slow => {
                    let until = Instant::now() + w;
                    while Instant::now() < until {
                        signal(&children.0[0], libc::SIGSTOP);
                        std::thread::sleep(Duration::from_millis(40));
                        signal(&children.0[0], libc::SIGCONT);
                        std::thread::sleep(Duration::from_millis(40));
                    }
                }
                Fault::Partition => {
                    net.iptables(0, &["-A", "INPUT", "-j", "DROP"]);
                    net.iptables(0, &["-A", "OUTPUT", "-j", "DROP"]);
                    std::thread::sleep(w);
                    net.iptables(0, &["-F"]);
                }
                Fault::BrokerCut => {
                    let port = redis.port.to_string();
                    net.iptables(0, &["-A", "OUTPUT", "-p", "tcp", "--dport", &port, "-j", "DROP"]);
                    net.iptables(0, &["-A", "INPUT", "-p", "tcp", "--sport", &port, "-j", "DROP"]);
                    std::thread::sleep(w);
                    net.iptables(0, &["-F"]);
                }
            }
            let to = began.elapsed();
            // Back in the rotation (a slow replica may never have left it): the goal is 5 s
            // (docs/BENCHMARKS.md); 15 s here, on whatever else the machine runs.
            let healed = Instant::now();
            let back = loop {
                let c = &client.replica_counts()[0][0];
                if c["ejected"] == false {
                    break healed.elapsed();
                }
                assert!(
                    healed.elapsed() < Duration::from_secs(15),
                    "{fault:?}: replica 0 not back in the rotation 15 s after the fault: {c}"
                );
                std::thread::sleep(Duration::from_millis(10));
            };
            let counts = client.replica_counts()[0].clone();
            // Over the group (a hedge goes to a sibling of the slow replica).
            let delta = |k: &str| -> u64 {
                counts.iter().zip(&counts_before).map(|(c, b)| c[k].as_u64().unwrap() - b[k].as_u64().unwrap()).sum()
            };
            windows.push((
                format!("{fault:?}"),
                from,
                to,
                Some((back, delta("ejections"), delta("hedges_sent"), delta("hedges_won"))),
            ));
            std::thread::sleep(Duration::from_millis(500));
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        let last = trainer.join().unwrap();
        let reads = reads.lock();
        let before = summary(&reads, windows[0].1, windows[0].2);
        eprintln!(
            "silent replica: group of {replicas}, {} s windows, 2 readers x {BATCH} keys, a checkpoint every 0.3 s (last {last}), 0 failed, 0 older than asked",
            w.as_secs_f64()
        );
        eprintln!("| fault on replica 0 | reads/s | vs before | p50 ms | p99 ms | longest ms | back in rotation | ejections | hedges sent (won) |");
        eprintln!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for (name, from, to, extra) in &windows {
            let (rate, p50, p99, max) = summary(&reads, *from, *to);
            let extra = extra.map_or("- | - | -".to_string(), |(back, ej, hs, hw)| {
                format!("{:.2} s | {ej} | {hs} ({hw})", back.as_secs_f64())
            });
            eprintln!(
                "| {name} | {rate:.0} | {:.0} % | {p50:.2} | {p99:.2} | {max:.1} | {extra} |",
                rate / before.0 * 100.0
            );
            rows_out.push((name.clone(), rate / before.0, p99, max));
        }
        eprintln!("replica counts: {}", serde_json::to_string(&client.replica_counts()).unwrap());
    });
    drop(children);
    // What must hold on any machine: no read waits for the silent replica (without
    // deadlines and hedging a read waited 15-30 s). Throughput and percentiles are
    // measured, not asserted: docs/BENCHMARKS.md has them, from a quiet machine.
    for (name, _, _, max) in &rows_out[1..] {
        assert!(*max <= 5000.0, "{name}: a read took {max:.0} ms");
    }
}

#[test]
fn a_silent_replica_of_two_costs_a_read_milliseconds() {
    silent_replica(2, &[Fault::Frozen, Fault::Slow, Fault::Partition, Fault::BrokerCut]);
}

#[test]
fn a_frozen_replica_of_three_costs_a_read_milliseconds() {
    silent_replica(3, &[Fault::Frozen]);
}
