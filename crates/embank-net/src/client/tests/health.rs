//! Ejection and the prober's rounds: who is readmitted, who is taken out.

use std::sync::atomic::Ordering;

use super::super::health::ProbeRounds;
use super::super::transport::Transport;
use super::*;

fn ejected(s: &Shard, r: usize) -> bool {
    s.replicas[r].rotation.ejected.load(Ordering::Relaxed)
}

#[test]
fn the_prober_readmits_an_ejected_replica_once_it_answers_and_is_current() {
    let sim = Sim::new(21);
    for r in 0..2 {
        sim.set(&addr(0, r), |b| b.served = Some(5));
    }
    let c = connect(&sim, &groups(1, 2), options());
    let s = shard(&c, 0);
    let mut rounds = ProbeRounds::new(sim.now());
    sim.set(&addr(0, 0), |b| b.silent = true);
    c.eject(&sim, &s, 0, "test");
    sim.advance(ms(1000));
    rounds.run(&c, &sim, false);
    assert!(ejected(&s, 0), "a replica that does not answer stays out");
    assert_eq!(*s.replicas[1].served.lock(), Some(5), "the check asked the admitted replica");

    sim.set(&addr(0, 0), |b| (b.silent, b.served) = (false, Some(3)));
    rounds.run(&c, &sim, false);
    assert!(ejected(&s, 0), "a replica behind its group stays out");

    sim.set(&addr(0, 0), |b| b.served = Some(5));
    rounds.run(&c, &sim, false);
    assert!(!ejected(&s, 0), "answering and current: back in the rotation");
    assert_eq!(s.replicas[0].counters.readmissions.load(Ordering::Relaxed), 1);
    assert!(s.replicas[0].rotation.why.lock().is_empty());
    let from = sim.log().len();
    for k in 0..4 {
        run(&sim, &c, &[read(&c, 0, &[k], None)]).unwrap();
    }
    assert_eq!(sent(&sim, from, Op::Lookup).iter().filter(|q| q.addr == addr(0, 0)).count(), 2, "it takes reads again");
}

#[test]
fn the_prober_ejects_a_read_only_replica_behind_its_group_or_not_answering() {
    let sim = Sim::new(22);
    for r in 0..3 {
        sim.set(&addr(0, r), |b| b.served = Some(5));
    }
    let c = connect(&sim, &groups(1, 3), options());
    let s = shard(&c, 0);
    let mut rounds = ProbeRounds::new(sim.now());
    let mut check = |sim: &Sim| {
        sim.advance(ms(1000));
        rounds.run(&c, sim, false);
    };
    check(&sim);
    for r in 0..2 {
        sim.set(&addr(0, r), |b| b.served = Some(6));
    }
    check(&sim);
    assert!(!ejected(&s, 2), "behind its group by less than a check: a replica may be applying");
    check(&sim);
    assert!(ejected(&s, 2), "below what its group served a check before");
    assert!(s.replicas[2].rotation.why.lock().contains("serves checkpoint 5, behind its group's 6"));
    assert!(!ejected(&s, 0) && !ejected(&s, 1));

    sim.set(&addr(0, 1), |b| b.silent = true);
    let mut rounds = ProbeRounds::new(sim.now());
    rounds.run(&c, &sim, false);
    assert!(!ejected(&s, 1), "rounds between checks leave the admitted replicas alone");
    sim.advance(ms(1000));
    rounds.run(&c, &sim, false);
    assert!(ejected(&s, 1));
    assert!(s.replicas[1].rotation.why.lock().contains("did not answer the prober"));
}

#[test]
fn ejecting_a_replica_twice_counts_once_keeps_the_first_why_and_drops_its_connections() {
    let sim = Sim::new(23);
    let c = connect(&sim, &groups(1, 2), options());
    let s = shard(&c, 0);
    run(&sim, &c, &[read(&c, 0, &[1], None)]).unwrap();
    assert!(sim.has_pooled(&s, 0));
    c.eject(&sim, &s, 0, "first");
    c.eject(&sim, &s, 0, "second");
    assert_eq!(s.replicas[0].counters.ejections.load(Ordering::Relaxed), 1);
    assert_eq!(*s.replicas[0].rotation.why.lock(), "first", "why it left, not why it was found out again");
    assert!(!sim.has_pooled(&s, 0) && s.replicas[0].tables.lock().is_empty(), "its connections and table ids go");
}
