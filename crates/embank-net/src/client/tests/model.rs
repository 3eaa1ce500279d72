//! Seeded random runs: calls (reads with and without a checkpoint asked for, exact
//! reads, writes) over replicas whose behaviour changes at random between them, with
//! the prober's rounds, time passing and map switches (between calls and within one),
//! each call checked against what must hold whatever happens:
//!
//! - every key goes to the shard the map in force when its call began says, and to a
//!   replica of that shard's group; a write to its primary;
//! - a read asking for a checkpoint never goes to a replica serving an older one;
//! - a read goes to a replica out of the rotation only after every replica in the
//!   rotation that the client knew to serve what it asks had it;
//! - a request is answered at most once, and every one when the call succeeds;
//! - a call succeeds when each of its shards has a replica that answers in time and
//!   serves what it asks.
//!
//! `EMBANK_SIM_SEED=n` runs seed n alone.

use super::super::health::ProbeRounds;
use super::super::sim::Behaviour;
use super::super::transport::Transport;
use super::*;

const SEEDS: u64 = 200;
const STEPS: usize = 150;
/// The longest a replica takes to answer (see [`change`]).
const SLOWEST: Duration = Duration::from_millis(400);

/// What a call asks of a replica.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Read(Option<u64>),
    Exact(u64),
    Write,
}

/// Whether a replica behaving as `b` serves a request of `kind` in time. A request's
/// deadline counts from before its connection is taken, and a first request to a
/// replica opens the table there: two round trips must fit in the deadline's floor.
fn good(b: &Behaviour, kind: Kind) -> bool {
    let answers = !b.down && !b.silent;
    let in_time = |floor: Duration| b.latency.1 * 2 < floor;
    match kind {
        Kind::Read(min) => {
            answers && !b.unavailable && in_time(ms(100)) && min.is_none_or(|m| b.served.is_some_and(|s| s >= m))
        }
        Kind::Exact(at) => {
            answers && !b.unavailable && in_time(ms(100)) && b.served.is_some_and(|s| at <= s && at + b.keeps >= s)
        }
        Kind::Write => answers && in_time(ms(5000)),
    }
}

/// A random change to one replica's behaviour.
fn change(sim: &Sim, addr: &str, published: u64) {
    let roll = sim.next_u64() % 100;
    let pick = sim.next_u64();
    sim.set(addr, |b| match roll {
        0..=14 => b.down = !b.down,
        15..=29 => b.silent = !b.silent,
        30..=59 => {
            b.latency = match pick % 3 {
                0 => (ms(1), ms(3)),
                1 => (ms(20), ms(60)),
                _ => (ms(150), SLOWEST),
            }
        }
        60..=69 => b.unavailable = !b.unavailable,
        70..=89 => b.served = Some(published),
        _ => b.keeps = pick % 3,
    });
}

#[test]
fn random_runs_keep_the_routing_invariants() {
    let seeds: Vec<u64> = match std::env::var("EMBANK_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("EMBANK_SIM_SEED is a number")],
        Err(_) => (0..SEEDS).collect(),
    };
    for seed in seeds {
        run_seed(seed);
    }
}

fn run_seed(seed: u64) {
    let sim = Sim::new(seed);
    // Groups of 2 replicas and of 3, by seed.
    let replicas = 2 + (seed % 2) as usize;
    let maps = [groups(2, replicas), groups(3, replicas)];
    let all: Vec<String> = maps[1].iter().flatten().cloned().collect();
    let mut published = 3;
    for a in &all {
        sim.set(a, |b| b.served = Some(published));
    }
    let hedging = sim.next_u64().is_multiple_of(2);
    let opts = ClientOptions {
        keys_per_request_max: 8,
        in_flight_per_shard: 2,
        hedge_delay: if hedging { None } else { Some(Duration::ZERO) },
        ..ClientOptions::default()
    };
    let c = connect(&sim, &maps[0], opts);
    c.set_version(1);
    let t = table(&c);
    let mut rounds = ProbeRounds::new(sim.now());
    let mut calls = 0u64;
    for step in 0..STEPS {
        let at = format!("seed {seed} step {step} (EMBANK_SIM_SEED={seed} replays it)");
        let roll = sim.next_u64() % 100;
        match roll {
            0..=24 => change(&sim, &all[sim.next_u64() as usize % all.len()], published),
            25..=31 => {
                published += 1;
                for a in &all {
                    if !sim.next_u64().is_multiple_of(3) {
                        sim.set(a, |b| b.served = Some(published));
                    }
                }
            }
            32..=41 => rounds.run(&c, &sim, sim.next_u64().is_multiple_of(2)),
            42..=47 => sim.advance(ms(sim.next_u64() % 2000)),
            48..=51 => {
                let next = &maps[sim.next_u64() as usize % 2];
                let _ = c.switch_map(&sim, &map(c.map_version() + 1, next), "the test");
            }
            _ => {
                calls += 1;
                call(&sim, &c, &t, &maps, published, calls, &at);
            }
        }
    }
}

/// One call of a random kind, checked.
fn call(sim: &Sim, c: &Client, t: &RemoteTable, maps: &[Vec<Vec<String>>; 2], published: u64, mark: u64, at: &str) {
    let groups = c.groups();
    let first = sim.next_u64() % 1_000_000 * 1000;
    let keys: Vec<u64> = (first..first + 1 + sim.next_u64() % 40).collect();
    let (op, kind, mut plan) = match sim.next_u64() % 10 {
        0..=4 => {
            let min = match sim.next_u64() % 4 {
                0 => None,
                n => Some(published + 1 - n),
            };
            (Op::Lookup, Kind::Read(min), t.plan(Op::Lookup, &keys, None))
        }
        5..=6 => {
            let b = published - sim.next_u64() % 3;
            (Op::LookupAt, Kind::Exact(b), t.plan_with(Op::LookupAt, &[b], &keys, None))
        }
        _ => {
            let rows = vec![0f32; keys.len() * 4];
            (Op::Push, Kind::Write, t.plan(Op::Push, &keys, Some(&rows)))
        }
    };
    let min = match kind {
        Kind::Read(min) => min,
        Kind::Exact(b) => Some(b),
        Kind::Write => None,
    };
    plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min);
    // Whether each shard the call reaches has a replica that serves it in time, and has
    // for longer than the slowest answer takes (a replica may be ejected for what it did
    // before).
    let servable = plan.reqs.iter().all(|r| {
        let group = &groups[r.shard.index];
        let replicas = if matches!(kind, Kind::Write) { &group[..1] } else { &group[..] };
        replicas.iter().any(|a| good(&sim.behaviour(a), kind) && sim.unchanged_for(a) > SLOWEST)
    });
    let mut switch_within = sim.next_u64().is_multiple_of(10);
    let next = maps[sim.next_u64() as usize % 2].clone();
    sim.mark(mark);
    let from = sim.log().len();
    let mut answers = vec![0; plan.reqs.len()];
    let result = c.run_over(sim, &plan.reqs, |i, _, _, _| {
        answers[i] += 1;
        if std::mem::take(&mut switch_within) {
            // The map's watcher switches while the call runs.
            let _ = sim.aside(|| c.switch_map(sim, &map(c.map_version() + 1, &next), "the test"));
        }
        Ok(())
    });
    let what = format!("{at}: {op:?} of {} keys ({kind:?}, {} requests)", keys.len(), plan.reqs.len());
    let behaviours = || groups.iter().flatten().map(|a| format!("\n  {a}: {:?}", sim.behaviour(a))).collect::<String>();
    let requests: Vec<Request> = sent(sim, from, op).into_iter().filter(|q| q.mark == mark).collect();
    let trace = || {
        sim.log()[from..]
            .iter()
            .map(|q| {
                format!(
                    "\n  {:?} {:?} {:?} to {} (shard {}), ejected {}, group {:?}",
                    q.at,
                    q.op,
                    q.keys.first(),
                    q.addr,
                    q.shard,
                    q.ejected,
                    q.group
                )
            })
            .collect::<String>()
    };
    match &result {
        Ok(()) => assert!(answers.iter().all(|&n| n == 1), "{what}: answers per request {answers:?}"),
        Err(e) => {
            assert!(answers.iter().all(|&n| n <= 1), "{what}: answers per request {answers:?}");
            assert!(
                !servable,
                "{what} failed though every shard had a replica to serve it: {e}\nreplicas:{}\nrequests:{}",
                behaviours(),
                trace()
            );
        }
    }
    routed_by(&requests, &groups, &what);
    for (n, q) in requests.iter().enumerate() {
        match kind {
            Kind::Write => assert_eq!(q.addr, groups[q.shard][0], "{what}: a write went to a replica not the primary"),
            Kind::Read(Some(m)) => {
                assert!(q.served >= Some(m), "{what}: a read of {m} or later went to {} serving {:?}", q.addr, q.served)
            }
            _ => {}
        }
        if q.ejected && !matches!(kind, Kind::Write) {
            // Every sibling in the rotation known to serve what it asks had it before.
            let had: Vec<&str> = requests[..n].iter().filter(|p| p.keys == q.keys).map(|p| p.addr.as_str()).collect();
            for (sibling, in_rotation, served) in &q.group {
                let serves = min.is_none_or(|m| served.is_some_and(|s| s >= m));
                assert!(
                    !in_rotation || !serves || sibling == &q.addr || had.contains(&sibling.as_str()),
                    "{what}: a read went to {}, out of the rotation, before {sibling}, in it (it had: {had:?})\nrequests:{}",
                    q.addr,
                    trace()
                );
            }
        }
    }
}
