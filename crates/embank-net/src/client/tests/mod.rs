//! The client's decisions over the simulated network (`sim`): which replica takes a
//! request, deadlines, hedging, failover, ejection and readmission, and the map a call
//! routes by. No processes, no sockets, no sleeping; randomized runs are seeded and print
//! their seed on failure.

mod found;
mod health;
mod map;
mod model;
mod route;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use embank_core::TableMeta;
use embank_core::{Result, TableOptions};

use super::cluster::ClientConfig;
use super::map::ShardMap;
use super::pool::Shard;
use super::route::Req;
use super::sim::{Request, Sim};
use super::table::RemoteTable;
use super::{Client, ClientOptions};
use crate::proto::{shard_of, Header, Op};

/// Replica `r` of shard `s`'s address.
fn addr(s: usize, r: usize) -> String {
    format!("s{s}r{r}:7070")
}

/// `shards` groups of `replicas` each.
fn groups(shards: usize, replicas: usize) -> Vec<Vec<String>> {
    (0..shards).map(|s| (0..replicas).map(|r| addr(s, r)).collect()).collect()
}

/// The defaults, with hedging off unless a test turns it on.
fn options() -> ClientOptions {
    ClientOptions { hedge_delay: Some(Duration::ZERO), ..ClientOptions::default() }
}

fn connect(sim: &Sim, groups: &[Vec<String>], opts: ClientOptions) -> Client {
    Client::connect_over(sim, groups, opts).expect("every shard answers")
}

fn shard(client: &Client, s: usize) -> Arc<Shard> {
    Arc::clone(&client.topology().shards[s])
}

/// A table of dim 4 on `client` (its requests name it; the simulated replicas know it).
fn table(client: &Client) -> RemoteTable {
    let o = TableOptions { dim: 4, ..TableOptions::default() };
    let meta = TableMeta {
        id: 1,
        name: "t".into(),
        dim: o.dim,
        dtype: o.dtype,
        init: o.init,
        seed: o.seed,
        growth: o.growth,
        load_factor_max: o.load_factor_max,
        missing: o.missing,
        index_generation: 0,
        grow_count: 0,
        medium: o.medium,
        placement: o.placement,
        optimizer: o.optimizer,
        staleness_bound: o.staleness_bound,
        lease_seconds: o.lease_seconds,
        lifecycle: o.lifecycle,
        optimizer_step: 0,
    };
    RemoteTable { client: client.clone(), name: "t".into(), dim: 4, id: "t".into(), meta }
}

/// A read of `keys` on shard `s` of the client's map now.
fn read(client: &Client, s: usize, keys: &[u64], min_checkpoint: Option<u64>) -> Req {
    keyed(client, s, Op::Lookup, &[], keys, min_checkpoint)
}

fn keyed(client: &Client, s: usize, op: Op, prefix: &[u64], keys: &[u64], min_checkpoint: Option<u64>) -> Req {
    let body: Vec<u8> = prefix.iter().chain(keys).flat_map(|k| k.to_le_bytes()).collect();
    Req { shard: shard(client, s), op, table: Some("t".into()), count: keys.len() as u32, body, min_checkpoint }
}

/// Which replica answered each request of a call (`None`: not answered), or the call's error.
fn run(sim: &Sim, client: &Client, reqs: &[Req]) -> Result<Vec<Option<usize>>> {
    let mut by = vec![None; reqs.len()];
    client.run_over(sim, reqs, |i, r, _: &Header, _| {
        assert!(by[i].is_none(), "request {i} answered twice (by {:?} and {r})", by[i]);
        by[i] = Some(r);
        Ok(())
    })?;
    Ok(by)
}

/// The requests of `op` logged since `from`.
fn sent(sim: &Sim, from: usize, op: Op) -> Vec<Request> {
    sim.log().into_iter().skip(from).filter(|q| q.op == op).collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A shard map of `version` with these groups, as a cluster file gives it.
fn map(version: u64, groups: &[Vec<String>]) -> ShardMap {
    let shards: String =
        groups.iter().map(|g| format!("[[shards]]\nreplicas = {:?}\n", g)).collect::<Vec<_>>().join("");
    let text = format!("version = {version}\n{shards}");
    ShardMap::from_config(ClientConfig::from_text(&text, "test", Path::new(".")).unwrap()).unwrap()
}

/// Checks that every keyed request of `requests` went to the shard `groups` route its
/// keys to, and to a replica of that shard's group (`at` says where, for the message).
fn routed_by(requests: &[Request], groups: &[Vec<String>], at: &str) {
    for q in requests {
        assert!(groups[q.shard].contains(&q.addr), "{at}: {} is no replica of shard {} of {groups:?}", q.addr, q.shard);
        for &k in &q.keys {
            let want = shard_of(k, groups.len() as u32) as usize;
            assert_eq!(
                q.shard,
                want,
                "{at}: key {k} went to shard {}, a map of {} shards says {want}",
                q.shard,
                groups.len()
            );
        }
    }
}
