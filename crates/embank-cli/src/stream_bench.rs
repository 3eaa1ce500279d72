//! `embank bench-stream`: the update stream's numbers, on a broker started here (or
//! one given with `--brokers`):
//!
//! - **ingest**: a trainer store of `--rows` rows of `--dim` publishes them whole; a
//!   replica (the ingest loop `embank serve` runs, in this process) then reads the
//!   stream from its start into an empty store: rows/s until it serves the checkpoint.
//!   The publisher's own rate is reported beside it.
//! - **reads during ingest**: ycsb-c (batches of 500 Zipf keys, `lookup`) on the
//!   replica for `--seconds` while it ingests a backlog of checkpoints of
//!   `--checkpoint-rows` changed rows (published beforehand, so the trainer does not
//!   share the cores), against idle reads: the two alternate one checkpoint at a time
//!   (the replica applies one while the reader reads, then holds at its commit while
//!   the reader reads as long again), so drift of the machine's pace cancels out. The
//!   ratio of the two rates. The broker runs on this machine too.
//! - **freshness**: `--checkpoints` checkpoints of `--checkpoint-rows` changed rows each;
//!   the time from the trainer's `checkpoint()` call to the replica serving it, p50/p99.
//! - **training cost**: a training loop (pull + push_grad of 500-key Zipf batches,
//!   Adagrad) with a checkpoint every `--checkpoint-every` batches, without and with a
//!   publisher: batches/s and the ratio.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use embank_core::{KeyStream, Optimizer, RowWrites, Store, StoreOptions, TableOptions};
use embank_net::stream::{PublishOptions, Publisher, Replica, ReplicaOptions, StreamConfig, TransportKind};

use crate::brokers::{BrokerKind, LocalBroker};
use embank_bench::workload::{percentile, row_for};

#[derive(Args, Debug, Clone)]
#[command(after_help = "Starts a local broker in a temporary directory unless --brokers is given \
    (Kafka needs `make kafka-jars`). Prints one table; --json prints the numbers as JSON too. \
    Goals (docs/BENCHMARKS.md): ingest >= 1 M rows/s through Kafka at dim 128, reads during ingest \
    >= 0.8x idle, freshness p99 <= 1 s for a 100 k-row checkpoint, publishing costs <= 5 % of training.")]
pub struct StreamBenchArgs {
    /// `kafka` or `redis`.
    #[arg(long, default_value = "kafka", value_parser = ["kafka", "redis"])]
    pub transport: String,
    /// An existing broker (Kafka bootstrap servers or a Redis URL) instead of a local one.
    #[arg(long)]
    pub brokers: Option<String>,
    /// Rows of the ingest run.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Elements per row.
    #[arg(long, default_value_t = 128)]
    pub dim: u32,
    /// Rows changed per checkpoint (reads during ingest, freshness).
    #[arg(long, default_value_t = 100_000)]
    pub checkpoint_rows: u64,
    /// Checkpoints timed for freshness.
    #[arg(long, default_value_t = 30)]
    pub checkpoints: u32,
    /// Seconds of each read run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// The replica's `ingest_share` in the reads-during-ingest run: the most of one core
    /// its applier takes while reads arrive (1.0: it never gives way to them).
    #[arg(long, default_value_t = 0.5)]
    pub ingest_share: f64,
    /// Training batches between checkpoints in the training-cost run.
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// Training batches per run of the training-cost part.
    #[arg(long, default_value_t = 2000)]
    pub train_batches: u64,
    /// Repeats of the training-cost runs (min/median reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: u32,
    /// Bound of one message in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub message_bytes: usize,
    /// Where the run's stores and local broker go (a new directory under this one; default:
    /// the system's temporary directory). On a disk file system the kernel's write-back
    /// cleans every page this process wrote through a mapping, each clean a TLB shootdown
    /// on the cores that read; a tmpfs (/dev/shm) has no write-back (docs/BENCHMARKS.md).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Open the replica's store with the `huge_pages` option (the index and rows on 2 MiB
    /// pages where the file system allows).
    #[arg(long)]
    pub huge_pages: bool,
    /// How the replica's store writes rows (`store_options.row_writes`): "mapped" (copied
    /// into the mapping, the default; the kernel's write-back then interrupts the reader
    /// with TLB shootdowns) or "file" (pwrite: no shootdowns, a slower apply).
    #[arg(long, default_value = "mapped", value_parser = ["mapped", "file"])]
    pub row_writes: String,
    /// Print the numbers as JSON after the table.
    #[arg(long)]
    pub json: bool,
}

const BATCH: usize = 500;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(a: StreamBenchArgs) -> Result<(), String> {
    let e = |e: embank_core::Error| e.to_string();
    let mut dir = tempfile::Builder::new();
    dir.prefix("embank-bench-stream");
    let dir = match &a.dir {
        Some(d) => dir.tempdir_in(d),
        None => dir.tempdir(),
    }
    .map_err(|e| format!("cannot make the run's directory: {e}"))?;
    let kind = if a.transport == "kafka" { BrokerKind::Kafka } else { BrokerKind::Redis };
    let _broker;
    let brokers = match &a.brokers {
        Some(b) => b.clone(),
        None => {
            eprintln!("starting a local {} broker ...", a.transport);
            let b = LocalBroker::start(kind, &dir.path().join("broker"))?;
            let s = b.brokers();
            _broker = b;
            s
        }
    };
    let transport = if kind == BrokerKind::Kafka { TransportKind::Kafka } else { TransportKind::Redis };
    let stream = |topic: &str| {
        let mut s = StreamConfig::new(transport, brokers.clone());
        s.topic = topic.into();
        s.timeout_seconds = 30.0;
        s
    };
    let publish_opts = |topic: &str| {
        let mut o = PublishOptions::new(stream(topic));
        o.message_bytes = a.message_bytes;
        o
    };
    let dim = a.dim as usize;
    let mut report = serde_json::Map::new();

    // Ingest: a whole table through the stream into an empty replica.
    eprintln!("ingest: {} rows of dim {dim} ...", a.rows);
    let trainer = Arc::new(Store::open(dir.path().join("trainer"), StoreOptions::default()).map_err(e)?);
    let mut o = TableOptions::new(a.dim);
    o.capacity = a.rows + a.rows / 4;
    let t = trainer.create_table("emb", o).map_err(e)?;
    let mut row = vec![0f32; dim];
    let mut fill_s = 0.0;
    for chunk in (0..a.rows).collect::<Vec<u64>>().chunks(2048) {
        let mut rows = Vec::with_capacity(chunk.len() * dim);
        for &k in chunk {
            row_for(k, &mut row);
            rows.extend_from_slice(&row);
        }
        let started = Instant::now();
        t.push(chunk, &rows).map_err(e)?;
        fill_s += started.elapsed().as_secs_f64();
    }
    // The same pushes a replica makes, straight into a store: the ceiling of ingest here.
    let push_rate = a.rows as f64 / fill_s;
    trainer.checkpoint(1).map_err(e)?;
    let started = Instant::now();
    let publisher = Publisher::start(Arc::clone(&trainer), publish_opts("ingest")).map_err(e)?;
    publisher.notify().map_err(e)?;
    publisher.flush(Duration::from_secs(600)).map_err(e)?;
    let publish_s = started.elapsed().as_secs_f64();
    let bytes = publisher.status().bytes;
    let row_writes = RowWrites::parse(&a.row_writes).map_err(e)?;
    let replica_store = Arc::new(
        Store::open(
            dir.path().join("replica"),
            StoreOptions { keep_checkpoints: 1, huge_pages: a.huge_pages, row_writes, ..Default::default() },
        )
        .map_err(e)?,
    );
    let mut ro = TableOptions::new(a.dim);
    ro.capacity = a.rows + a.rows / 4;
    replica_store.create_table("emb", ro).map_err(e)?;
    let started = Instant::now();
    let mut replica = Replica::start(Arc::clone(&replica_store), ReplicaOptions::new(stream("ingest"))).map_err(e)?;
    wait_seq(&replica, 1, Duration::from_secs(600))?;
    let ingest_s = started.elapsed().as_secs_f64();
    let ingest = a.rows as f64 / ingest_s;
    let publish = a.rows as f64 / publish_s;
    replica.close();
    report.insert("ingest_rows_per_second".into(), ingest.into());
    report.insert("publish_rows_per_second".into(), publish.into());
    report.insert("push_rows_per_second".into(), push_rate.into());
    report.insert("stream_bytes".into(), bytes.into());

    // Reads on the replica, idle and while it ingests a backlog of checkpoints (published
    // beforehand, so the trainer does not share these two cores with the replica).
    let backlog = ((ingest * a.seconds * 1.5) / a.checkpoint_rows as f64).ceil().max(2.0) as u64;
    eprintln!("reads during ingest: a backlog of {backlog} checkpoints of {} rows ...", a.checkpoint_rows);
    let mut batch_id = 1;
    for n in 0..backlog {
        checkpoint_of(&trainer, &mut batch_id, n, a.checkpoint_rows, a.rows, dim)?;
        // Each checkpoint sent on its own (a publisher that is behind sends several as one,
        // and one of many checkpoints can pass the served view's bound): the replica then
        // applies checkpoints of `checkpoint_rows`, as one that keeps up does.
        publisher.notify().map_err(e)?;
        publisher.flush(Duration::from_secs(600)).map_err(e)?;
    }
    let last_seq = trainer.checkpoints().map_err(e)?.last().unwrap().seq;
    // The trainer's pages reach the disk now, not by the kernel's write-back in the reading
    // windows: it runs in this process, and cleaning a page it wrote through its mapping
    // interrupts every core running this process, the reader's too (a trainer is another
    // process where this is deployed).
    trainer.flush().map_err(e)?;
    let table = replica_store.table("emb").map_err(e)?;
    // The read batches drawn beforehand (the Zipf draw is not what is measured), replayed.
    let batches = KeyStream::new(a.rows, 0.99, 7)?.batches(4096, BATCH);
    let mut keys = batches.chunks(BATCH).cycle();
    // Keys/s, seconds, and the share of a core the reading thread had; each batch's
    // nanoseconds are added to `times`.
    let read_for = |secs: f64,
                    keys: &mut dyn Iterator<Item = &[u64]>,
                    until_seq: Option<(&Replica, u64)>,
                    times: &mut Vec<u64>|
     -> Result<(f64, f64, f64), String> {
        let (mut out, mut found) = (vec![0f32; BATCH * dim], vec![false; BATCH]);
        let view = until_seq.map(|(r, _)| r.view());
        let until = Instant::now() + Duration::from_secs_f64(secs);
        let (started, cpu0) = (Instant::now(), own_cpu_seconds());
        let mut n = 0u64;
        while Instant::now() < until {
            // The replica's status (a lock and a copy) every 16 batches, not every batch.
            if let Some((r, seq)) = until_seq.filter(|_| n.is_multiple_of(16 * BATCH as u64)) {
                if r.status().checkpoint_seq.is_some_and(|s| s >= seq) {
                    break;
                }
            }
            let batch = keys.next().expect("cycles");
            let t0 = Instant::now();
            // A running replica's reads go through its served view, as `embank serve`'s do.
            match &view {
                Some(v) => v.lookup(&table, batch, &mut out, &mut found),
                None => table.lookup(batch, &mut out, &mut found),
            }
            .map_err(|e| e.to_string())?;
            times.push(t0.elapsed().as_nanos() as u64);
            n += BATCH as u64;
        }
        let secs = started.elapsed().as_secs_f64();
        Ok((n as f64 / secs, secs, (own_cpu_seconds() - cpu0) / secs))
    };
    let (idle_before, _, _) = read_for(a.seconds, &mut keys, None, &mut Vec::new())?;
    let reading = ReplicaOptions { ingest_share: a.ingest_share, ..ReplicaOptions::new(stream("ingest")) };
    let mut replica = Replica::start(Arc::clone(&replica_store), reading).map_err(e)?;
    // Ingest and idle alternate one checkpoint at a time: the replica applies the next
    // checkpoint while the reader reads (an "ingesting" window, from the first row to the
    // commit), then holds at the commit and the reader reads as long again with nothing
    // kept in the view (an "idle" window). This machine's pace drifts by tens of percent
    // over a minute, so only windows this close together compare. The first checkpoint
    // (the broker connection, the first fetch) is not measured.
    let first = replica.status().checkpoint_seq.unwrap_or(0) + 1;
    replica.hold_after(Some(1));
    wait_seq(&replica, first, Duration::from_secs(120)).map_err(|m| format!("the first backlog checkpoint: {m}"))?;
    let (mut on, mut off) = ((0f64, 0f64, 0f64), (0f64, 0f64, 0f64)); // keys, seconds, CPU seconds
    let mut windows = 0u32;
    let mut ingest_rows = 0u64;
    let (mut on_times, mut off_times) = (Vec::new(), Vec::new());
    loop {
        let st = replica.status();
        let served = st.checkpoint_seq.unwrap_or(0);
        if on.1 >= a.seconds || served >= last_seq {
            break;
        }
        let rows0 = st.rows;
        replica.hold_after(Some(1));
        let (rate, secs, cpu) = read_for(120.0, &mut keys, Some((&replica, served + 1)), &mut on_times)?;
        ingest_rows += replica.status().rows - rows0;
        on = (on.0 + rate * secs, on.1 + secs, on.2 + cpu * secs);
        // Held at that commit (the reader saw it within 16 batches of the replica).
        let (rate, secs, cpu) = read_for(secs, &mut keys, Some((&replica, u64::MAX)), &mut off_times)?;
        off = (off.0 + rate * secs, off.1 + secs, off.2 + cpu * secs);
        windows += 1;
    }
    replica.hold_after(None);
    if windows == 0 {
        return Err(format!(
            "the backlog of {backlog} checkpoints ran out before a read window (the first is not measured): \
             raise --seconds or lower --checkpoint-rows"
        ));
    }
    let (busy, busy_secs, busy_cpu) = (on.0 / on.1, on.1, on.2 / on.1);
    let (idle, idle_cpu) = (off.0 / off.1, off.2 / off.1);
    let busy_ingest = ingest_rows as f64 / busy_secs;
    let (on_lat, off_lat) = (BatchTimes::of(on_times), BatchTimes::of(off_times));
    wait_seq(&replica, last_seq, Duration::from_secs(600))?;
    let mut fresh: Vec<u64> = Vec::new();
    eprintln!("freshness: {} checkpoints of {} rows ...", a.checkpoints, a.checkpoint_rows);
    // Freshness: checkpoint() on the trainer to the replica serving it, one at a time.
    for i in 0..a.checkpoints {
        let started = Instant::now();
        checkpoint_of(&trainer, &mut batch_id, 1000 + i as u64, a.checkpoint_rows, a.rows, dim)?;
        let seq = trainer.checkpoints().map_err(e)?.last().unwrap().seq;
        publisher.notify().map_err(e)?;
        wait_seq(&replica, seq, Duration::from_secs(60))?;
        fresh.push(started.elapsed().as_micros() as u64);
    }
    fresh.sort_unstable();
    let (p50, p99) = (percentile(&fresh, 50.0) as f64 / 1e6, percentile(&fresh, 99.0) as f64 / 1e6);
    replica.close();
    drop(publisher);
    report.insert("reads_idle_keys_per_second".into(), idle.into());
    report.insert("reads_idle_before_keys_per_second".into(), idle_before.into());
    report.insert("read_windows".into(), windows.into());
    report.insert("reads_during_ingest_keys_per_second".into(), busy.into());
    report.insert("reader_cpu_share_idle".into(), idle_cpu.into());
    report.insert("reader_cpu_share_during_ingest".into(), busy_cpu.into());
    report.insert("ingest_rows_per_second_while_reading".into(), busy_ingest.into());
    for (name, t) in [("idle", &off_lat), ("during_ingest", &on_lat)] {
        report.insert(format!("reads_{name}_batch_p50_us"), t.p50_us.into());
        report.insert(format!("reads_{name}_batch_p99_us"), t.p99_us.into());
        report.insert(format!("reads_{name}_time_in_batches_over_1ms"), t.over_1ms.into());
    }
    report.insert("freshness_p50_seconds".into(), p50.into());
    report.insert("freshness_p99_seconds".into(), p99.into());

    // Training-side cost of publishing.
    eprintln!("training cost: {} batches, a checkpoint every {} ...", a.train_batches, a.checkpoint_every);
    let (mut plain, mut with, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..a.repeats {
        for publishing in [false, true] {
            let path = dir.path().join(format!("train-{r}-{publishing}"));
            let (rate, c) = train(&path, publishing.then(|| publish_opts(&format!("train-{r}"))), &a)?;
            if publishing {
                with.push(rate);
                cpu.push(c);
            } else {
                plain.push(rate)
            };
        }
    }
    let cpu_med = median(&mut cpu);
    let (plain_min, with_min) =
        (plain.iter().copied().fold(f64::MAX, f64::min), with.iter().copied().fold(f64::MAX, f64::min));
    let (plain_med, with_med) = (median(&mut plain), median(&mut with));
    report.insert("train_batches_per_second".into(), plain_med.into());
    report.insert("train_batches_per_second_publishing".into(), with_med.into());
    report.insert("publisher_cpu_per_training_second".into(), cpu_med.into());

    report.insert("replica_row_writes".into(), row_writes.name().into());
    let how = match row_writes {
        RowWrites::File => "through the file (pwrite)",
        RowWrites::Mapped => "through the mapping",
    };
    println!("embank bench-stream: {} at {brokers}, dim {dim}, the replica's rows written {how}", a.transport);
    println!(
        "  ingest into a replica     {:>12.0} rows/s   ({} rows, {:.1} MB on the stream; publisher {:.0} rows/s)",
        ingest,
        a.rows,
        bytes as f64 / 1e6,
        publish
    );
    println!(
        "  push into a new table     {:>12.0} rows/s   (the same pushes without a stream: the ceiling)",
        push_rate
    );
    println!(
        "  ycsb-c reads, idle        {:>12.0} keys/s   (in {windows} windows, each right after an ingesting one and as \
         long, the replica held at its commit; {:.0} in one run before; the reader had {:.0} % of a core)",
        idle,
        idle_before,
        idle_cpu * 100.0
    );
    println!(
        "  ycsb-c reads, ingesting   {:>12.0} keys/s   ({:.2}x idle, over {:.1} s of ingest in {windows} windows of one \
         checkpoint each, at {:.0} rows/s; the reader had {:.0} % of a core)",
        busy,
        busy / idle,
        busy_secs,
        busy_ingest,
        busy_cpu * 100.0
    );
    println!(
        "  a read batch of {BATCH}          p50 {:.1} / {:.1} us, p99 {:.1} / {:.1} us idle / ingesting   ({:.1} / {:.1} % of \
         the reading time in batches over 1 ms)",
        off_lat.p50_us,
        on_lat.p50_us,
        off_lat.p99_us,
        on_lat.p99_us,
        off_lat.over_1ms * 100.0,
        on_lat.over_1ms * 100.0
    );
    println!(
        "  freshness                 p50 {:.3} s, p99 {:.3} s   ({} checkpoints of {} rows)",
        p50, p99, a.checkpoints, a.checkpoint_rows
    );
    println!(
        "  training                  {:.0} batches/s plain, {:.0} publishing (median of {}; {:.3}x; min {:.0} vs {:.0})",
        plain_med, with_med, a.repeats, with_med / plain_med, plain_min, with_min
    );
    println!(
        "  publisher thread          {:.3} CPU-seconds per training second (median; the broker's work not included)",
        cpu_med
    );
    if a.json {
        println!("{}", serde_json::Value::Object(report));
    }
    Ok(())
}

/// Changes `rows` rows (a window that moves with `n`) and takes a checkpoint.
fn checkpoint_of(store: &Store, batch_id: &mut u64, n: u64, rows: u64, total: u64, dim: usize) -> Result<(), String> {
    let t = store.table("emb").map_err(|e| e.to_string())?;
    let start = (n * rows) % total.max(1);
    let keys: Vec<u64> = (0..rows).map(|i| (start + i) % total).collect();
    let mut row = vec![0f32; dim];
    for chunk in keys.chunks(8192) {
        let mut out = Vec::with_capacity(chunk.len() * dim);
        for &k in chunk {
            row_for(k ^ n, &mut row);
            out.extend_from_slice(&row);
        }
        t.push(chunk, &out).map_err(|e| e.to_string())?;
    }
    *batch_id += 1;
    store.checkpoint(*batch_id).map_err(|e| e.to_string())
}

fn wait_seq(replica: &Replica, seq: u64, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while replica.status().checkpoint_seq.is_none_or(|s| s < seq) {
        if Instant::now() > deadline {
            return Err(format!("the replica did not apply checkpoint seq {seq} in {limit:?}: {:?}", replica.status()));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    Ok(())
}

/// Batches/s of a training loop, with a publisher or without.
fn train(path: &std::path::Path, publish: Option<PublishOptions>, a: &StreamBenchArgs) -> Result<(f64, f64), String> {
    let e = |e: embank_core::Error| e.to_string();
    let store = Arc::new(Store::open(path, StoreOptions::default()).map_err(e)?);
    let mut o = TableOptions::new(a.dim);
    o.optimizer = Optimizer::Adagrad { lr: 0.05, eps: 1e-8, initial_accumulator_value: 0.1 };
    o.capacity = 2_000_000;
    let t = store.create_table("emb", o).map_err(e)?;
    let publisher = match publish {
        Some(p) => Some(Publisher::start(Arc::clone(&store), p).map_err(e)?),
        None => None,
    };
    let mut keys = KeyStream::new(1_000_000, 0.99, 3)?;
    let dim = a.dim as usize;
    let (mut rows, grads) = (vec![0f32; BATCH * dim], vec![0.01f32; BATCH * dim]);
    let started = Instant::now();
    for b in 1..=a.train_batches {
        let batch = keys.batches(1, BATCH);
        t.pull(&batch, &mut rows).map_err(e)?;
        t.push_grad(&batch, &grads).map_err(e)?;
        if b % a.checkpoint_every == 0 {
            store.checkpoint(b).map_err(e)?;
            if let Some(p) = &publisher {
                p.notify().map_err(e)?;
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let rate = a.train_batches as f64 / wall;
    if let Some(p) = &publisher {
        p.flush(Duration::from_secs(120)).map_err(e)?;
    }
    // The publisher thread's CPU time over the training time: what publishing takes
    // from the trainer's machine (the broker's own work excluded).
    let cpu = thread_cpu_seconds("embank-publish").map_or(0.0, |c| c / wall);
    if let Some(p) = &publisher {
        let s = p.status();
        eprintln!(
            "  published {} checkpoints: {:.1} MB, {} rows in {:.2} s of training ({:.0} MB/s)",
            s.checkpoints_published,
            s.bytes as f64 / 1e6,
            s.rows,
            wall,
            s.bytes as f64 / 1e6 / wall
        );
    }
    Ok((rate, cpu))
}

/// User + system CPU seconds of this process's thread named `name` (Linux).
fn thread_cpu_seconds(name: &str) -> Option<f64> {
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        if std::fs::read_to_string(task.path().join("comm")).ok()?.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let (utime, stime): (f64, f64) = (fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?);
        return Some((utime + stime) / ticks);
    }
    None
}

/// CPU seconds the calling thread has run.
fn own_cpu_seconds() -> f64 {
    embank_bench::thread_cpu_ns() as f64 * 1e-9
}

/// A read window's batch times, summed up.
struct BatchTimes {
    p50_us: f64,
    p99_us: f64,
    /// The share of the reading time spent in batches that took over 1 ms (a reader that
    /// waited or lost its core, not one slowed down evenly).
    over_1ms: f64,
}

impl BatchTimes {
    fn of(mut nanos: Vec<u64>) -> BatchTimes {
        nanos.sort_unstable();
        let total: u64 = nanos.iter().sum();
        let over: u64 = nanos.iter().filter(|&&n| n > 1_000_000).sum();
        BatchTimes {
            p50_us: percentile(&nanos, 50.0) as f64 / 1e3,
            p99_us: percentile(&nanos, 99.0) as f64 / 1e3,
            over_1ms: if total == 0 { 0.0 } else { over as f64 / total as f64 },
        }
    }
}
