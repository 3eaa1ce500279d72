//! The update stream from training to serving: the [`message`] format, one small pair of
//! traits ([`Sink`] for publishers, [`Source`] for replicas) with two transports behind
//! them ([`kafka`], [`redis`]), the [`publisher`] that sends each checkpoint's changes,
//! and the [`replica`] that applies them to a serving store and checkpoints with the
//! stream position.
//!
//! A stream has `partitions` partitions (Kafka partitions of one topic; Redis Streams
//! keys `<topic>.<partition>`). Keys are routed to partitions by the shard hash of
//! [`crate::proto::shard_of`], so serving shard `i` (a group of replicas) consumes
//! partition `i` alone. Every partition gets every checkpoint's commit marker.
//!
//! Every partition begins with a full snapshot: the publisher trims it only there (see
//! [`publisher`]), so a replica that reads it from its start, a new one or one whose
//! position was trimmed away, gets every row.

pub mod bootstrap;
pub mod kafka;
pub mod message;
pub mod publisher;
pub mod redis;
pub mod replica;
pub mod view;

use std::time::Duration;

use embank_core::{Error, Result};
use serde::{Deserialize, Serialize};

pub use publisher::{PublishOptions, Publisher, PublisherStatus};
pub use replica::{Replica, ReplicaOptions, ReplicaStatus};

/// Which broker carries the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    Kafka,
    Redis,
}

impl TransportKind {
    /// Every transport, by name.
    pub const ALL: [(&'static str, TransportKind); 2] =
        [("kafka", TransportKind::Kafka), ("redis", TransportKind::Redis)];

    /// The transport called `name` (as configs spell it), or an error naming those there are.
    pub fn parse(name: &str) -> Result<TransportKind> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, t)| t).ok_or_else(|| {
            embank_core::Error::config(format!(
                "unknown transport {name:?}: {}",
                Self::ALL.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ))
        })
    }
}

/// Where the stream is: what a publisher and a replica share.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamConfig {
    /// `kafka` or `redis`.
    pub transport: TransportKind,
    /// Kafka: bootstrap servers (`host:port,...`). Redis: a URL (`redis://127.0.0.1:6379`).
    pub brokers: String,
    /// Kafka: the topic. Redis: the prefix of the stream keys (`<topic>.<partition>`).
    #[serde(default = "default_topic")]
    pub topic: String,
    /// How long one broker operation may take before it fails (connect, send, flush).
    #[serde(default = "default_timeout")]
    pub timeout_seconds: f64,
}

fn default_topic() -> String {
    "embank-updates".into()
}

fn default_timeout() -> f64 {
    10.0
}

impl StreamConfig {
    pub fn new(transport: TransportKind, brokers: impl Into<String>) -> StreamConfig {
        StreamConfig { transport, brokers: brokers.into(), topic: default_topic(), timeout_seconds: default_timeout() }
    }

    pub fn validate(&self) -> Result<()> {
        if self.brokers.trim().is_empty() {
            return Err(Error::config("updates: `brokers` is empty"));
        }
        if self.topic.is_empty() || self.topic.len() > 200 || self.topic.contains(char::is_whitespace) {
            return Err(Error::config(format!("updates: bad topic {:?} (1-200 characters, no spaces)", self.topic)));
        }
        self.timeout()?;
        Ok(())
    }

    pub fn timeout(&self) -> Result<Duration> {
        if !(self.timeout_seconds.is_finite() && self.timeout_seconds > 0.0) {
            return Err(Error::config(format!(
                "updates: timeout_seconds must be a positive number, got {}",
                self.timeout_seconds
            )));
        }
        Ok(Duration::from_secs_f64(self.timeout_seconds))
    }

    /// `kafka://brokers/topic` or the Redis URL with the topic: for messages and metrics.
    pub fn describe(&self) -> String {
        match self.transport {
            TransportKind::Kafka => format!("kafka://{}/{}", self.brokers, self.topic),
            TransportKind::Redis => format!("{} stream {}.*", self.brokers, self.topic),
        }
    }

    /// A sink for a publisher of `partitions` partitions (created if missing).
    pub fn sink(&self, partitions: u32) -> Result<Box<dyn Sink>> {
        self.validate()?;
        Ok(match self.transport {
            TransportKind::Kafka => Box::new(kafka::KafkaSink::connect(self, partitions)?),
            TransportKind::Redis => Box::new(redis::RedisSink::connect(self, partitions)?),
        })
    }

    /// A source reading `partition`.
    pub fn source(&self, partition: u32) -> Result<Box<dyn Source>> {
        self.validate()?;
        Ok(match self.transport {
            TransportKind::Kafka => Box::new(kafka::KafkaSource::connect(self, partition)?),
            TransportKind::Redis => Box::new(redis::RedisSource::connect(self, partition)?),
        })
    }
}

/// The publishing end of a stream.
pub trait Sink: Send {
    /// Appends messages to `partition`, in order. May return before the broker has them;
    /// [`flush`](Self::flush) says whether it did.
    fn send(&mut self, partition: u32, messages: Vec<Vec<u8>>) -> Result<()>;
    /// Waits until every message sent so far is acknowledged by the broker; fails if any
    /// was not (then the caller sends them again: a replica applies repeats harmlessly).
    fn flush(&mut self) -> Result<()>;
    fn partitions(&self) -> u32;
    /// Notes, in every partition, the place of the next message sent: [`marked`](Self::marked)
    /// gives it once a [`flush`](Self::flush) returned. The publisher marks where each full
    /// snapshot begins, the places it later [`trim`](Self::trim)s at.
    fn mark(&mut self) -> Result<()>;
    /// Per partition, the place of the first message sent after the last
    /// [`mark`](Self::mark) (Redis: its entry id; Kafka: its offset); None where none was
    /// sent since, or its acknowledgement has not come back.
    fn marked(&self) -> Vec<Option<String>>;
    /// Drops every message of `partition` before `place` (one [`marked`](Self::marked)
    /// gave; that message stays). The number dropped, when the broker says.
    fn trim(&mut self, partition: u32, place: &str) -> Result<Option<u64>>;
}

/// One message read from a stream, and the position just after it.
pub struct Polled {
    pub position: String,
    pub payload: Vec<u8>,
}

/// Where a replica with no checkpoint of its own starts reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Start {
    /// The oldest message the broker keeps (a replica then gets every checkpoint).
    #[default]
    Earliest,
    /// Only what is published from now on.
    Latest,
}

/// The consuming end of one partition.
pub trait Source: Send {
    /// Continues after `position` (one returned with a [`Polled`]), or at `start` when `None`.
    fn seek(&mut self, position: Option<&str>, start: Start) -> Result<()>;
    /// Up to `max` messages, waiting at most `wait` for the first.
    fn poll(&mut self, max: usize, wait: Duration) -> Result<Vec<Polled>>;
    /// Messages published to the partition and not yet polled (None: unknown now).
    fn lag(&mut self) -> Result<Option<u64>>;
}

pub(crate) fn unavailable(what: String, e: impl std::fmt::Display) -> Error {
    Error::new(embank_core::ErrorKind::Unavailable, format!("{what}: {e}"))
}
