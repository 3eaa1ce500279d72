//! `embank map`: the shard map clients reload (a cluster file): show what its replicas
//! serve, and switch it to a new one once the new replicas have caught up.

use std::path::PathBuf;
use std::time::Duration;

use embank_net::client::{served_range, switch_when_serving};
use embank_net::{Client, MapSource};

#[derive(clap::Subcommand, Debug)]
pub enum MapCommand {
    /// Print the map's version, shards and what each replica serves.
    Show {
        /// The cluster file (or an http:// URL serving it).
        map: String,
    },
    /// Replace the map with NEXT (one version up) once every replica of NEXT serves a
    /// checkpoint at least as new as the newest the current map's replicas serve.
    #[command(after_help = "Grow or shrink a serving cluster while it serves:\n\
        - add a replica: start `embank serve` with `bootstrap = [\"sibling:7070\", ...]` in its [updates] \
          section (it copies a sibling's checkpoint, then follows the stream), then switch to a map that \
          lists it;\n\
        - remove a replica: switch to a map without it, wait for clients to reload (reload_seconds), then \
          stop it (SIGTERM drains it);\n\
        - reshard N -> M: publish the same checkpoints to a second topic with M partitions \
          (a second publisher beside the first), start M new replica groups on it, switch to the map of \
          the new groups, then retire the old ones.\n\n\
        Clients connected to the map file reload it every `reload_seconds` and switch between calls: no \
        call mixes two maps, and no read fails.\n\n\
        Example: embank map switch --map /etc/embank/cluster.toml --next cluster-3-shards.toml")]
    Switch {
        /// The cluster file clients reload.
        #[arg(long)]
        map: PathBuf,
        /// The map to switch to (its `version` is set to one above the current).
        #[arg(long)]
        next: PathBuf,
        /// Give up after this many seconds of waiting for the new replicas.
        #[arg(long, default_value_t = 600.0)]
        timeout_seconds: f64,
    },
}

pub fn run(cmd: MapCommand) -> Result<(), String> {
    match cmd {
        MapCommand::Show { map } => {
            let source = MapSource::parse(&map);
            let m = source.load().map_err(|e| e.to_string())?;
            let client = Client::connect_groups(&m.groups, m.settings().options().map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            println!("{}: version {}, {} shards", source.describe(), m.version, m.groups.len());
            for (s, shard) in client.served_all().iter().enumerate() {
                for v in shard {
                    let what = match v.get("error") {
                        Some(e) => format!("unreachable: {}", e.as_str().unwrap_or("")),
                        None => format!(
                            "serves {} ({})",
                            v["batch_id"].as_u64().map_or("no checkpoint".into(), |b| format!("checkpoint {b}")),
                            v["state"].as_str().unwrap_or("")
                        ),
                    };
                    println!("  shard {s}  {:<24} {what}", v["address"].as_str().unwrap_or(""));
                }
            }
            let (newest, oldest) = served_range(&client);
            println!(
                "newest served {}, slowest replica {}",
                newest.map_or("none".into(), |b| b.to_string()),
                oldest.map_or("none".into(), |b| b.to_string())
            );
            Ok(())
        }
        MapCommand::Switch { map, next, timeout_seconds } => {
            let timeout = Duration::from_secs_f64(timeout_seconds.max(0.0));
            let v = switch_when_serving(&map, &next, timeout, |line| eprintln!("embank map: {line}"))
                .map_err(|e| e.to_string())?;
            println!("switched {} to version {v}", map.display());
            Ok(())
        }
    }
}
