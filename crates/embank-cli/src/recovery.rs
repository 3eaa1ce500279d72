//! `embank bench-recovery`: time to the first served batch after a SIGKILL.
//!
//! Builds (or reuses) a store of `--rows` rows, then for each repeat:
//!
//! - **clean**: close, reopen, serve one batch of Zipf keys;
//! - **background** (the default): a writer process opens the store, takes a
//!   checkpoint, overwrites rows until it is SIGKILLed; the store is reopened
//!   (rollback to the checkpoint, buckets repaired on first touch, the rest in the
//!   background) and one batch served; then the time until the background repair
//!   is done;
//! - **full pass** (`background_repair = false`, what every open after a crash
//!   did before): the same kill, then an open that repairs everything first.
//!
//! Every reopen after a kill is checked: the row count once repaired, and the
//! overwritten rows back at their checkpointed values.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Args;
use embank_core::{human_bytes, KeyStream, MediumKind, Store, StoreOptions, Table, TableOptions};

use embank_bench::workload::row_for;

#[derive(Args, Debug, Clone)]
pub struct RecoveryArgs {
    /// Store directory: built if missing, reused if it holds a table of --rows rows.
    #[arg(long, default_value = "bench-recovery-store")]
    pub path: PathBuf,
    /// Rows in the table.
    #[arg(long, default_value_t = 10_000_000)]
    pub rows: u64,
    /// Elements per row.
    #[arg(long, default_value_t = 8)]
    pub dim: u32,
    /// How the table stores elements: f32, f16 or int8 (the API stays f32).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// `mmap` or `block`.
    #[arg(long, default_value = "mmap")]
    pub medium: String,
    /// Measured repeats of each kind of reopen.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Rows the writer overwrites (after its checkpoint) before it is killed.
    #[arg(long, default_value_t = 200_000)]
    pub writes: u64,
    /// The writer takes no checkpoint first (a serving store fed by pushes): nothing to
    /// roll back, the rows keep the overwrites.
    #[arg(long)]
    pub no_checkpoint: bool,
    /// Keys in the first served batch.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Before each reopen, write the store's dirty pages and drop its files from the page
    /// cache (`fdatasync`, then `POSIX_FADV_DONTNEED`): a machine whose DRAM does not hold
    /// the store, whatever this one's holds.
    #[arg(long)]
    pub cold: bool,
    /// Internal: run as the writer that gets killed.
    #[arg(long, hide = true)]
    pub writer: bool,
}

const TABLE: &str = "t";

fn open(path: &Path, background: bool) -> Result<Store, String> {
    let o = StoreOptions { create: false, background_repair: background, ..Default::default() };
    Store::open(path, o).map_err(|e| e.to_string())
}

/// The value a row holds after the writer's overwrite (the build wrote `row_for`).
fn overwritten(key: u64, out: &mut [f32]) {
    row_for(key, out);
    out[0] = -1.0;
}

fn build(args: &RecoveryArgs) -> Result<(), String> {
    if let Ok(store) = open(&args.path, true) {
        if let Ok(t) = store.table(TABLE) {
            let dtype = t.layout().dtype.name();
            if t.len().map_err(|e| e.to_string())? == args.rows && t.dim() == args.dim as usize && dtype == args.dtype {
                println!("reusing the store at {} ({} rows)", args.path.display(), args.rows);
                return store.close().map_err(|e| e.to_string());
            }
        }
        return Err(format!("{} holds another store; remove it or give another --path", args.path.display()));
    }
    let store = Store::open(&args.path, StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut o = TableOptions::new(args.dim);
    o.capacity = args.rows;
    o.medium = MediumKind::parse(&args.medium).map_err(|e| e.to_string())?;
    o.dtype = embank_core::DType::parse(&args.dtype).map_err(|e| e.to_string())?;
    let table = store.create_table(TABLE, o).map_err(|e| e.to_string())?;
    crate::demo::load(&table, args.rows, args.dim as usize)?;
    store.close().map_err(|e| e.to_string())
}

/// The writer: checkpoint, then overwrite rows 0, 1, 2, ... until killed.
fn writer(args: &RecoveryArgs) -> Result<(), String> {
    let store = open(&args.path, true)?;
    store.wait_repaired().map_err(|e| e.to_string())?;
    let table = store.table(TABLE).map_err(|e| e.to_string())?;
    if !args.no_checkpoint {
        let batch = store.checkpoints().map_err(|e| e.to_string())?.last().map_or(0, |c| c.batch_id) + 1;
        store.checkpoint(batch).map_err(|e| e.to_string())?;
    }
    let dim = args.dim as usize;
    let chunk = 4096u64;
    let mut data = vec![0f32; chunk as usize * dim];
    let mut k = 0;
    loop {
        let m = chunk.min(args.rows - k % args.rows);
        let keys: Vec<u64> = (k % args.rows..k % args.rows + m).collect();
        for (i, &key) in keys.iter().enumerate() {
            overwritten(key, &mut data[i * dim..(i + 1) * dim]);
        }
        table.push(&keys, &data[..m as usize * dim]).map_err(|e| e.to_string())?;
        let before = k;
        k += m;
        if before < args.writes && k >= args.writes {
            println!("WROTE {k}");
        }
    }
}

/// Starts the writer, waits for its writes, SIGKILLs it.
fn kill_a_writer(args: &RecoveryArgs) -> Result<(), String> {
    let mut cmd = crate::soak::self_command()?;
    cmd.args(["bench-recovery", "--writer", "--path"])
        .arg(&args.path)
        .args(["--rows", &args.rows.to_string(), "--dim", &args.dim.to_string()])
        .args(["--writes", &args.writes.to_string()])
        .stdout(Stdio::piped());
    if args.no_checkpoint {
        cmd.arg("--no-checkpoint");
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start the writer: {e}"))?;
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut line).map_err(|e| e.to_string())?;
    child.kill().map_err(|e| e.to_string())?; // SIGKILL
    let _ = child.wait();
    if !line.starts_with("WROTE") {
        return Err(format!("the writer stopped before its writes (said {line:?})"));
    }
    Ok(())
}

struct Reopen {
    open_s: f64,
    first_batch_s: f64,
    /// Until the background repair is done (background reopens).
    repaired_s: Option<f64>,
    /// Until every key was back at the checkpoint (a rollback on first touch).
    rolled_back_s: Option<f64>,
}

fn first_batch(table: &Table, keys: &[u64], dim: usize) -> Result<(), String> {
    let mut out = vec![0f32; keys.len() * dim];
    table.pull(keys, &mut out).map_err(|e| e.to_string())?;
    std::hint::black_box(&out);
    Ok(())
}

/// Reopens, serves one batch, and checks what a crash must not lose: the row count, and
/// each probed row at `before` (the rows when the writer started: a checkpoint rolls the
/// overwrites back) or, without a checkpoint, at `before` or overwritten. Returns the
/// probed rows as they are now.
fn reopen(
    args: &RecoveryArgs,
    background: bool,
    keys: &[u64],
    before: Option<&[f32]>,
) -> Result<(Reopen, Vec<f32>), String> {
    let dim = args.dim as usize;
    if args.cold {
        drop_cached(&args.path)?;
    }
    let t0 = Instant::now();
    let store = open(&args.path, background)?;
    let table = store.table(TABLE).map_err(|e| e.to_string())?;
    let open_s = t0.elapsed().as_secs_f64();
    first_batch(&table, keys, dim)?;
    let first_batch_s = t0.elapsed().as_secs_f64();
    // (Not `stats()`, which walks the index.)
    let pending = table.recover_stats().is_some_and(|r| r.pending);
    store.wait_repaired().map_err(|e| e.to_string())?;
    let repaired_s = pending.then(|| t0.elapsed().as_secs_f64());
    // Counted by the table from the end of its open.
    let rolled_back_s = table.recover_stats().and_then(|r| r.rollback_seconds);
    let len = table.len().map_err(|e| e.to_string())?;
    if len != args.rows {
        return Err(format!("after the reopen the table has {len} rows, not {}", args.rows));
    }
    let probe: Vec<u64> = (0..args.writes.min(args.rows)).step_by(997).collect();
    let mut now = vec![0f32; probe.len() * dim];
    table.pull(&probe, &mut now).map_err(|e| e.to_string())?;
    if let Some(before) = before {
        let mut over = vec![0f32; dim];
        for (i, &k) in probe.iter().enumerate() {
            let (row, was) = (&now[i * dim..(i + 1) * dim], &before[i * dim..(i + 1) * dim]);
            overwritten(k, &mut over);
            let ok = row == was || (args.no_checkpoint && stored_as(row, &over));
            if !ok {
                return Err(format!("row {k} after the reopen is {row:?}; it was {was:?} when the writer started"));
            }
        }
    }
    drop(table);
    store.close().map_err(|e| e.to_string())?;
    Ok((Reopen { open_s, first_batch_s, repaired_s, rolled_back_s }, now))
}

/// Writes every file under `dir` to the disk and drops it from the page cache.
fn drop_cached(dir: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            drop_cached(&path)?;
            continue;
        }
        let Ok(file) = std::fs::File::open(&path) else { continue };
        file.sync_data().map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: an open descriptor; the advice only drops clean cached pages.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

/// True when `row` is `written` as the table stores it: equal for f32 rows, within the
/// rounding of f16 and int8 (a row's largest magnitude / 127 at most) otherwise.
fn stored_as(row: &[f32], written: &[f32]) -> bool {
    let scale = written.iter().fold(0f32, |m, v| m.max(v.abs()));
    row.iter().zip(written).all(|(a, b)| a == b || (a - b).abs() <= scale / 127.0)
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

fn summary(name: &str, runs: &[f64]) -> String {
    let mut v = runs.to_vec();
    v.sort_by(f64::total_cmp);
    let cells: Vec<String> = runs.iter().map(|&s| ms(s)).collect();
    format!("| {name} | {} | {} | {} |", cells.join(" / "), ms(v[v.len() / 2]), ms(v[0]))
}

pub fn run(args: RecoveryArgs) -> Result<(), String> {
    if args.writer {
        return writer(&args);
    }
    if args.rows < 1000 || args.repeats == 0 || args.batch == 0 || args.writes == 0 {
        return Err("bench-recovery: --rows >= 1000, --repeats, --batch and --writes >= 1".into());
    }
    build(&args)?;
    let size: u64 = std::fs::read_dir(args.path.join("tables"))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|t| std::fs::read_dir(t.path()).into_iter().flatten().flatten())
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "bench-recovery: {} rows x dim {} ({}) at {}, {} on disk; {} overwrites{}, then SIGKILL{}",
        args.rows,
        args.dim,
        args.medium,
        args.path.display(),
        human_bytes(size),
        args.writes,
        if args.no_checkpoint { " (no checkpoint)" } else { " after a checkpoint" },
        if args.cold { "; every reopen from a cold page cache" } else { "" }
    );
    let keys = KeyStream::new(args.rows, 0.99, 7)?.batches(1, args.batch);
    let (mut clean, mut bg_first, mut bg_open, mut bg_done, mut full_first) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut bg_rolled = Vec::new();
    for rep in 0..args.repeats {
        let (c, rows) = reopen(&args, true, &keys, None)?;
        kill_a_writer(&args)?;
        let (b, rows) = reopen(&args, true, &keys, Some(&rows))?;
        kill_a_writer(&args)?;
        let (f, _) = reopen(&args, false, &keys, Some(&rows))?;
        println!(
            "repeat {}: clean reopen + first batch {}; after SIGKILL: background {} (open {}, then rolled back after {}; repaired after {}), full pass {}",
            rep + 1,
            ms(c.first_batch_s),
            ms(b.first_batch_s),
            ms(b.open_s),
            b.rolled_back_s.map_or("-".into(), ms),
            b.repaired_s.map_or("-".into(), ms),
            ms(f.first_batch_s)
        );
        clean.push(c.first_batch_s);
        bg_first.push(b.first_batch_s);
        bg_open.push(b.open_s);
        bg_done.push(b.repaired_s.unwrap_or(b.first_batch_s));
        bg_rolled.extend(b.rolled_back_s);
        full_first.push(f.first_batch_s);
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("\n| time to the first served batch ({} rows) | runs | median | min |", args.rows);
    println!("| --- | --- | --- | --- |");
    println!("{}", summary("clean reopen", &clean));
    println!("{}", summary("**after SIGKILL, background repair**", &bg_first));
    println!("{}", summary("  of which the open", &bg_open));
    if !bg_rolled.is_empty() {
        println!("{}", summary("  every key back at the checkpoint, after the open", &bg_rolled));
    }
    println!("{}", summary("  background repair done after", &bg_done));
    println!("{}", summary("after SIGKILL, full pass first", &full_first));
    Ok(())
}
