//! The map a call routes by, and switching to a new one.

use embank_core::ErrorKind;

use super::*;

#[test]
fn every_key_goes_to_the_shard_the_map_says() {
    let sim = Sim::new(31);
    let g = groups(3, 2);
    let c = connect(&sim, &g, ClientOptions { keys_per_request_max: 64, ..options() });
    let keys: Vec<u64> = (0..2000).map(|i| i * 7919).collect();
    let plan = table(&c).plan(Op::Lookup, &keys, None);
    let mut answered = vec![false; plan.reqs.len()];
    c.run_over(&sim, &plan.reqs, |i, _, _, _| {
        answered[i] = true;
        Ok(())
    })
    .unwrap();
    assert!(answered.iter().all(|&a| a));
    let requests = sent(&sim, 0, Op::Lookup);
    routed_by(&requests, &g, "the call");
    let mut seen: Vec<u64> = requests.iter().flat_map(|q| q.keys.iter().copied()).collect();
    seen.sort_unstable();
    let mut want = keys.clone();
    want.sort_unstable();
    assert_eq!(seen, want, "every key asked once");
}

#[test]
fn a_call_keeps_the_map_it_began_with_and_the_next_call_takes_the_new_one() {
    let sim = Sim::new(32);
    let v1 = groups(2, 2);
    let opts = ClientOptions { keys_per_request_max: 50, in_flight_per_shard: 1, ..options() };
    let c = connect(&sim, &v1, opts);
    c.set_version(1);
    let v2 = vec![v1[0].clone(), vec![addr(1, 0), addr(2, 5)], vec![addr(3, 0), addr(3, 1)]];
    let keys: Vec<u64> = (0..1000).collect();
    let t = table(&c);
    let plan = t.plan(Op::Lookup, &keys, None);
    assert!(plan.reqs.len() >= 20, "requests wait their turn: {}", plan.reqs.len());
    sim.mark(1);
    let mut switched = false;
    c.run_over(&sim, &plan.reqs, |_, _, _, _| {
        // A reload between two replies of a call.
        if !switched {
            switched = c.switch_map(&sim, &map(2, &v2), "test").unwrap();
        }
        Ok(())
    })
    .unwrap();
    assert!(switched);
    assert_eq!(c.map_version(), 2);
    // An address that stays keeps its replica's state (health, latencies, table ids).
    let kept = shard(&c, 0).replicas[0].clone();
    assert_eq!(kept.addr, addr(0, 0));
    assert!(kept.counters.answered.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert!(kept.tables.lock().contains_key("t"));
    let old: Vec<Request> = sent(&sim, 0, Op::Lookup).into_iter().filter(|q| q.mark == 1).collect();
    assert_eq!(old.iter().map(|q| q.keys.len()).sum::<usize>(), keys.len());
    routed_by(&old, &v1, "the call that began with version 1");

    sim.mark(2);
    let plan = t.plan(Op::Lookup, &keys, None);
    c.run_over(&sim, &plan.reqs, |_, _, _, _| Ok(())).unwrap();
    let new: Vec<Request> = sent(&sim, 0, Op::Lookup).into_iter().filter(|q| q.mark == 2).collect();
    routed_by(&new, &v2, "the call after the switch");
}

#[test]
fn a_map_is_switched_to_only_when_newer_and_every_shard_answers() {
    let sim = Sim::new(33);
    let v3 = groups(2, 2);
    let c = connect(&sim, &v3, options());
    c.set_version(3);
    let e = c.switch_map(&sim, &map(2, &groups(3, 2)), "test").unwrap_err();
    assert!(e.to_string().contains("older than the version in use (3)"), "{e}");
    assert!(!c.switch_map(&sim, &map(3, &v3), "test").unwrap(), "the same map");
    let e = c.switch_map(&sim, &map(3, &groups(3, 2)), "test").unwrap_err();
    assert!(e.to_string().contains("changed but kept version 3"), "{e}");

    let v4 = groups(3, 2);
    for r in 0..2 {
        sim.set(&addr(2, r), |b| b.down = true);
    }
    let e = c.switch_map(&sim, &map(4, &v4), "test").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("no replica of shard 2"), "{e}");
    assert_eq!((c.map_version(), c.groups()), (3, v3.clone()), "the map in use stays");
    sim.set(&addr(2, 1), |b| b.down = false);
    assert!(c.switch_map(&sim, &map(4, &v4), "test").unwrap(), "one replica of each shard answers");
    assert_eq!((c.map_version(), c.groups()), (4, v4));
}
