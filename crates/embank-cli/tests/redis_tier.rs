//! The Redis Cluster shared tier with real processes: a 3-master Redis Cluster on
//! loopback (Debian's `redis-server`, `redis-cli --cluster create`) shared by two
//! `embank serve` processes. A row one server read from its medium is a cluster hit
//! for the other; a cluster node SIGKILLed mid-load loses no request.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use embank_core::{MediumKind, Store, StoreOptions, TableOptions};
use embank_net::{Client, ClientOptions};

const DIM: usize = 8;
const ROWS: u64 = 4000;

fn have(cmd: &str) -> bool {
    Command::new(cmd).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let p = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if p < 55000 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Three masters, no replicas, slots split by `redis-cli --cluster create`.
fn start_cluster(dir: &Path) -> (Vec<Killed>, Vec<u16>) {
    let mut nodes = Vec::new();
    let mut ports = Vec::new();
    for i in 0..3 {
        let port = free_port();
        let d = dir.join(format!("redis{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--cluster-enabled", "yes"])
            .args(["--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"])
            .args(["--cluster-node-timeout", "2000"])
            .arg("--dir")
            .arg(&d)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        nodes.push(Killed(child));
        ports.push(port);
    }
    for &p in &ports {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !redis_cli(p, &["ping"]).contains("PONG") {
            assert!(Instant::now() < deadline, "redis-server on {p} did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ports.iter().all(|&p| redis_cli(p, &["cluster", "info"]).contains("cluster_state:ok")) {
        assert!(Instant::now() < deadline, "the cluster did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    (nodes, ports)
}

fn row_of(key: u64) -> Vec<f32> {
    (0..DIM).map(|j| key as f32 * 0.25 + j as f32).collect()
}

/// A store with the same table and rows as every other serving node's.
fn load_store(path: &Path) {
    let store = Store::open(path, StoreOptions::default()).unwrap();
    let t = store
        .create_table("items", TableOptions { dim: DIM as u32, medium: MediumKind::Block, ..Default::default() })
        .unwrap();
    let keys: Vec<u64> = (0..ROWS).collect();
    let rows: Vec<f32> = keys.iter().flat_map(|&k| row_of(k)).collect();
    t.push(&keys, &rows).unwrap();
    store.close().unwrap();
}

struct Server {
    _child: Killed,
    addr: String,
}

fn serve(dir: &Path, name: &str, ports: &[u16]) -> Server {
    let store: PathBuf = dir.join(name);
    load_store(&store);
    let config = dir.join(format!("{name}.toml"));
    let nodes: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\n[store_options]\ncache_bytes = 262144\n\
             [shared_tier]\nredis_cluster = [{}]\ntimeout_ms = 300\nbackoff_ms = 300\n",
            store.display().to_string(),
            nodes.join(", ")
        ),
    )
    .unwrap();
    let s = common::try_serve(&config, &[], common::Stderr::Shown, &[("EMBANK_LOG", "error")])
        .expect("embank serve started");
    Server { _child: Killed(s.child), addr: s.addr }
}

fn client(s: &Server) -> Client {
    Client::connect(std::slice::from_ref(&s.addr), ClientOptions::default()).unwrap()
}

fn tier_stats(c: &Client) -> serde_json::Value {
    c.stats().unwrap()["shards"][0]["shared_tier"].clone()
}

/// Looks `keys` up through `c` and checks every row against the loaded values.
fn lookup_checked(c: &Client, keys: &[u64]) {
    let t = c.table("items").unwrap();
    let mut out = vec![0f32; keys.len() * DIM];
    let mut found = vec![false; keys.len()];
    t.lookup(keys, &mut out, &mut found).unwrap();
    for (i, &k) in keys.iter().enumerate() {
        assert!(found[i], "key {k} not found");
        assert_eq!(&out[i * DIM..(i + 1) * DIM], &row_of(k)[..], "key {k}");
    }
}

#[test]
fn two_servers_share_a_redis_cluster_and_survive_a_node_killed_mid_load() {
    if !have("redis-server") || !have("redis-cli") {
        eprintln!("skipped: redis-server and redis-cli are needed (Debian's redis-server package)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut nodes, ports) = start_cluster(dir.path());
    let a = serve(dir.path(), "a", &ports);
    let b = serve(dir.path(), "b", &ports);
    let (ca, cb) = (client(&a), client(&b));

    // Server a reads keys 0..1000 from its medium and fills the cluster.
    let warm: Vec<u64> = (0..1000).collect();
    for chunk in warm.chunks(500) {
        lookup_checked(&ca, chunk);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier_stats(&ca)["puts"].as_u64().unwrap() < 1000 {
        assert!(Instant::now() < deadline, "the cluster was not filled: {}", tier_stats(&ca));
        std::thread::sleep(Duration::from_millis(50));
    }
    // For server b the same rows are cluster hits: its medium is not read for them.
    for chunk in warm.chunks(500) {
        lookup_checked(&cb, chunk);
    }
    let sb = tier_stats(&cb);
    assert_eq!(sb["hits"].as_u64().unwrap(), 1000, "{sb}");
    assert_eq!(sb["misses"].as_u64().unwrap(), 0, "{sb}");
    let b_read = cb.stats().unwrap()["shards"][0]["tables"][0]["medium_rows_read"].as_u64().unwrap();
    assert_eq!(b_read, 0, "server b read its medium for rows the cluster had");

    // A cluster node SIGKILLed while server b serves lookups: no request fails, every
    // row is right, and the tier counts what it could not serve.
    let stop = Arc::new(AtomicBool::new(false));
    let loader = {
        let (stop, addr) = (Arc::clone(&stop), b.addr.clone());
        std::thread::spawn(move || {
            let c = Client::connect(&[addr], ClientOptions::default()).unwrap();
            let mut batches = 0u64;
            let mut k = 1000u64;
            while !stop.load(Ordering::Relaxed) || batches < 40 {
                let keys: Vec<u64> = (0..250).map(|i| 1000 + (k + i * 7) % (ROWS - 1000)).collect();
                lookup_checked(&c, &keys);
                k += 250;
                batches += 1;
            }
            batches
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut killed = nodes.remove(1);
    killed.0.kill().unwrap();
    killed.0.wait().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let batches = loader.join().expect("a lookup failed while a cluster node was down");
    assert!(batches >= 40);
    let sb = tier_stats(&cb);
    assert!(sb["errors"].as_u64().unwrap() > 0, "{sb}");
    assert!(sb["degraded_keys"].as_u64().unwrap() > 0, "{sb}");
    drop((a, b, nodes));
}
