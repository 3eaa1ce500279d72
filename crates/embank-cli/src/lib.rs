//! The `embank` command line. `run` is shared by the `embank` binary and by
//! the Python package (`python -m embank`, the `embank` script).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub mod brokers;
pub mod cert;
pub mod demo;
pub mod map;
pub mod plan;
pub mod publish;
pub mod recovery;
pub mod reshard;
pub mod serve;
pub mod soak;
pub mod stream_bench;
pub mod tools;

#[derive(Parser, Debug)]
#[command(
    name = "embank",
    version,
    about = "embank: a tiered parameter server for huge embedding tables",
    long_about = "embank keeps embedding tables far larger than DRAM on persistent media, \
                  serves batched lookups at close to DRAM speed and reopens instantly after a crash.\n\n\
                  Start with `embank demo`. Set EMBANK_LOG=info (or debug) for engine logs."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build a store of a few million rows, run a Zipf workload of batched pulls against it
    /// and an in-DRAM hash map, then time reopening the store.
    Demo(demo::DemoArgs),
    /// Run a serving or training workload (`--workload`: YCSB-like pulls and pushes, HPS-like
    /// skew, training steps, pooled bags) against embank and baseline engines side by side,
    /// next to the machine's physical limits measured in the same run (docs/BENCHMARKS.md).
    Bench(embank_bench::BenchArgs),
    /// Serve a store over TCP as one shard of a networked store (see docs/serve.sample.toml).
    Serve(serve::ServeArgs),
    /// Show a store's tables: rows, capacity, load factor, bytes, probe lengths.
    Inspect {
        /// Store directory.
        path: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write a table's keys and rows as `<out>/<table>.keys.npy` (uint64) and `<table>.rows.npy` (float32, n x dim).
    Export(tools::ExportArgs),
    /// Load keys and rows from .npy files into a table (created if missing; existing keys are replaced).
    Import(tools::ImportArgs),
    /// Write a development CA and server and client certificates (PEM) for `embank serve`'s [tls].
    Cert(cert::CertArgs),
    /// Run a server under mixed load (pulls, pushes, push_grad, checkpoints, clients that come
    /// and go) for a set time, sampling RSS, descriptors, disk and p99 into a CSV and a PNG.
    Soak(soak::SoakArgs),
    /// Time the first served batch after a SIGKILL (background repair, full pass) against
    /// a clean reopen, on a store of --rows rows.
    #[command(name = "bench-recovery")]
    BenchRecovery(recovery::RecoveryArgs),
    /// Publish a store's newest checkpoint to an update stream (Kafka or Redis Streams) once.
    Publish(publish::PublishArgs),
    /// Measure the update stream: ingest rate into a replica, reads during ingest, freshness
    /// from checkpoint() to serving, and what publishing costs training.
    #[command(name = "bench-stream")]
    BenchStream(stream_bench::StreamBenchArgs),
    /// Size every tier from a key trace before buying memory: hit-rate curves of the row
    /// cache and a GPU cache over sizes, bytes per tier, a placement per table, and what a
    /// DRAM or GPU budget buys.
    Plan(plan::PlanArgs),
    /// Turn a checkpoint of N closed shard stores into M stores (offline): every table,
    /// rows with their optimizer state, routed as clients route; training resumes from it.
    Reshard(reshard::ReshardArgs),
    /// The shard map clients reload (a cluster file): show what its replicas serve, or
    /// switch it once new replicas (added, or a resharded set) have caught up.
    #[command(subcommand)]
    Map(map::MapCommand),
}

/// Runs the command line; returns the process exit code.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EMBANK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => embank_bench::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Inspect { path, json } => tools::inspect(&path, json),
        Command::Export(args) => tools::export(args),
        Command::Import(args) => tools::import(args),
        Command::Cert(args) => cert::run(args),
        Command::Soak(args) => soak::run(args),
        Command::BenchRecovery(args) => recovery::run(args),
        Command::Publish(args) => publish::run(args),
        Command::BenchStream(args) => stream_bench::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Reshard(args) => reshard::run(args),
        Command::Map(cmd) => map::run(cmd),
    };
    match result {
        Ok(()) => 0,
        Err(message) => {
            eprintln!("embank: error: {message}");
            1
        }
    }
}
