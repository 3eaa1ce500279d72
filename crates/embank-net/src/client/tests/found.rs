//! Corner cases the seeded random runs over the simulated network found (`model`), each as
//! the shortest run that shows it.

use super::*;

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
