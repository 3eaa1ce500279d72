//! embank-net: embank over TCP.
//!
//! - [`proto`]: the framed binary protocol (header layout, opcodes, status codes,
//!   the consistent hash that routes keys to shards). Pure, no I/O.
//! - [`server`]: a run-to-completion loop over an `embank_core::Store`, with
//!   zero-copy replies from the mapped rows file.
//! - [`client`]: N shard addresses, keys routed by consistent hash, batches split
//!   into requests sent in parallel over pooled connections and reassembled in order.
//! - [`config`]: the `embank serve` TOML config.
//! - [`metrics`]: counters, Prometheus text, the admin HTTP endpoint.
//! - [`tls`]: rustls for both ends (server certificate, optional client certificates).
//! - [`stream`]: the update stream from training to serving (Kafka, Redis Streams):
//!   message format, publisher, replica ingest.
//!
//! The server is a thin layer: every decision about rows is the core's.

pub mod client;
pub mod config;
pub mod metrics;
pub mod proto;
pub mod redis_tier;
pub mod server;
pub mod stream;
pub mod tls;

pub use client::{Client, ClientOptions, ClientSettings, MapSource, RemoteTable, ShardMap};
pub use server::{Server, ServerOptions};
pub use tls::{ClientTls, ClientTlsFiles, ServerTls, ServerTlsFiles};
