//! Readiness and liveness of `embank serve` processes, with a real Redis broker: a
//! replica is ready (`/readyz`, and `/healthz`, its older name) only once it serves a
//! checkpoint, so a DNS-named group never takes an empty replica; it is live (`/livez`)
//! throughout. A primary is ready at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::replica::*;
use common::{http_get, sigkill};
use embank_cli::brokers::{BrokerKind, LocalBroker};
use embank_net::stream::{PublishOptions, Publisher};
use embank_net::{Client, ClientOptions};
use rand::SeedableRng;

/// The status code of an admin GET, and the body.
fn get(admin: &str, path: &str) -> (u16, String) {
    let reply = http_get(admin, path);
    let code = reply.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

#[test]
fn a_replica_is_ready_only_once_it_serves_a_checkpoint_and_live_throughout() {
    let dir = tempfile::tempdir().unwrap();
    let broker = LocalBroker::start(BrokerKind::Redis, &dir.path().join("broker")).unwrap();
    let config = dir.path().join("replica.toml");
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[updates]\ntransport = \"redis\"\n\
             brokers = \"{}\"\ntopic = \"ready\"\ntimeout_seconds = 5.0\n",
            dir.path().join("replica").display().to_string(),
            broker.brokers()
        ),
    )
    .unwrap();
    let mut replica = spawn_replica(&config);
    // An empty stream: ingesting, serving nothing. Not ready (both names), live.
    std::thread::sleep(Duration::from_millis(500));
    // /healthz first: the name probes use today (it answered 200 here before).
    for path in ["/healthz", "/readyz"] {
        let (code, body) = get(&replica.admin, path);
        assert_eq!(code, 503, "{path} of a replica serving no checkpoint: {body}");
        assert!(body.contains("serving no checkpoint yet"), "{path}: {body}");
    }
    assert_eq!(get(&replica.admin, "/livez").0, 200);
    // What a reader would get from it meanwhile: nothing (why it must not be ready).
    let client = Client::connect(&[replica.addr.clone()], ClientOptions::default()).unwrap();
    assert!(client.served().unwrap()[0]["batch_id"].is_null(), "{:?}", client.served());

    // The trainer publishes its first checkpoint: ready once the replica applied it.
    let store = trainer(&dir.path().join("trainer"));
    let publisher =
        Publisher::start(Arc::clone(&store), PublishOptions::new(stream(BrokerKind::Redis, &broker, "ready"))).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    step(&store, 1, &mut rng);
    store.checkpoint(1).unwrap();
    publisher.notify().unwrap();
    publisher.flush(Duration::from_secs(30)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut not_ready, mut ready_at) = (0u64, None);
    while ready_at.is_none() {
        assert!(Instant::now() < deadline, "never ready: {:?}", get(&replica.admin, "/readyz"));
        assert_eq!(get(&replica.admin, "/livez").0, 200, "liveness while it applies the first checkpoint");
        match get(&replica.admin, "/readyz") {
            (200, body) => ready_at = Some(body),
            (503, _) => not_ready += 1,
            other => panic!("/readyz answered {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let body = ready_at.unwrap();
    assert!(body.contains("replica ingesting") && body.contains("\"checkpoint_batch_id\":1") && body.ends_with("ok\n"));
    // Ready means it answers with the checkpoint's rows.
    let served = client.served().unwrap();
    assert_eq!(served[0]["batch_id"].as_u64(), Some(1), "{served:?}");
    let want = trainer_at(&store, "emb", 1, (0, 1));
    let keys: Vec<u64> = want.keys().copied().collect();
    let (mut rows, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
    client.table("emb").unwrap().lookup(&keys, &mut rows, &mut found).unwrap();
    assert!(
        found.iter().all(|&f| f),
        "a ready replica misses {} of {} keys",
        found.iter().filter(|&&f| !f).count(),
        keys.len()
    );
    assert_eq!(get(&replica.admin, "/healthz").0, 200);
    assert_eq!(get(&replica.admin, "/livez").0, 200);
    eprintln!("not ready for {not_ready} looks after the publish, then ready: {}", body.lines().next().unwrap_or(""));

    // Restarted on its store, it serves its own checkpoint at once: ready before the
    // stream says anything (the broker is down).
    sigkill(&mut replica.child);
    drop(broker);
    let mut replica = spawn_replica(&config);
    let (code, body) = get(&replica.admin, "/readyz");
    assert_eq!(code, 200, "a restarted replica serving its checkpoint: {body}");
    assert_eq!(get(&replica.admin, "/livez").0, 200);
    sigkill(&mut replica.child);
}

#[test]
fn a_primary_is_ready_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("primary.toml");
    std::fs::write(
        &config,
        format!(
            "store = {:?}\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[[tables]]\nname = \"t\"\ndim = 4\n",
            dir.path().join("store").display().to_string()
        ),
    )
    .unwrap();
    let mut primary = common::serve(&config, &[], common::Stderr::Hidden);
    for path in ["/readyz", "/healthz", "/livez"] {
        let (code, body) = get(&primary.admin, path);
        assert_eq!(code, 200, "{path} of a primary: {body}");
    }
    assert_eq!(get(&primary.admin, "/nope").0, 404);
    sigkill(&mut primary.child);
}
