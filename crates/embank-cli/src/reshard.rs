//! `embank reshard`: a coordinated checkpoint of N closed shard stores turned into M
//! stores, streaming, rows with their optimizer state, so training resumes exactly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use embank_core::catalog::TableMeta;
use embank_core::{CheckpointInfo, Store, StoreOptions, TableOptions};
use embank_net::proto::shard_of;
use indicatif::ProgressBar;

use crate::tools::{human_bytes, progress};

/// Keys per chunk of the export by default: a chunk of dim-128 Adagrad records is 64 MiB.
pub const CHUNK_KEYS_DEFAULT: u64 = 65_536;
/// Most keys per chunk: bounds what a chunk holds in memory.
pub const CHUNK_KEYS_MAX: u64 = 1 << 22;

#[derive(clap::Args, Debug)]
#[command(after_help = "Turns a checkpoint of N shard stores into M stores, for a cluster that changes its shard \
    count (TorchRec's answer to this is to reshard yourself; this is the offline way, for training clusters).\n\n\
    OFFLINE: every store must be closed (stop `embank serve` and the trainers first); a store open elsewhere is \
    refused by its lock. The sources are only read: nothing in them changes.\n\n\
    CHECKPOINT: by default the newest checkpoint that every source retains; --checkpoint BATCH_ID names one \
    (it must be retained by every source: `embank inspect` or store.checkpoints() lists them). The rows are \
    taken as they were at that checkpoint, also when training went on after it (the undo journals give the \
    older records). The checkpoint's metadata (a trainer's position) must be the same on every source; it is \
    kept.\n\n\
    ROUTING: each key goes to target embank_net::proto::shard_of(key, M), the jump consistent hash that \
    clients and publishers route by: list the targets in the order clients will list the new shards (the \
    i-th --to is shard i). The sources may be listed in any order.\n\n\
    WHAT MOVES: every table, created on each target with the same options (dim, dtype, initializer and seed, \
    optimizer with its learning rate as last set, medium, placement, growth, staleness bound, lifecycle), \
    then every row with its optimizer state; then each target takes a checkpoint with the same batch id and \
    metadata, so `store.restore(batch)` and a trainer's resume find it. What is not kept, as on any reopen: \
    the lifecycle's in-memory activity (each row counts as touched once at the reopen) and admission \
    candidates; older checkpoints (a target retains only this one).\n\n\
    TARGETS: must not exist or be empty directories (created). If the reshard fails they are emptied again.\n\n\
    Example, 2 shards to 3:\n  embank reshard --from /data/s0 /data/s1 --to /data/n0 /data/n1 /data/n2")]
pub struct ReshardArgs {
    /// Source shard stores (closed), the N stores of one cluster.
    #[arg(long, num_args = 1.., required = true, value_name = "DIR")]
    pub from: Vec<PathBuf>,
    /// Target stores, in shard order (the i-th is shard i of M): absent or empty directories.
    #[arg(long, num_args = 1.., required = true, value_name = "DIR")]
    pub to: Vec<PathBuf>,
    /// The checkpoint to reshard (default: the newest one every source retains).
    #[arg(long, value_name = "BATCH_ID")]
    pub checkpoint: Option<u64>,
    /// Keys per chunk streamed from a source (memory: one chunk of records at a time).
    #[arg(long, default_value_t = CHUNK_KEYS_DEFAULT, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=CHUNK_KEYS_MAX))]
    pub chunk_keys: u64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// What a reshard did.
#[derive(Clone, Debug, PartialEq)]
pub struct ReshardReport {
    pub batch_id: u64,
    pub tables: usize,
    pub rows: u64,
    /// Bytes of records read from the sources (rows and optimizer state, as stored).
    pub bytes_read: u64,
    /// Bytes the targets occupy on disk once written (index and records).
    pub bytes_written: u64,
    pub seconds: f64,
}

pub fn run(args: ReshardArgs) -> Result<(), String> {
    let r = reshard(&args)?;
    eprintln!(
        "resharded {} -> {} stores at checkpoint {}: {} tables, {} rows, {} read, {} written, {:.2} s",
        args.from.len(),
        args.to.len(),
        r.batch_id,
        r.tables,
        r.rows,
        human_bytes(r.bytes_read),
        human_bytes(r.bytes_written),
        r.seconds
    );
    Ok(())
}

/// Checks the arguments, then reshards; on a failure after the targets were created,
/// empties them again.
pub fn reshard(args: &ReshardArgs) -> Result<ReshardReport, String> {
    let t0 = Instant::now();
    check_targets(&args.from, &args.to)?;
    let sources = open_sources(&args.from)?;
    let (batch_id, meta) = pick_checkpoint(&args.from, &sources, args.checkpoint)?;
    let shards = u32::try_from(args.to.len()).map_err(|_| "too many targets".to_owned())?;
    let tables = table_options(&args.from, &sources, shards)?;
    let created: Vec<bool> = args.to.iter().map(|p| !p.exists()).collect();
    let result = write_targets(args, &sources, batch_id, &meta, &tables);
    for s in &sources {
        let _ = s.close();
    }
    match result {
        Ok((rows, bytes_read, bytes_written)) => Ok(ReshardReport {
            batch_id,
            tables: tables.len(),
            rows,
            bytes_read,
            bytes_written,
            seconds: t0.elapsed().as_secs_f64(),
        }),
        Err(e) => {
            for (dir, &was_absent) in args.to.iter().zip(&created) {
                empty_again(dir, was_absent);
            }
            Err(format!("{e} (the targets were emptied again; the sources are unchanged)"))
        }
    }
}

/// Every target absent or an empty directory, none of them a source or named twice.
fn check_targets(from: &[PathBuf], to: &[PathBuf]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for p in from.iter().chain(to) {
        let id = p.canonicalize().unwrap_or_else(|_| p.clone());
        if !seen.insert(id) {
            return Err(format!("{} is named twice (sources and targets must be distinct stores)", p.display()));
        }
    }
    for p in to {
        if !p.exists() {
            continue;
        }
        let mut entries = std::fs::read_dir(p)
            .map_err(|e| format!("target {}: {e} (a target must not exist or be an empty directory)", p.display()))?;
        if entries.next().is_some() {
            return Err(format!(
                "target {} is not empty: a target must not exist or be an empty directory (nothing was written)",
                p.display()
            ));
        }
    }
    Ok(())
}

fn open_sources(from: &[PathBuf]) -> Result<Vec<Store>, String> {
    let options = StoreOptions { create: false, cache_bytes: 0, ..Default::default() };
    from.iter()
        .map(|p| {
            Store::open(p, options.clone()).map_err(|e| {
                format!("source {}: {e} (reshard is offline: stop every server and trainer using it)", p.display())
            })
        })
        .collect()
}

/// The checkpoint to reshard and its metadata, the same on every source.
fn pick_checkpoint(from: &[PathBuf], sources: &[Store], asked: Option<u64>) -> Result<(u64, Vec<u8>), String> {
    let kept: Vec<Vec<CheckpointInfo>> =
        sources.iter().map(|s| s.checkpoints().map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let retained_by_all = |b: u64| kept.iter().all(|k| k.iter().any(|c| c.batch_id == b));
    let batch = match asked {
        Some(b) => b,
        None => kept[0].iter().rev().map(|c| c.batch_id).find(|&b| retained_by_all(b)).unwrap_or(u64::MAX),
    };
    if batch == u64::MAX || !retained_by_all(batch) {
        let listing: Vec<String> = from
            .iter()
            .zip(&kept)
            .map(|(p, k)| format!("{} retains {:?}", p.display(), k.iter().map(|c| c.batch_id).collect::<Vec<_>>()))
            .collect();
        let what = match asked {
            Some(b) => format!("checkpoint {b} is not retained by every source"),
            None => "no checkpoint is retained by every source".to_owned(),
        };
        return Err(format!("{what}: {}", listing.join("; ")));
    }
    let metas: Vec<&[u8]> =
        kept.iter().map(|k| k.iter().find(|c| c.batch_id == batch).map_or(&[][..], |c| &c.meta[..])).collect();
    if let Some(i) = metas.iter().position(|m| *m != metas[0]) {
        return Err(format!(
            "the metadata of checkpoint {batch} differs between {} ({} bytes) and {} ({} bytes): the sources are \
             not shards of one coordinated checkpoint",
            from[0].display(),
            metas[0].len(),
            from[i].display(),
            metas[i].len()
        ));
    }
    Ok((batch, metas[0].to_vec()))
}

/// Each table's options for the targets: the same on every source (the catalog's entry
/// but its id, index generation and growth count), the capacity for one of `shards`
/// targets' share.
fn table_options(
    from: &[PathBuf],
    sources: &[Store],
    shards: u32,
) -> Result<BTreeMap<String, TableOptions>, String> {
    let mut out = BTreeMap::new();
    let names = sources[0].tables().map_err(|e| e.to_string())?;
    for (p, s) in from.iter().zip(sources).skip(1) {
        let theirs = s.tables().map_err(|e| e.to_string())?;
        if theirs != names {
            return Err(format!(
                "the sources hold different tables: {} has {names:?}, {} has {theirs:?}",
                from[0].display(),
                p.display()
            ));
        }
    }
    for name in names {
        let mut metas = Vec::new();
        let (mut capacity, mut rows) = (0u64, 0u64);
        for s in sources {
            let t = s.table(&name).map_err(|e| e.to_string())?;
            let stats = t.stats().map_err(|e| e.to_string())?;
            capacity = capacity.max(stats.capacity);
            rows += stats.rows;
            metas.push(t.meta());
        }
        for (i, m) in metas.iter().enumerate().skip(1) {
            if let Some(field) = differing_field(&metas[0], m) {
                return Err(format!(
                    "table {name:?}: its {field} differs between {} ({}) and {} ({})",
                    from[0].display(),
                    field_value(&metas[0], &field),
                    from[i].display(),
                    field_value(m, &field)
                ));
            }
        }
        let m = &metas[0];
        // A target's share of the rows (those now: at the checkpoint there may be fewer),
        // with room to spare, and never less than a source's capacity.
        let share = rows.div_ceil(u64::from(shards.max(1)));
        let options = TableOptions {
            dim: m.dim,
            dtype: m.dtype,
            init: m.init,
            seed: m.seed,
            capacity: capacity.max(share + share / 4),
            growth: m.growth,
            load_factor_max: m.load_factor_max,
            missing: m.missing,
            medium: m.medium,
            placement: m.placement,
            optimizer: m.optimizer,
            staleness_bound: m.staleness_bound,
            lease_seconds: m.lease_seconds,
            lifecycle: m.lifecycle.clone(),
        };
        out.insert(name, options);
    }
    Ok(out)
}

/// The catalog entry as JSON, less what is each store's own (id, index generation, growths).
fn comparable(m: &TableMeta) -> serde_json::Map<String, serde_json::Value> {
    let mut v = match serde_json::to_value(m) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    for own in ["id", "index_generation", "grow_count"] {
        v.remove(own);
    }
    v
}

fn differing_field(a: &TableMeta, b: &TableMeta) -> Option<String> {
    let (a, b) = (comparable(a), comparable(b));
    a.iter().find(|(k, v)| b.get(*k) != Some(*v)).map(|(k, _)| k.clone())
}

fn field_value(m: &TableMeta, field: &str) -> String {
    comparable(m).get(field).map_or_else(String::new, |v| v.to_string())
}

/// Creates the targets, streams every table, checkpoints and closes them; returns rows,
/// bytes read and bytes written.
fn write_targets(
    args: &ReshardArgs,
    sources: &[Store],
    batch_id: u64,
    meta: &[u8],
    tables: &BTreeMap<String, TableOptions>,
) -> Result<(u64, u64, u64), String> {
    let shards = u32::try_from(args.to.len()).map_err(|_| "too many targets".to_owned())?;
    let targets: Vec<Store> = args
        .to
        .iter()
        .map(|p| {
            Store::open(p, StoreOptions { cache_bytes: 0, ..Default::default() })
                .map_err(|e| format!("target {}: {e}", p.display()))
        })
        .collect::<Result<_, _>>()?;
    let mut total_rows = 0u64;
    for s in sources {
        for name in tables.keys() {
            total_rows += s.table(name).and_then(|t| t.len()).map_err(|e| e.to_string())?;
        }
    }
    let bar = if args.quiet { ProgressBar::hidden() } else { progress(total_rows, "reshard") };
    let (mut rows, mut bytes_read) = (0u64, 0u64);
    let chunk_keys = args.chunk_keys as usize;
    for (name, options) in tables {
        let outs: Vec<_> = targets
            .iter()
            .map(|t| t.create_table(name, options.clone()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("creating table {name:?}: {e}"))?;
        let record_bytes = sources[0].table(name).map_err(|e| e.to_string())?.stats().map_err(|e| e.to_string())?;
        let record_bytes = record_bytes.record_bytes;
        let w = options.dim as usize + outs[0].state_len();
        let mut table_rows = 0u64;
        let (mut keys_of, mut records_of): (Vec<Vec<u64>>, Vec<Vec<f32>>) =
            (vec![Vec::new(); outs.len()], vec![Vec::new(); outs.len()]);
        for (p, s) in args.from.iter().zip(sources) {
            s.export_checkpoint_with_state(name, batch_id, chunk_keys, |keys, records| {
                for (i, &key) in keys.iter().enumerate() {
                    let to = shard_of(key, shards) as usize;
                    keys_of[to].push(key);
                    records_of[to].extend_from_slice(&records[i * w..(i + 1) * w]);
                }
                for (t, (k, r)) in outs.iter().zip(keys_of.iter_mut().zip(records_of.iter_mut())) {
                    if !k.is_empty() {
                        t.push_with_state(k, r)?;
                        k.clear();
                        r.clear();
                    }
                }
                table_rows += keys.len() as u64;
                bar.inc(keys.len() as u64);
                Ok(())
            })
            .map_err(|e| format!("table {name:?} from {}: {e}", p.display()))?;
        }
        let written: u64 = outs.iter().map(|t| t.len()).sum::<embank_core::Result<u64>>().map_err(|e| e.to_string())?;
        if written != table_rows {
            return Err(format!(
                "table {name:?}: {table_rows} rows read but the targets hold {written}: a key is on two sources \
                 (they are not shards of one cluster), or the table's rows_max evicted rows on a target"
            ));
        }
        rows += table_rows;
        bytes_read += table_rows * record_bytes;
    }
    bar.finish_and_clear();
    for (p, t) in args.to.iter().zip(&targets) {
        t.checkpoint_with_meta(batch_id, meta).map_err(|e| format!("checkpoint of target {}: {e}", p.display()))?;
    }
    let mut bytes_written = 0;
    for (p, t) in args.to.iter().zip(&targets) {
        t.flush().map_err(|e| format!("target {}: {e}", p.display()))?;
        bytes_written += t.stats().map_err(|e| e.to_string())?.bytes_on_disk;
        t.close().map_err(|e| format!("target {}: {e}", p.display()))?;
    }
    Ok((rows, bytes_read, bytes_written))
}

/// Leaves `dir` as the reshard found it: absent, or an empty directory.
fn empty_again(dir: &Path, was_absent: bool) {
    if was_absent {
        let _ = std::fs::remove_dir_all(dir);
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }
}
