//! `embank inspect`, `embank export`, `embank import`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use embank_bench::progress;
use embank_core::{human_bytes, Initializer, NpyReader, NpyWriter, Store, StoreOptions, TableOptions};

fn open_existing(path: &Path) -> Result<Store, String> {
    Store::open(path, StoreOptions { create: false, ..Default::default() }).map_err(|e| e.to_string())
}

pub fn inspect(path: &Path, json: bool) -> Result<(), String> {
    let store = open_existing(path)?;
    let stats = store.stats().map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json_string(&stats));
        return Ok(());
    }
    println!(
        "store {}: {} tables, {} rows, {} on disk",
        stats.path,
        stats.tables.len(),
        stats.rows,
        human_bytes(stats.bytes_on_disk)
    );
    println!(
        "{:<20} {:>5} {:>12} {:>12} {:>6} {:>10} {:>10} {:>5}  probe lengths 0,1,2,..,7+",
        "table", "dim", "rows", "capacity", "load", "index", "rows file", "grown"
    );
    for t in &stats.tables {
        println!(
            "{:<20} {:>5} {:>12} {:>12} {:>5.1}% {:>10} {:>10} {:>5}  {:?}",
            t.name,
            t.dim,
            t.rows,
            t.capacity,
            t.load_factor * 100.0,
            human_bytes(t.index_bytes),
            human_bytes(t.rows_file_bytes),
            t.grow_count,
            t.probe_histogram
        );
        let direct = match t.direct_io {
            Some(true) => format!(", O_DIRECT aligned to {} B", t.io_align.unwrap_or(0)),
            Some(false) => ", page cache (file system refused O_DIRECT)".to_owned(),
            None => String::new(),
        };
        let engine =
            t.io.as_ref().map(|io| format!(", I/O engine {} (depth {})", io.engine, io.depth)).unwrap_or_default();
        println!("{:<20} dtype {}, medium {}, placement {}{direct}{engine}", "", t.dtype, t.medium, t.placement);
        if let Some(r) = &t.recovered {
            println!(
                "{:<20} repaired on open: {} interrupted buckets, {} slots dropped, {} free records found, {:.3}s",
                "", r.buckets_interrupted, r.slots_dropped, r.records_freed, r.seconds
            );
        }
    }
    if let Some(c) = &stats.cache {
        println!(
            "row cache: budget {}, {} shards (empty until rows are read: this is a fresh open)",
            human_bytes(c.budget_bytes),
            c.shards
        );
    }
    store.close().map_err(|e| e.to_string())
}

fn serde_json_string<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).expect("serializes")
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Store directory.
    pub path: PathBuf,
    /// Table to export.
    #[arg(long)]
    pub table: String,
    /// Directory the .npy files go to (created if missing).
    #[arg(long, default_value = ".")]
    pub out: PathBuf,
    /// Export the table as it was at this checkpoint (a batch id of `store.checkpoint`)
    /// instead of as it is now. In-process, `Store::export_checkpoint` does the same while
    /// training goes on.
    #[arg(long)]
    pub checkpoint: Option<u64>,
}

pub fn export(args: ExportArgs) -> Result<(), String> {
    let store = open_existing(&args.path)?;
    let table = store.table(&args.table).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let kp = args.out.join(format!("{}.keys.npy", args.table));
    let rp = args.out.join(format!("{}.rows.npy", args.table));
    let mut kw = NpyWriter::create(&kp, "<u8", None).map_err(|e| format!("{}: {e}", kp.display()))?;
    let mut rw = NpyWriter::create(&rp, "<f4", Some(table.dim())).map_err(|e| format!("{}: {e}", rp.display()))?;
    let bar = progress(table.len().map_err(|e| e.to_string())?, "export");
    let t0 = Instant::now();
    let mut n = 0u64;
    let write = |keys: &[u64], rows: &[f32]| {
        kw.write_u64(keys).map_err(|e| embank_core::Error::io("writing keys", e))?;
        rw.write_f32_rows(rows).map_err(|e| embank_core::Error::io("writing rows", e))?;
        n += keys.len() as u64;
        bar.set_position(n);
        Ok(())
    };
    match args.checkpoint {
        Some(batch) => store.export_checkpoint(&args.table, batch, 65_536, write),
        None => table.export(65_536, write),
    }
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    kw.finish().map_err(|e| e.to_string())?;
    rw.finish().map_err(|e| e.to_string())?;
    println!(
        "exported {n} rows of {:?}{} to {} and {} in {:.2}s",
        args.table,
        args.checkpoint.map_or(String::new(), |b| format!(" at checkpoint {b}")),
        kp.display(),
        rp.display(),
        t0.elapsed().as_secs_f64()
    );
    store.close().map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Store directory (created if missing).
    pub path: PathBuf,
    /// Table to load into; created with the rows' dim if missing.
    #[arg(long)]
    pub table: String,
    /// Keys: a 1-D .npy of uint64 (or non-negative int64), one per row. Not with --remap.
    #[arg(long, required_unless_present = "remap", conflicts_with = "remap")]
    pub keys: Option<PathBuf>,
    /// Rows: a 2-D .npy of float32, float16, or uint8 rows in the fused 8-bit row-wise
    /// layout (dim bytes, then an f32 scale and an f32 bias per row: de-quantized as
    /// q * scale + bias). Rows are converted to the table's dtype.
    #[arg(long)]
    pub rows: PathBuf,
    /// De-prune: a 1-D .npy of int64/int32, entry i the row of --rows that original id i
    /// maps to, -1 for a pruned id. The table is written keyed by original ids, so
    /// serving needs no remap lookup; pruned ids are not stored and `lookup` answers
    /// them with the table's missing default (--missing, zeros unless set).
    #[arg(long)]
    pub remap: Option<PathBuf>,
    /// Element type of a newly created table: f32, f16 or int8 (an f32 export quantized
    /// on the way in). An existing table keeps its own.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Capacity of a newly created table (default: 1.25 x the number of keys).
    #[arg(long)]
    pub capacity: Option<u64>,
    /// Initializer of a newly created table: zeros, normal:MEAN:STD, uniform:LOW:HIGH.
    #[arg(long, default_value = "zeros")]
    pub init: String,
    /// What `lookup` answers for missing (and pruned) keys of a newly created table:
    /// a number (default 0).
    #[arg(long, allow_hyphen_values = true)]
    pub missing: Option<f32>,
}

pub fn parse_init(s: &str) -> Result<Initializer, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let num = |i: usize| -> Result<f32, String> {
        parts
            .get(i)
            .ok_or_else(|| format!("initializer {s:?} needs two numbers"))?
            .parse::<f32>()
            .map_err(|e| format!("{s:?}: {e}"))
    };
    match parts[0] {
        "zeros" => Ok(Initializer::Zeros),
        "normal" => Ok(Initializer::Normal { mean: num(1)?, std: num(2)? }),
        "uniform" => Ok(Initializer::Uniform { low: num(1)?, high: num(2)? }),
        other => Err(format!("unknown initializer {other:?}: use zeros, normal:MEAN:STD or uniform:LOW:HIGH")),
    }
}

/// Where the keys of an import come from.
enum KeySource {
    /// One key per row, from a keys file.
    Keys(NpyReader),
    /// De-pruning: the mapping from original ids to rows, and the pruned rows in memory.
    Remap { mapping: Vec<i64>, rows: Vec<f32> },
}

pub fn import(args: ImportArgs) -> Result<(), String> {
    let mut rows = NpyReader::open(&args.rows)?;
    if rows.shape.len() != 2 {
        return Err(format!("{}: rows must be 2-D, found shape {:?}", args.rows.display(), rows.shape));
    }
    let dim = rows.row_dim().map_err(|e| format!("{}: {e}", args.rows.display()))?;
    let n_rows = rows.shape[0];
    let dtype = args.dtype.as_deref().map(embank_core::DType::parse).transpose().map_err(|e| e.to_string())?;
    let (mut source, n) = match (&args.keys, &args.remap) {
        (Some(kp), None) => {
            let keys = NpyReader::open(kp)?;
            if keys.descr != "<u8" && keys.descr != "<i8" {
                return Err(format!("{}: keys must be uint64 or int64, found dtype {}", kp.display(), keys.descr));
            }
            if keys.shape.len() != 1 {
                return Err(format!("{}: keys must be 1-D, found shape {:?}", kp.display(), keys.shape));
            }
            if keys.shape[0] != n_rows {
                return Err(format!("{} keys but {n_rows} rows", keys.shape[0]));
            }
            (KeySource::Keys(keys), n_rows)
        }
        (None, Some(mp)) => {
            let mut m = NpyReader::open(mp)?;
            if m.shape.len() != 1 {
                return Err(format!("{}: the mapping must be 1-D, found shape {:?}", mp.display(), m.shape));
            }
            let mut mapping = Vec::new();
            m.read_ints(m.shape[0], &mut mapping).map_err(|e| format!("{}: {e}", mp.display()))?;
            if let Some((id, &to)) = mapping.iter().enumerate().find(|(_, &to)| to < -1 || to >= n_rows as i64) {
                return Err(format!(
                    "{}: original id {id} maps to row {to}, but the pruned table has rows 0..{n_rows} (-1 marks a pruned id)",
                    mp.display()
                ));
            }
            let mut all = Vec::new();
            rows.read_rows(n_rows, dim, &mut all).map_err(|e| format!("{}: {e}", args.rows.display()))?;
            let kept = mapping.iter().filter(|&&to| to >= 0).count();
            (KeySource::Remap { mapping, rows: all }, kept)
        }
        _ => return Err("give --keys (one key per row) or --remap (a mapping from original ids to rows)".into()),
    };
    let store = Store::open(&args.path, StoreOptions::default()).map_err(|e| e.to_string())?;
    let table = match store.table(&args.table) {
        Ok(t) => {
            if let Some(d) = dtype {
                if t.meta().dtype != d {
                    return Err(format!(
                        "table {:?} exists with dtype {}; --dtype {d} only applies to a new table",
                        args.table,
                        t.meta().dtype
                    ));
                }
            }
            t
        }
        Err(e) if e.kind() == embank_core::ErrorKind::NotFound => {
            let mut o = TableOptions::new(dim as u32);
            o.capacity = args.capacity.unwrap_or((n as u64 * 5 / 4).max(1024));
            o.init = parse_init(&args.init)?;
            o.dtype = dtype.unwrap_or(embank_core::DType::F32);
            if let Some(v) = args.missing {
                o.missing = embank_core::MissingDefault::Value { value: v };
            }
            store.create_table(&args.table, o).map_err(|e| e.to_string())?
        }
        Err(e) => return Err(e.to_string()),
    };
    if table.dim() != dim {
        return Err(format!("table {:?} has dim {}, the rows have dim {dim}", args.table, table.dim()));
    }
    let bar = progress(n as u64, "import");
    let t0 = Instant::now();
    let (mut kb, mut rb) = (Vec::new(), Vec::new());
    let mut done = 0;
    let mut pruned = 0u64;
    // One bulk load: rows written in order, the index built once (a table with a row
    // cache takes them through push); nothing counts until it finishes.
    let mut loader = table.loader(n as u64).map_err(|e| e.to_string())?;
    match &mut source {
        KeySource::Keys(keys) => {
            while done < n {
                let m = (n - done).min(65_536);
                keys.read_keys(m, &mut kb)?;
                rows.read_rows(m, dim, &mut rb)?;
                loader.push(&kb, &rb).map_err(|e| format!("after {done} rows: {e}"))?;
                done += m;
                bar.set_position(done as u64);
            }
        }
        KeySource::Remap { mapping, rows: all } => {
            for (start, chunk) in (0..mapping.len()).step_by(65_536).zip(mapping.chunks(65_536)) {
                kb.clear();
                rb.clear();
                for (i, &to) in chunk.iter().enumerate() {
                    if to < 0 {
                        pruned += 1;
                        continue;
                    }
                    kb.push((start + i) as u64);
                    rb.extend_from_slice(&all[to as usize * dim..(to as usize + 1) * dim]);
                }
                loader.push(&kb, &rb).map_err(|e| format!("after {done} rows: {e}"))?;
                done += kb.len();
                bar.set_position(done as u64);
            }
        }
    }
    loader.finish().map_err(|e| format!("after {done} rows: {e}"))?;
    bar.finish_and_clear();
    store.flush().map_err(|e| e.to_string())?;
    let meta = table.meta();
    println!(
        "imported {n} rows into {:?} ({} rows now, stored as {}{}) in {:.2}s",
        args.table,
        table.len().map_err(|e| e.to_string())?,
        meta.dtype,
        if args.remap.is_some() { format!("; {pruned} pruned ids left to the missing default") } else { String::new() },
        t0.elapsed().as_secs_f64()
    );
    store.close().map_err(|e| e.to_string())
}
