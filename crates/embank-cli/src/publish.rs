//! `embank publish`: send a store's newest checkpoint to an update stream, once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Store, StoreOptions};
use embank_net::stream::{PublishOptions, Publisher, StreamConfig, TransportKind};

#[derive(clap::Args, Debug)]
#[command(after_help = "Sends the changes since the checkpoint this store last published to the stream \
    (the first time, and after the publisher lost its place, every table whole), then a commit marker in \
    every partition, and waits for the broker's acknowledgement. The place is kept in \
    <store>/PUBLISHED-<topic>.json. The store must not be open elsewhere (a training process publishes \
    with store.publisher(...) instead).\n\n\
    Replicas apply the stream with `embank serve` and an [updates] section (docs/serve.sample.toml).\n\n\
    Example: embank publish --store /data/model --transport kafka --brokers 127.0.0.1:9092 --partitions 2")]
pub struct PublishArgs {
    /// Store directory (its newest checkpoint is published).
    #[arg(long)]
    pub store: PathBuf,
    /// `kafka` or `redis`.
    #[arg(long, value_parser = |s: &str| TransportKind::parse(s).map_err(|e| e.to_string()))]
    pub transport: TransportKind,
    /// Kafka bootstrap servers (host:port,...) or a Redis URL (redis://host:port).
    #[arg(long)]
    pub brokers: String,
    /// Kafka topic, or the prefix of the Redis stream keys.
    #[arg(long, default_value = "embank-updates")]
    pub topic: String,
    /// Partitions: one per serving shard (keys routed by the shard hash).
    #[arg(long, default_value_t = 1)]
    pub partitions: u32,
    /// Bound of one message in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub message_bytes: usize,
    /// Only these tables (comma-separated; default all).
    #[arg(long, value_delimiter = ',')]
    pub tables: Option<Vec<String>>,
    /// Checkpoints the stream keeps: the stream is trimmed to the newest full snapshot with
    /// this many checkpoints published after it (0: never trimmed).
    #[arg(long, default_value_t = 8)]
    pub keep_checkpoints: usize,
    /// Give up after this many seconds without the broker's acknowledgement.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
}

pub fn run(a: PublishArgs) -> Result<(), String> {
    let mut stream = StreamConfig::new(a.transport, a.brokers);
    stream.topic = a.topic;
    stream.timeout_seconds = a.timeout.clamp(1.0, 600.0);
    let mut opts = PublishOptions::new(stream);
    opts.partitions = a.partitions;
    opts.message_bytes = a.message_bytes;
    opts.tables = a.tables;
    opts.keep_checkpoints = a.keep_checkpoints;
    let store = Arc::new(
        Store::open(&a.store, StoreOptions { create: false, ..Default::default() }).map_err(|e| e.to_string())?,
    );
    let Some(latest) = store.checkpoints().map_err(|e| e.to_string())?.pop() else {
        return Err(format!(
            "{} has no checkpoint to publish: take one with store.checkpoint(batch)",
            a.store.display()
        ));
    };
    let started = Instant::now();
    let publisher = Publisher::start(Arc::clone(&store), opts).map_err(|e| e.to_string())?;
    publisher.notify().map_err(|e| e.to_string())?;
    publisher.flush(Duration::from_secs_f64(a.timeout.max(1.0))).map_err(|e| e.to_string())?;
    let s = publisher.status();
    publisher.close();
    println!(
        "published checkpoint batch {} (seq {}) to {}: {} rows, {} deletes, {} messages, {:.1} MB{} in {:.2} s",
        latest.batch_id,
        latest.seq,
        s.stream,
        s.rows,
        s.deletes,
        s.messages,
        s.bytes as f64 / 1e6,
        if s.full_snapshots > 0 {
            " (full snapshot)"
        } else if s.retention_snapshots > 0 {
            " (and a full snapshot for the stream to be trimmed to)"
        } else {
            ""
        },
        started.elapsed().as_secs_f64()
    );
    drop(publisher);
    Arc::try_unwrap(store).map_err(|_| "store still in use".to_string())?.close().map_err(|e| e.to_string())
}
