//! Kafka through `rskafka`, a Kafka client in pure Rust: nothing to link, nothing to
//! compile but Rust, on any machine (the wheel and `make demo` need no system library).
//!
//! Ordering is kept by the sink, not by an idempotent producer: each partition's messages
//! go out in order, one produce request at a time (`acks=all`), and the first request
//! that fails ends the send or flush with an error, so a partition never gets a later
//! message after a lost one. A request that failed may still have been written (its
//! answer was lost): the caller sends the checkpoint again, and a replica skips what it
//! already applied, so a repeat is harmless. Partitions are flushed concurrently.
//!
//! The replica's source reads its one partition from an offset it keeps itself (no
//! consumer group, nothing committed to Kafka): its position lives in its own checkpoints.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use embank_core::{Error, Result};
use rskafka::client::error::{Error as KafkaError, ProtocolError};
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;
use rskafka::BackoffConfig;
use tokio::runtime::Runtime;

use super::{unavailable, Polled, Sink, Source, Start, StreamConfig};

/// Bytes of messages one produce request carries at most (a single larger message goes
/// alone). Kafka's default limit of a record batch is 1 MiB.
const REQUEST_BYTES_MAX: usize = 1 << 20;
/// Bytes one fetch asks for at most.
const FETCH_BYTES_MAX: i32 = 16 << 20;
/// Messages a partition may buffer in the sink before they go out (the bound of what
/// waits for the broker): a request's worth, so `send` produces as soon as it has one.
const PENDING_BYTES_MAX: usize = REQUEST_BYTES_MAX;

/// One small runtime per sink or source: every call blocks on it, so the stream's
/// threads stay the plain threads they are for the other transports.
fn runtime(what: &str) -> Result<Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| unavailable(format!("cannot start the Kafka client's runtime for {what}"), e))
}

/// Connects to the cluster; every request retries transient errors until `timeout`.
fn client(rt: &Runtime, c: &StreamConfig, timeout: Duration, what: &str) -> Result<Client> {
    let brokers: Vec<String> = c.brokers.split(',').map(|b| b.trim().to_owned()).filter(|b| !b.is_empty()).collect();
    let backoff = BackoffConfig {
        init_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(500),
        base: 2.0,
        deadline: Some(timeout),
    };
    let build = ClientBuilder::new(brokers).client_id("embank").backoff_config(backoff).build();
    block_on(rt, timeout, build, || format!("cannot reach Kafka at {what}"))
}

/// Runs `f` on `rt` for at most `timeout`.
fn block_on<T>(
    rt: &Runtime,
    timeout: Duration,
    f: impl std::future::Future<Output = std::result::Result<T, KafkaError>>,
    what: impl FnOnce() -> String,
) -> Result<T> {
    match rt.block_on(async { tokio::time::timeout(timeout, f).await }) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(unavailable(what(), e)),
        Err(_) => Err(unavailable(what(), format!("no answer within {timeout:?}"))),
    }
}

fn record(payload: Vec<u8>) -> Record {
    let ms = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    Record {
        key: None,
        value: Some(payload),
        headers: Default::default(),
        timestamp: rskafka::chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default(),
    }
}

/// Splits a partition's messages into produce requests of at most [`REQUEST_BYTES_MAX`].
fn requests(messages: Vec<Vec<u8>>) -> Vec<Vec<Record>> {
    let mut out: Vec<Vec<Record>> = Vec::new();
    let mut bytes = 0;
    for m in messages {
        if out.is_empty() || bytes + m.len() > REQUEST_BYTES_MAX {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += m.len();
        out.last_mut().expect("pushed").push(record(m));
    }
    out
}

/// Produces a partition's messages in order, one request at a time; stops at the first
/// request that fails.
async fn produce_in_order(client: &PartitionClient, messages: Vec<Vec<u8>>) -> std::result::Result<(), KafkaError> {
    for r in requests(messages) {
        client.produce(r, Compression::NoCompression).await?;
    }
    Ok(())
}

pub struct KafkaSink {
    rt: Runtime,
    clients: Vec<PartitionClient>,
    /// Messages sent and not yet produced, per partition, with their bytes.
    pending: Vec<(Vec<Vec<u8>>, usize)>,
    topic: String,
    timeout: Duration,
    what: String,
}

impl KafkaSink {
    /// Connects, creates the topic with `partitions` partitions if it is missing
    /// (replication factor 1: create it yourself for a replicated cluster), and checks
    /// that it has at least that many.
    pub fn connect(c: &StreamConfig, partitions: u32) -> Result<KafkaSink> {
        let timeout = c.timeout()?;
        let what = c.describe();
        let rt = runtime(&what)?;
        let client = client(&rt, c, timeout, &what)?;
        let controller =
            client.controller_client().map_err(|e| unavailable(format!("cannot reach Kafka at {what}"), e))?;
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        match rt.block_on(async {
            tokio::time::timeout(timeout, controller.create_topic(c.topic.clone(), partitions as i32, 1, ms)).await
        }) {
            Ok(Ok(())) => {}
            Ok(Err(KafkaError::ServerError { protocol_error: ProtocolError::TopicAlreadyExists, .. })) => {}
            Ok(Err(e)) => return Err(unavailable(format!("cannot create Kafka topic {:?} at {what}", c.topic), e)),
            Err(_) => {
                return Err(unavailable(format!("cannot create Kafka topic {:?} at {what}", c.topic), "timed out"))
            }
        }
        let have = partition_count(&rt, &client, &c.topic, timeout, &what)?;
        if have < partitions {
            return Err(Error::config(format!(
                "Kafka topic {:?} has {have} partitions, the publisher needs {partitions} (one per serving shard)",
                c.topic
            )));
        }
        let mut clients = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            let pc = client.partition_client(c.topic.clone(), p as i32, UnknownTopicHandling::Retry);
            clients.push(block_on(&rt, timeout, pc, || format!("cannot reach {what} partition {p}"))?);
        }
        let pending = vec![(Vec::new(), 0); partitions as usize];
        Ok(KafkaSink { rt, clients, pending, topic: c.topic.clone(), timeout, what })
    }

    /// Produces what partition `p` has pending; on failure drops every partition's
    /// pending messages (the caller sends the checkpoint again).
    fn produce(&mut self, p: usize) -> Result<()> {
        let (messages, _) = std::mem::take(&mut self.pending[p]);
        let r = block_on(&self.rt, self.timeout, produce_in_order(&self.clients[p], messages), || {
            format!("cannot send to {} partition {p}", self.what)
        });
        if r.is_err() {
            self.pending.iter_mut().for_each(|q| *q = (Vec::new(), 0));
        }
        r
    }
}

/// Partitions of `topic` (a topic just created shows up after a moment).
fn partition_count(rt: &Runtime, client: &Client, topic: &str, timeout: Duration, what: &str) -> Result<u32> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let topics = block_on(rt, timeout, client.list_topics(), || format!("cannot read Kafka metadata of {what}"))?;
        let n = topics.iter().find(|t| t.name == topic).map_or(0, |t| t.partitions.len() as u32);
        if n > 0 || std::time::Instant::now() > deadline {
            return Ok(n);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Sink for KafkaSink {
    fn send(&mut self, partition: u32, messages: Vec<Vec<u8>>) -> Result<()> {
        let p = partition as usize;
        if p >= self.clients.len() {
            return Err(Error::invalid(format!(
                "partition {partition} of Kafka topic {:?}: the sink has {}",
                self.topic,
                self.clients.len()
            )));
        }
        for m in messages {
            self.pending[p].1 += m.len();
            self.pending[p].0.push(m);
        }
        if self.pending[p].1 >= PENDING_BYTES_MAX {
            self.produce(p)?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let batches: Vec<Vec<Vec<u8>>> = self.pending.iter_mut().map(|q| std::mem::take(q).0).collect();
        let clients = &self.clients;
        let all = async {
            let each = batches.into_iter().zip(clients).map(|(m, c)| produce_in_order(c, m));
            futures::future::join_all(each).await
        };
        let results = match self.rt.block_on(async { tokio::time::timeout(self.timeout, all).await }) {
            Ok(r) => r,
            Err(_) => {
                return Err(unavailable(
                    format!("messages to {} not acknowledged", self.what),
                    format!("no answer within {:?}", self.timeout),
                ))
            }
        };
        for (p, r) in results.into_iter().enumerate() {
            r.map_err(|e| unavailable(format!("messages to {} partition {p} were not delivered", self.what), e))?;
        }
        Ok(())
    }

    fn partitions(&self) -> u32 {
        self.clients.len() as u32
    }
}

pub struct KafkaSource {
    rt: Runtime,
    client: PartitionClient,
    /// Offset of the next message to hand out.
    next: i64,
    /// Messages fetched and not handed out yet (a fetch returns whole record batches).
    fetched: VecDeque<(i64, Vec<u8>)>,
    timeout: Duration,
    what: String,
}

impl KafkaSource {
    pub fn connect(c: &StreamConfig, partition: u32) -> Result<KafkaSource> {
        let timeout = c.timeout()?;
        let what = format!("{} partition {partition}", c.describe());
        let rt = runtime(&what)?;
        let cl = client(&rt, c, timeout, &what)?;
        // A replica may start before its publisher created the topic: retry until then.
        let pc = cl.partition_client(c.topic.clone(), partition as i32, UnknownTopicHandling::Retry);
        let client = block_on(&rt, timeout, pc, || format!("cannot reach {what}"))?;
        Ok(KafkaSource { rt, client, next: 0, fetched: VecDeque::new(), timeout, what })
    }

    fn offset(&self, at: OffsetAt) -> Result<i64> {
        block_on(&self.rt, self.timeout, self.client.get_offset(at), || {
            format!("cannot read the offsets of {}", self.what)
        })
    }
}

impl Source for KafkaSource {
    fn seek(&mut self, position: Option<&str>, start: Start) -> Result<()> {
        self.fetched.clear();
        self.next = match position {
            Some(p) => p.parse().map_err(|_| {
                Error::invalid(format!("{p:?} is not a Kafka offset (from a checkpoint of another transport?)"))
            })?,
            None => self.offset(match start {
                Start::Earliest => OffsetAt::Earliest,
                Start::Latest => OffsetAt::Latest,
            })?,
        };
        Ok(())
    }

    fn poll(&mut self, max: usize, wait: Duration) -> Result<Vec<Polled>> {
        if self.fetched.is_empty() {
            let wait_ms = wait.as_millis().min(i32::MAX as u128) as i32;
            let fetch = self.client.fetch_records(self.next, 1..FETCH_BYTES_MAX, wait_ms);
            let (records, _high) =
                block_on(&self.rt, self.timeout + wait, fetch, || format!("cannot read {}", self.what))?;
            for r in records {
                if r.offset >= self.next {
                    self.fetched.push_back((r.offset, r.record.value.unwrap_or_default()));
                }
            }
        }
        let mut out = Vec::new();
        while out.len() < max {
            let Some((offset, payload)) = self.fetched.pop_front() else { break };
            self.next = offset + 1;
            out.push(Polled { position: self.next.to_string(), payload });
        }
        Ok(out)
    }

    fn lag(&mut self) -> Result<Option<u64>> {
        let high = self.offset(OffsetAt::Latest)?;
        Ok(Some(high.saturating_sub(self.next).max(0) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_keep_order_and_bound_bytes() {
        let messages: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 300 << 10]).collect();
        let rs = requests(messages);
        // 300 KiB each: three fit in 1 MiB, the fourth opens the next request.
        assert_eq!(rs.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3, 3, 1]);
        let flat: Vec<u8> = rs.iter().flatten().map(|r| r.value.as_ref().unwrap()[0]).collect();
        assert_eq!(flat, (0..10u8).collect::<Vec<_>>());
        // A message over the bound goes alone.
        let rs = requests(vec![vec![0; 10], vec![1; 2 << 20], vec![2; 10]]);
        assert_eq!(rs.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 1]);
    }
}
