//! Corner cases the seeded random runs over the simulated network found (`model`), each as
//! the shortest run that shows it.

use std::sync::atomic::Ordering;

use super::super::transport::Transport;
use super::*;

fn ejected(s: &Shard, r: usize) -> bool {
    s.replicas[r].rotation.ejected.load(Ordering::Relaxed)
}

/// Reads every replica of shard 0 once (their table ids known, a connection pooled each).
fn warm(sim: &Sim, client: &Client) {
    for _ in 0..shard(client, 0).replicas.len() {
        run(sim, client, &[read(client, 0, &[0], None)]).expect("a healthy group answers");
    }
}

#[test]
fn a_read_whose_known_replicas_refuse_asks_those_passed_over_as_behind() {
    let sim = Sim::new(41);
    for r in 0..2 {
        sim.set(&addr(0, r), |b| b.served = Some(5));
    }
    let c = connect(&sim, &groups(1, 2), options());
    warm(&sim, &c);
    let s = shard(&c, 0);
    // The client last heard replica 1 serve 3: it is passed over for a read of 5 while
    // replica 0 is known to serve it. Replica 0 is gone.
    *s.replicas[0].served.lock() = Some(5);
    *s.replicas[1].served.lock() = Some(3);
    sim.set(&addr(0, 0), |b| b.down = true);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], Some(5))]).unwrap(), [Some(1)]);
}

#[test]
fn a_write_goes_to_a_primary_that_let_a_lost_hedge_pass_its_deadline() {
    let sim = Sim::new(42);
    let c = connect(&sim, &groups(1, 2), ClientOptions::default());
    warm(&sim, &c);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.latency = (ms(150), ms(150)));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)], "the hedge wins");
    // The primary's copy is past its 100 ms deadline, not yet answered.
    sim.advance(ms(100));
    run(&sim, &c, &[keyed(&c, 0, Op::Push, &[], &[1], None)]).expect("the write waits for the primary");
    assert!(ejected(&s, 0), "reads still leave the slow primary to its siblings");
}

#[test]
fn a_replica_restarted_after_losing_a_hedge_takes_the_next_read() {
    let sim = Sim::new(43);
    let c = connect(&sim, &groups(1, 2), ClientOptions::default());
    warm(&sim, &c);
    let s = shard(&c, 0);
    sim.set(&addr(0, 0), |b| b.latency = (ms(50), ms(50)));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap(), [Some(1)], "the hedge wins");
    sim.set(&addr(0, 0), |b| b.down = true);
    sim.set(&addr(0, 0), |b| (b.down, b.latency) = (false, (ms(1), ms(1))));
    s.next.store(0, Ordering::Relaxed);
    assert_eq!(run(&sim, &c, &[read(&c, 0, &[2], None)]).unwrap(), [Some(0)]);
    assert!(!ejected(&s, 0), "a connection its server closed says nothing of the server now");
}

#[test]
fn a_reply_that_came_while_the_call_connected_elsewhere_is_in_time() {
    let sim = Sim::new(44);
    let c = connect(&sim, &groups(1, 3), ClientOptions { in_flight_per_shard: 2, ..options() });
    warm(&sim, &c);
    let s = shard(&c, 0);
    // Replica 2 stops, its connections gone: the call's third request, sent when the
    // first is answered, waits its deadline for a hello while the second's reply comes.
    sim.set(&addr(0, 0), |b| b.latency = (ms(1), ms(1)));
    sim.set(&addr(0, 1), |b| b.latency = (ms(2), ms(2)));
    sim.set(&addr(0, 2), |b| b.silent = true);
    sim.clear_pool(&s, 2);
    s.next.store(0, Ordering::Relaxed);
    let reqs: Vec<Req> = (1..4).map(|k| read(&c, 0, &[k], None)).collect();
    let by = run(&sim, &c, &reqs).unwrap();
    assert_eq!(by[..2], [Some(0), Some(1)], "{by:?}");
    assert!(!ejected(&s, 1), "replica 1 answered in 2 ms");
    assert!(ejected(&s, 2));
}
