//! Which replica takes a request, its deadline, hedging and failover.

use std::sync::atomic::Ordering;

use embank_core::ErrorKind;

use super::*;

/// Reads every replica of shard `s` once so their table ids are known (a first request to
/// a replica opens the table there, a blocking exchange of its own).
fn warm(sim: &Sim, client: &Client, s: usize) {
    for _ in 0..shard(client, s).replicas.len() {
        run(sim, client, &[read(client, s, &[0], None)]).expect("a healthy group answers");
    }
}

/// How many of `requests` went to each replica of shard 0 (of `n`).
fn per_replica(requests: &[Request], n: usize) -> Vec<usize> {
    (0..n).map(|r| requests.iter().filter(|q| q.addr == addr(0, r)).count()).collect()
}

#[test]
fn reads_rotate_over_the_replicas_in_rotation_and_writes_go_to_the_primary() {
    let sim = Sim::new(1);
    let c = connect(&sim, &groups(1, 3), options());
    for k in 0..30 {
        run(&sim, &c, &[read(&c, 0, &[k], None)]).unwrap();
    }
    assert_eq!(per_replica(&sent(&sim, 0, Op::Lookup), 3), [10, 10, 10], "reads spread evenly");

    c.eject(&sim, &shard(&c, 0), 1, "test");
    let from = sim.log().len();
    for k in 0..30 {
        assert_ne!(run(&sim, &c, &[read(&c, 0, &[k], None)]).unwrap(), [Some(1)]);
    }
    // The rotation passes over it: its turn goes to the replica after it.
    let reads = sent(&sim, from, Op::Lookup);
    assert_eq!(per_replica(&reads, 3), [10, 0, 20], "an ejected replica takes no reads");
    assert!(reads.iter().all(|q| !q.ejected && !q.group[1].1), "each read saw replica 1 out of the rotation");

    let from = sim.log().len();
    for k in 0..5 {
        run(&sim, &c, &[keyed(&c, 0, Op::Push, &[], &[k], None)]).unwrap();
    }
    assert_eq!(per_replica(&sent(&sim, from, Op::Push), 3), [5, 0, 0], "writes go to the primary alone");
}

#[test]
fn a_read_goes_only_to_replicas_serving_the_checkpoint_asked_for() {
    let sim = Sim::new(2);
    for (r, b) in [(0, 5), (1, 7), (2, 9)] {
        sim.set(&addr(0, r), |x| x.served = Some(b));
    }
    let c = connect(&sim, &groups(1, 3), options());
    for k in 0..20 {
        assert_eq!(run(&sim, &c, &[read(&c, 0, &[k], Some(8))]).unwrap(), [Some(2)], "read {k}");
    }
    let e = run(&sim, &c, &[read(&c, 0, &[1], Some(10))]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    for (r, b) in [(0, 5), (1, 7), (2, 9)] {
        assert!(e.to_string().contains(&format!("({}): {b}", addr(0, r))), "{e}");
    }
    // A replica that catches up is asked again and takes the read.
    sim.set(&addr(0, 1), |x| x.served = Some(10));
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], Some(10))]).unwrap(), [Some(1)]);
    for q in sent(&sim, 0, Op::Lookup) {
        assert!(q.served >= Some(8), "{q:?} went to a replica behind the checkpoint asked for");
    }
}

#[test]
fn a_deadline_is_ten_times_the_replicas_p99_between_its_floor_and_the_timeout() {
    let sim = Sim::new(3);
    let c = connect(&sim, &[vec![addr(0, 0), addr(0, 1)], vec![addr(1, 0)]], options());
    let (group, single) = (shard(&c, 0), shard(&c, 1));
    // Nothing measured yet: the floors.
    assert_eq!(c.deadline(&group, 0, Op::Lookup), ms(100), "a read a sibling could take");
    assert_eq!(c.deadline(&group, 0, Op::Push), ms(5000), "a write: no sibling takes it");
    assert_eq!(c.deadline(&single, 0, Op::Lookup), ms(5000), "a read of a single server");
    assert_eq!(c.deadline(&group, 0, Op::Checkpoint), ms(30_000), "store-wide: the timeout");
    assert_eq!(c.deadline(&group, 0, Op::StoreStats), ms(15_000), "a store-wide read: the timeout over 2");
    let record = |took: Duration, n: usize| {
        for _ in 0..n {
            group.replicas[0].latency.lock().record(took);
        }
    };
    record(ms(20), 16);
    assert_eq!(c.deadline(&group, 0, Op::Lookup), ms(200), "10x a p99 of 20 ms");
    assert_eq!(c.deadline(&group, 1, Op::Lookup), ms(100), "each replica by its own latencies");
    record(ms(1), 256);
    assert_eq!(c.deadline(&group, 0, Op::Lookup), ms(100), "never under the floor");
    record(ms(5000), 256);
    assert_eq!(c.deadline(&group, 0, Op::Lookup), ms(30_000), "never over the timeout");
}

#[test]
fn the_hedging_delay_is_the_groups_p95_at_least_a_millisecond() {
    let sim = Sim::new(4);
    let c = connect(&sim, &[vec![addr(0, 0), addr(0, 1)], vec![addr(1, 0)]], ClientOptions::default());
    let (group, single) = (shard(&c, 0), shard(&c, 1));
    assert_eq!(c.hedge_delay(&single), None, "a single server has no sibling");
    assert_eq!(c.hedge_delay(&group), Some(ms(20)), "too few latencies measured yet");
    for i in 0..100 {
        group.latency.lock().record(Duration::from_micros(if i % 10 == 0 { 40_000 } else { 300 }));
    }
    assert_eq!(c.hedge_delay(&group), Some(ms(40)), "the group's p95");
    for _ in 0..256 {
        group.latency.lock().record(Duration::from_micros(200));
    }
    assert_eq!(c.hedge_delay(&group), Some(ms(1)), "at least 1 ms");
    let off = connect(&sim, &groups(1, 2), options());
    assert_eq!(off.hedge_delay(&shard(&off, 0)), None, "hedge_delay 0: never");
}

#[test]
fn a_silent_replica_costs_a_read_its_deadline_then_takes_no_reads() {
    let sim = Sim::new(5);
    let c = connect(&sim, &groups(1, 2), options());
    warm(&sim, &c, 0);
    sim.set(&addr(0, 0), |b| b.silent = true);
    let s = shard(&c, 0);
    s.next.store(0, Ordering::Relaxed);
    let (from, began) = (sim.log().len(), sim.elapsed());
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)]);
    let took = sim.elapsed() - began;
    assert!(took >= ms(100) && took < ms(110), "took {took:?}: the deadline_min, then the sibling");
    assert_eq!(per_replica(&sent(&sim, from, Op::Lookup), 2), [1, 1]);
    assert!(s.replicas[0].rotation.ejected.load(Ordering::Relaxed));
    assert_eq!(s.replicas[0].counters.deadlines_missed.load(Ordering::Relaxed), 1);
    let from = sim.log().len();
    for k in 0..10 {
        assert_eq!(run(&sim, &c, &[read(&c, 0, &[k], None)]).unwrap(), [Some(1)]);
    }
    assert_eq!(per_replica(&sent(&sim, from, Op::Lookup), 2), [0, 10], "the ejected replica waits for the prober");
}

#[test]
fn a_read_on_the_last_replica_it_can_go_to_waits_the_longer_deadline() {
    let sim = Sim::new(6);
    let c = connect(&sim, &groups(1, 2), options());
    warm(&sim, &c, 0);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.latency = (ms(300), ms(300)));
    // Its sibling is out: the slow replica is the only one left, and is waited for.
    c.eject(&sim, &s, 1, "test");
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(0)]);
    assert!(!s.replicas[0].rotation.ejected.load(Ordering::Relaxed));
    assert_eq!(s.replicas[0].counters.deadlines_missed.load(Ordering::Relaxed), 0);
    // With its sibling back, the slow replica misses its deadline and the sibling answers.
    s.replicas[1].rotation.ejected.store(false, Ordering::Relaxed);
    s.next.store(0, Ordering::Relaxed);
    let began = sim.elapsed();
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)]);
    assert!(sim.elapsed() - began < ms(110), "{:?}", sim.elapsed() - began);
    assert!(s.replicas[0].rotation.ejected.load(Ordering::Relaxed));
}

#[test]
fn a_slow_read_is_copied_to_a_sibling_after_the_hedging_delay_and_the_first_answer_wins() {
    let sim = Sim::new(7);
    let c = connect(&sim, &groups(1, 2), ClientOptions::default());
    warm(&sim, &c, 0);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.latency = (ms(50), ms(50)));
    s.next.store(0, Ordering::Relaxed);
    let (from, began) = (sim.log().len(), sim.elapsed());
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)], "the copy answers first");
    let reads = sent(&sim, from, Op::Lookup);
    assert_eq!(reads.iter().map(|q| (q.addr.clone(), q.at - began)).collect::<Vec<_>>().len(), 2);
    assert_eq!((reads[0].addr.as_str(), reads[1].addr.as_str()), (addr(0, 0).as_str(), addr(0, 1).as_str()));
    assert_eq!(reads[1].at - reads[0].at, ms(20), "the delay of a group with too few latencies measured");
    assert_eq!(s.replicas[1].counters.hedges_sent.load(Ordering::Relaxed), 1);
    assert_eq!(s.replicas[1].counters.hedges_won.load(Ordering::Relaxed), 1);
    // The slow copy drains, and its answer in time keeps its replica in the rotation.
    sim.advance(ms(100));
    sim.set(&addr(0, 0), |b| b.latency = (ms(1), ms(1)));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[2], None)]).unwrap(), [Some(0)]);
    assert!(!s.replicas[0].rotation.ejected.load(Ordering::Relaxed));

    // A copy lost to a hedge on a replica that then stops: its deadline passes, and the
    // replica is ejected when next chosen; the read goes to its sibling.
    sim.set(&addr(0, 0), |b| b.latency = (ms(50), ms(50)));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[3], None)]).unwrap(), [Some(1)]);
    sim.set(&addr(0, 0), |b| b.silent = true);
    sim.advance(ms(200));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[4], None)]).unwrap(), [Some(1)]);
    assert!(s.replicas[0].rotation.ejected.load(Ordering::Relaxed));
    assert!(s.replicas[0].rotation.why.lock().contains("did not answer a request within"));
}

#[test]
fn a_read_is_hedged_once_and_only_to_a_replica_serving_the_checkpoint_asked_for() {
    let sim = Sim::new(8);
    let c = connect(&sim, &groups(1, 4), ClientOptions::default());
    warm(&sim, &c, 0);
    let s = shard(&c, 0);
    for r in 0..4 {
        sim.set(&addr(0, r), |b| {
            b.latency = (ms(50), ms(50));
            b.served = Some(if r == 1 { 1 } else { 2 });
        });
        *s.replicas[r].served.lock() = sim.behaviour(&addr(0, r)).served;
    }
    s.next.store(0, Ordering::Relaxed);
    let from = sim.log().len();
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], Some(2))]).unwrap(), [Some(0)], "the first copy answers first");
    let reads = sent(&sim, from, Op::Lookup);
    // Replica 1 is behind, replica 3 not asked: one copy, to replica 2.
    assert_eq!(reads.iter().map(|q| q.addr.clone()).collect::<Vec<_>>(), [addr(0, 0), addr(0, 2)]);
}

#[test]
fn a_refused_connection_ejects_the_replica_and_a_write_to_it_fails() {
    let sim = Sim::new(9);
    let c = connect(&sim, &groups(1, 2), options());
    warm(&sim, &c, 0);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.down = true);
    s.next.store(0, Ordering::Relaxed);
    let began = sim.elapsed();
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)]);
    assert!(sim.elapsed() - began < ms(5), "a refused connection costs no wait");
    assert!(s.replicas[0].rotation.why.lock().contains("unreachable"));
    let e = run(&sim, &c, &[keyed(&c, 0, Op::Push, &[], &[1], None)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("shard 0 replica 0"), "{e}");
}

#[test]
fn an_unavailable_replica_passes_a_read_on_and_an_exact_read_skips_one_without_the_checkpoint() {
    let sim = Sim::new(10);
    let c = connect(&sim, &groups(1, 3), options());
    warm(&sim, &c, 0);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.unavailable = true);
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)]);
    assert!(s.replicas[0].rotation.ejected.load(Ordering::Relaxed), "copying a checkpoint: out until current");

    sim.set(&addr(0, 0), |b| b.unavailable = false);
    s.replicas[0].rotation.ejected.store(false, Ordering::Relaxed);
    for (r, served, keeps) in [(0, 5, 0), (1, 6, 0), (2, 5, 1)] {
        sim.set(&addr(0, r), |b| (b.served, b.keeps) = (Some(served), keeps));
        *s.replicas[r].served.lock() = Some(served);
    }
    s.next.store(1, Ordering::Relaxed);
    let from = sim.log().len();
    let exact = |at: u64| keyed(&c, 0, Op::LookupAt, &[at], &[1], Some(at));
    assert_eq!(run(&sim, &c, &[exact(5)]).unwrap(), [Some(2)]);
    let reads = sent(&sim, from, Op::LookupAt);
    assert_eq!(reads[0].addr, addr(0, 1), "the rotation's first, which no longer holds 5");
    assert!(!s.replicas[1].rotation.ejected.load(Ordering::Relaxed), "not holding a checkpoint is no failure");
    let e = run(&sim, &c, &[exact(3)]).unwrap_err();
    assert!(e.to_string().contains("not held"), "{e}");
}

#[test]
fn a_write_that_misses_its_deadline_fails_the_call_and_is_not_sent_again() {
    let sim = Sim::new(11);
    let c = connect(&sim, &groups(1, 2), options());
    run(&sim, &c, &[keyed(&c, 0, Op::Push, &[], &[1], None)]).unwrap();
    sim.set(&addr(0, 0), |b| b.silent = true);
    let (from, began) = (sim.log().len(), sim.elapsed());
    let e = run(&sim, &c, &[keyed(&c, 0, Op::Push, &[], &[1], None)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("may or may not have been applied"), "{e}");
    assert_eq!(sim.elapsed() - began, ms(5000), "deadline_alone_min");
    assert_eq!(sent(&sim, from, Op::Push).len(), 1);
}
